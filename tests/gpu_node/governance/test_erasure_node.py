"""Erasure on one node, no broker: a subject command deletes every tier, crypto-erases sealed copies, and
no build of the subject's old blocks survives it — also one streaming or waiting while the command arrives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from events import schema
from events.tiers import Tier
from gpu_node.engine.async_engine import (
    AsyncEngine,
    GenerationDone,
    GenerationRequest,
    PromptStats,
    SamplingParams,
    TokenDelta,
)
from gpu_node.governance.applier import InvalidationApplier
from gpu_node.governance.predicates import block_predicate
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_records import BlockRestoreError, decode_block_record
from gpu_node.pool.vocabulary import BlockState
from gpu_node.settings import CacheSettings, NodeSettings
from prefix_keys.blocks import CacheScope, Principal, compute_block_keys
from prefix_keys.prompt import ChatMessage, render_prompt

BLOCK = 16
SUBJECT_KEY = "unit-test-subject-key-0123456789"
SYSTEM = ChatMessage(
    "system", "You are the assistant of the people team; answer briefly.", CacheScope.PUBLIC
)


@pytest.fixture
async def node(tiny_model_dir, tmp_path):
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path / "node",
        subject_key=SUBJECT_KEY,
        cache=CacheSettings(
            block_size=BLOCK, num_device_blocks=64, num_host_blocks=64, max_disk_blocks=256
        ),
    )
    engine = AsyncEngine.from_settings(settings)
    await engine.start()
    handler = InvalidationApplier(engine, SUBJECT_KEY.encode(), deferred_wait_s=5.0)
    yield engine, handler
    await engine.stop()


def history(subject: str) -> list[ChatMessage]:
    text = " ".join(f"{subject} said message {i} about the leave request" for i in range(8))
    return [
        SYSTEM,
        ChatMessage("user", text, CacheScope.USER),
        ChatMessage("user", "and then?", CacheScope.USER),
    ]


def erase(tenant: str, subject: str, cutoff: datetime | None = None) -> schema.Invalidate:
    predicate = schema.SubjectPredicate(
        tenant=tenant, subject_id=schema.subject_digest(SUBJECT_KEY.encode(), tenant, subject)
    )
    return schema.Invalidate(
        command_id=uuid.uuid4(), predicate=predicate, cutoff=cutoff or datetime.now(UTC)
    )


async def run(engine: AsyncEngine, principal: Principal, max_tokens: int = 1) -> int:
    request = GenerationRequest(
        uuid.uuid4().hex,
        tuple(history(principal.subject_id)),
        SamplingParams(max_tokens=max_tokens),
        principal,
    )
    cached = None
    async for item in engine.generate(request):
        if isinstance(item, PromptStats):
            cached = item.num_cached_tokens
    assert cached is not None
    return cached


def of_subject(tenant: str, subject: str):
    """Every block of the subject, whenever created."""
    later = datetime.now(UTC) + timedelta(days=1)
    return block_predicate(erase(tenant, subject, later).predicate, later, SUBJECT_KEY.encode())


def holdings(engine: AsyncEngine, predicate) -> set[tuple[bytes, str]]:
    held = {
        (entry.block_hash, entry.tier.value)
        for entry in engine.pool.ready_entries()
        if predicate(entry.provenance)
    }
    for keys in engine.snapshot_inventory().values():
        held.update((key.block_hash, "snapshot") for key in keys if predicate(key.provenance))
    return held


async def test_subject_erasure_clears_memory_and_crypto_erases_disk_and_snapshots(
    node, tmp_path, caplog
):
    engine, handler = node
    caplog.set_level(logging.DEBUG)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    alice, bob = (Principal(tenant, name, frozenset(), {}) for name in ("alice-x91", "bob-x92"))
    await run(engine, alice)
    await run(engine, bob)
    bob_hit = await run(engine, bob)
    assert bob_hit > BLOCK
    alice_blocks = [
        entry.block_hash
        for entry in engine.pool.ready_entries()
        if of_subject(tenant, alice.subject_id)(entry.provenance)
    ]
    assert len(alice_blocks) >= 3
    assert engine.pool.demote(alice_blocks[0], Tier.HOST) and engine.pool.demote(
        alice_blocks[1], Tier.DISK
    )
    await engine.write_snapshot()
    store = engine.pool.key_provider
    assert isinstance(store, LocalKeyStore)
    alice_key = store.current_key_id(tenant, alice.subject_id)
    assert alice_key is not None
    copied = engine.pool.disk_path(
        alice_blocks[1]
    ).read_bytes()  # a copy taken off the node before the erasure
    before = holdings(engine, of_subject(tenant, alice.subject_id))
    assert {tier for _, tier in before} == {"device", "host", "disk", "snapshot"}

    evidence = {item.tier: item for item in await handler.apply(erase(tenant, alice.subject_id))}

    assert {
        (bytes.fromhex(h), tier) for tier, item in evidence.items() for h in item.block_hashes
    } == before
    assert all(item.verified for item in evidence.values())
    methods = {
        tier: (item.method, item.post_check, item.key_ids) for tier, item in evidence.items()
    }
    assert methods == {
        "device": ("overwrite", "readback_zero", []),
        "host": ("overwrite", "readback_zero", []),
        "disk": ("crypto_erase", "key_destroyed", [alice_key]),
        "snapshot": ("crypto_erase", "key_destroyed", [alice_key]),
    }
    assert holdings(engine, of_subject(tenant, alice.subject_id)) == set()
    assert not engine.pool.disk_path(alice_blocks[1]).exists()
    with pytest.raises(BlockRestoreError) as undecryptable:
        decode_block_record(copied, store)
    assert undecryptable.value.reason == "key_unavailable"
    assert alice_key not in (tmp_path / "node" / "keys.json").read_text()
    assert store.current_key_id(tenant, alice.subject_id) is None
    # alice's request created the public system block bob shares, so it went with her: bob's next
    # request recomputes it (nothing before it cached, so nothing after it either) and the one after
    # hits everything again.
    assert await run(engine, bob) == 0
    assert await run(engine, bob) == bob_hit
    assert await run(engine, alice) == BLOCK  # only the public system block (bob's now) is shared
    # A command removes what the node holds when it applies it, whatever its cutoff (docs/design.md
    # §5, "Cutoffs"): the same erasure applied again, with a cutoff long past, removes the blocks
    # alice's request since then built.
    rebuilt = holdings(engine, of_subject(tenant, alice.subject_id))
    assert rebuilt and {tier for _, tier in rebuilt} == {"device"}
    again = await handler.apply(
        erase(tenant, alice.subject_id, datetime.now(UTC) - timedelta(hours=1))
    )
    assert [(item.tier, sorted(item.block_hashes)) for item in again] == [
        ("device", sorted(h.hex() for h, _ in rebuilt))
    ]
    assert holdings(engine, of_subject(tenant, alice.subject_id)) == set()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "alice-x91" not in logged


async def test_a_cutoff_ahead_of_the_node_clock_refuses_nothing_built_after_the_command_was_applied(
    node,
):
    """The node compares its blocks only with its own clock at application: a command's cutoff (the
    coordinator's database time, here 30 s ahead) neither spares blocks built before it is applied
    nor refuses blocks built after."""
    engine, handler = node
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    alice, bob = (
        Principal(tenant, "alice", frozenset(), {}),
        Principal(tenant, "bob", frozenset(), {}),
    )
    await run(engine, alice)
    assert holdings(engine, of_subject(tenant, "alice"))
    await handler.apply(erase(tenant, "alice", datetime.now(UTC) + timedelta(seconds=30)))
    assert holdings(engine, of_subject(tenant, "alice")) == set()
    await run(engine, alice)
    assert await run(engine, alice) > BLOCK
    await run(engine, bob)
    assert await run(engine, bob) > BLOCK


async def test_builds_keyed_before_the_command_was_applied_are_refused_when_claimed_after_it(node):
    """A request that computed its keys before the erasure was applied (on the node's clock) and claims its blocks
    only after the removal (it waited on another build) would rebuild the subject's old data: refused."""
    engine, handler = node
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    alice = Principal(tenant, "alice", frozenset(), {})
    prompt = render_prompt(engine.runner.tokenizer, history("alice"))

    def user_keys():
        keys = compute_block_keys(
            engine.namespace.namespace,
            prompt.token_ids,
            prompt.segments,
            alice,
            BLOCK,
            now=engine.pool.wall_time(),
        )
        return [key for key in keys if key.provenance.scope is CacheScope.USER]

    keyed_before = user_keys()
    await handler.apply(erase(tenant, "alice"))
    assert keyed_before and all(engine.pool.begin_build(key) is None for key in keyed_before)
    keyed_after = user_keys()
    entry = engine.pool.begin_build(keyed_after[0])
    assert entry is not None
    engine.pool.fail_build(entry)


async def test_generation_streaming_while_the_subject_is_erased_completes_and_leaves_nothing(node):
    engine, handler = node
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    alice = Principal(tenant, "alice", frozenset(), {})
    await run(engine, alice)
    await engine.write_snapshot()
    # Hold the model worker so the next request's prefill (and its claimed BUILDING blocks) wait
    # behind it.
    gate = threading.Event()
    held = asyncio.ensure_future(engine.run_exclusive(gate.wait, 30))
    longer = history("alice") + [
        ChatMessage("user", " ".join(f"more detail {i}" for i in range(20)), CacheScope.USER)
    ]
    request = GenerationRequest(
        uuid.uuid4().hex, tuple(longer), SamplingParams(max_tokens=8), alice
    )
    items: list = []

    async def stream() -> None:
        async for item in engine.generate(request):
            items.append(item)

    streaming = asyncio.create_task(stream())
    prompt = render_prompt(engine.runner.tokenizer, longer)
    keys = compute_block_keys(
        engine.namespace.namespace, prompt.token_ids, prompt.segments, alice, BLOCK
    )
    new_blocks = [key.block_hash for key in keys if engine.pool.state_of(key.block_hash) is None]
    users = [key.block_hash for key in keys if key.provenance.scope is CacheScope.USER]
    assert new_blocks
    async with asyncio.timeout(10):
        while not all(engine.pool.state_of(block) is BlockState.BUILDING for block in new_blocks):
            await asyncio.sleep(0.01)
    applying = asyncio.create_task(handler.apply(erase(tenant, "alice")))
    async with asyncio.timeout(
        10
    ):  # removed: the request's hits are tombstoned (EVICTING), its builds too
        while any(engine.pool.state_of(block) is BlockState.READY for block in users):
            await asyncio.sleep(0.01)
    gate.set()
    await held
    evidence = await asyncio.wait_for(applying, 30)
    await asyncio.wait_for(streaming, 30)

    assert isinstance(items[0], PromptStats) and isinstance(items[-1], GenerationDone)
    assert (
        sum(isinstance(item, TokenDelta) for item in items) == items[-1].num_completion_tokens > 0
    )
    assert all(item.verified for item in evidence)
    assert {"device", "snapshot"} <= {item.tier for item in evidence}
    assert holdings(engine, of_subject(tenant, "alice")) == set()
    assert all(engine.pool.state_of(block) is None for block in new_blocks), (
        "blocks of the in-flight request survived"
    )
