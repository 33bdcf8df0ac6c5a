"""Acks: recording nodes' answers to commands and completing the commands (docs/design.md §5, §6).

Nodes answer every ``Invalidate`` on ``kvledger.acks``. An ack with verified evidence
marks the node's target row ``acked`` and the node's removed copies ``deleted``; one with
an unverified post-check marks it ``failed``. A command is ``complete`` once every
expected node acked (a namespace it drained becomes ``retired``).

An ack too large for one record arrives as parts (``events.ack_parts``): each part is staged in
``ack_parts`` and counts for nothing until every part of that ack is in; then the parts' evidence is
merged into one entry per tier and the ack is applied like an ack of one record. A lost part leaves
the target pending, so the command is re-sent (``coordinator.handlers.resend``) and the node
re-sends every part of the same ack: the staged ones are duplicates.

An ack names the last kv-event ``seq`` the node had published when it built it (its fence,
``CommandAck.after_seq``). Acks and kv-events travel on different topics to different consumer
groups, so an ack may overtake the very events it is fenced behind — the ``SnapshotWritten`` of
a snapshot it rewrote, the ``BlockRemoved`` of its removals. Applied then, it would delete
nothing and leave copies live in the ledger that the node no longer holds. So an ack whose
node's ledger row has not reached its fence (same epoch, lower ``last_seq``) is *deferred*: held
whole in ``deferred_acks``, its target still pending, and applied by
:func:`release_deferred_acks` once the node's kv-events catch up (the kv-events consumer wakes
it after every batch; a node's heartbeats keep its row moving). Applied after its fence, a
fenced ack deletes only the snapshot copies it lists: the node's block events already deleted
its pool copies (device, host, disk), and deleting by hash again could delete a copy of the same
block the node stored after its removal. An ack without a fence (a node that predates it)
deletes every copy it lists, at once.

Locking: the node rows first (the same lock a kv-events batch of those nodes takes, so a
node's acks and block events serialize), then the target rows, then the ledger-writes
lock right before the placements (:mod:`coordinator.ledger.transactions` states the order and why).
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    LargeBinary,
    Text,
    Uuid,
    bindparam,
    delete,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.handlers.decisions import APPLIED
from coordinator.ledger import inbox
from coordinator.ledger.models import AckPart, DeferredAck, Node
from coordinator.ledger.states import InvalidationStatus, NamespaceStatus, TargetStatus
from coordinator.ledger.transactions import lock_ledger_writes
from events.ack_parts import merge_evidence
from events.fault_points import fault_point
from events.schema import CommandAck, Envelope
from events.tiers import Tier

UNEXPECTED = "unexpected"
UNVERIFIED = "unverified"
PART_STAGED = "part_staged"
"""Outcome of an ack part that was staged while other parts of its ack are still missing."""
DEFERRED = "deferred"
"""Outcome of an ack held in ``deferred_acks`` until the ledger has its node's events up to its
fence."""
RELEASED = "released"
"""Outcome of a deferred ack applied once its node's events caught up."""

# Fixed SQL text with array parameters: one prepared statement per step whatever the batch size.

_UUIDS = ARRAY(Uuid())
_TEXTS = ARRAY(Text())
_BIGINTS = ARRAY(BigInteger())
_BYTEAS = ARRAY(LargeBinary())

_COMPLETE = text(
    "UPDATE invalidations SET status = 'complete', completed_at = :now WHERE command_id = ANY(:command_ids)"
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)), bindparam("command_ids", type_=_UUIDS)
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
    # A copy listed by several acks of the batch is deleted by the first, as applying them in turn
    # does. Each copy is probed by its hash alone (a LATERAL lookup behind an ``OFFSET 0`` fence),
    # which only the (block_hash, ...) unique index serves. Without statistics (right after a fill)
    # the planner otherwise chose badly: given node, tier and state too, the (node, tier, state)
    # index, reading every live placement of the node; given ``block_hash = ANY(...)``, a scan of
    # the whole table.
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
_FAIL = text(
    "UPDATE invalidations SET status = 'failed' WHERE command_id = ANY(:command_ids)"
).bindparams(bindparam("command_ids", type_=_UUIDS))
_RETIRE_NAMESPACES = text(
    f"UPDATE namespaces SET status = '{NamespaceStatus.RETIRED}', updated_at = :now"
    f" WHERE invalidation_id = ANY(:command_ids) AND status = '{NamespaceStatus.DRAINING}'"
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)), bindparam("command_ids", type_=_UUIDS)
)


@dataclass(slots=True)
class Finished:
    """What :func:`finish_if_acked` found: latencies of the commands completed now, and the erasure
    commands."""

    completed_s: list[float] = field(default_factory=list)
    subject_command_ids: list[uuid.UUID] = field(default_factory=list)
    """The commands among those given that carry a subject predicate (erasures and their re-sends),
    complete or not: only their acks can advance an erasure."""


async def finish_if_acked(
    session: AsyncSession, command_ids: Iterable[uuid.UUID], now: datetime
) -> Finished:
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
    counts = {
        row.command_id: (row.pending, row.failed)
        for row in await session.execute(_TARGET_COUNTS, {"command_ids": ids})
    }
    finished = Finished(
        subject_command_ids=[row.command_id for row in rows if row.kind == "subject"]
    )
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


@dataclass(frozen=True, slots=True)
class _WholeAck:
    """One node's whole answer to one command: an ack of one record, or the merge of every part of
    one."""

    event_type: str
    command_id: uuid.UUID
    node_id: str
    epoch: int
    evidence: list[dict]
    key_id: str | None
    after_seq: int | None

    @classmethod
    def of(cls, envelope: Envelope) -> _WholeAck:
        """An ack of one record, as it is."""
        ack: CommandAck = envelope.payload
        return cls(
            envelope.type,
            ack.command_id,
            ack.node_id,
            ack.epoch,
            [item.model_dump(mode="json") for item in ack.evidence],
            None if envelope.signature is None else envelope.signature.kid,
            ack.after_seq,
        )

    def caught_up(self, position: tuple[int, int]) -> bool:
        """Whether a node whose ledger row is at ``position`` (epoch, last seq) holds every event this ack is fenced behind.

        A later epoch counts: the events of the ack's epoch either were applied before the
        restart or describe bytes the restart already dropped (the new epoch's inventory
        replaces the node's placements).
        """
        if self.after_seq is None:
            return True
        epoch, last_seq = position
        return epoch > self.epoch or (epoch == self.epoch and last_seq >= self.after_seq)

    def deletes(self, tier: str) -> bool:
        """Whether applying this ack deletes its verified copies in ``tier`` (see the module
        docstring)."""
        return self.after_seq is None or tier == Tier.SNAPSHOT


async def _whole_acks(
    session: AsyncSession,
    acks: list[Envelope],
    status: dict[tuple[uuid.UUID, str], str],
    outcomes: collections.Counter[tuple[str, str]],
) -> list[_WholeAck]:
    """The batch's acks as whole acks, in order: parts are staged, and an ack whose last part is in is merged.

    A part of a target that is not pending or failed is counted like an ack of one record
    would be (unexpected, duplicate) and not staged, so ``ack_parts`` only holds parts that
    can still complete an ack.
    """
    whole: list[_WholeAck | tuple[uuid.UUID, str, uuid.UUID, int]] = []
    staging: list[dict] = []
    for envelope in acks:
        ack: CommandAck = envelope.payload
        if ack.parts == 1:
            whole.append(_WholeAck.of(envelope))
            continue
        current = status.get((ack.command_id, ack.node_id))
        if current is None or current == TargetStatus.ACKED:
            outcomes[(envelope.type, UNEXPECTED if current is None else inbox.DUPLICATE)] += 1
            continue
        staging.append(
            {
                "command_id": ack.command_id,
                "node_id": ack.node_id,
                "ack_id": ack.ack_id,
                "part": ack.part,
                "num_parts": ack.parts,
                "epoch": ack.epoch,
                "evidence": [item.model_dump(mode="json") for item in ack.evidence],
                "key_id": None if envelope.signature is None else envelope.signature.kid,
                "after_seq": ack.after_seq,
            }
        )
        whole.append((ack.command_id, ack.node_id, ack.ack_id, ack.part))
    if not staging:
        return [item for item in whole if isinstance(item, _WholeAck)]
    inserted = await session.execute(
        pg_insert(AckPart)
        .values(staging)
        .on_conflict_do_nothing()
        .returning(AckPart.command_id, AckPart.node_id, AckPart.ack_id, AckPart.part)
    )
    staged = {tuple(row) for row in inserted}
    complete = await _complete_parts(
        session, {item[:3] for item in whole if isinstance(item, tuple)}
    )
    result: list[_WholeAck] = []
    for item in whole:
        if isinstance(item, _WholeAck):
            result.append(item)
        elif item[:3] in complete:
            result.append(
                complete.pop(item[:3])
            )  # the first part of the batch that completes it stands for the ack
        else:
            outcomes[(CommandAck.TYPE, PART_STAGED if item in staged else inbox.DUPLICATE)] += 1
    return result


async def _complete_parts(
    session: AsyncSession, ack_keys: set[tuple[uuid.UUID, str, uuid.UUID]]
) -> dict:
    """(command id, node id, ack id) → the merged :class:`_WholeAck` of each of ``ack_keys`` with every part staged."""
    rows = await session.execute(
        select(
            AckPart.command_id,
            AckPart.node_id,
            AckPart.ack_id,
            AckPart.part,
            AckPart.num_parts,
            AckPart.epoch,
            AckPart.evidence,
            AckPart.key_id,
            AckPart.after_seq,
        )
        .where(tuple_(AckPart.command_id, AckPart.node_id, AckPart.ack_id).in_(sorted(ack_keys)))
        .order_by(AckPart.command_id, AckPart.node_id, AckPart.ack_id, AckPart.part)
    )
    staged: dict[tuple[uuid.UUID, str, uuid.UUID], list] = collections.defaultdict(list)
    for row in rows:
        staged[(row.command_id, row.node_id, row.ack_id)].append(row)
    complete = {}
    for key, parts in staged.items():
        # Complete: parts 0..n-1 all staged, all saying n (a node that said otherwise never
        # completes).
        if [row.part for row in parts] == list(range(parts[0].num_parts)) and {
            row.num_parts for row in parts
        } == {len(parts)}:
            complete[key] = _WholeAck(
                CommandAck.TYPE,
                key[0],
                key[1],
                parts[-1].epoch,
                merge_evidence(row.evidence for row in parts),
                parts[-1].key_id,
                parts[-1].after_seq,
            )
    return complete


@dataclass(slots=True)
class AppliedAcks:
    """What :func:`apply_acks` or :func:`release_deferred_acks` did: the copies deleted and the
    commands completed."""

    num_copies_deleted: int = 0
    finished: Finished = field(default_factory=Finished)


_CAUGHT_UP = "(n.epoch > d.epoch OR (n.epoch = d.epoch AND n.last_seq >= d.after_seq))"
_RELEASABLE_NODES = text(
    f"SELECT DISTINCT d.node_id FROM deferred_acks d JOIN nodes n ON n.node_id = d.node_id WHERE {_CAUGHT_UP} ORDER BY d.node_id"
).columns(node_id=Text())
_TAKE_RELEASABLE = (
    text(
        "DELETE FROM deferred_acks d USING nodes n"
        f" WHERE n.node_id = d.node_id AND d.node_id = ANY(:node_ids) AND {_CAUGHT_UP}"
        " RETURNING d.command_id, d.node_id, d.epoch, d.after_seq, d.evidence, d.key_id"
    )
    .bindparams(bindparam("node_ids", type_=_TEXTS))
    .columns(
        command_id=Uuid(), node_id=Text(), epoch=BigInteger(), after_seq=BigInteger(), key_id=Text()
    )
)


async def _lock_nodes(session: AsyncSession, node_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Lock the node rows (the same lock a kv-events batch of these nodes takes, so a node's acks and
    block events serialize); returns each node's ledger position (epoch, last applied seq)."""
    rows = await session.execute(
        select(Node.node_id, Node.epoch, Node.last_seq)
        .where(Node.node_id.in_(node_ids))
        .order_by(Node.node_id)
        .with_for_update(key_share=True)
    )
    return {row.node_id: (row.epoch, row.last_seq) for row in rows}


async def _lock_targets(
    session: AsyncSession, keys: list[tuple[uuid.UUID, str]]
) -> dict[tuple[uuid.UUID, str], str]:
    rows = await session.execute(
        _LOCK_TARGETS, {"command_ids": [k[0] for k in keys], "node_ids": [k[1] for k in keys]}
    )
    return {(row.command_id, row.node_id): row.status for row in rows}


async def apply_acks(
    session: AsyncSession,
    acks: list[Envelope],
    now: datetime,
    outcomes: collections.Counter[tuple[str, str]],
) -> AppliedAcks:
    """Record each ack on its target row, delete the copies it verified, then complete the commands it touched.

    In ack order, with one statement per step for the whole batch: the targets are
    locked and read at once, folded in order here (a second ack of a target already
    acked is a duplicate, one after a failure replaces it), then written at once. An ack
    fenced behind kv-events the ledger does not hold yet is deferred instead (module
    docstring). The caller owns the transaction; every outcome is counted in ``outcomes``.
    """
    positions = await _lock_nodes(session, sorted({ack.payload.node_id for ack in acks}))
    status = await _lock_targets(
        session, sorted({(ack.payload.command_id, ack.payload.node_id) for ack in acks})
    )
    whole = await _whole_acks(session, acks, status, outcomes)
    return await _record(session, whole, positions, status, now, outcomes)


async def release_deferred_acks(
    session: AsyncSession, now: datetime, outcomes: collections.Counter[tuple[str, str]]
) -> AppliedAcks:
    """Apply every deferred ack whose node's ledger row reached its fence, as :func:`apply_acks` would have.

    Same lock order as an ack batch: the node rows first, so a concurrent batch of the same
    node (which may defer another ack of it) waits, and each deferred ack is taken exactly once.
    """
    node_ids = list((await session.scalars(_RELEASABLE_NODES)).all())
    if not node_ids:
        return AppliedAcks()
    positions = await _lock_nodes(session, node_ids)
    rows = (await session.execute(_TAKE_RELEASABLE, {"node_ids": node_ids})).all()
    status = await _lock_targets(session, sorted({(row.command_id, row.node_id) for row in rows}))
    whole = [
        _WholeAck(
            CommandAck.TYPE,
            row.command_id,
            row.node_id,
            row.epoch,
            row.evidence,
            row.key_id,
            row.after_seq,
        )
        for row in sorted(rows, key=lambda row: (row.command_id, row.node_id))
    ]
    released = collections.Counter[tuple[str, str]]()
    applied = await _record(session, whole, positions, status, now, released)
    for (event_type, outcome), count in released.items():
        outcomes[(event_type, RELEASED if outcome == APPLIED else outcome)] += count
    return applied


async def _record(
    session: AsyncSession,
    whole: list[_WholeAck],
    positions: dict[str, tuple[int, int]],
    status: dict[tuple[uuid.UUID, str], str],
    now: datetime,
    outcomes: collections.Counter[tuple[str, str]],
) -> AppliedAcks:
    """Fold ``whole`` into the locked targets in order, defer what is not caught up, write the rest,
    complete commands."""
    updates: dict[tuple[uuid.UUID, str], tuple[str, int, str, str | None]] = {}
    deferred: dict[tuple[uuid.UUID, str], _WholeAck] = {}
    copies: dict[str, list] = collections.defaultdict(list)
    touched: set[uuid.UUID] = set()
    for ack in whole:
        key = (ack.command_id, ack.node_id)
        current = status.get(key)
        if current is None:
            # Not a command of this ledger, or a node registered after the decision.
            outcomes[(ack.event_type, UNEXPECTED)] += 1
            continue
        if current == TargetStatus.ACKED:
            outcomes[(ack.event_type, inbox.DUPLICATE)] += 1
            continue
        if not ack.caught_up(positions[ack.node_id]):
            deferred[key] = ack  # a later ack of the same target replaces it, as on the target row
            outcomes[(ack.event_type, DEFERRED)] += 1
            continue
        verified = all(evidence["verified"] for evidence in ack.evidence)
        status[key] = TargetStatus.ACKED if verified else TargetStatus.FAILED
        updates[key] = (status[key], ack.epoch, json.dumps(ack.evidence), ack.key_id)
        for evidence in ack.evidence:
            if evidence["verified"] and ack.deletes(evidence["tier"]):
                for block_hash in evidence["block_hashes"]:
                    copies["node_ids"].append(ack.node_id)
                    copies["tiers"].append(evidence["tier"])
                    copies["hashes"].append(bytes.fromhex(block_hash))
                    copies["command_ids"].append(ack.command_id)
        touched.add(ack.command_id)
        outcomes[(ack.event_type, APPLIED if verified else UNVERIFIED)] += 1
    if deferred:
        await _defer(session, [ack for key, ack in deferred.items() if key not in updates])
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
        # Staged parts and deferred acks of a target now recorded are spent: its ack is on the
        # target row.
        await session.execute(
            delete(AckPart).where(tuple_(AckPart.command_id, AckPart.node_id).in_(sorted(updates)))
        )
        await session.execute(
            delete(DeferredAck).where(
                tuple_(DeferredAck.command_id, DeferredAck.node_id).in_(sorted(updates))
            )
        )
    fault_point("coordinator.mid_ack_batch")
    await lock_ledger_writes(session)
    applied = AppliedAcks()
    if copies:
        deleted = await session.execute(_DELETE_COPIES, {"now": now, **copies})
        applied.num_copies_deleted = len(deleted.all())
    applied.finished = await finish_if_acked(session, touched, now)
    return applied


async def _defer(session: AsyncSession, acks: list[_WholeAck]) -> None:
    """Hold ``acks`` in ``deferred_acks``; one already held for the same target is replaced (the later ack stands)."""
    if not acks:
        return
    statement = pg_insert(DeferredAck).values(
        [
            {
                "command_id": ack.command_id,
                "node_id": ack.node_id,
                "epoch": ack.epoch,
                "after_seq": ack.after_seq,
                "evidence": ack.evidence,
                "key_id": ack.key_id,
            }
            for ack in acks
        ]
    )
    excluded = statement.excluded
    await session.execute(
        statement.on_conflict_do_update(
            index_elements=[DeferredAck.command_id, DeferredAck.node_id],
            set_={
                "epoch": excluded.epoch,
                "after_seq": excluded.after_seq,
                "evidence": excluded.evidence,
                "key_id": excluded.key_id,
                "deferred_at": excluded.deferred_at,
            },
        )
    )
