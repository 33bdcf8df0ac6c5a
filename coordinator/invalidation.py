"""Invalidation decisions and their completion (docs/design.md §5, §6).

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

Locking: a decision holds the ledger's decision lock exclusively, so no kv-events or
ack batch interleaves with it (:mod:`coordinator.ledger` states the lock order and why).
"""

from __future__ import annotations

import collections
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from pydantic import TypeAdapter
from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    DateTime,
    Exists,
    LargeBinary,
    Select,
    Text,
    Uuid,
    and_,
    any_,
    bindparam,
    exists,
    func,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import inbox, metrics
from coordinator.db import Database
from coordinator.ledger import begin_ledger_transaction, lock_decisions, lock_ledger_writes
from coordinator.models import (
    Block,
    BlockAuthScope,
    BlockDocument,
    Document,
    Erasure,
    Invalidation,
    InvalidationTarget,
    Namespace,
    Node,
    OutboxEntry,
    Placement,
    Policy,
)
from coordinator.outbox import outbox_row
from coordinator.states import ErasureStatus, InvalidationStatus, NamespaceStatus, PlacementState, TargetStatus
from events.fault_points import fault_point
from events.kafka import ConsumedEvent
from events.schema import (
    ANY_VERSION,
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
from events.topics import ACKS
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

_MAX_HASHES_PER_STATEMENT = 5000
"""Keeps ``IN`` lists of block hashes well under asyncpg's 32767 bind parameters."""

_PREDICATE = TypeAdapter(Predicate)

# --------------------------------------------------------------------------- bulk statements (one per batch)
#
# Fixed SQL text with array parameters: one prepared statement whatever the batch size (no
# per-size compilation, no bind-count limit), one round trip per step instead of one per event.

_UUIDS = ARRAY(Uuid())
_TEXTS = ARRAY(Text())
_BIGINTS = ARRAY(BigInteger())
_TIMES = ARRAY(DateTime(timezone=True))
_BYTEAS = ARRAY(LargeBinary())

_LOAD_DOCUMENTS = text(
    "SELECT d.tenant_id, d.doc_id, d.version, d.deleted FROM documents d"
    " JOIN unnest(:tenants, :keys) AS k(tenant_id, doc_id) ON d.tenant_id = k.tenant_id AND d.doc_id = k.doc_id"
).bindparams(bindparam("tenants", type_=_TEXTS), bindparam("keys", type_=_TEXTS))
_LOAD_POLICIES = text(
    "SELECT p.tenant_id, p.auth_scope, p.policy_version FROM policies p"
    " JOIN unnest(:tenants, :keys)"
    " AS k(tenant_id, auth_scope) ON p.tenant_id = k.tenant_id AND p.auth_scope = k.auth_scope"
).bindparams(bindparam("tenants", type_=_TEXTS), bindparam("keys", type_=_TEXTS))
_COMPLETE = text("UPDATE invalidations SET status = 'complete', completed_at = :now WHERE command_id = ANY(:command_ids)").bindparams(
    bindparam("now", type_=DateTime(timezone=True)), bindparam("command_ids", type_=_UUIDS)
)
_DECIDE = (
    text(
        # Every write of a batch of document/permission decisions in one statement (one round trip,
        # not six, inside the transaction every invalidation waits for). Data-modifying CTEs all run
        # to completion on one snapshot; the foreign keys to the new invalidations are checked at the
        # end of the statement, when they exist. A decision with no registered node to wait for is
        # complete at once.
        "WITH decided AS ("
        "  INSERT INTO invalidations (command_id, kind, predicate, cutoff, trigger, source_event_id,"
        "  requested_at, created_at, status, completed_at)"
        "  SELECT m.command_id, m.kind, m.predicate::jsonb, :now, 'event', m.source_event_id, m.requested_at, :now,"
        "  CASE WHEN n.num_nodes = 0 THEN 'complete' ELSE 'pending' END, CASE WHEN n.num_nodes = 0 THEN :now END"
        "  FROM unnest(:command_ids, :kinds, :predicates, :source_event_ids, :requested_at)"
        "  WITH ORDINALITY AS m(command_id, kind, predicate, source_event_id, requested_at, ord)"
        "  CROSS JOIN (SELECT count(*) AS num_nodes FROM nodes) n ORDER BY m.ord"
        "), targets AS ("
        "  INSERT INTO invalidation_targets (command_id, node_id)"
        "  SELECT m.command_id, n.node_id FROM unnest(:command_ids) WITH ORDINALITY AS m(command_id, ord)"
        "  CROSS JOIN nodes n ORDER BY m.ord, n.node_id RETURNING command_id"
        "), marked AS ("
        # The same placements each event's ``matching_blocks`` covers; one matched by several
        # decisions of the batch keeps the last one's command id, as deciding them in turn does.
        # A document's blocks are looked up per document on the (doc_id, version) index, then each
        # block's tenant by primary key (LATERAL lookups behind ``OFFSET 0`` fences): without
        # statistics (right after a fill) the planner hashed all of block_documents, or read every
        # block of the tenant through the tenant index, for each batch.
        "  UPDATE placements p SET invalidation_id = m.command_id FROM ("
        "  SELECT DISTINCT ON (x.block_hash) x.block_hash, x.command_id FROM ("
        "   SELECT bd.block_hash, d.command_id, d.ord"
        "   FROM unnest(:d_command_ids, :d_tenants, :d_doc_ids, :d_below, :d_ord)"
        "   AS d(command_id, tenant_id, doc_id, below, ord)"
        "   CROSS JOIN LATERAL (SELECT block_hash FROM block_documents"
        "   WHERE doc_id = d.doc_id AND version < d.below OFFSET 0) bd"
        "   CROSS JOIN LATERAL (SELECT tenant_id FROM blocks WHERE block_hash = bd.block_hash OFFSET 0) b"
        "   WHERE b.tenant_id = d.tenant_id"
        "   UNION ALL"
        "   SELECT ba.block_hash, q.command_id, q.ord"
        "   FROM unnest(:p_command_ids, :p_tenants, :p_scopes, :p_below, :p_ord)"
        "   AS q(command_id, tenant_id, auth_scope, below, ord)"
        "   JOIN block_auth_scopes ba ON ba.auth_scope = q.auth_scope AND ba.policy_version < q.below"
        "   JOIN blocks b ON b.block_hash = ba.block_hash AND b.tenant_id = q.tenant_id"
        "  ) x ORDER BY x.block_hash, x.ord DESC"
        "  ) m WHERE p.block_hash = m.block_hash AND p.state = 'live'"
        "), documents_now AS ("
        "  INSERT INTO documents (tenant_id, doc_id, version, deleted, invalidation_id, updated_at)"
        "  SELECT m.tenant_id, m.doc_id, m.version, m.deleted, m.invalidation_id, :now"
        "  FROM unnest(:doc_tenants, :doc_ids, :doc_versions, :doc_deleted, :doc_invalidation_ids)"
        "  AS m(tenant_id, doc_id, version, deleted, invalidation_id)"
        "  ON CONFLICT (tenant_id, doc_id) DO UPDATE SET version = excluded.version, deleted = excluded.deleted,"
        "  invalidation_id = excluded.invalidation_id, updated_at = excluded.updated_at"
        "), policies_now AS ("
        "  INSERT INTO policies (tenant_id, auth_scope, policy_version, invalidation_id, updated_at)"
        "  SELECT m.tenant_id, m.auth_scope, m.policy_version, m.invalidation_id, :now"
        "  FROM unnest(:policy_tenants, :policy_scopes, :policy_versions, :policy_invalidation_ids)"
        "  AS m(tenant_id, auth_scope, policy_version, invalidation_id)"
        "  ON CONFLICT (tenant_id, auth_scope) DO UPDATE SET policy_version = excluded.policy_version,"
        "  invalidation_id = excluded.invalidation_id, updated_at = excluded.updated_at"
        "), commands AS ("
        "  INSERT INTO outbox (topic, key, payload, lease_until)"
        "  SELECT m.topic, m.key, m.payload::jsonb, :lease_until FROM unnest(:topics, :keys, :payloads)"
        "  WITH ORDINALITY AS m(topic, key, payload, ord) ORDER BY m.ord RETURNING id, payload->>'event_id' AS event_id"
        ")"
        " SELECT 'target' AS row_kind, command_id::text AS ref, NULL::bigint AS outbox_id FROM targets"
        " UNION ALL SELECT 'command', event_id, id FROM commands"
    )
    .bindparams(
        bindparam("now", type_=DateTime(timezone=True)),
        bindparam("command_ids", type_=_UUIDS),
        bindparam("kinds", type_=_TEXTS),
        bindparam("predicates", type_=_TEXTS),
        bindparam("source_event_ids", type_=_UUIDS),
        bindparam("requested_at", type_=_TIMES),
        bindparam("d_command_ids", type_=_UUIDS),
        bindparam("d_tenants", type_=_TEXTS),
        bindparam("d_doc_ids", type_=_TEXTS),
        bindparam("d_below", type_=_BIGINTS),
        bindparam("d_ord", type_=_BIGINTS),
        bindparam("p_command_ids", type_=_UUIDS),
        bindparam("p_tenants", type_=_TEXTS),
        bindparam("p_scopes", type_=_TEXTS),
        bindparam("p_below", type_=_BIGINTS),
        bindparam("p_ord", type_=_BIGINTS),
        bindparam("doc_tenants", type_=_TEXTS),
        bindparam("doc_ids", type_=_TEXTS),
        bindparam("doc_versions", type_=_BIGINTS),
        bindparam("doc_deleted", type_=ARRAY(Boolean())),
        bindparam("doc_invalidation_ids", type_=_UUIDS),
        bindparam("policy_tenants", type_=_TEXTS),
        bindparam("policy_scopes", type_=_TEXTS),
        bindparam("policy_versions", type_=_BIGINTS),
        bindparam("policy_invalidation_ids", type_=_UUIDS),
        bindparam("lease_until", type_=DateTime(timezone=True)),
        bindparam("topics", type_=_TEXTS),
        bindparam("keys", type_=_TEXTS),
        bindparam("payloads", type_=_TEXTS),
    )
    .columns(row_kind=Text(), ref=Text(), outbox_id=BigInteger())
)
_LOCK_TARGETS = (
    text(
        "SELECT t.command_id, t.node_id, t.status FROM invalidation_targets t"
        " JOIN unnest(:command_ids, :node_ids)"
        " AS k(command_id, node_id) ON t.command_id = k.command_id AND t.node_id = k.node_id"
        " WHERE t.command_id = ANY(:command_ids) ORDER BY t.command_id, t.node_id FOR UPDATE OF t"
    )
    .bindparams(bindparam("command_ids", type_=_UUIDS), bindparam("node_ids", type_=_TEXTS))
    .columns(command_id=Uuid(), node_id=Text(), status=Text())
)
_UPDATE_TARGETS = text(
    "UPDATE invalidation_targets t"
    " SET status = m.status, epoch = m.epoch, acked_at = :now, evidence = m.evidence::jsonb, ack_key_id = m.key_id"
    " FROM unnest(:command_ids, :node_ids, :statuses, :epochs, :evidence, :key_ids)"
    " AS m(command_id, node_id, status, epoch, evidence, key_id)"
    " WHERE t.command_id = ANY(:command_ids) AND t.command_id = m.command_id AND t.node_id = m.node_id"
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("command_ids", type_=_UUIDS),
    bindparam("node_ids", type_=_TEXTS),
    bindparam("statuses", type_=_TEXTS),
    bindparam("epochs", type_=_BIGINTS),
    bindparam("evidence", type_=_TEXTS),
    bindparam("key_ids", type_=_TEXTS),
)
_DELETE_COPIES = text(
    # A copy listed by several acks of the batch is deleted by the first, as applying them in turn does.
    # Each copy is probed by its hash alone (a LATERAL lookup behind an ``OFFSET 0`` fence), which only
    # the (block_hash, ...) unique index serves. Without statistics (right after a fill) the planner
    # otherwise chose badly: given node, tier and state too, the (node, tier, state) index, reading
    # every live placement of the node; given ``block_hash = ANY(...)``, a scan of the whole table.
    "UPDATE placements p SET state = 'deleted', reason = 'invalidated',"
    " invalidation_id = m.command_id, updated_at = :now"
    " FROM (SELECT DISTINCT ON (d.node_id, d.tier, d.block_hash) d.node_id, d.tier, d.block_hash, d.command_id"
    "  FROM unnest(:node_ids, :tiers, :hashes, :command_ids) WITH ORDINALITY"
    " AS d(node_id, tier, block_hash, command_id, ord)"
    "  ORDER BY d.node_id, d.tier, d.block_hash, d.ord) m"
    " CROSS JOIN LATERAL (SELECT id, node_id, tier FROM placements WHERE block_hash = m.block_hash OFFSET 0) c"
    " WHERE p.id = c.id AND c.node_id = m.node_id AND c.tier = m.tier AND p.state = 'live' RETURNING p.id"
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("node_ids", type_=_TEXTS),
    bindparam("tiers", type_=_TEXTS),
    bindparam("hashes", type_=_BYTEAS),
    bindparam("command_ids", type_=_UUIDS),
)
_LOCK_INVALIDATIONS = (
    text(
        "SELECT command_id, status, kind, created_at FROM invalidations WHERE command_id = ANY(:command_ids) ORDER BY command_id FOR UPDATE"
    )
    .bindparams(bindparam("command_ids", type_=_UUIDS))
    .columns(command_id=Uuid(), status=Text(), kind=Text(), created_at=DateTime(timezone=True))
)
_TARGET_COUNTS = (
    text(
        "SELECT command_id, count(*) FILTER (WHERE status = 'pending') AS pending,"
        " count(*) FILTER (WHERE status = 'failed') AS failed"
        " FROM invalidation_targets WHERE command_id = ANY(:command_ids) GROUP BY command_id"
    )
    .bindparams(bindparam("command_ids", type_=_UUIDS))
    .columns(command_id=Uuid(), pending=BigInteger(), failed=BigInteger())
)
_FAIL = text("UPDATE invalidations SET status = 'failed' WHERE command_id = ANY(:command_ids)").bindparams(
    bindparam("command_ids", type_=_UUIDS)
)
_RETIRE_NAMESPACES = text(
    f"UPDATE namespaces SET status = '{NamespaceStatus.RETIRED}', updated_at = :now"
    f" WHERE invalidation_id = ANY(:command_ids) AND status = '{NamespaceStatus.DRAINING}'"
).bindparams(bindparam("now", type_=DateTime(timezone=True)), bindparam("command_ids", type_=_UUIDS))


APPLIED = "applied"
SUPERSEDED = "superseded"
IGNORED = "ignored"
UNEXPECTED = "unexpected"


def parse_predicate(data: dict) -> Predicate:
    return _PREDICATE.validate_python(data)


def matching_blocks(predicate: Predicate) -> Select:
    """Hashes of the ledger's blocks that ``predicate`` covers, whenever they were built.

    No predicate compares a block's ``created_at`` with the decision's time: that is
    the node's clock against the database's (docs/design.md §5, "Cutoffs"). A block
    holding a superseded version, or living in a retired namespace, is stale whenever
    it was built; the blocks of a subject or tenant that the ledger holds at the
    decision were built before it, by the ledger's own order. Which copies recorded
    later an erasure still waits for is :func:`coordinator.erasure.progress`'s rule.
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
                Block.tenant_id == predicate.tenant, Block.subject_hash == bytes.fromhex(predicate.subject_id)
            )
        case NamespacePredicate():
            return select(Block.block_hash).where(Block.namespace == predicate.ns)
        case TenantPredicate():
            return select(Block.block_hash).where(Block.tenant_id == predicate.tenant)
    raise AssertionError(f"no ledger match for predicate {predicate!r}")


def acked_erasure_command(erasure_command_id: ColumnElement[uuid.UUID], node_id: ColumnElement[str]) -> Exists:
    """Whether ``node_id`` acked the erasure command ``erasure_command_id`` or one of its re-sends (SQL expressions)."""
    return exists().where(
        InvalidationTarget.node_id == node_id,
        InvalidationTarget.status == TargetStatus.ACKED,
        InvalidationTarget.command_id.in_(
            select(Invalidation.command_id).where(
                or_(Invalidation.command_id == erasure_command_id, Invalidation.parent_command_id == erasure_command_id)
            )
        ),
    )


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
    signer: EnvelopeSigner,
    now: datetime,
    trigger: str,
    requested_at: datetime,
    source_event_id: uuid.UUID | None = None,
    parent_command_id: uuid.UUID | None = None,
) -> Decision:
    """Record an invalidation, its expected nodes and marked placements, and queue the command.

    The cutoff is ``now`` (the deciding transaction's database time, the same clock
    for every coordinator replica); it dates and orders the decision, and no node
    compares its own blocks' times with it (a node removes what it holds when it
    applies the command). Expected nodes are all nodes registered now:
    one that is down keeps the command pending until it returns, replays and acks.
    With no node registered the command is complete at once (nothing can hold a copy).
    The caller owns the transaction and the locking (:func:`lock_decisions`); the command
    is signed with ``signer`` (the coordinator's command key) before it enters the outbox.
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
        .from_select(["command_id", "node_id"], select(literal(command_id, InvalidationTarget.command_id.type), Node.node_id))
        .returning(InvalidationTarget.node_id)
    )
    num_targets = len(targets.all())
    if num_targets == 0:
        await session.execute(
            update(Invalidation).where(Invalidation.command_id == command_id).values(status=InvalidationStatus.COMPLETE, completed_at=now)
        )
    await session.execute(
        update(Placement)
        .where(Placement.state == PlacementState.LIVE, Placement.block_hash.in_(matching_blocks(predicate)))
        .values(invalidation_id=command_id)
    )
    tenant = getattr(predicate, "tenant", None)
    command = signer(make_event(Invalidate(command_id=command_id, predicate=predicate, cutoff=now), tenant_id=tenant))
    await session.execute(pg_insert(OutboxEntry).values(outbox_row(command)))
    return Decision(command_id, predicate.kind, trigger, num_targets)


async def reissue_for_late_blocks(session: AsyncSession, hashes: Iterable[bytes], now: datetime, signer: EnvelopeSigner) -> list[Decision]:
    """Re-send decided predicates that blocks stored in this batch still match (docs/design.md §6, late events).

    A block is late when its provenance was superseded by a decision already taken:
    a document version below the recorded one (or a deleted document), a policy
    version below the recorded one, a namespace that is draining or retired, or a
    subject with an erasure not yet verified whose live copy is on a node that has not
    acked any of the erasure's commands — a node acks only after removing every copy it
    held when it applied the command, so after its ack its new copies are the subject's
    new data, whatever their ``created_at`` says (its re-send names the erasure's command
    as parent, which keeps the erasure from being verified until every node acked it
    too). A node
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
                Namespace.status.in_((NamespaceStatus.DRAINING, NamespaceStatus.RETIRED)),
            )
        )
        erasures = (
            select(Erasure.command_id)
            .join(Block, and_(Block.tenant_id == Erasure.tenant_id, Block.subject_hash == Erasure.subject_hash))
            .join(Placement, and_(Placement.block_hash == Block.block_hash, Placement.state == PlacementState.LIVE))
            .where(in_chunk, Erasure.status != ErasureStatus.VERIFIED, ~acked_erasure_command(Erasure.command_id, Placement.node_id))
        )
        originals.update((await session.scalars(documents.union(policies, namespaces, erasures))).all())
    if not originals:
        return []
    rows = (
        await session.execute(
            select(Invalidation.command_id, Invalidation.predicate).where(Invalidation.command_id.in_(originals)).order_by(Invalidation.seq)
        )
    ).all()
    return [
        await decide(
            session,
            parse_predicate(row.predicate),
            signer=signer,
            now=now,
            trigger="late_block",
            requested_at=now,
            parent_command_id=row.command_id,
        )
        for row in rows
    ]


@dataclass(slots=True)
class Finished:
    """What :func:`finish_if_acked` found: latencies of the commands completed now, and the erasure commands."""

    completed_s: list[float] = field(default_factory=list)
    subject_command_ids: list[uuid.UUID] = field(default_factory=list)
    """The commands among those given that carry a subject predicate (erasures and their re-sends),
    complete or not: only their acks can advance an erasure."""


async def finish_if_acked(session: AsyncSession, command_ids: Iterable[uuid.UUID], now: datetime) -> Finished:
    """Set each command's status from its targets.

    ``complete`` when every target acked with verified evidence (a namespace drained
    by it becomes ``retired``), ``failed`` while some target reported an unverified
    post-check, else still ``pending``.
    """
    ids = sorted(set(command_ids))
    if not ids:
        return Finished()
    rows = (await session.execute(_LOCK_INVALIDATIONS, {"command_ids": ids})).all()
    found = {row.command_id for row in rows}
    missing = [command_id for command_id in ids if command_id not in found]
    assert not missing, f"target rows of {missing[0]} without an invalidation"
    counts = {row.command_id: (row.pending, row.failed) for row in await session.execute(_TARGET_COUNTS, {"command_ids": ids})}
    finished = Finished(subject_command_ids=[row.command_id for row in rows if row.kind == "subject"])
    complete: list[uuid.UUID] = []
    failed: list[uuid.UUID] = []
    namespaces: list[uuid.UUID] = []
    for row in rows:
        if row.status == InvalidationStatus.COMPLETE:
            continue
        pending, failures = counts.get(row.command_id, (0, 0))
        if pending == 0 and failures == 0:
            complete.append(row.command_id)
            finished.completed_s.append((now - row.created_at).total_seconds())
            if row.kind == "namespace":
                namespaces.append(row.command_id)
        elif failures:
            failed.append(row.command_id)
    if complete:
        await session.execute(_COMPLETE, {"now": now, "command_ids": complete})
    if failed:
        await session.execute(_FAIL, {"command_ids": failed})
    if namespaces:
        await session.execute(_RETIRE_NAMESPACES, {"now": now, "command_ids": namespaces})
    return finished


_DECISION_EVENTS = (DocumentUpdated, DocumentDeleted, PermissionRevoked, ErasureRequested)


class ErasureHooks(Protocol):
    """What the handler needs of ``coordinator.erasure.ErasureService`` (a protocol: that module imports this one)."""

    async def start_from_event(self, session: AsyncSession, envelope: Envelope, now: datetime) -> tuple[str, Decision | None]:
        """Start the requested erasure in the batch's transaction (decision lock held): outcome and decision."""

    async def acks_applied(self, command_ids: Iterable[uuid.UUID]) -> None:
        """Called after an ack batch committed, with the erasure (subject) commands it touched; often none."""


@dataclass(slots=True)
class _BatchResult:
    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    decisions: list[Decision] = field(default_factory=list)
    leased: list[tuple[int, Envelope]] = field(default_factory=list)
    """Outbox rows (id, command) this process publishes itself once the batch committed."""
    finished: Finished = field(default_factory=Finished)
    copies_deleted: int = 0


def _record_metrics(result: _BatchResult) -> None:
    """Only after the commit: a rolled-back batch is redelivered and counted then."""
    for (event_type, outcome), count in result.outcomes.items():
        metrics.INVALIDATION_EVENTS_TOTAL.labels(type=event_type, outcome=outcome).inc(count)
    for decision in result.decisions:
        metrics.INVALIDATIONS_TOTAL.labels(kind=decision.kind, trigger=decision.trigger).inc()
    for seconds in result.finished.completed_s:
        metrics.INVALIDATION_SECONDS.observe(seconds)
    metrics.PLACEMENT_CHANGES_TOTAL.labels(state=PlacementState.DELETED, cause="invalidation").inc(result.copies_deleted)


class InvalidationHandler:
    """Batch handler of the coordinator's decisions consumer (documents, permissions, erasures) and of its ack
    consumer; commits before returning.

    Erasure requests are decided like the other user events (decision lock, same
    transaction as their inbox rows) by ``erasures``, which is also told about every
    committed ack batch so it can verify the erasures those acks advance.
    """

    def __init__(
        self,
        database: Database,
        *,
        erasures: ErasureHooks,
        command_signer: EnvelopeSigner,
        on_outbox: Callable[[], None] | None = None,
        publish_leased: Callable[[list[tuple[int, Envelope]]], None] | None = None,
        outbox_lease_s: float = 10.0,
    ) -> None:
        """``publish_leased`` (the relay's): the document and permission commands are leased in the
        deciding transaction and handed to it after the commit, instead of waiting for the relay."""
        if outbox_lease_s <= 0:
            raise ValueError("outbox_lease_s must be positive")
        self._database = database
        self._erasures = erasures
        self._sign = command_signer
        self._on_outbox = on_outbox
        self._publish_leased = publish_leased
        self._outbox_lease = timedelta(seconds=outbox_lease_s)

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        """Decide the batch's user events in one transaction, then apply its acks in another.

        Two transactions so the commands are published (the outbox relay is woken) as soon as
        the decisions commit, not after the acks that arrived with them; and so an ack batch
        holds the ledger-writes lock only for its own statements. Redelivery after a failure
        between the two is safe: the inbox turns the committed half into duplicates.

        Only acks read from ``kvledger.acks`` are acks: that consumer passes on only those
        signed by their node's enrolled key (``coordinator.node_keys.VerifiedRecords``). A
        ``CommandAck`` put on a customer topic is ignored like any other misplaced type.
        """
        if not events:
            return
        started = time.perf_counter()
        acks, others = [], []
        for event in events:
            is_ack = event.topic == ACKS and isinstance(event.envelope.payload, CommandAck)
            (acks if is_ack else others).append(event)
        if others:
            await self._decide_batch(others)
        if acks:
            await self._ack_batch(acks)
        metrics.INVALIDATION_BATCH_SECONDS.observe(time.perf_counter() - started)

    async def _decide_batch(self, events: list[ConsumedEvent]) -> None:
        result = _BatchResult()
        async with self._database.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            fresh = await inbox.claim(session, events, result.outcomes)
            deciding = [e for e in fresh if isinstance(e.payload, _DECISION_EVENTS)]
            for envelope in fresh:
                if not isinstance(envelope.payload, _DECISION_EVENTS):
                    log.warning("ignoring %s event on an invalidation topic", envelope.type)
                    result.outcomes[(envelope.type, IGNORED)] += 1
            if deciding:
                await lock_decisions(session)
            # Consecutive document/permission events are decided together (a few statements for
            # the whole run); an erasure in between is decided on its own, so the order holds.
            run: list[Envelope] = []
            for envelope in deciding:
                if isinstance(envelope.payload, ErasureRequested):
                    await self._decide_many(session, run, now, result)
                    run = []
                    outcome, decision = await self._erasures.start_from_event(session, envelope, now)
                    result.decisions.extend([decision] if decision is not None else [])
                    result.outcomes[(envelope.type, outcome)] += 1
                else:
                    run.append(envelope)
            await self._decide_many(session, run, now, result)
        fault_point("coordinator.after_decision_commit")
        _record_metrics(result)
        if result.leased:
            self._publish_leased(result.leased)
        if len(result.decisions) > len(result.leased) and self._on_outbox is not None:
            self._on_outbox()

    async def _ack_batch(self, events: list[ConsumedEvent]) -> None:
        result = _BatchResult()
        async with self._database.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            acks = await inbox.claim(session, events, result.outcomes)
            if acks:
                touched = await self._apply_acks(session, acks, now, result)
                result.finished = await finish_if_acked(session, touched, now)
        _record_metrics(result)
        await self._erasures.acks_applied(result.finished.subject_command_ids)

    # -- decisions -----------------------------------------------------------------

    async def _decide_many(self, session: AsyncSession, envelopes: list[Envelope], now: datetime, result: _BatchResult) -> None:
        """Decide document/permission events in order: one read of the current versions, one statement for every write.

        The same rows as deciding each event in turn (:func:`decide`, then the upsert of the
        new current version): an event superseded by the recorded version *or by an earlier
        event of the batch* is ignored, a placement matched by several decisions keeps the
        last one's command id, and the current version is the last applied event's.
        """
        if not envelopes:
            return
        doc_keys = sorted({(e.tenant_id, e.payload.doc_id) for e in envelopes if isinstance(e.payload, (DocumentUpdated, DocumentDeleted))})
        policy_keys = sorted({(e.tenant_id, e.payload.auth_scope) for e in envelopes if isinstance(e.payload, PermissionRevoked)})
        documents: dict[tuple[str, str], tuple[int, bool]] = {}
        policies: dict[tuple[str, str], int] = {}
        if doc_keys:
            rows = await session.execute(_LOAD_DOCUMENTS, {"tenants": [k[0] for k in doc_keys], "keys": [k[1] for k in doc_keys]})
            documents = {(row.tenant_id, row.doc_id): (row.version, row.deleted) for row in rows}
        if policy_keys:
            rows = await session.execute(_LOAD_POLICIES, {"tenants": [k[0] for k in policy_keys], "keys": [k[1] for k in policy_keys]})
            policies = {(row.tenant_id, row.auth_scope): row.policy_version for row in rows}
        decided: list[tuple[Envelope, Predicate, uuid.UUID]] = []
        document_ids: dict[tuple[str, str], uuid.UUID] = {}
        policy_ids: dict[tuple[str, str], uuid.UUID] = {}
        for envelope in envelopes:
            payload, tenant = envelope.payload, envelope.tenant_id
            assert tenant is not None, "the contract requires tenant_id on user events"
            command_id = uuid.uuid4()
            match payload:
                case DocumentUpdated():
                    key = (tenant, payload.doc_id)
                    current = documents.get(key)
                    if current is not None and payload.version <= current[0]:
                        result.outcomes[(envelope.type, SUPERSEDED)] += 1
                        continue
                    predicate = DocumentPredicate(tenant=tenant, doc_id=payload.doc_id, below_version=payload.version)
                    documents[key] = (payload.version, False)
                    document_ids[key] = command_id
                case DocumentDeleted():
                    key = (tenant, payload.doc_id)
                    current = documents.get(key)
                    if current is not None and current[1]:
                        result.outcomes[(envelope.type, SUPERSEDED)] += 1
                        continue
                    predicate = DocumentPredicate(tenant=tenant, doc_id=payload.doc_id, below_version=ANY_VERSION)
                    documents[key] = (current[0] if current is not None else 0, True)
                    document_ids[key] = command_id
                case PermissionRevoked():
                    # ``subject_id`` narrows who lost access, but tenant-scope blocks record the
                    # (auth scope, policy version) they were built under, not who built or read
                    # them: nothing in the ledger or on a node can tell which of them the subject
                    # could read. The policy version moves for the whole scope (tokens of older
                    # versions are refused), so every older block is unreachable anyway; deleting
                    # them all is the safe superset and costs only recomputation. The raw subject
                    # is therefore neither stored nor logged.
                    key = (tenant, payload.auth_scope)
                    current_version = policies.get(key)
                    if current_version is not None and payload.policy_version <= current_version:
                        result.outcomes[(envelope.type, SUPERSEDED)] += 1
                        continue
                    predicate = PolicyPredicate(tenant=tenant, auth_scope=payload.auth_scope, below_version=payload.policy_version)
                    policies[key] = payload.policy_version
                    policy_ids[key] = command_id
                case _:
                    raise AssertionError(f"not a decision event: {envelope.type}")
            decided.append((envelope, predicate, command_id))
            result.outcomes[(envelope.type, APPLIED)] += 1
        if not decided:
            return
        marks: dict[str, list] = {
            name: []
            for name in (
                "d_command_ids",
                "d_tenants",
                "d_doc_ids",
                "d_below",
                "d_ord",
                "p_command_ids",
                "p_tenants",
                "p_scopes",
                "p_below",
                "p_ord",
            )
        }
        for ordinal, (_, predicate, command_id) in enumerate(decided):
            prefix = "d_" if isinstance(predicate, DocumentPredicate) else "p_"
            marks[prefix + "command_ids"].append(command_id)
            marks[prefix + "tenants"].append(predicate.tenant)
            marks[prefix + "doc_ids" if prefix == "d_" else "p_scopes"].append(predicate.doc_id if prefix == "d_" else predicate.auth_scope)
            marks[prefix + "below"].append(predicate.below_version)
            marks[prefix + "ord"].append(ordinal)
        commands = [
            self._sign(make_event(Invalidate(command_id=command_id, predicate=predicate, cutoff=now), tenant_id=predicate.tenant))
            for _, predicate, command_id in decided
        ]
        outbox = [outbox_row(command) for command in commands]
        document_keys, policy_keys = sorted(document_ids), sorted(policy_ids)
        rows = await session.execute(
            _DECIDE,
            {
                "now": now,
                "command_ids": [command_id for _, _, command_id in decided],
                "kinds": [predicate.kind for _, predicate, _ in decided],
                "predicates": [json.dumps(predicate.model_dump(mode="json")) for _, predicate, _ in decided],
                "source_event_ids": [envelope.event_id for envelope, _, _ in decided],
                "requested_at": [envelope.occurred_at for envelope, _, _ in decided],
                **marks,
                "doc_tenants": [k[0] for k in document_keys],
                "doc_ids": [k[1] for k in document_keys],
                "doc_versions": [documents[k][0] for k in document_keys],
                "doc_deleted": [documents[k][1] for k in document_keys],
                "doc_invalidation_ids": [document_ids[k] for k in document_keys],
                "policy_tenants": [k[0] for k in policy_keys],
                "policy_scopes": [k[1] for k in policy_keys],
                "policy_versions": [policies[k] for k in policy_keys],
                "policy_invalidation_ids": [policy_ids[k] for k in policy_keys],
                "lease_until": None if self._publish_leased is None else now + self._outbox_lease,
                "topics": [row["topic"] for row in outbox],
                "keys": [row["key"] for row in outbox],
                "payloads": [json.dumps(row["payload"]) for row in outbox],
            },
        )
        targets: collections.Counter[uuid.UUID] = collections.Counter()
        outbox_ids: dict[str, int] = {}
        for row in rows:
            if row.row_kind == "target":
                targets[uuid.UUID(row.ref)] += 1
            else:
                outbox_ids[row.ref] = row.outbox_id
        if self._publish_leased is not None:
            result.leased.extend((outbox_ids[str(command.event_id)], command) for command in commands)
        result.decisions.extend(Decision(command_id, predicate.kind, "event", targets[command_id]) for _, predicate, command_id in decided)

    # -- acks ----------------------------------------------------------------------

    async def _apply_acks(self, session: AsyncSession, acks: list[Envelope], now: datetime, result: _BatchResult) -> set[uuid.UUID]:
        """Record each ack on its target row and delete the copies it verified; returns commands touched.

        In ack order, with one statement per step for the whole batch: the targets are
        locked and read at once, folded in order here (a second ack of a target already
        acked is a duplicate, one after a failure replaces it), then written at once.
        Leaves the ledger-writes lock held (taken before the copies are deleted) for
        the caller's completion of the commands.
        """
        node_ids = sorted({ack.payload.node_id for ack in acks})
        # Same lock as a kv-events batch of these nodes, so acks and block events of one node serialize.
        await session.execute(select(Node.node_id).where(Node.node_id.in_(node_ids)).order_by(Node.node_id).with_for_update(key_share=True))
        keys = sorted({(ack.payload.command_id, ack.payload.node_id) for ack in acks})
        rows = await session.execute(_LOCK_TARGETS, {"command_ids": [k[0] for k in keys], "node_ids": [k[1] for k in keys]})
        status = {(row.command_id, row.node_id): row.status for row in rows}
        updates: dict[tuple[uuid.UUID, str], tuple[str, int, str, str | None]] = {}
        copies: dict[str, list] = collections.defaultdict(list)
        touched: set[uuid.UUID] = set()
        for envelope in acks:
            ack: CommandAck = envelope.payload
            key = (ack.command_id, ack.node_id)
            current = status.get(key)
            if current is None:
                # Not a command of this ledger, or a node registered after the decision.
                result.outcomes[(envelope.type, UNEXPECTED)] += 1
                continue
            if current == TargetStatus.ACKED:
                result.outcomes[(envelope.type, inbox.DUPLICATE)] += 1
                continue
            verified = all(evidence.verified for evidence in ack.evidence)
            status[key] = TargetStatus.ACKED if verified else TargetStatus.FAILED
            updates[key] = (
                status[key],
                ack.epoch,
                json.dumps([evidence.model_dump(mode="json") for evidence in ack.evidence]),
                None if envelope.signature is None else envelope.signature.kid,
            )
            for evidence in ack.evidence:
                if evidence.verified and evidence.block_hashes:
                    for block_hash in evidence.block_hashes:
                        copies["node_ids"].append(ack.node_id)
                        copies["tiers"].append(evidence.tier)
                        copies["hashes"].append(bytes.fromhex(block_hash))
                        copies["command_ids"].append(ack.command_id)
            touched.add(ack.command_id)
            result.outcomes[(envelope.type, APPLIED if verified else "unverified")] += 1
        if updates:
            await session.execute(
                _UPDATE_TARGETS,
                {
                    "now": now,
                    "command_ids": [k[0] for k in updates],
                    "node_ids": [k[1] for k in updates],
                    "statuses": [v[0] for v in updates.values()],
                    "epochs": [v[1] for v in updates.values()],
                    "evidence": [v[2] for v in updates.values()],
                    "key_ids": [v[3] for v in updates.values()],
                },
            )
        fault_point("coordinator.mid_ack_batch")
        await lock_ledger_writes(session)
        if copies:
            deleted = await session.execute(_DELETE_COPIES, {"now": now, **copies})
            result.copies_deleted += len(deleted.all())
        return touched


def live_copies_matching(predicate: Predicate) -> Select:
    """(node, tier, count) of live placements of blocks ``predicate`` covers — what the ledger says remains."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.state == PlacementState.LIVE, Placement.block_hash.in_(matching_blocks(predicate)))
        .group_by(Placement.node_id, Placement.tier)
    )


def deleted_by(command_id: uuid.UUID) -> Select:
    """(node, tier, count) of placements this command's acks deleted."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.invalidation_id == command_id, Placement.state == PlacementState.DELETED)
        .group_by(Placement.node_id, Placement.tier)
    )
