"""Invalidation decisions and their completion (DESIGN §5, §6; issue 4).

Users publish ``DocumentUpdated``/``DocumentDeleted`` (``kvledger.documents``) and
``PermissionRevoked`` (``kvledger.permissions``). For each, one database transaction
records the new current version, decides an :class:`events.schema.Invalidate`
(:func:`decide`): an ``invalidations`` row, one ``invalidation_targets`` row per
registered node, the matching live placements marked with the command id, and the
command itself in the outbox — so the decision and the command exist together or
not at all. Nodes answer on ``kvledger.acks``; an ack with verified evidence marks
the node's removed copies deleted, and the command is ``complete`` once every
expected node acked. Events and acks are claimed in the inbox in the same
transaction, so redelivery is a no-op.

Versions only move forward: an update to a version not above the recorded one is
ignored (it is a replay or arrived out of order), so a late, older event can never
resurrect superseded data.

Locking: a decision must not interleave with a kv-events batch, or a block stored
concurrently could escape both the decision's marking and the batch's late-block
check (:func:`reissue_for_late_blocks`). Decisions take a transaction-level
advisory lock exclusively; ledger writers (kv-events batches, ack batches) take it
shared, so they run concurrently with each other and each waits at most for one
short decision transaction. Lock order: advisory lock, node rows, placements. The
one exception is a late-block re-issue inside a kv-events batch, which marks other
nodes' placements too; a deadlock that could cause is detected by PostgreSQL, rolls
the batch back and the consumer re-delivers it, so it costs time, never correctness.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from pydantic import TypeAdapter
from sqlalchemy import LargeBinary, Select, and_, any_, bindparam, func, literal, or_, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import metrics
from coordinator.db import Database
from coordinator.models import (
    Block,
    BlockAuthScope,
    BlockDocument,
    Document,
    Erasure,
    InboxEntry,
    Invalidation,
    InvalidationTarget,
    Namespace,
    Node,
    OutboxEntry,
    Placement,
    Policy,
)
from coordinator.outbox import outbox_row
from events.kafka import ConsumedEvent
from events.schema import (
    CommandAck,
    DocumentDeleted,
    DocumentPredicate,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    Invalidate,
    NamespacePredicate,
    PermissionRevoked,
    PolicyPredicate,
    Predicate,
    SubjectPredicate,
    TenantPredicate,
    make_event,
)

log = logging.getLogger(__name__)

ANY_VERSION = 2**62
"""``below_version`` of a deleted document: every version of it matches."""

_DECISION_LOCK_KEY = 0x6B766C2D696E76  # "kvl-inv"; arbitrary, constant across releases
_MAX_HASHES_PER_STATEMENT = 5000
"""Keeps ``IN`` lists of block hashes well under asyncpg's 32767 bind parameters."""

_PREDICATE = TypeAdapter(Predicate)

APPLIED = "applied"
DUPLICATE = "duplicate"
SUPERSEDED = "superseded"
IGNORED = "ignored"
UNEXPECTED = "unexpected"


async def lock_decisions(session: AsyncSession) -> None:
    """Exclusive: no kv-events or ack batch is between its start and commit while this transaction decides."""
    await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DECISION_LOCK_KEY})


async def lock_ledger_writes(session: AsyncSession) -> None:
    """Shared: many ledger writers at once, but never concurrently with a decision (see module docstring)."""
    await session.execute(text("SELECT pg_advisory_xact_lock_shared(:key)"), {"key": _DECISION_LOCK_KEY})


def parse_predicate(data: dict) -> Predicate:
    return _PREDICATE.validate_python(data)


def matching_blocks(predicate: Predicate, cutoff: datetime) -> Select:
    """Hashes of the ledger's blocks that ``predicate`` covers.

    Version predicates (document, policy) and namespace predicates ignore ``cutoff``:
    a block holding a superseded version, or living in a retired namespace, is stale
    whenever it was built. Subject and tenant predicates remove data that existed
    at the decision, so only blocks created before ``cutoff`` match.
    """
    match predicate:
        case DocumentPredicate():
            return (
                select(BlockDocument.block_hash)
                .join(Block, Block.block_hash == BlockDocument.block_hash)
                .where(
                    Block.tenant_id == predicate.tenant,
                    BlockDocument.doc_id == predicate.doc_id,
                    BlockDocument.version < predicate.below_version,
                )
            )
        case PolicyPredicate():
            return (
                select(BlockAuthScope.block_hash)
                .join(Block, Block.block_hash == BlockAuthScope.block_hash)
                .where(
                    Block.tenant_id == predicate.tenant,
                    BlockAuthScope.auth_scope == predicate.auth_scope,
                    BlockAuthScope.policy_version < predicate.below_version,
                )
            )
        case SubjectPredicate():
            return select(Block.block_hash).where(
                Block.tenant_id == predicate.tenant,
                Block.subject_hash == bytes.fromhex(predicate.subject_id),
                Block.created_at < cutoff,
            )
        case NamespacePredicate():
            return select(Block.block_hash).where(Block.namespace == predicate.ns)
        case TenantPredicate():
            return select(Block.block_hash).where(Block.tenant_id == predicate.tenant, Block.created_at < cutoff)
    raise AssertionError(f"no ledger match for predicate {predicate!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    command_id: uuid.UUID
    kind: str
    trigger: str
    num_targets: int


async def decide(
    session: AsyncSession,
    predicate: Predicate,
    *,
    now: datetime,
    trigger: str,
    requested_at: datetime,
    source_event_id: uuid.UUID | None = None,
    parent_command_id: uuid.UUID | None = None,
) -> Decision:
    """Record an invalidation, its expected nodes and marked placements, and queue the command.

    The cutoff is ``now`` (the deciding transaction's database time, the same clock
    for every coordinator replica). Expected nodes are all nodes registered now:
    one that is down keeps the command pending until it returns, replays and acks.
    With no node registered the command is complete at once (nothing can hold a copy).
    The caller owns the transaction and the locking (:func:`lock_decisions`).
    """
    command_id = uuid.uuid4()
    await session.execute(
        pg_insert(Invalidation).values(
            command_id=command_id,
            kind=predicate.kind,
            predicate=predicate.model_dump(mode="json"),
            cutoff=now,
            trigger=trigger,
            source_event_id=source_event_id,
            parent_command_id=parent_command_id,
            requested_at=requested_at,
            created_at=now,
        )
    )
    targets = await session.execute(
        pg_insert(InvalidationTarget)
        .from_select(
            ["command_id", "node_id"], select(literal(command_id, InvalidationTarget.command_id.type), Node.node_id)
        )
        .returning(InvalidationTarget.node_id)
    )
    num_targets = len(targets.all())
    if num_targets == 0:
        await session.execute(
            update(Invalidation)
            .where(Invalidation.command_id == command_id)
            .values(status="complete", completed_at=now)
        )
    await session.execute(
        update(Placement)
        .where(Placement.state == "live", Placement.block_hash.in_(matching_blocks(predicate, now)))
        .values(invalidation_id=command_id)
    )
    tenant = getattr(predicate, "tenant", None)
    command = make_event(Invalidate(command_id=command_id, predicate=predicate, cutoff=now), tenant_id=tenant)
    await session.execute(pg_insert(OutboxEntry).values(outbox_row(command)))
    return Decision(command_id, predicate.kind, trigger, num_targets)


async def reissue_for_late_blocks(session: AsyncSession, hashes: Iterable[bytes], now: datetime) -> list[Decision]:
    """Re-send decided predicates that blocks stored in this batch still match (DESIGN §6, late events).

    A block is late when its provenance was superseded by a decision already taken:
    a document version below the recorded one (or a deleted document), a policy
    version below the recorded one, a namespace that is draining or retired, or a
    subject with an erasure whose cutoff is after the block's ``created_at`` (its
    re-send names the erasure's command as parent, which keeps the erasure from being
    verified until every node acked it too). A node
    can report one after the command passed it (it was built from stale input before
    the node learned the new version, or the node missed the command). The command
    is re-issued with the *same predicate* and a fresh cutoff ``now`` — a fresh cutoff
    so that a node honouring the cutoff also removes a stale block built after the
    first decision; the predicate is unchanged, so current data never matches and
    nodes apply it idempotently. One re-issue per decided predicate per batch.
    """
    hashes = list(hashes)
    originals: set[uuid.UUID] = set()
    for start in range(0, len(hashes), _MAX_HASHES_PER_STATEMENT):
        chunk = hashes[start : start + _MAX_HASHES_PER_STATEMENT]
        # one array parameter instead of one bind per hash (an IN list of thousands of binds
        # made statement compilation the slowest part of ingesting a batch)
        in_chunk = Block.block_hash == any_(bindparam("late_hashes", chunk, type_=ARRAY(LargeBinary)))
        documents = (
            select(Document.invalidation_id)
            .join(BlockDocument, BlockDocument.doc_id == Document.doc_id)
            .join(Block, and_(Block.block_hash == BlockDocument.block_hash, Block.tenant_id == Document.tenant_id))
            .where(
                in_chunk,
                Document.invalidation_id.is_not(None),
                or_(Document.deleted, BlockDocument.version < Document.version),
            )
        )
        policies = (
            select(Policy.invalidation_id)
            .join(BlockAuthScope, BlockAuthScope.auth_scope == Policy.auth_scope)
            .join(Block, and_(Block.block_hash == BlockAuthScope.block_hash, Block.tenant_id == Policy.tenant_id))
            .where(
                in_chunk,
                Policy.invalidation_id.is_not(None),
                BlockAuthScope.policy_version < Policy.policy_version,
            )
        )
        namespaces = (
            select(Namespace.invalidation_id)
            .join(Block, Block.namespace == Namespace.namespace)
            .where(
                in_chunk,
                Namespace.invalidation_id.is_not(None),
                Namespace.status.in_(("draining", "retired")),
            )
        )
        erasures = (
            select(Erasure.command_id)
            .join(Block, and_(Block.tenant_id == Erasure.tenant_id, Block.subject_hash == Erasure.subject_hash))
            .where(in_chunk, Block.created_at < Erasure.cutoff)
        )
        originals.update((await session.scalars(documents.union(policies, namespaces, erasures))).all())
    if not originals:
        return []
    rows = (
        await session.execute(
            select(Invalidation.command_id, Invalidation.predicate)
            .where(Invalidation.command_id.in_(originals))
            .order_by(Invalidation.seq)
        )
    ).all()
    return [
        await decide(
            session,
            parse_predicate(row.predicate),
            now=now,
            trigger="late_block",
            requested_at=now,
            parent_command_id=row.command_id,
        )
        for row in rows
    ]


async def finish_if_acked(session: AsyncSession, command_ids: Iterable[uuid.UUID], now: datetime) -> list[float]:
    """Set each command's status from its targets; returns the latencies (s) of commands completed now.

    ``complete`` when every target acked with verified evidence (a namespace drained
    by it becomes ``retired``), ``failed`` while some target reported an unverified
    post-check, else still ``pending``.
    """
    completed: list[float] = []
    for command_id in sorted(command_ids):
        invalidation = await session.get(Invalidation, command_id, with_for_update=True)
        assert invalidation is not None, f"target rows of {command_id} without an invalidation"
        if invalidation.status == "complete":
            continue
        statuses = collections.Counter(
            (
                await session.scalars(
                    select(InvalidationTarget.status).where(InvalidationTarget.command_id == command_id)
                )
            ).all()
        )
        if statuses["pending"] == 0 and statuses["failed"] == 0:
            invalidation.status = "complete"
            invalidation.completed_at = now
            completed.append((now - invalidation.created_at).total_seconds())
            if invalidation.kind == "namespace":
                await session.execute(
                    update(Namespace)
                    .where(Namespace.invalidation_id == command_id, Namespace.status == "draining")
                    .values(status="retired", updated_at=now)
                )
        elif statuses["failed"]:
            invalidation.status = "failed"
    return completed


_DECISION_EVENTS = (DocumentUpdated, DocumentDeleted, PermissionRevoked, ErasureRequested)


class ErasureHooks(Protocol):
    """What the handler needs of ``coordinator.erasure.ErasureService`` (a protocol: that module imports this one)."""

    async def start_from_event(
        self, session: AsyncSession, envelope: Envelope, now: datetime
    ) -> tuple[str, Decision | None]:
        """Start the requested erasure in the batch's transaction (decision lock held): outcome and decision."""

    async def acks_applied(self, command_ids: Iterable[uuid.UUID]) -> None:
        """Called after an ack batch committed, with the commands it touched."""


@dataclass(slots=True)
class _BatchResult:
    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    decisions: list[Decision] = field(default_factory=list)
    completed: list[float] = field(default_factory=list)
    copies_deleted: int = 0


class InvalidationHandler:
    """Batch handler of the coordinator's documents/permissions/erasures/acks consumer; commits before returning.

    Erasure requests are decided like the other user events (decision lock, same
    transaction as their inbox rows) by ``erasures``, which is also told about every
    committed ack batch so it can verify the erasures those acks advance.
    """

    def __init__(
        self, database: Database, *, erasures: ErasureHooks, on_outbox: Callable[[], None] | None = None
    ) -> None:
        self._database = database
        self._erasures = erasures
        self._on_outbox = on_outbox

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        if not events:
            return
        started = time.perf_counter()
        result = _BatchResult()
        async with self._database.session() as session, session.begin():
            now = (await session.scalar(select(func.now()))).astimezone(UTC)
            fresh = await self._claim(session, events, result)
            deciding = [e for e in fresh if isinstance(e.payload, _DECISION_EVENTS)]
            acks = [e for e in fresh if isinstance(e.payload, CommandAck)]
            if deciding:
                await lock_decisions(session)
            elif acks:
                await lock_ledger_writes(session)
            for envelope in fresh:
                if not isinstance(envelope.payload, (*_DECISION_EVENTS, CommandAck)):
                    log.warning("ignoring %s event on an invalidation topic", envelope.type)
                    result.outcomes[(envelope.type, IGNORED)] += 1
            for envelope in deciding:
                if isinstance(envelope.payload, ErasureRequested):
                    outcome, decision = await self._erasures.start_from_event(session, envelope, now)
                    result.decisions.extend([decision] if decision is not None else [])
                else:
                    outcome = await self._decide(session, envelope, now, result)
                result.outcomes[(envelope.type, outcome)] += 1
            touched: set[uuid.UUID] = set()
            if acks:
                touched = await self._apply_acks(session, acks, now, result)
                result.completed = await finish_if_acked(session, touched, now)
        # Metrics only after the commit: a rolled-back batch is redelivered and counted then.
        for (event_type, outcome), count in result.outcomes.items():
            metrics.INVALIDATION_EVENTS_TOTAL.labels(type=event_type, outcome=outcome).inc(count)
        for decision in result.decisions:
            metrics.INVALIDATIONS_TOTAL.labels(kind=decision.kind, trigger=decision.trigger).inc()
        for seconds in result.completed:
            metrics.INVALIDATION_SECONDS.observe(seconds)
        metrics.PLACEMENT_CHANGES_TOTAL.labels(state="deleted", cause="invalidation").inc(result.copies_deleted)
        metrics.INVALIDATION_BATCH_SECONDS.observe(time.perf_counter() - started)
        if result.decisions and self._on_outbox is not None:
            self._on_outbox()
        await self._erasures.acks_applied(touched)

    async def _claim(self, session: AsyncSession, events: list[ConsumedEvent], result: _BatchResult) -> list[Envelope]:
        """Inbox rows for the batch's events; returns the ones not applied before, in order."""
        unique: dict[uuid.UUID, ConsumedEvent] = {}
        for event in events:
            if event.envelope.event_id in unique:
                result.outcomes[(event.envelope.type, DUPLICATE)] += 1
            else:
                unique[event.envelope.event_id] = event
        rows = [
            {"event_id": event_id, "topic": event.topic, "event_type": event.envelope.type}
            for event_id, event in unique.items()
        ]
        claimed = set(
            (
                await session.scalars(
                    pg_insert(InboxEntry).values(rows).on_conflict_do_nothing().returning(InboxEntry.event_id)
                )
            ).all()
        )
        fresh = []
        for event_id, event in unique.items():
            if event_id in claimed:
                fresh.append(event.envelope)
            else:
                result.outcomes[(event.envelope.type, DUPLICATE)] += 1
        return fresh

    # -- decisions -----------------------------------------------------------------

    async def _decide(self, session: AsyncSession, envelope: Envelope, now: datetime, result: _BatchResult) -> str:
        payload, tenant = envelope.payload, envelope.tenant_id
        assert tenant is not None, "the contract requires tenant_id on user events"
        match payload:
            case DocumentUpdated():
                current = await session.get(Document, (tenant, payload.doc_id))
                if current is not None and payload.version <= current.version:
                    return SUPERSEDED
                predicate = DocumentPredicate(tenant=tenant, doc_id=payload.doc_id, below_version=payload.version)
                state = {"version": payload.version, "deleted": False}
                model = Document
            case DocumentDeleted():
                current = await session.get(Document, (tenant, payload.doc_id))
                if current is not None and current.deleted:
                    return SUPERSEDED
                predicate = DocumentPredicate(tenant=tenant, doc_id=payload.doc_id, below_version=ANY_VERSION)
                state = {"version": current.version if current is not None else 0, "deleted": True}
                model = Document
            case PermissionRevoked():
                # ``subject_id`` narrows who lost access, but tenant-scope blocks record the
                # (auth scope, policy version) they were built under, not who built or read
                # them: nothing in the ledger or on a node can tell which of them the subject
                # could read. The policy version moves for the whole scope (tokens of older
                # versions are refused), so every older block is unreachable anyway; deleting
                # them all is the safe superset and costs only recomputation. The raw subject
                # is therefore neither stored nor logged.
                current = await session.get(Policy, (tenant, payload.auth_scope))
                if current is not None and payload.policy_version <= current.policy_version:
                    return SUPERSEDED
                predicate = PolicyPredicate(
                    tenant=tenant, auth_scope=payload.auth_scope, below_version=payload.policy_version
                )
                state = {"policy_version": payload.policy_version}
                model = Policy
            case _:
                raise AssertionError(f"not a decision event: {envelope.type}")
        decision = await decide(
            session,
            predicate,
            now=now,
            trigger="event",
            requested_at=envelope.occurred_at,
            source_event_id=envelope.event_id,
        )
        result.decisions.append(decision)
        key = {"tenant_id": tenant, "doc_id": payload.doc_id} if model is Document else {
            "tenant_id": tenant,
            "auth_scope": payload.auth_scope,
        }
        values = {**key, **state, "invalidation_id": decision.command_id, "updated_at": now}
        await session.execute(
            pg_insert(model).values(values).on_conflict_do_update(index_elements=list(key), set_=values)
        )
        return APPLIED

    # -- acks ----------------------------------------------------------------------

    async def _apply_acks(
        self, session: AsyncSession, acks: list[Envelope], now: datetime, result: _BatchResult
    ) -> set[uuid.UUID]:
        """Record each ack on its target row and delete the copies it verified; returns commands touched."""
        node_ids = sorted({ack.payload.node_id for ack in acks})
        # Same lock as a kv-events batch of these nodes, so acks and block events of one node serialize.
        await session.execute(
            select(Node.node_id)
            .where(Node.node_id.in_(node_ids))
            .order_by(Node.node_id)
            .with_for_update(key_share=True)
        )
        touched: set[uuid.UUID] = set()
        for envelope in acks:
            ack: CommandAck = envelope.payload
            target = await session.get(InvalidationTarget, (ack.command_id, ack.node_id), with_for_update=True)
            if target is None:
                # Not a command of this ledger, or a node registered after the decision.
                result.outcomes[(envelope.type, UNEXPECTED)] += 1
                continue
            if target.status == "acked":
                result.outcomes[(envelope.type, DUPLICATE)] += 1
                continue
            verified = all(evidence.verified for evidence in ack.evidence)
            target.status = "acked" if verified else "failed"
            target.epoch = ack.epoch
            target.acked_at = now
            target.evidence = [evidence.model_dump(mode="json") for evidence in ack.evidence]
            for evidence in ack.evidence:
                if evidence.verified and evidence.block_hashes:
                    result.copies_deleted += await self._delete_copies(
                        session, ack, evidence.tier, evidence.block_hashes, now
                    )
            touched.add(ack.command_id)
            result.outcomes[(envelope.type, APPLIED if verified else "unverified")] += 1
        return touched

    async def _delete_copies(
        self, session: AsyncSession, ack: CommandAck, tier: str, block_hashes: list[str], now: datetime
    ) -> int:
        """Mark the node's live copies in ``tier`` that the node verified removed as deleted; returns how many."""
        hashes = [bytes.fromhex(h) for h in block_hashes]
        deleted = 0
        for start in range(0, len(hashes), _MAX_HASHES_PER_STATEMENT):
            result = await session.execute(
                update(Placement)
                .where(
                    Placement.node_id == ack.node_id,
                    Placement.tier == tier,
                    Placement.state == "live",
                    Placement.block_hash.in_(hashes[start : start + _MAX_HASHES_PER_STATEMENT]),
                )
                .values(state="deleted", reason="invalidated", invalidation_id=ack.command_id, updated_at=now)
                .returning(Placement.id)
            )
            deleted += len(result.all())
        return deleted


def live_copies_matching(predicate: Predicate, cutoff: datetime) -> Select:
    """(node, tier, count) of live placements of blocks ``predicate`` covers — what the ledger says remains."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.state == "live", Placement.block_hash.in_(matching_blocks(predicate, cutoff)))
        .group_by(Placement.node_id, Placement.tier)
    )


def deleted_by(command_id: uuid.UUID) -> Select:
    """(node, tier, count) of placements this command's acks deleted."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.invalidation_id == command_id, Placement.state == "deleted")
        .group_by(Placement.node_id, Placement.tier)
    )

