"""The decision rule: which live copies an invalidation covers, and recording decisions (docs/design.md §5, §6).

A decision is one database transaction's work: an ``invalidations`` row, one
``invalidation_targets`` row per registered node, the matching live placements marked with
the command id, and the signed :class:`events.schema.Invalidate` in the outbox — so the
decision and the command exist together or not at all. The caller owns the transaction
and holds the decision lock (:func:`coordinator.ledger.transactions.lock_decisions`).

One rule, two paths: :func:`decide` records one predicate (API decisions, erasures,
namespace retirement, late-block re-sends), matching blocks with :func:`matching_blocks`;
:func:`decide_many` records a batch of document/permission events in one statement. A
property test (``tests/coordinator/handlers/test_decision_equivalence.py``) holds them to the same rows.

Versions only move forward: an update to a version not above the recorded one is
ignored (it is a replay or arrived out of order), so a late, older event can never
resurrect superseded data.

Nothing here consumes events or acks: the erasure code (:mod:`coordinator.handlers.erasure`), the
ack code (:mod:`coordinator.handlers.acks`) and the consumers' handler (:mod:`coordinator.handlers.invalidation`)
build on this module, never the other way round (an import-linter contract keeps it so).
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

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

from coordinator.handlers.outbox import outbox_row
from coordinator.ledger.models import (
    Block,
    BlockAuthScope,
    BlockCreator,
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
from coordinator.ledger.states import (
    ErasureStatus,
    InvalidationStatus,
    NamespaceStatus,
    PlacementState,
    TargetStatus,
)
from events.schema import (
    ANY_VERSION,
    DocumentDeleted,
    DocumentPredicate,
    DocumentUpdated,
    Envelope,
    Invalidate,
    NamespacePredicate,
    PermissionRevoked,
    PolicyPredicate,
    Predicate,
    SubjectPredicate,
    TenantPredicate,
    make_event,
)
from identity.signing import EnvelopeSigner

_MAX_HASHES_PER_STATEMENT = 5000
"""Keeps ``IN`` lists of block hashes well under asyncpg's 32767 bind parameters."""

_PREDICATE = TypeAdapter(Predicate)

APPLIED = "applied"
SUPERSEDED = "superseded"

# --------------------------------------------------------------------------- the bulk statements
# (one per batch)
#
# Fixed SQL text with array parameters: one prepared statement whatever the batch size (no
# per-size compilation, no bind-count limit), one round trip per step instead of one per event.

_UUIDS = ARRAY(Uuid())
_TEXTS = ARRAY(Text())
_BIGINTS = ARRAY(BigInteger())
_TIMES = ARRAY(DateTime(timezone=True))

_LOAD_DOCUMENTS = text(
    "SELECT d.tenant_id, d.doc_id, d.version, d.deleted FROM documents d"
    " JOIN unnest(:tenants, :keys) AS k(tenant_id, doc_id) ON d.tenant_id = k.tenant_id AND d.doc_id = k.doc_id"
).bindparams(bindparam("tenants", type_=_TEXTS), bindparam("keys", type_=_TEXTS))
_LOAD_POLICIES = text(
    "SELECT p.tenant_id, p.auth_scope, p.policy_version FROM policies p"
    " JOIN unnest(:tenants, :keys)"
    " AS k(tenant_id, auth_scope) ON p.tenant_id = k.tenant_id AND p.auth_scope = k.auth_scope"
).bindparams(bindparam("tenants", type_=_TEXTS), bindparam("keys", type_=_TEXTS))
_DECIDE = (
    text(
        # Every write of a batch of document/permission decisions in one statement (one round trip,
        # not six, inside the transaction every invalidation waits for). Data-modifying CTEs all run
        # to completion on one snapshot; the foreign keys to the new invalidations are checked at
        # the end of the statement, when they exist. A decision with no registered node to wait for
        # is complete at once.
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


def parse_predicate(data: dict) -> Predicate:
    return _PREDICATE.validate_python(data)


def matching_blocks(predicate: Predicate) -> Select:
    """Hashes of the ledger's blocks that ``predicate`` covers, whenever they were built.

    No predicate compares a block's ``created_at`` with the decision's time: that is
    the node's clock against the database's (docs/design.md §5, "Cutoffs"). A block
    holding a superseded version, or living in a retired namespace, is stale whenever
    it was built; the blocks of a subject or tenant that the ledger holds at the
    decision were built before it, by the ledger's own order. Which copies recorded
    later an erasure still waits for is :func:`coordinator.handlers.erasure.progress`'s rule.
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
            return user_blocks(predicate).union(created_blocks(predicate))
        case NamespacePredicate():
            return select(Block.block_hash).where(Block.namespace == predicate.ns)
        case TenantPredicate():
            return select(Block.block_hash).where(Block.tenant_id == predicate.tenant)
    raise AssertionError(f"no ledger match for predicate {predicate!r}")


def user_blocks(predicate: SubjectPredicate) -> Select:
    """The subject's user-scope blocks: salted with the subject, so no other subject ever has them."""
    return select(Block.block_hash).where(
        Block.tenant_id == predicate.tenant,
        Block.subject_hash == bytes.fromhex(predicate.subject_id),
    )


def created_blocks(predicate: SubjectPredicate) -> Select:
    """Blocks of any scope that a node reported the subject's requests created (``block_creators``).

    A public or tenant block is shared: other subjects may hit the same copy, and other nodes
    hold copies of their own that someone else created. An erasure removes every copy the
    subject created, and the nodes recompute the block for its next caller.
    """
    return select(BlockCreator.block_hash).where(
        BlockCreator.subject_hash == bytes.fromhex(predicate.subject_id)
    )


def acked_erasure_command(
    erasure_command_id: ColumnElement[uuid.UUID], node_id: ColumnElement[str]
) -> Exists:
    """Whether ``node_id`` acked the erasure command ``erasure_command_id`` or one of its re-sends (SQL expressions)."""
    return exists().where(
        InvalidationTarget.node_id == node_id,
        InvalidationTarget.status == TargetStatus.ACKED,
        InvalidationTarget.command_id.in_(
            select(Invalidation.command_id).where(
                or_(
                    Invalidation.command_id == erasure_command_id,
                    Invalidation.parent_command_id == erasure_command_id,
                )
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

    The cutoff is ``now`` (the deciding transaction's database time, the same clock for every
    coordinator replica); it dates and orders the decision, and no node compares its own blocks'
    times with it (a node removes what it holds when it applies the command). Expected nodes are all
    nodes registered now: one that is down keeps the command pending until it returns, replays and
    acks. With no node registered the command is complete at once (nothing can hold a copy). The
    caller owns the transaction and the locking
    (:func:`coordinator.ledger.transactions.lock_decisions`); the command is signed with ``signer``
    (the coordinator's command key) before it enters the outbox."""
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
            ["command_id", "node_id"],
            select(literal(command_id, InvalidationTarget.command_id.type), Node.node_id),
        )
        .returning(InvalidationTarget.node_id)
    )
    num_targets = len(targets.all())
    if num_targets == 0:
        await session.execute(
            update(Invalidation)
            .where(Invalidation.command_id == command_id)
            .values(status=InvalidationStatus.COMPLETE, completed_at=now)
        )
    await session.execute(
        update(Placement)
        .where(
            Placement.state == PlacementState.LIVE,
            Placement.block_hash.in_(matching_blocks(predicate)),
        )
        .values(invalidation_id=command_id)
    )
    tenant = getattr(predicate, "tenant", None)
    command = signer(
        make_event(
            Invalidate(command_id=command_id, predicate=predicate, cutoff=now), tenant_id=tenant
        )
    )
    await session.execute(pg_insert(OutboxEntry).values(outbox_row(command)))
    return Decision(command_id, predicate.kind, trigger, num_targets)


async def reissue_for_late_blocks(
    session: AsyncSession, hashes: Iterable[bytes], now: datetime, signer: EnvelopeSigner
) -> list[Decision]:
    """Re-send decided predicates that blocks stored in this batch still match (docs/design.md §6, late events).

    A block is late when its provenance was superseded by a decision already taken:
    a document version below the recorded one (or a deleted document), a policy
    version below the recorded one, a namespace that is draining or retired, or a
    subject with an erasure not yet verified whose live copy is on a node that has not
    acked any of the erasure's commands — a node acks only after removing every copy it
    held when it applied the command, so after its ack its new copies are the subject's
    new data, whatever their ``created_at`` says (its re-send names the erasure's command
    as parent, which keeps the erasure from being verified until every node acked it
    too) — the subject's user blocks, and any block a node reported the subject created
    (:func:`created_blocks`). A node
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
        in_chunk = Block.block_hash == any_(
            bindparam("late_hashes", chunk, type_=ARRAY(LargeBinary))
        )
        documents = (
            select(Document.invalidation_id)
            .join(BlockDocument, BlockDocument.doc_id == Document.doc_id)
            .join(
                Block,
                and_(
                    Block.block_hash == BlockDocument.block_hash,
                    Block.tenant_id == Document.tenant_id,
                ),
            )
            .where(
                in_chunk,
                Document.invalidation_id.is_not(None),
                or_(Document.deleted, BlockDocument.version < Document.version),
            )
        )
        policies = (
            select(Policy.invalidation_id)
            .join(BlockAuthScope, BlockAuthScope.auth_scope == Policy.auth_scope)
            .join(
                Block,
                and_(
                    Block.block_hash == BlockAuthScope.block_hash,
                    Block.tenant_id == Policy.tenant_id,
                ),
            )
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
            .join(
                Block,
                and_(
                    Block.tenant_id == Erasure.tenant_id, Block.subject_hash == Erasure.subject_hash
                ),
            )
            .join(
                Placement,
                and_(
                    Placement.block_hash == Block.block_hash, Placement.state == PlacementState.LIVE
                ),
            )
            .where(
                in_chunk,
                Erasure.status != ErasureStatus.VERIFIED,
                ~acked_erasure_command(Erasure.command_id, Placement.node_id),
            )
        )
        created = (
            select(Erasure.command_id)
            .join(BlockCreator, BlockCreator.subject_hash == Erasure.subject_hash)
            .join(
                Placement,
                and_(
                    Placement.block_hash == BlockCreator.block_hash,
                    Placement.state == PlacementState.LIVE,
                ),
            )
            .where(
                BlockCreator.block_hash
                == any_(bindparam("late_created_hashes", chunk, type_=ARRAY(LargeBinary))),
                Erasure.status != ErasureStatus.VERIFIED,
                ~acked_erasure_command(Erasure.command_id, Placement.node_id),
            )
        )
        originals.update(
            (await session.scalars(documents.union(policies, namespaces, erasures, created))).all()
        )
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
            signer=signer,
            now=now,
            trigger="late_block",
            requested_at=now,
            parent_command_id=row.command_id,
        )
        for row in rows
    ]


@dataclass(slots=True)
class BulkDecisions:
    """What :func:`decide_many` decided, in event order."""

    decisions: list[Decision] = field(default_factory=list)
    queued: list[tuple[int, Envelope]] = field(default_factory=list)
    """(outbox id, signed command) of each decision: a caller that leased them publishes them itself
    after the commit."""


async def decide_many(
    session: AsyncSession,
    envelopes: list[Envelope],
    now: datetime,
    *,
    signer: EnvelopeSigner,
    lease_until: datetime | None,
    outcomes: collections.Counter[tuple[str, str]],
) -> BulkDecisions:
    """Decide document/permission events in order: one read of the current versions, one statement for every write.

    The same rows as deciding each event in turn (:func:`decide`, then the upsert of the
    new current version): an event superseded by the recorded version *or by an earlier
    event of the batch* is ignored, a placement matched by several decisions keeps the
    last one's command id, and the current version is the last applied event's.
    """
    if not envelopes:
        return BulkDecisions()
    documents, policies = await _current_versions(session, envelopes)
    decided, document_ids, policy_ids = _in_order(envelopes, documents, policies, outcomes)
    if not decided:
        return BulkDecisions()
    marks = _mark_arrays(decided)
    commands = [
        signer(
            make_event(
                Invalidate(command_id=command_id, predicate=predicate, cutoff=now),
                tenant_id=predicate.tenant,
            )
        )
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
            "predicates": [
                json.dumps(predicate.model_dump(mode="json")) for _, predicate, _ in decided
            ],
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
            "lease_until": lease_until,
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
    return BulkDecisions(
        decisions=[
            Decision(command_id, predicate.kind, "event", targets[command_id])
            for _, predicate, command_id in decided
        ],
        queued=[(outbox_ids[str(command.event_id)], command) for command in commands],
    )


_Decided = list[tuple[Envelope, Predicate, uuid.UUID]]
"""The events of a batch that apply, in order, each with its predicate and new command id."""


async def _current_versions(
    session: AsyncSession, envelopes: list[Envelope]
) -> tuple[dict[tuple[str, str], tuple[int, bool]], dict[tuple[str, str], int]]:
    """The recorded (version, deleted) of every document and the policy version of every scope the
    batch names."""
    doc_keys = sorted(
        {
            (e.tenant_id, e.payload.doc_id)
            for e in envelopes
            if isinstance(e.payload, (DocumentUpdated, DocumentDeleted))
        }
    )
    policy_keys = sorted(
        {
            (e.tenant_id, e.payload.auth_scope)
            for e in envelopes
            if isinstance(e.payload, PermissionRevoked)
        }
    )
    documents: dict[tuple[str, str], tuple[int, bool]] = {}
    policies: dict[tuple[str, str], int] = {}
    if doc_keys:
        rows = await session.execute(
            _LOAD_DOCUMENTS, {"tenants": [k[0] for k in doc_keys], "keys": [k[1] for k in doc_keys]}
        )
        documents = {(row.tenant_id, row.doc_id): (row.version, row.deleted) for row in rows}
    if policy_keys:
        rows = await session.execute(
            _LOAD_POLICIES,
            {"tenants": [k[0] for k in policy_keys], "keys": [k[1] for k in policy_keys]},
        )
        policies = {(row.tenant_id, row.auth_scope): row.policy_version for row in rows}
    return documents, policies


def _in_order(
    envelopes: list[Envelope],
    documents: dict[tuple[str, str], tuple[int, bool]],
    policies: dict[tuple[str, str], int],
    outcomes: collections.Counter[tuple[str, str]],
) -> tuple[_Decided, dict[tuple[str, str], uuid.UUID], dict[tuple[str, str], uuid.UUID]]:
    """Decide each event against the versions recorded *and* those of the batch's earlier events, which
    ``documents``/``policies`` are advanced to; returns the events that apply and, per document and per
    scope, the command id of the last one (the current version's invalidation)."""
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
                    outcomes[(envelope.type, SUPERSEDED)] += 1
                    continue
                predicate = DocumentPredicate(
                    tenant=tenant, doc_id=payload.doc_id, below_version=payload.version
                )
                documents[key] = (payload.version, False)
                document_ids[key] = command_id
            case DocumentDeleted():
                key = (tenant, payload.doc_id)
                current = documents.get(key)
                if current is not None and current[1]:
                    outcomes[(envelope.type, SUPERSEDED)] += 1
                    continue
                predicate = DocumentPredicate(
                    tenant=tenant, doc_id=payload.doc_id, below_version=ANY_VERSION
                )
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
                    outcomes[(envelope.type, SUPERSEDED)] += 1
                    continue
                predicate = PolicyPredicate(
                    tenant=tenant,
                    auth_scope=payload.auth_scope,
                    below_version=payload.policy_version,
                )
                policies[key] = payload.policy_version
                policy_ids[key] = command_id
            case _:
                raise AssertionError(f"not a decision event: {envelope.type}")
        decided.append((envelope, predicate, command_id))
        outcomes[(envelope.type, APPLIED)] += 1
    return decided, document_ids, policy_ids


def _mark_arrays(decided: _Decided) -> dict[str, list]:
    """The decided predicates as the parallel arrays ``_DECIDE`` unnests (``d_*``: documents, ``p_*``: policies),
    each with the event's ordinal so a placement matched by several keeps the last command id."""
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
        marks[prefix + "doc_ids" if prefix == "d_" else "p_scopes"].append(
            predicate.doc_id if prefix == "d_" else predicate.auth_scope
        )
        marks[prefix + "below"].append(predicate.below_version)
        marks[prefix + "ord"].append(ordinal)
    return marks


def live_copies_matching(predicate: Predicate) -> Select:
    """(node, tier, count) of live placements of blocks ``predicate`` covers — what the ledger says
    remains."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(
            Placement.state == PlacementState.LIVE,
            Placement.block_hash.in_(matching_blocks(predicate)),
        )
        .group_by(Placement.node_id, Placement.tier)
    )


def deleted_by(command_id: uuid.UUID) -> Select:
    """(node, tier, count) of placements this command's acks deleted."""
    return (
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.invalidation_id == command_id, Placement.state == PlacementState.DELETED)
        .group_by(Placement.node_id, Placement.tier)
    )
