"""Invalidation on one engine, no broker: the command handler, the version registry and the pool
together.

The property (docs/design.md §4, §5): across random interleavings of requests, document
updates and policy revocations, no served response reports cached tokens from a
block whose document or policy version was superseded before the request started,
and once a command is applied no tier or snapshot of the node holds a match.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import pytest
from helpers.ledger import eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events import schema
from events.tiers import Tier
from gpu_node.engine.async_engine import AsyncEngine, GenerationRequest, PromptStats, SamplingParams
from gpu_node.entrypoints.routes import CACHE_BYPASS_HEADER, create_app
from gpu_node.governance.applier import EVIDENCE_SUBSCRIBER, InvalidationApplier
from gpu_node.governance.predicates import block_predicate, predicate_index_key
from gpu_node.pool.vocabulary import RemovalReason, provenance_index_keys
from gpu_node.settings import CacheSettings, NodeSettings
from identity.tokens import TokenVerifier, issue_token
from prefix_keys.blocks import (
    CacheProvenance,
    CacheScope,
    DocumentRef,
    Principal,
    compute_block_keys,
)
from prefix_keys.prompt import ChatMessage, render_prompt

BLOCK = 16
SUBJECT_KEY = b"unit-test-subject-key-0123456789"
JWT_SECRET = "unit-test-jwt-secret-0123456789abcdef0123"
SYSTEM = ChatMessage(
    "system", "You answer from the tenant handbook and nothing else.", CacheScope.PUBLIC
)


@pytest.fixture
async def node(tiny_model_dir, tmp_path):
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path / "node",
        auth={"jwt_secret": JWT_SECRET},
        cache=CacheSettings(
            block_size=BLOCK, num_device_blocks=64, num_host_blocks=64, max_disk_blocks=256
        ),
    )
    engine = AsyncEngine.from_settings(settings)
    await engine.start()
    handler = InvalidationApplier(engine, SUBJECT_KEY, deferred_wait_s=5.0)
    yield engine, handler
    await engine.stop()


def document_text(doc_id: str, version: int) -> str:
    return " ".join(f"{doc_id} rule{i} v{version} applies" for i in range(12))


def messages_for(doc_id: str, version: int, question: int) -> list[ChatMessage]:
    return [
        SYSTEM,
        ChatMessage(
            "user",
            document_text(doc_id, version),
            CacheScope.TENANT,
            DocumentRef(doc_id, version, "hr"),
        ),
        ChatMessage("user", f"question {question}", CacheScope.USER),
    ]


async def cached_tokens(
    engine: AsyncEngine, messages: list[ChatMessage], principal: Principal
) -> int:
    request = GenerationRequest(
        uuid.uuid4().hex, tuple(messages), SamplingParams(max_tokens=1), principal
    )
    stats = None
    async for item in engine.generate(request):
        if isinstance(item, PromptStats):
            stats = item
    assert stats is not None
    return stats.num_cached_tokens


def invalidate(predicate) -> schema.Invalidate:
    return schema.Invalidate(command_id=uuid.uuid4(), predicate=predicate, cutoff=datetime.now(UTC))


def new_reader() -> Principal:
    """A reader (scope ``hr``, policy version 1) of a tenant no other test uses."""
    return Principal(f"t-{uuid.uuid4().hex[:8]}", "alice", frozenset({"hr"}), {"hr": 1})


def prompt_keys(engine: AsyncEngine, messages: list[ChatMessage], principal: Principal) -> list:
    """The block keys a request for ``messages`` computes: the engine's rendering and hashing."""
    prompt = render_prompt(engine.runner.tokenizer, messages)
    return compute_block_keys(
        engine.namespace.namespace, prompt.token_ids, prompt.segments, principal, BLOCK
    )


async def cache_document(engine: AsyncEngine, principal: Principal, doc_id: str) -> list:
    """Serve one question on version 1 of ``doc_id`` (its blocks are cached then); returns the
    request's block keys."""
    messages = messages_for(doc_id, 1, 0)
    await cached_tokens(engine, messages, principal)
    return prompt_keys(engine, messages, principal)


@dataclass
class World:
    """The test's own model of what is current, independent of the node's registry."""

    tenant: str
    documents: dict[str, int] = field(default_factory=lambda: {"d0": 1, "d1": 1})
    policy: int = 1


async def request(
    engine: AsyncEngine, world: World, doc_id: str, stale_doc: bool, stale_pv: bool, question: int
) -> None:
    version = world.documents[doc_id] - (1 if stale_doc and world.documents[doc_id] > 1 else 0)
    pv = world.policy - (1 if stale_pv and world.policy > 1 else 0)
    principal = Principal(world.tenant, "alice", frozenset({"hr"}), {"hr": pv})
    messages = messages_for(doc_id, version, question)
    # The request starts here: this is the API's check, against versions current now.
    current_docs, current_policy = dict(world.documents), world.policy
    stale = engine.versions.check(principal, messages)
    assert (stale is not None) == (version < current_docs[doc_id] or pv < current_policy)
    if stale is not None:
        return
    num_cached = await cached_tokens(engine, messages, principal)
    keys = prompt_keys(engine, messages, principal)
    for key in keys[: num_cached // BLOCK]:
        for tag in key.provenance.documents:
            tag_doc, _, tag_version = tag.rpartition("@")
            assert int(tag_version) >= current_docs[tag_doc], (
                "served a block of a superseded document version"
            )
        for scope, version_used in key.provenance.auth_scopes:
            assert scope != "hr" or version_used >= current_policy, (
                "served a block of a superseded policy version"
            )


async def apply(
    engine: AsyncEngine, handler: InvalidationApplier, command: schema.Invalidate
) -> list[schema.TierEvidence]:
    evidence = await handler.apply(command)
    matches = block_predicate(command.predicate, command.cutoff, SUBJECT_KEY)
    assert not [entry for entry in engine.pool.ready_entries() if matches(entry.provenance)]
    for keys in engine.snapshot_inventory().values():
        assert not [key for key in keys if matches(key.provenance)]
    assert all(item.verified for item in evidence)
    return evidence


async def update_document(engine, handler, world: World, doc_id: str) -> None:
    world.documents[doc_id] += 1
    predicate = schema.DocumentPredicate(
        tenant=world.tenant, doc_id=doc_id, below_version=world.documents[doc_id]
    )
    await apply(engine, handler, invalidate(predicate))


async def revoke_policy(engine, handler, world: World) -> None:
    world.policy += 1
    await apply(
        engine,
        handler,
        invalidate(
            schema.PolicyPredicate(tenant=world.tenant, auth_scope="hr", below_version=world.policy)
        ),
    )


def demote_some(engine: AsyncEngine, tier: Tier) -> None:
    for entry in engine.pool.ready_entries()[::2]:
        engine.pool.demote(entry.block_hash, tier)


request_op = st.tuples(
    st.just("request"),
    st.sampled_from(["d0", "d1"]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2),
)
operations = st.lists(
    st.one_of(
        request_op,
        request_op,
        st.tuples(st.just("update"), st.sampled_from(["d0", "d1"])),
        st.tuples(st.just("revoke")),
        st.tuples(st.just("demote"), st.sampled_from([Tier.HOST, Tier.DISK])),
        st.tuples(st.just("snapshot")),
        st.tuples(
            st.just("concurrent"),
            request_op,
            st.sampled_from(["update", "revoke"]),
            st.sampled_from(["d0", "d1"]),
        ),
    ),
    min_size=3,
    max_size=10,
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=operations)
async def test_no_response_uses_blocks_superseded_before_it_started(node, ops):
    engine, handler = node
    world = World(tenant=f"t-{uuid.uuid4().hex[:8]}")
    for op in ops:
        match op:
            case ("request", doc_id, stale_doc, stale_pv, question):
                await request(engine, world, doc_id, stale_doc, stale_pv, question)
            case ("update", doc_id):
                await update_document(engine, handler, world, doc_id)
            case ("revoke",):
                await revoke_policy(engine, handler, world)
            case ("demote", tier):
                demote_some(engine, tier)
            case ("snapshot",):
                await engine.write_snapshot()
            case ("concurrent", (_, doc_id, stale_doc, stale_pv, question), command, command_doc):
                change = (
                    update_document(engine, handler, world, command_doc)
                    if command == "update"
                    else revoke_policy(engine, handler, world)
                )
                await asyncio.gather(
                    request(engine, world, doc_id, stale_doc, stale_pv, question), change
                )
        assert engine.versions.policy_version(world.tenant, "hr") in (None, world.policy)
        for doc_id, version in world.documents.items():
            assert engine.versions.document_version(world.tenant, doc_id) in (None, version)


async def test_update_removes_old_version_everywhere_and_keeps_the_rest_cached(node):
    """The deterministic core of the property, with exact evidence per tier."""
    engine, handler = node
    principal = new_reader()
    tenant = principal.tenant_id
    old, other = messages_for("d0", 1, 0), messages_for("d1", 1, 0)
    await cached_tokens(engine, old, principal)
    await cached_tokens(engine, other, principal)
    other_hit = await cached_tokens(engine, other, principal)
    assert other_hit > 0
    keys = prompt_keys(engine, old, principal)
    doomed = [key.block_hash for key in keys if "d0@1" in key.provenance.documents]
    assert len(doomed) >= 3
    assert engine.pool.demote(doomed[0], Tier.HOST) and engine.pool.demote(doomed[1], Tier.DISK)
    await engine.write_snapshot()

    command = invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d0", below_version=2))
    evidence = {item.tier: item for item in await apply(engine, handler, command)}
    assert set(evidence) == {"device", "host", "disk", "snapshot"}
    assert (
        evidence["host"].block_hashes == [doomed[0].hex()]
        and evidence["host"].method == "overwrite"
    )
    assert evidence["disk"].block_hashes == [doomed[1].hex()] and (
        evidence["disk"].method,
        evidence["disk"].post_check,
    ) == (
        "unlink",
        "file_absent",
    )
    assert sorted(evidence["device"].block_hashes) == sorted(h.hex() for h in doomed[2:])
    assert sorted(evidence["snapshot"].block_hashes) == sorted(h.hex() for h in doomed)
    assert not engine.pool.disk_path(doomed[1]).exists()
    assert all(engine.pool.state_of(h) is None for h in doomed)
    assert await cached_tokens(engine, other, principal) == other_hit
    assert engine.versions.check(principal, old).kind == "document"

    nothing = await handler.apply(
        invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d0", below_version=2))
    )
    assert nothing == []


async def test_a_batch_attributes_each_block_to_the_commands_that_match_it(node):
    """One pass for three commands: each ack carries exactly its own blocks, in every tier and the
    snapshot."""
    engine, handler = node
    principal = new_reader()
    tenant = principal.tenant_id
    hashes: dict[str, list[bytes]] = {}
    under_policy_1: set[str] = set()
    for doc_id in ("d0", "d1", "d2"):
        keys = await cache_document(engine, principal, doc_id)
        hashes[doc_id] = [
            key.block_hash for key in keys if f"{doc_id}@1" in key.provenance.documents
        ]
        under_policy_1 |= {
            key.block_hash.hex() for key in keys if ("hr", 1) in key.provenance.auth_scopes
        }
    assert len(engine.pool.ready_entries()) < 64, "nothing was evicted"
    assert engine.pool.demote(hashes["d1"][0], Tier.HOST) and engine.pool.demote(
        hashes["d1"][1], Tier.DISK
    )
    assert not engine.may_hold_snapshots()
    await engine.write_snapshot()
    assert engine.may_hold_snapshots()

    d0 = invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d0", below_version=2))
    d1 = invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d1", below_version=2))
    # The policy revocation also covers d0's and d1's blocks, already gone when it runs: it keeps
    # d2's alone.
    policy = invalidate(schema.PolicyPredicate(tenant=tenant, auth_scope="hr", below_version=2))
    applied = [
        (command, evidence) async for command, evidence in handler.apply_batch([d0, d1, policy])
    ]
    assert [command for command, _ in applied] == [d0, d1, policy]

    def blocks(evidence: list[schema.TierEvidence]) -> dict[str, set[str]]:
        return {item.tier: set(item.block_hashes) for item in evidence}

    (_, d0_evidence), (_, d1_evidence), (_, policy_evidence) = applied
    assert blocks(d0_evidence) == {
        "device": {h.hex() for h in hashes["d0"]},
        "snapshot": {h.hex() for h in hashes["d0"]},
    }
    assert blocks(d1_evidence) == {
        "device": {h.hex() for h in hashes["d1"][2:]},
        "host": {hashes["d1"][0].hex()},
        "disk": {hashes["d1"][1].hex()},
        "snapshot": {h.hex() for h in hashes["d1"]},
    }
    # The pool pass runs command by command, so the revocation finds d0's and d1's blocks gone; the
    # snapshot pass sees all three predicates at once, so it claims d0's and d1's snapshot copies
    # too.
    earlier = {h.hex() for h in hashes["d0"] + hashes["d1"]}
    assert {h.hex() for h in hashes["d2"]} <= under_policy_1
    assert blocks(policy_evidence) == {
        "device": under_policy_1 - earlier,
        "snapshot": under_policy_1,
    }
    assert all(item.verified for _, evidence in applied for item in evidence)
    doomed = set(hashes["d0"] + hashes["d1"] + hashes["d2"])
    assert not [entry for entry in engine.pool.ready_entries() if entry.block_hash in doomed]
    assert not [
        key
        for keys in engine.snapshot_inventory().values()
        for key in keys
        if key.block_hash in doomed
    ]


async def test_blocks_held_by_a_reader_are_deleted_on_release_and_reported(node):
    engine, handler = node
    principal = new_reader()
    tenant = principal.tenant_id
    keys = await cache_document(engine, principal, "d0")
    held = [
        entry
        for entry in engine.pool.longest_ready_prefix([key.block_hash for key in keys])
        if "d0@1" in entry.provenance.documents
    ]
    engine.pool.inc_lock_ref(held)
    command = invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d0", below_version=2))
    applying = asyncio.create_task(handler.apply(command))
    await asyncio.sleep(0.2)
    assert not applying.done(), "the ack waits for referenced matches"
    engine.pool.dec_lock_ref(held)
    engine.manager.drain_events()
    evidence = await asyncio.wait_for(applying, 5)
    assert {h for item in evidence for h in item.block_hashes} == {
        entry.block_hash.hex() for entry in held
    }


async def test_a_failing_subscriber_ahead_of_the_applier_does_not_keep_deferred_evidence_from_its_ack(
    node,
):
    engine, _ = node
    # The applier subscribes after a subscriber that always raises: construction order does not
    # matter.
    engine.manager.unsubscribe(EVIDENCE_SUBSCRIBER)

    batches_refused: list[tuple] = []

    def broken(events) -> None:
        batches_refused.append(tuple(events))
        raise RuntimeError("broken subscriber")

    engine.manager.subscribe("broken", broken)
    handler = InvalidationApplier(engine, SUBJECT_KEY, deferred_wait_s=5.0)
    principal = new_reader()
    keys = await cache_document(engine, principal, "d0")
    held = [
        entry
        for entry in engine.pool.longest_ready_prefix([key.block_hash for key in keys])
        if "d0@1" in entry.provenance.documents
    ]
    assert held
    engine.pool.inc_lock_ref(held)
    applying = asyncio.create_task(
        handler.apply(
            invalidate(
                schema.DocumentPredicate(tenant=principal.tenant_id, doc_id="d0", below_version=2)
            )
        )
    )
    await eventually(lambda: all(entry.tombstoned for entry in held), timeout_s=5.0)
    assert not applying.done(), "the ack waits for referenced matches"
    engine.pool.dec_lock_ref(held)
    engine.manager.drain_events()
    evidence = await asyncio.wait_for(applying, 5)
    assert {h for item in evidence for h in item.block_hashes} == {
        entry.block_hash.hex() for entry in held
    }
    assert all(item.verified for item in evidence)
    failures = engine.metrics.registry.get_sample_value(
        "kvledger_pool_event_subscriber_failures_total", {"subscriber": "broken"}
    )
    assert failures == len(batches_refused), (
        "every batch the broken subscriber raised on is counted"
    )
    invalidated = {
        event.block_hash
        for batch in batches_refused
        for event in batch
        if getattr(event, "reason", None) is RemovalReason.INVALIDATED
    }
    assert invalidated == {entry.block_hash for entry in held}, (
        "the broken subscriber was offered the same removals"
    )


async def test_retired_namespace_is_emptied_and_then_served_without_cache(node):
    engine, handler = node
    app = create_app(engine, TokenVerifier(engine.settings.auth))
    bearer = {
        "Authorization": f"Bearer {issue_token(tenant='acme', sub='alice', scopes=['hr'], pv=1, ttl_s=600, secret=JWT_SECRET)}"
    }
    body = {
        "model": engine.model_name,
        "max_tokens": 1,
        "messages": [
            {"role": m.role, "content": m.content, "cache_scope": m.scope.label}
            for m in messages_for("d0", 1, 0)[::2]
        ],
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://node"
    ) as client:
        await client.post("/v1/chat/completions", json=body, headers=bearer)
        cached = await client.post("/v1/chat/completions", json=body, headers=bearer)
        assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert CACHE_BYPASS_HEADER not in cached.headers
        evidence = await apply(
            engine, handler, invalidate(schema.NamespacePredicate(ns=engine.namespace.namespace))
        )
        assert sum(item.removed for item in evidence) > 0 and engine.pool.ready_entries() == []
        for _ in range(2):
            bypassed = await client.post("/v1/chat/completions", json=body, headers=bearer)
            assert bypassed.status_code == 200
            assert bypassed.headers[CACHE_BYPASS_HEADER] == "namespace_retired"
            assert bypassed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert engine.pool.ready_entries() == []


# --- the provenance index narrows, the predicate decides ------------------------------------------

NAMES = ("acme", "globex", "d1", "d2", "hr", "kb")
ns_names = st.sampled_from(["ns-a", "ns-b"])


@st.composite
def provenances(draw) -> CacheProvenance:
    scope = draw(st.sampled_from(list(CacheScope)))
    return CacheProvenance(
        namespace=draw(ns_names),
        tenant_id=None if scope == CacheScope.PUBLIC else draw(st.sampled_from(NAMES[:2])),
        scope=scope,
        auth_scopes=tuple(
            draw(st.lists(st.tuples(st.sampled_from(NAMES[4:]), st.integers(1, 3)), max_size=2))
        ),
        subject_id=draw(st.sampled_from(["alice", "bob"])) if scope == CacheScope.USER else None,
        documents=tuple(
            f"{doc}@{version}"
            for doc, version in draw(
                st.lists(st.tuples(st.sampled_from(NAMES[2:4]), st.integers(1, 3)), max_size=3)
            )
        ),
        created_at=0.0,
    )


schema_predicates = st.one_of(
    st.builds(
        schema.DocumentPredicate,
        tenant=st.sampled_from(NAMES[:2]),
        doc_id=st.sampled_from(NAMES[2:4]),
        below_version=st.integers(1, 4),
    ),
    st.builds(
        schema.PolicyPredicate,
        tenant=st.sampled_from(NAMES[:2]),
        auth_scope=st.sampled_from(NAMES[4:]),
        below_version=st.integers(1, 4),
    ),
    st.builds(
        lambda tenant, subject: schema.SubjectPredicate(
            tenant=tenant, subject_id=schema.subject_digest(SUBJECT_KEY, tenant, subject)
        ),
        st.sampled_from(NAMES[:2]),
        st.sampled_from(["alice", "bob"]),
    ),
    st.builds(schema.NamespacePredicate, ns=ns_names),
    st.builds(schema.TenantPredicate, tenant=st.sampled_from(NAMES[:2])),
)


@settings(max_examples=300, deadline=None)
@given(predicate=schema_predicates, provenance=provenances())
def test_every_block_a_predicate_matches_is_filed_under_its_index_key(predicate, provenance):
    matches = block_predicate(predicate, datetime.now(UTC), SUBJECT_KEY)
    key = predicate_index_key(predicate)
    if matches(provenance) and key is not None:  # None: the whole pool is scanned
        if key[0] == "namespace":
            assert provenance.namespace == key[1]
        else:
            assert key in provenance_index_keys(provenance)


async def test_a_command_delivered_twice_in_one_batch_is_applied_once_and_acked_twice(node):
    """A re-published outbox row reaches the node twice; both records get the same evidence, nothing
    fails."""
    engine, handler = node
    principal = new_reader()
    tenant = principal.tenant_id
    keys = await cache_document(engine, principal, "d0")
    doomed = {key.block_hash.hex() for key in keys if "d0@1" in key.provenance.documents}
    command = invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="d0", below_version=2))
    applied = [evidence async for _, evidence in handler.apply_batch([command, command])]
    assert len(applied) == 2 and applied[0] == applied[1]
    assert {h for item in applied[0] for h in item.block_hashes} == doomed
