"""Property: the decision rule's two implementations mark exactly the same placements.

The rule "which live copies does a decision cover" exists twice in
``coordinator.handlers.decisions``: :func:`~coordinator.handlers.decisions.decide` with
:func:`~coordinator.handlers.decisions.matching_blocks` (SQLAlchemy, one decision at a time: late
re-sends, erasures, namespace retirement, the API) and the bulk ``_DECIDE`` statement of
:func:`~coordinator.handlers.decisions.decide_many` (every document/permission event of a batch at
once). A rule change made in one of them only would silently diverge, so for random ledgers — blocks
of a few tenants, namespaces and subjects, with documents and auth scopes at several versions,
copies on a few nodes in every tier, live or deleted — and random event sequences (documents updated
or deleted, permissions revoked; some superseded by the recorded version or by an earlier event of
the batch) this test runs both on the same ledger (real Postgres, each in a savepoint that is rolled
back) and compares everything they write: which decision marks each placement, each decision's kind,
predicate, targets and status, the recorded current versions, and the commands queued.

Both are also held against the rule as stated in docs/design.md §5 and written here in Python over
the generated ledger, which covers the kinds only ``decide()`` serves (subject, namespace, tenant).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers.ledger import sign_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.handlers.decisions import APPLIED, SUPERSEDED, decide, decide_many, parse_predicate
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    Block,
    BlockAuthScope,
    BlockDocument,
    Document,
    Invalidation,
    InvalidationTarget,
    Namespace,
    Node,
    OutboxEntry,
    Placement,
    Policy,
    Snapshot,
)
from coordinator.ledger.transactions import begin_ledger_transaction
from coordinator.settings import DatabaseSettings
from events.schema import (
    ANY_VERSION,
    SCHEMA_VERSION,
    DocumentDeleted,
    DocumentPredicate,
    DocumentUpdated,
    Envelope,
    EventPayload,
    NamespacePredicate,
    PermissionRevoked,
    PolicyPredicate,
    Predicate,
    SubjectPredicate,
    TenantPredicate,
)
from events.tiers import Tier

TENANTS = ("t1", "t2")
NAMESPACES = ("ns1", "ns2")
SUBJECTS = ("alice", "bob")
DOC_IDS = ("a", "b", "c")
AUTH_SCOPES = ("s1", "s2")
NODE_IDS = ("node-1", "node-2", "node-3")
SNAPSHOT_ID = "snap-1"
VERSIONS = st.integers(0, 4)
PRIOR_COMMAND = uuid.UUID(int=1)
"""An earlier command already marking some copies: a decision that does not cover them must leave
it."""
OCCURRED_BY = datetime(2026, 1, 1, tzinfo=UTC)
"""The generated events happened in the hour before this (``requested_at`` of their decisions)."""


def _subject_hash(subject: str) -> bytes:
    return hashlib.sha256(subject.encode()).digest()


@dataclass(frozen=True)
class GenBlock:
    block_hash: bytes
    namespace: str
    tenant: str | None
    subject: str | None
    documents: frozenset[tuple[str, int]]
    auth_scopes: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class GenPlacement:
    block_hash: bytes
    node_id: str
    tier: str
    state: str
    invalidation_id: uuid.UUID | None


@dataclass(frozen=True)
class Ledger:
    nodes: tuple[str, ...]
    blocks: tuple[GenBlock, ...]
    placements: tuple[GenPlacement, ...]
    documents: dict[tuple[str, str], tuple[int, bool]]
    policies: dict[tuple[str, str], int]


@st.composite
def blocks(draw, index: int) -> GenBlock:
    scope = draw(st.sampled_from(("public", "tenant", "user")))
    block_hash = hashlib.sha256(f"block-{index}".encode()).digest()
    namespace = draw(st.sampled_from(NAMESPACES))
    if scope == "public":
        return GenBlock(block_hash, namespace, None, None, frozenset(), ())
    documents = draw(st.frozensets(st.tuples(st.sampled_from(DOC_IDS), VERSIONS), max_size=3))
    scopes = draw(st.dictionaries(st.sampled_from(AUTH_SCOPES), VERSIONS, max_size=2))
    subject = draw(st.sampled_from(SUBJECTS)) if scope == "user" else None
    return GenBlock(
        block_hash,
        namespace,
        draw(st.sampled_from(TENANTS)),
        subject,
        documents,
        tuple(sorted(scopes.items())),
    )


@st.composite
def ledgers(draw) -> Ledger:
    num_blocks = draw(st.integers(1, 8))
    generated = tuple(draw(blocks(index)) for index in range(num_blocks))
    nodes = tuple(sorted(draw(st.sets(st.sampled_from(NODE_IDS), min_size=1, max_size=3))))
    placements = []
    for block in generated:
        for node_id, tier in sorted(
            draw(
                st.sets(st.tuples(st.sampled_from(nodes), st.sampled_from(tuple(Tier))), max_size=4)
            )
        ):
            state = draw(st.sampled_from(("live", "live", "deleted")))
            marked = draw(st.sampled_from((None, PRIOR_COMMAND)))
            placements.append(GenPlacement(block.block_hash, node_id, tier, state, marked))
    documents = draw(
        st.dictionaries(
            st.tuples(st.sampled_from(TENANTS), st.sampled_from(DOC_IDS)),
            st.tuples(VERSIONS, st.booleans()),
            max_size=3,
        )
    )
    policies = draw(
        st.dictionaries(
            st.tuples(st.sampled_from(TENANTS), st.sampled_from(AUTH_SCOPES)), VERSIONS, max_size=2
        )
    )
    return Ledger(nodes, generated, tuple(placements), documents, policies)


@st.composite
def user_events(draw, ledger: Ledger) -> list[Envelope]:
    """Document and permission events, mostly about what the ledger holds and at versions next to its blocks'
    (where ``<`` and ``<=`` differ), some about anything; several for one key, so later ones supersede."""
    held_documents = sorted(
        {(b.tenant, d, v) for b in ledger.blocks if b.tenant for d, v in b.documents}
    )
    held_scopes = sorted(
        {(b.tenant, s, v) for b in ledger.blocks if b.tenant for s, v in b.auth_scopes}
    )
    anything = st.tuples(st.sampled_from(TENANTS), st.sampled_from(DOC_IDS), VERSIONS)
    documents = st.sampled_from(held_documents) | anything if held_documents else anything
    anything = st.tuples(st.sampled_from(TENANTS), st.sampled_from(AUTH_SCOPES), VERSIONS)
    scopes = st.sampled_from(held_scopes) | anything if held_scopes else anything
    nearby = st.sampled_from((-1, 0, 1, 2))
    payloads: list[tuple[EventPayload, str]] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(("updated", "deleted", "revoked")))
        if kind == "revoked":
            tenant, scope, version = draw(scopes)
            revoked = PermissionRevoked(
                auth_scope=scope,
                policy_version=max(0, version + draw(nearby)),
                subject_id=draw(st.sampled_from((None, "alice"))),
            )
            payloads.append((revoked, tenant))
            continue
        tenant, doc_id, version = draw(documents)
        payload = (
            DocumentUpdated(doc_id=doc_id, version=max(0, version + draw(nearby)))
            if kind == "updated"
            else DocumentDeleted(doc_id=doc_id)
        )
        payloads.append((payload, tenant))
    # Every part of an envelope is drawn (no fresh uuid4 or clock reading), so an example replays
    # exactly.
    event_ids = draw(
        st.lists(st.uuids(version=4), min_size=len(payloads), max_size=len(payloads), unique=True)
    )
    ages_s = draw(st.lists(st.integers(0, 3600), min_size=len(payloads), max_size=len(payloads)))
    return [
        Envelope(
            event_id=event_id,
            type=payload.TYPE,
            schema_version=SCHEMA_VERSION,
            occurred_at=OCCURRED_BY - timedelta(seconds=age_s),
            tenant_id=tenant,
            payload=payload,
        )
        for (payload, tenant), event_id, age_s in zip(payloads, event_ids, ages_s, strict=True)
    ]


@st.composite
def events_on_ledgers(draw) -> tuple[Ledger, list[Envelope]]:
    ledger = draw(ledgers())
    return ledger, draw(user_events(ledger))


PREDICATES = st.lists(
    st.one_of(
        st.builds(
            DocumentPredicate,
            tenant=st.sampled_from(TENANTS),
            doc_id=st.sampled_from(DOC_IDS),
            below_version=st.one_of(st.integers(0, 5), st.just(ANY_VERSION)),
        ),
        st.builds(
            PolicyPredicate,
            tenant=st.sampled_from(TENANTS),
            auth_scope=st.sampled_from(AUTH_SCOPES),
            below_version=st.integers(0, 5),
        ),
        st.builds(
            SubjectPredicate,
            tenant=st.sampled_from(TENANTS),
            subject_id=st.sampled_from(SUBJECTS).map(lambda subject: _subject_hash(subject).hex()),
        ),
        st.builds(NamespacePredicate, ns=st.sampled_from(NAMESPACES)),
        st.builds(TenantPredicate, tenant=st.sampled_from(TENANTS)),
    ),
    min_size=1,
    max_size=5,
)


def covers(predicate: Predicate, block: GenBlock) -> bool:
    """The decision rule, stated over one block (docs/design.md §5): whether ``predicate`` covers
    it."""
    match predicate:
        case DocumentPredicate():
            return block.tenant == predicate.tenant and any(
                doc_id == predicate.doc_id and version < predicate.below_version
                for doc_id, version in block.documents
            )
        case PolicyPredicate():
            return block.tenant == predicate.tenant and any(
                scope == predicate.auth_scope and version < predicate.below_version
                for scope, version in block.auth_scopes
            )
        case SubjectPredicate():
            return (
                block.tenant == predicate.tenant
                and block.subject is not None
                and _subject_hash(block.subject).hex() == predicate.subject_id
            )
        case NamespacePredicate():
            return block.namespace == predicate.ns
        case TenantPredicate():
            return block.tenant == predicate.tenant
    raise AssertionError(f"no rule for {predicate!r}")


def expected_marks(
    ledger: Ledger, predicates: list[Predicate]
) -> dict[tuple[bytes, str, str], object]:
    """Each placement's mark after deciding ``predicates`` in turn: the last covering decision's
    ordinal for a live copy; a deleted copy, or a live one nothing covers, keeps what it had."""
    by_hash = {block.block_hash: block for block in ledger.blocks}
    marks: dict[tuple[bytes, str, str], object] = {}
    for placement in ledger.placements:
        mark: object = "prior" if placement.invalidation_id == PRIOR_COMMAND else None
        if placement.state == "live":
            for ordinal, predicate in enumerate(predicates):
                if covers(predicate, by_hash[placement.block_hash]):
                    mark = ordinal
        marks[(placement.block_hash, placement.node_id, placement.tier)] = mark
    return marks


async def _build(session: AsyncSession, ledger: Ledger, now: datetime) -> None:
    await session.execute(pg_insert(Namespace).values([{"namespace": ns} for ns in NAMESPACES]))
    if ledger.nodes:
        await session.execute(
            pg_insert(Node).values(
                [{"node_id": n, "epoch": 1, "last_seq": 0} for n in ledger.nodes]
            )
        )
        await session.execute(
            pg_insert(Snapshot).values(
                [
                    {
                        "node_id": n,
                        "snapshot_id": SNAPSHOT_ID,
                        "epoch": 1,
                        "state": "live",
                        "num_blocks": 0,
                    }
                    for n in ledger.nodes
                ]
            )
        )
    await session.execute(
        pg_insert(Block).values(
            [
                {
                    "block_hash": block.block_hash,
                    "namespace": block.namespace,
                    "tenant_id": block.tenant,
                    "scope": "public"
                    if block.tenant is None
                    else "tenant"
                    if block.subject is None
                    else "user",
                    "subject_hash": None if block.subject is None else _subject_hash(block.subject),
                    "token_offset": 0,
                    "created_at": now - timedelta(minutes=1),
                }
                for block in ledger.blocks
            ]
        )
    )
    documents = [
        {"block_hash": b.block_hash, "doc_id": d, "version": v}
        for b in ledger.blocks
        for d, v in b.documents
    ]
    scopes = [
        {"block_hash": b.block_hash, "auth_scope": s, "policy_version": v}
        for b in ledger.blocks
        for s, v in b.auth_scopes
    ]
    if documents:
        await session.execute(pg_insert(BlockDocument).values(documents))
    if scopes:
        await session.execute(pg_insert(BlockAuthScope).values(scopes))
    if ledger.placements:
        await session.execute(
            pg_insert(Placement).values(
                [
                    {
                        "block_hash": p.block_hash,
                        "node_id": p.node_id,
                        "tier": p.tier,
                        "snapshot_id": SNAPSHOT_ID if p.tier == Tier.SNAPSHOT else None,
                        "state": p.state,
                        "epoch": 1,
                        "invalidation_id": p.invalidation_id,
                    }
                    for p in ledger.placements
                ]
            )
        )
    if ledger.documents:
        await session.execute(
            pg_insert(Document).values(
                [
                    {"tenant_id": t, "doc_id": d, "version": v, "deleted": gone}
                    for (t, d), (v, gone) in ledger.documents.items()
                ]
            )
        )
    if ledger.policies:
        await session.execute(
            pg_insert(Policy).values(
                [
                    {"tenant_id": t, "auth_scope": s, "policy_version": v}
                    for (t, s), v in ledger.policies.items()
                ]
            )
        )


async def _written(session: AsyncSession, ordinals: dict[uuid.UUID, int]) -> dict[str, object]:
    """Everything a decision writes, with command ids replaced by the decision's ordinal (ids are
    random)."""

    def ordinal(command_id: uuid.UUID | None) -> object:
        if command_id is None:
            return None
        return "prior" if command_id == PRIOR_COMMAND else ordinals[command_id]

    placements = {
        (row.block_hash, row.node_id, row.tier): ordinal(row.invalidation_id)
        for row in await session.execute(
            select(
                Placement.block_hash, Placement.node_id, Placement.tier, Placement.invalidation_id
            )
        )
    }
    invalidations = sorted(
        (
            (
                ordinal(row.command_id),
                row.kind,
                row.predicate,
                row.trigger,
                row.status,
                row.source_event_id,
                row.cutoff,
                row.requested_at,
                row.completed_at,
                row.parent_command_id,
            )
            for row in (await session.scalars(select(Invalidation))).all()
        ),
        key=lambda invalidation: invalidation[0],
    )
    targets = sorted(
        (ordinal(row.command_id), row.node_id, row.status)
        for row in await session.execute(
            select(
                InvalidationTarget.command_id, InvalidationTarget.node_id, InvalidationTarget.status
            )
        )
    )
    documents = sorted(
        (row.tenant_id, row.doc_id, row.version, row.deleted, ordinal(row.invalidation_id))
        for row in await session.execute(
            select(
                Document.tenant_id,
                Document.doc_id,
                Document.version,
                Document.deleted,
                Document.invalidation_id,
            )
        )
    )
    policies = sorted(
        (row.tenant_id, row.auth_scope, row.policy_version, ordinal(row.invalidation_id))
        for row in await session.execute(
            select(
                Policy.tenant_id, Policy.auth_scope, Policy.policy_version, Policy.invalidation_id
            )
        )
    )
    commands = [
        (
            row.topic,
            row.key,
            ordinal(uuid.UUID(row.payload["payload"]["command_id"])),
            row.payload["tenant_id"],
            row.payload["payload"]["predicate"],
            row.payload["payload"]["cutoff"],
            row.lease_until,
        )
        for row in (await session.scalars(select(OutboxEntry).order_by(OutboxEntry.id))).all()
    ]
    return {
        "placements": placements,
        "invalidations": invalidations,
        "targets": targets,
        "documents": documents,
        "policies": policies,
        "commands": commands,
    }


async def _decide_in_turn(
    session: AsyncSession, events: list[Envelope], now: datetime
) -> tuple[list[uuid.UUID], Counter]:
    """The per-event semantics ``decide_many`` promises: each event, in order, is ignored when the
    recorded version supersedes it, else decided with ``decide()`` and recorded as the new current
    version."""
    command_ids: list[uuid.UUID] = []
    outcomes: Counter = Counter()
    for envelope in events:
        payload, tenant = envelope.payload, envelope.tenant_id
        match payload:
            case DocumentUpdated() | DocumentDeleted():
                current = (
                    await session.execute(
                        select(Document.version, Document.deleted).where(
                            Document.tenant_id == tenant, Document.doc_id == payload.doc_id
                        )
                    )
                ).one_or_none()
                if isinstance(payload, DocumentUpdated):
                    superseded = current is not None and payload.version <= current.version
                    predicate = DocumentPredicate(
                        tenant=tenant, doc_id=payload.doc_id, below_version=payload.version
                    )
                    version, deleted = payload.version, False
                else:
                    superseded = current is not None and current.deleted
                    predicate = DocumentPredicate(
                        tenant=tenant, doc_id=payload.doc_id, below_version=ANY_VERSION
                    )
                    version, deleted = (0 if current is None else current.version), True
            case PermissionRevoked():
                current = await session.scalar(
                    select(Policy.policy_version).where(
                        Policy.tenant_id == tenant, Policy.auth_scope == payload.auth_scope
                    )
                )
                superseded = current is not None and payload.policy_version <= current
                predicate = PolicyPredicate(
                    tenant=tenant,
                    auth_scope=payload.auth_scope,
                    below_version=payload.policy_version,
                )
        if superseded:
            outcomes[(envelope.type, SUPERSEDED)] += 1
            continue
        decision = await decide(
            session,
            predicate,
            signer=sign_command,
            now=now,
            trigger="event",
            requested_at=envelope.occurred_at,
            source_event_id=envelope.event_id,
        )
        command_ids.append(decision.command_id)
        outcomes[(envelope.type, APPLIED)] += 1
        if isinstance(predicate, DocumentPredicate):
            values = {
                "tenant_id": tenant,
                "doc_id": payload.doc_id,
                "version": version,
                "deleted": deleted,
            }
            statement = pg_insert(Document).values(
                **values, invalidation_id=decision.command_id, updated_at=now
            )
            await session.execute(
                statement.on_conflict_do_update(
                    index_elements=[Document.tenant_id, Document.doc_id],
                    set_={
                        "version": version,
                        "deleted": deleted,
                        "invalidation_id": decision.command_id,
                        "updated_at": now,
                    },
                )
            )
        else:
            statement = pg_insert(Policy).values(
                tenant_id=tenant,
                auth_scope=payload.auth_scope,
                policy_version=payload.policy_version,
                invalidation_id=decision.command_id,
                updated_at=now,
            )
            await session.execute(
                statement.on_conflict_do_update(
                    index_elements=[Policy.tenant_id, Policy.auth_scope],
                    set_={
                        "policy_version": payload.policy_version,
                        "invalidation_id": decision.command_id,
                        "updated_at": now,
                    },
                )
            )
    return command_ids, outcomes


@dataclass(frozen=True)
class PrivateLedger:
    loop: asyncio.AbstractEventLoop
    database: Database

    def run(self, check: Coroutine[Any, Any, None]) -> None:
        self.loop.run_until_complete(asyncio.wait_for(check, timeout=60))


@pytest.fixture(scope="module")
def ledger(ledger_url: str) -> Iterator[PrivateLedger]:
    """The ledger database on an event loop of this module's own, run only while an example is checked.

    The tests are synchronous: Hypothesis draws every example in the test's thread while no event loop
    runs, so nothing else in the process (a client left on the session's loop, aiokafka's backoff) can
    move the global ``random`` state during a draw — Hypothesis rightly warns when that happens, since it
    cannot then replay or shrink an example.
    """
    loop = asyncio.new_event_loop()
    database = Database(DatabaseSettings(url=ledger_url))
    try:
        yield PrivateLedger(loop, database)
    finally:
        loop.run_until_complete(database.dispose())
        loop.close()


async def _check_events(database: Database, ledger: Ledger, events: list[Envelope]) -> None:
    async with database.session() as session, session.begin():
        now = await begin_ledger_transaction(session)
        await _build(session, ledger, now)

        bulk_outcomes: Counter = Counter()
        savepoint = await session.begin_nested()
        bulk = await decide_many(
            session, events, now, signer=sign_command, lease_until=None, outcomes=bulk_outcomes
        )
        bulk_ids = [decision.command_id for decision in bulk.decisions]
        by_bulk = await _written(session, {command_id: n for n, command_id in enumerate(bulk_ids)})
        await savepoint.rollback()

        savepoint = await session.begin_nested()
        in_turn_ids, in_turn_outcomes = await _decide_in_turn(session, events, now)
        by_decide = await _written(
            session, {command_id: n for n, command_id in enumerate(in_turn_ids)}
        )
        await savepoint.rollback()
        await session.rollback()

    assert by_bulk == by_decide
    assert bulk_outcomes == in_turn_outcomes
    assert [d.num_targets for d in bulk.decisions] == [len(ledger.nodes)] * len(bulk_ids)
    decided = [parse_predicate(invalidation[2]) for invalidation in by_decide["invalidations"]]
    assert by_decide["placements"] == expected_marks(ledger, decided)


async def _check_predicates(
    database: Database, ledger: Ledger, predicates: list[Predicate]
) -> None:
    async with database.session() as session, session.begin():
        now = await begin_ledger_transaction(session)
        await _build(session, ledger, now)
        command_ids = [
            (
                await decide(
                    session,
                    predicate,
                    signer=sign_command,
                    now=now,
                    trigger="api",
                    requested_at=now,
                )
            ).command_id
            for predicate in predicates
        ]
        written = await _written(
            session, {command_id: n for n, command_id in enumerate(command_ids)}
        )
        await session.rollback()
    assert written["placements"] == expected_marks(ledger, predicates)
    assert [(n, p) for n, _, p, *_ in written["invalidations"]] == [
        (n, p.model_dump(mode="json")) for n, p in enumerate(predicates)
    ]
    assert written["targets"] == sorted(
        (n, node_id, "pending") for n in range(len(predicates)) for node_id in ledger.nodes
    )


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=events_on_ledgers())
def test_bulk_decisions_mark_what_deciding_each_event_in_turn_marks(
    ledger: PrivateLedger, case: tuple[Ledger, list[Envelope]]
) -> None:
    generated, events = case
    ledger.run(_check_events(ledger.database, generated, events))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(generated=ledgers(), predicates=PREDICATES)
def test_decide_marks_the_live_copies_of_the_blocks_each_predicate_covers(
    ledger: PrivateLedger, generated: Ledger, predicates: list[Predicate]
) -> None:
    ledger.run(_check_predicates(ledger.database, generated, predicates))
