"""kv-events → ledger: the batch handler of the ``kvledger.kv-events`` consumer.

One polled batch is one database transaction:

1. every event id goes into ``inbox`` (``ON CONFLICT DO NOTHING RETURNING``): ids
   already there are redeliveries and are skipped, so a replay changes nothing;
2. the batch's nodes are locked (``FOR UPDATE``, in id order) so two coordinators
   that briefly own the same partition during a rebalance serialize per node (and
   with ack batches of those nodes); then the invalidation advisory lock is taken,
   shared — unless every event only removes copies or beats (:data:`_ADD_NO_COPIES`);
3. events are applied in order. Block and placement changes are accumulated and
   written in bulk: blocks new to the ledger and their placements by binary ``COPY``
   (the server's bulk path; such placements cannot exist yet), changes to known
   blocks' placements by ``INSERT … ON CONFLICT`` / ``UPDATE`` over arrays; set-based
   operations (restart, snapshot, inventory) first flush what is accumulated, so
   the net effect always equals applying the events one by one;
4. commands decided on the way (``InventoryRequested``) are inserted into the
   outbox in the same transaction;
5. blocks stored by the batch whose provenance an earlier invalidation already
   superseded (a *late* ``BlockStored``) get that invalidation re-issued at once
   (:func:`coordinator.handlers.decisions.reissue_for_late_blocks`), still in the same
   transaction. Holding the advisory lock shared, no decision interleaves with the
   batch (see :mod:`coordinator.ledger.transactions` for the lock order).

Ordering model: records of one node share a partition (key = node id), so they
arrive in ``seq`` order within an epoch. An event whose ``seq`` is not above the
last applied one is already reflected (``replayed``); an event of an older epoch
describes a process that is gone (``stale``). A hole — a skipped ``seq``, a new
epoch without its ``NodeStarted``, a node never seen, a heartbeat announcing a
higher ``seq``, a placement of an unknown block — means the ledger may be wrong
for that node: it is marked ``reconciling`` and asked for an ``Inventory``, which
replaces the node's placements wholesale once complete.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import metrics
from coordinator.handlers.decisions import Decision, reissue_for_late_blocks
from coordinator.handlers.outbox import outbox_row
from coordinator.ledger import inbox
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    VOLATILE_TIERS,
    BlockAuthScope,
    BlockCreator,
    BlockDocument,
    DeadLetterCount,
    InventoryChunk,
    Namespace,
    Node,
    OutboxEntry,
    Placement,
    Replica,
    Snapshot,
    UsageReport,
)
from coordinator.ledger.states import PlacementState
from coordinator.ledger.transactions import (
    begin_ledger_transaction,
    generic_plans,
    lock_ledger_writes,
)
from events.kafka.consumer import ConsumedEvent
from events.metrics import DEAD_LETTER_TOTAL
from events.schema import (
    BlockMoved,
    BlockProvenance,
    BlockRemoved,
    BlockStored,
    Envelope,
    Inventory,
    InventoryRequested,
    NodeEvent,
    NodeHeartbeat,
    NodeStarted,
    SnapshotDeleted,
    SnapshotWritten,
    UsageReported,
    make_event,
)
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

PLACEMENT_CONSTRAINT = "uq_placements_block_hash_node_id_tier_snapshot_id"
_ADD_NO_COPIES = (BlockRemoved, SnapshotDeleted, NodeHeartbeat, UsageReported)
"""Events that never add a copy to the ledger: a batch of only these cannot hide a copy from a
concurrent decision, so it does not take the ledger-writes lock and no decision waits for it
(most batches while an invalidation runs: the nodes report what they removed)."""

_BLOCK_COLUMNS = (
    "block_hash",
    "parent_hash",
    "namespace",
    "tenant_id",
    "scope",
    "subject_hash",
    "token_offset",
    "created_at",
)
_BLOCK_PARAMETERS = (
    "block_hashes",
    "parent_hashes",
    "namespaces",
    "tenant_ids",
    "scopes",
    "subject_hashes",
    "token_offsets",
    "created_ats",
)
"""The array parameters of :data:`_INSERT_BLOCKS`, in the order of :data:`_BLOCK_COLUMNS`."""
_PLACEMENT_COLUMNS = ("block_hash", "node_id", "tier", "snapshot_id", "state", "epoch", "reason")

_KNOWN_BLOCKS = text(
    "SELECT block_hash FROM blocks WHERE block_hash = ANY(CAST(:block_hashes AS bytea[]))"
)
"""Which of a batch's blocks the ledger already has (a raw array parameter: no per-element bind
processing)."""

_INSERT_BLOCKS = text(
    """
    INSERT INTO blocks (block_hash, parent_hash, namespace, tenant_id, scope, subject_hash, token_offset, created_at)
    SELECT * FROM unnest(
        CAST(:block_hashes AS bytea[]), CAST(:parent_hashes AS bytea[]), CAST(:namespaces AS text[]),
        CAST(:tenant_ids AS text[]), CAST(:scopes AS text[]), CAST(:subject_hashes AS bytea[]),
        CAST(:token_offsets AS integer[]), CAST(:created_ats AS timestamptz[])
    )
    ON CONFLICT (block_hash) DO NOTHING
    RETURNING block_hash
    """
)
"""The fallback of :meth:`_BatchApplier._write_blocks` when another transaction inserted one of the
batch's new blocks meanwhile: returns the hashes this statement inserted."""

_UPSERT_PLACEMENTS = text(
    f"""
    INSERT INTO placements (block_hash, node_id, tier, snapshot_id, state, epoch, reason)
    SELECT block_hash, :node_id, tier, snapshot_id, :state, :epoch, :reason
    FROM unnest(CAST(:block_hashes AS bytea[]), CAST(:tiers AS text[]), CAST(:snapshot_ids AS text[]))
        AS batch(block_hash, tier, snapshot_id)
    ON CONFLICT ON CONSTRAINT {PLACEMENT_CONSTRAINT}
    DO UPDATE SET state = EXCLUDED.state, epoch = EXCLUDED.epoch, reason = EXCLUDED.reason, updated_at = now()
    """
)
_MARK_PLACEMENTS_DELETED = text(
    """
    UPDATE placements p SET state = 'deleted', epoch = :epoch, reason = :reason, updated_at = now()
    FROM unnest(CAST(:block_hashes AS bytea[]), CAST(:tiers AS text[]), CAST(:snapshot_ids AS text[]))
        AS batch(block_hash, tier, snapshot_id)
    WHERE p.block_hash = batch.block_hash AND p.node_id = :node_id AND p.tier = batch.tier
        AND p.snapshot_id IS NOT DISTINCT FROM batch.snapshot_id AND p.state = 'live'
    RETURNING p.id
    """
)
"""Probes the (block_hash, node_id, tier, snapshot_id) unique index once per ref: a removal batch costs
its own size, not a scan of the node's live placements."""

APPLIED = "applied"
REPLAYED = "replayed"
STALE = "stale"
IGNORED = "ignored"

# (block_hash, tier, snapshot_id) of one node.
PlacementRef = tuple[bytes, str, str | None]


def _placement_params(node: Node, refs: list[PlacementRef], epoch: int, reason: str | None) -> dict:
    """Parameters of the bulk placement statements: ``refs`` as parallel arrays, the rest as
    scalars."""
    return {
        "block_hashes": [block_hash for block_hash, _, _ in refs],
        "tiers": [tier for _, tier, _ in refs],
        "snapshot_ids": [snapshot_id for _, _, snapshot_id in refs],
        "node_id": node.node_id,
        "epoch": epoch,
        "reason": reason,
    }


@dataclass(slots=True)
class _PendingPlacement:
    """Net change of one placement within a batch. ``created``: it was live at some point in this
    batch, so its row must exist afterwards even if the net state is ``deleted``."""

    state: str
    epoch: int
    reason: str | None
    created: bool


class _BatchApplier:
    """Applies one batch inside one open transaction; discarded afterwards."""

    def __init__(
        self,
        session: AsyncSession,
        inventory_retry_s: float,
        now: datetime,
        command_signer: EnvelopeSigner,
    ) -> None:
        self.session = session
        self.sign = command_signer
        self.inventory_retry = timedelta(seconds=inventory_retry_s)
        self.now = now
        self.nodes: dict[str, Node] = {}
        self.fresh_nodes: set[str] = set()
        self.blocks: dict[bytes, BlockProvenance] = {}
        self.creators: set[tuple[bytes, bytes]] = set()
        """(block hash, creator digest) of every provenance in the batch: nodes may name different creators of one block."""
        self.known_blocks: set[bytes] = set()
        self.placements: dict[tuple[bytes, str, str], _PendingPlacement] = {}
        self.outbox: list[dict] = []
        self.stored: set[bytes] = set()
        self.replicas: dict[tuple[bytes, str], tuple[str, datetime]] = {}
        """(block hash, node) → (source node, pulled at) of the pulled copies stored in this batch."""
        self.late: list[Decision] = []
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.placement_changes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.gaps: collections.Counter[str] = collections.Counter()
        self.num_inventories = 0
        self.usage: list[dict] = []

    # -- batch ------------------------------------------------------------------------

    async def apply(self, events: list[ConsumedEvent]) -> None:
        fresh_events = await inbox.claim(self.session, events, self.outcomes)
        await self._lock_nodes(fresh_events)
        if not all(isinstance(envelope.payload, _ADD_NO_COPIES) for envelope in fresh_events):
            await lock_ledger_writes(self.session)
        for envelope in fresh_events:
            self.outcomes[(envelope.type, await self._apply_event(envelope))] += 1
        await self._flush()
        if self.replicas:
            await self._write_replicas()
        if self.usage:
            await self.session.execute(pg_insert(UsageReport).on_conflict_do_nothing(), self.usage)
        if self.stored:
            self.late = await reissue_for_late_blocks(
                self.session, self.stored, self.now, self.sign
            )
        if self.outbox:
            await self.session.execute(pg_insert(OutboxEntry), self.outbox)

    async def _write_replicas(self) -> None:
        """Record where the batch's pulled copies came from (the latest pull of a block onto a node
        wins)."""
        statement = pg_insert(Replica).values(
            [
                {
                    "block_hash": block_hash,
                    "node_id": node_id,
                    "source_node_id": source,
                    "pulled_at": pulled_at,
                }
                for (block_hash, node_id), (source, pulled_at) in self.replicas.items()
            ]
        )
        await self.session.execute(
            statement.on_conflict_do_update(
                index_elements=[Replica.block_hash, Replica.node_id],
                set_={
                    "source_node_id": statement.excluded.source_node_id,
                    "pulled_at": statement.excluded.pulled_at,
                },
            )
        )

    async def _lock_nodes(self, envelopes: list[Envelope]) -> None:
        """Create rows for nodes never seen (``fresh``) and lock every node of the batch."""
        first: dict[str, NodeEvent | NodeHeartbeat] = {}
        for envelope in envelopes:
            payload = envelope.payload
            if isinstance(payload, (NodeEvent, NodeHeartbeat)):
                first.setdefault(payload.node_id, payload)
        if not first:
            return
        node_ids = sorted(first)
        # last_seq -1: nothing applied yet. Sorted ids keep lock order identical across replicas.
        created = await self.session.scalars(
            pg_insert(Node)
            .values(
                [
                    {"node_id": node_id, "epoch": first[node_id].epoch, "last_seq": -1}
                    for node_id in node_ids
                ]
            )
            .on_conflict_do_nothing()
            .returning(Node.node_id)
        )
        self.fresh_nodes = set(created.all())
        # NO KEY UPDATE: exclusive among ledger writers, yet foreign-key checks of inserts
        # referencing these nodes (placements, invalidation targets) do not wait for it.
        locked = await self.session.scalars(
            select(Node)
            .where(Node.node_id.in_(node_ids))
            .order_by(Node.node_id)
            .with_for_update(key_share=True)
        )
        self.nodes = {node.node_id: node for node in locked.all()}

    # -- ordering ---------------------------------------------------------------------

    async def _apply_event(self, envelope: Envelope) -> str:
        payload = envelope.payload
        if not isinstance(payload, (NodeEvent, NodeHeartbeat)):
            log.warning("ignoring %s event on the kv-events topic", envelope.type)
            return IGNORED
        node = self.nodes[payload.node_id]
        if payload.epoch < node.epoch:
            return STALE
        fresh = node.node_id in self.fresh_nodes
        self.fresh_nodes.discard(node.node_id)
        restarted = payload.epoch > node.epoch
        if restarted:
            await self._restart(node, payload.epoch, envelope.occurred_at)
        # The node's own clock: a lagging consumer must not make a silent node look alive.
        node.last_event_at = (
            envelope.occurred_at if fresh else max(node.last_event_at, envelope.occurred_at)
        )

        if isinstance(payload, NodeHeartbeat):
            node.last_heartbeat = max(
                node.last_heartbeat or envelope.occurred_at, envelope.occurred_at
            )
            if fresh:
                self._gap(node, "unseen_node")
            elif restarted:
                self._gap(node, "missed_start")
            elif payload.seq is not None and payload.seq > node.last_seq:
                self._gap(node, "silent_seq")
            self._retry_inventory(node)
            return APPLIED

        if not (fresh or restarted) and payload.seq <= node.last_seq:
            return REPLAYED
        # An Inventory is the cure for a hole, never a reason to ask for another one.
        if not isinstance(payload, (NodeStarted, Inventory)):
            if fresh:
                self._gap(node, "unseen_node")
            elif restarted:
                self._gap(node, "missed_start")
            elif payload.seq > node.last_seq + 1:
                self._gap(node, "seq")
        node.last_seq = payload.seq
        await self._dispatch(node, payload, envelope.occurred_at, envelope.event_id)
        self._retry_inventory(node)
        return APPLIED

    async def _dispatch(
        self, node: Node, payload: NodeEvent, occurred_at: datetime, event_id: uuid.UUID
    ) -> None:
        match payload:
            case NodeStarted():
                node.namespace = payload.namespace
                node.started_at = occurred_at
                await self.session.execute(
                    pg_insert(Namespace)
                    .values(namespace=payload.namespace)
                    .on_conflict_do_nothing()
                )
            case BlockStored():
                for block in payload.blocks:
                    block_hash = bytes.fromhex(block.block_hash)
                    self._describe(block_hash, block)
                    self.stored.add(block_hash)
                    self._place(
                        node, block_hash, block.tier, PlacementState.LIVE, payload.epoch, None
                    )
                    if block.replica_of is not None:
                        self.replicas[(block_hash, node.node_id)] = (
                            block.replica_of.source_node_id,
                            block.replica_of.pulled_at,
                        )
            case BlockRemoved():
                for block in payload.blocks:
                    self._place(
                        node,
                        bytes.fromhex(block.block_hash),
                        block.tier,
                        PlacementState.DELETED,
                        payload.epoch,
                        payload.reason,
                    )
            case BlockMoved():
                for block in payload.blocks:
                    block_hash = bytes.fromhex(block.block_hash)
                    self._place(
                        node,
                        block_hash,
                        block.from_tier,
                        PlacementState.DELETED,
                        payload.epoch,
                        "moved",
                    )
                    self._place(
                        node, block_hash, block.to_tier, PlacementState.LIVE, payload.epoch, None
                    )
            case SnapshotWritten():
                await self._flush()
                await self._write_snapshot(node, payload)
            case SnapshotDeleted():
                await self._flush()
                await self._delete_snapshot(node, payload.snapshot_id)
            case Inventory():
                await self._inventory(node, payload)
            case UsageReported():
                self.usage.append(
                    payload.model_dump(exclude={"epoch", "seq"}) | {"event_id": event_id}
                )
            case _:
                raise AssertionError(f"unhandled node event {type(payload).__name__}")

    def _describe(self, block_hash: bytes, block: BlockProvenance) -> None:
        """Keep a block's provenance for :meth:`_write_blocks`, and its creator (every one
        reported)."""
        self.blocks[block_hash] = block
        if block.creator_subject_id is not None:
            self.creators.add((block_hash, bytes.fromhex(block.creator_subject_id)))

    def _place(
        self, node: Node, block_hash: bytes, tier: str, state: str, epoch: int, reason: str | None
    ) -> None:
        key = (block_hash, node.node_id, tier)
        previous = self.placements.get(key)
        created = state == PlacementState.LIVE or (previous is not None and previous.created)
        self.placements[key] = _PendingPlacement(state, epoch, reason, created)

    # -- holes and inventory requests --------------------------------------------

    def _gap(self, node: Node, kind: str) -> None:
        self.gaps[kind] += 1
        self._request_inventory(node)

    def _retry_inventory(self, node: Node) -> None:
        """Ask again when a pending request went unanswered for ``inventory_retry_s`` (lost command or chunk)."""
        if node.status == "reconciling":
            self._request_inventory(node)

    def _request_inventory(self, node: Node) -> None:
        requested_at = node.inventory_requested_at
        if (
            node.status == "reconciling"
            and requested_at is not None
            and self.now - requested_at < self.inventory_retry
        ):
            return
        request_id = uuid.uuid4()
        node.status = "reconciling"
        node.inventory_request_id = request_id
        node.inventory_requested_at = self.now
        request = make_event(InventoryRequested(node_id=node.node_id, request_id=request_id))
        self.outbox.append(outbox_row(self.sign(request)))

    # -- set-based operations -------------------------------------------------------

    async def _restart(self, node: Node, epoch: int, occurred_at: datetime) -> None:
        """A new epoch: device and host bytes of older epochs did not survive the restart."""
        await self._flush()
        result = await self.session.execute(
            update(Placement)
            .where(
                Placement.node_id == node.node_id,
                Placement.state == PlacementState.LIVE,
                Placement.tier.in_(VOLATILE_TIERS),
                Placement.epoch < epoch,
            )
            .values(state=PlacementState.DELETED, reason="node_restarted", updated_at=func.now())
            .returning(Placement.id)
        )
        self.placement_changes[(PlacementState.DELETED, "restart")] += len(result.all())
        node.epoch = epoch
        node.last_seq = -1
        node.started_at = occurred_at

    async def _write_snapshot(self, node: Node, payload: SnapshotWritten) -> None:
        """Part 0 (or a snapshot of one record) replaces the snapshot's placements; a later part adds its slice.

        The parts are consecutive seqs of the node, applied in seq order, so after the last
        part the ledger holds exactly the snapshot's blocks.
        """
        hashes = {bytes.fromhex(block_hash) for block_hash in payload.block_hashes}
        num_blocks = len(hashes) if payload.part == 0 else Snapshot.num_blocks + len(hashes)
        await self.session.execute(
            pg_insert(Snapshot)
            .values(
                node_id=node.node_id,
                snapshot_id=payload.snapshot_id,
                epoch=payload.epoch,
                state=PlacementState.LIVE,
                num_blocks=len(hashes),
            )
            .on_conflict_do_update(
                index_elements=[Snapshot.node_id, Snapshot.snapshot_id],
                set_={
                    "epoch": payload.epoch,
                    "state": PlacementState.LIVE,
                    "num_blocks": num_blocks,
                    "deleted_at": None,
                },
            )
        )
        if payload.part == 0:
            existing = await self._live_placements(
                node, Placement.snapshot_id == payload.snapshot_id
            )
            gone = {ref for ref in existing if ref[0] not in hashes}
            await self._mark_deleted(node, gone, payload.epoch, "replaced", "snapshot")
        unknown = await self._unknown_blocks(hashes)
        if unknown:
            self._gap(node, "unknown_block")
        known = hashes - unknown
        await self._upsert(
            node, [(h, "snapshot", payload.snapshot_id) for h in known], payload.epoch, "snapshot"
        )

    async def _delete_snapshot(self, node: Node, snapshot_id: str) -> None:
        await self.session.execute(
            update(Snapshot)
            .where(
                Snapshot.node_id == node.node_id,
                Snapshot.snapshot_id == snapshot_id,
                Snapshot.state == PlacementState.LIVE,
            )
            .values(state=PlacementState.DELETED, deleted_at=func.now())
        )
        result = await self.session.execute(
            update(Placement)
            .where(
                Placement.node_id == node.node_id,
                Placement.snapshot_id == snapshot_id,
                Placement.state == PlacementState.LIVE,
            )
            .values(state=PlacementState.DELETED, reason="snapshot_deleted", updated_at=func.now())
            .returning(Placement.id)
        )
        self.placement_changes[(PlacementState.DELETED, "snapshot")] += len(result.all())

    async def _inventory(self, node: Node, payload: Inventory) -> None:
        """Reconcile now (single record) or once the last chunk of a complete set is in.

        Chunks are staged in ``inventory_chunks`` because a set can span batches. The
        node sends a set as consecutive records, so no block event falls between its
        chunks; the reconciled state is the node's state at the last chunk.
        """
        for block in payload.blocks:
            self._describe(bytes.fromhex(block.block_hash), block)
        refs = {(bytes.fromhex(p.block_hash), p.tier, p.snapshot_id) for p in payload.placements}
        if payload.chunks == 1:
            await self._flush()
            await self._reconcile(node, refs, payload.epoch)
            return
        request_key = str(payload.request_id) if payload.request_id is not None else ""
        chunk_key = {"node_id": node.node_id, "epoch": payload.epoch, "request_key": request_key}
        listed = {"placements": [[h.hex(), tier, snapshot_id] for h, tier, snapshot_id in refs]}
        await self.session.execute(
            pg_insert(InventoryChunk)
            .values(**chunk_key, chunk=payload.chunk, num_chunks=payload.chunks, placements=listed)
            .on_conflict_do_update(
                index_elements=[
                    InventoryChunk.node_id,
                    InventoryChunk.epoch,
                    InventoryChunk.request_key,
                    InventoryChunk.chunk,
                ],
                set_={
                    "num_chunks": payload.chunks,
                    "placements": listed,
                    "received_at": func.now(),
                },
            )
        )
        if payload.chunk != payload.chunks - 1:
            return
        chunks = (
            await self.session.scalars(
                select(InventoryChunk).where(
                    *(getattr(InventoryChunk, k) == v for k, v in chunk_key.items())
                )
            )
        ).all()
        if sorted(c.chunk for c in chunks) != list(range(payload.chunks)) or any(
            c.num_chunks != payload.chunks for c in chunks
        ):
            self._gap(node, "inventory_chunks")
            return
        everything: set[PlacementRef] = set()
        for chunk in chunks:
            everything.update(
                (bytes.fromhex(h), tier, snapshot_id)
                for h, tier, snapshot_id in chunk.placements["placements"]
            )
        await self._flush()
        await self._reconcile(node, everything, payload.epoch)
        await self.session.execute(
            InventoryChunk.__table__.delete().where(InventoryChunk.node_id == node.node_id)
        )

    async def _reconcile(self, node: Node, listed: set[PlacementRef], epoch: int) -> None:
        """Make the node's live placements exactly ``listed`` (all blocks are already in
        ``blocks``)."""
        snapshot_sizes = collections.Counter(
            snapshot_id for _, tier, snapshot_id in listed if tier == "snapshot"
        )
        if snapshot_sizes:
            stmt = pg_insert(Snapshot)
            await self.session.execute(
                stmt.on_conflict_do_update(
                    index_elements=[Snapshot.node_id, Snapshot.snapshot_id],
                    set_={
                        "state": PlacementState.LIVE,
                        "num_blocks": stmt.excluded.num_blocks,
                        "deleted_at": None,
                    },
                ),
                [
                    {
                        "node_id": node.node_id,
                        "snapshot_id": sid,
                        "epoch": epoch,
                        "state": PlacementState.LIVE,
                        "num_blocks": n,
                    }
                    for sid, n in snapshot_sizes.items()
                ],
            )
        await self.session.execute(
            update(Snapshot)
            .where(
                Snapshot.node_id == node.node_id,
                Snapshot.state == PlacementState.LIVE,
                Snapshot.snapshot_id.not_in(list(snapshot_sizes)),
            )
            .values(state=PlacementState.DELETED, deleted_at=func.now())
        )
        existing = await self._live_placements(node)
        await self._mark_deleted(node, existing - listed, epoch, "reconciled", "reconcile")
        await self._upsert(node, listed - existing, epoch, "reconcile")
        # Copies that survived (disk, snapshots) are now confirmed in this epoch.
        await self.session.execute(
            update(Placement)
            .where(
                Placement.node_id == node.node_id,
                Placement.state == PlacementState.LIVE,
                Placement.epoch < epoch,
            )
            .values(epoch=epoch, updated_at=func.now())
        )
        node.status = "active"
        node.inventory_request_id = None
        node.inventory_requested_at = None
        self.num_inventories += 1

    async def _live_placements(self, node: Node, *criteria) -> set[PlacementRef]:
        rows = await self.session.execute(
            select(Placement.block_hash, Placement.tier, Placement.snapshot_id).where(
                Placement.node_id == node.node_id, Placement.state == PlacementState.LIVE, *criteria
            )
        )
        return {(row.block_hash, row.tier, row.snapshot_id) for row in rows}

    async def _mark_deleted(
        self, node: Node, refs: Iterable[PlacementRef], epoch: int, reason: str, cause: str
    ) -> None:
        """Flip the node's live copies among ``refs`` to deleted (absent ones are already gone:
        no-op)."""
        refs = list(refs)
        if not refs:
            return
        result = await self.session.execute(
            _MARK_PLACEMENTS_DELETED, _placement_params(node, refs, epoch, reason)
        )
        self.placement_changes[(PlacementState.DELETED, cause)] += len(result.all())

    async def _upsert(
        self,
        node: Node,
        refs: Iterable[PlacementRef],
        epoch: int,
        cause: str,
        state: str = PlacementState.LIVE,
        reason: str | None = None,
    ) -> None:
        """Insert or overwrite the node's placements ``refs`` with ``state`` (blocks must be in
        ``blocks``)."""
        refs = list(refs)
        if not refs:
            return
        # One statement over unnest()ed arrays: the per-row work happens in Postgres, not in
        # SQLAlchemy's multi-VALUES rendering, which dominated batch time at 10k+ rows. A plain str:
        # SQLAlchemy types a raw statement's parameter by the value's class, and an enum member is
        # untyped.
        await self.session.execute(
            _UPSERT_PLACEMENTS,
            {**_placement_params(node, refs, epoch, reason), "state": str(state)},
        )
        self.placement_changes[(state, cause)] += len(refs)

    # -- accumulated writes -----------------------------------------------------------

    async def _flush(self) -> None:
        """Write accumulated block provenance and per-event placement changes (net effect, bulk)."""
        if self.blocks:
            async with generic_plans(self.session):
                await self._copy_placements(await self._write_blocks())
        if not self.placements:
            return
        pending, self.placements = self.placements, {}
        # node → (state, reason) → refs; rows that must exist are upserted, the rest only updated.
        upserts: dict[str, dict[tuple[str, str | None], list[PlacementRef]]] = (
            collections.defaultdict(lambda: collections.defaultdict(list))
        )
        updates: dict[str, dict[str, list[PlacementRef]]] = collections.defaultdict(
            lambda: collections.defaultdict(list)
        )
        epochs: dict[str, int] = {}
        for (block_hash, node_id, tier), change in pending.items():
            # A new epoch is a barrier (_restart flushes first), so one node's pending changes share
            # one epoch.
            assert epochs.setdefault(node_id, change.epoch) == change.epoch, (
                "pending placements span epochs"
            )
            if change.created:
                upserts[node_id][(change.state, change.reason)].append((block_hash, tier, None))
            else:
                updates[node_id][change.reason or "removed"].append((block_hash, tier, None))
        unknown = await self._unknown_blocks(
            {ref[0] for groups in upserts.values() for refs in groups.values() for ref in refs}
        )
        # The upserts' per-row foreign-key checks want cached plans too; the upsert itself (rows
        # from unnest(), no join) has one plan either way. The removals below join: custom plans.
        async with generic_plans(self.session) if upserts else contextlib.nullcontext():
            for node_id, groups in upserts.items():
                node = self.nodes[node_id]
                for (state, reason), refs in groups.items():
                    if any(ref[0] in unknown for ref in refs):
                        # Moved a block we never saw stored: an event went missing.
                        self._gap(node, "unknown_block")
                    known = [ref for ref in refs if ref[0] not in unknown]
                    await self._upsert(node, known, epochs[node_id], "event", state, reason)
        for node_id, groups in updates.items():
            for reason, refs in groups.items():
                await self._mark_deleted(
                    self.nodes[node_id], refs, epochs[node_id], reason, "event"
                )

    async def _copy_placements(self, inserted: set[bytes]) -> None:
        """Copy the accumulated placements of blocks in ``inserted`` (just inserted by this flush)
        straight into ``placements``, and take them off the accumulated changes.

        Such a placement cannot exist yet (a placement references its block), and one flush writes
        each (block, node, tier) once, so the copied rows collide with nothing; every other change
        goes through the upsert / update statements, which settle conflicts with existing rows."""
        copied = [
            (block_hash, node_id, tier, None, str(change.state), change.epoch, change.reason)
            for (block_hash, node_id, tier), change in self.placements.items()
            if change.created and block_hash in inserted
        ]
        if not copied:
            return
        for block_hash, node_id, tier, _, state, _, _ in copied:
            del self.placements[(block_hash, node_id, tier)]
            self.placement_changes[(state, "event")] += 1
        await self._copy("placements", _PLACEMENT_COLUMNS, copied)

    async def _unknown_blocks(self, hashes: set[bytes]) -> set[bytes]:
        candidates = hashes - self.known_blocks
        if not candidates:
            return set()
        found = await self._existing_blocks(candidates)
        self.known_blocks |= found
        return candidates - found

    async def _existing_blocks(self, hashes: Iterable[bytes]) -> set[bytes]:
        """Which of ``hashes`` the ledger has (one array probe of the primary key)."""
        return set(
            (await self.session.scalars(_KNOWN_BLOCKS, {"block_hashes": list(hashes)})).all()
        )

    async def _copy(self, table: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
        """Binary ``COPY`` of ``rows`` into ``table`` on the session's connection, inside the batch's transaction."""
        connection = await (await self.session.connection()).get_raw_connection()
        await connection.driver_connection.copy_records_to_table(
            table, records=rows, columns=columns
        )

    async def _write_blocks(self) -> set[bytes]:
        """Write the accumulated provenance; returns the hashes of the blocks this call inserted.

        Blocks are content-addressed and shared by nodes, so most of a busy ledger's stores may
        name known blocks: those are looked up first (index probes, no writes) and only the rest
        are copied in. A concurrent transaction (another replica ingesting another node's
        partition) may insert one of them between the lookup and the copy: the copy then fails
        on the primary key, is rolled back to its savepoint, and the batch's new blocks go
        through ``INSERT … ON CONFLICT DO NOTHING`` instead, which tells which rows it inserted.
        """
        pending, self.blocks = self.blocks, {}
        namespaces = sorted({block.namespace for block in pending.values()})
        await self.session.execute(
            pg_insert(Namespace).on_conflict_do_nothing(), [{"namespace": ns} for ns in namespaces]
        )
        existing = await self._existing_blocks(pending)
        new = {
            block_hash: block for block_hash, block in pending.items() if block_hash not in existing
        }
        rows = [
            (
                block_hash,
                bytes.fromhex(block.parent_hash) if block.parent_hash else None,
                block.namespace,
                block.tenant_id,
                block.scope,
                bytes.fromhex(block.subject_id) if block.subject_id else None,
                block.token_offset,
                block.created_at,
            )
            for block_hash, block in new.items()
        ]
        inserted: set[bytes] = set(new)
        if rows:
            try:
                async with self.session.begin_nested():
                    await self._copy("blocks", _BLOCK_COLUMNS, rows)
            except asyncpg.UniqueViolationError:
                result = await self.session.execute(
                    _INSERT_BLOCKS,
                    {
                        name: list(column)
                        for name, column in zip(
                            _BLOCK_PARAMETERS, zip(*rows, strict=True), strict=True
                        )
                    },
                )
                inserted = set(result.scalars().all())
        auth_scopes = [
            {"block_hash": block_hash, "auth_scope": scope, "policy_version": version}
            for block_hash, block in pending.items()
            for scope, version in block.auth_scopes
        ]
        if auth_scopes:
            await self.session.execute(
                pg_insert(BlockAuthScope).on_conflict_do_nothing(), auth_scopes
            )
        documents = [
            {"block_hash": block_hash, "doc_id": doc_id, "version": int(version)}
            for block_hash, block in pending.items()
            for doc_id, version in (tag.rsplit("@", 1) for tag in block.documents)
        ]
        if documents:
            await self.session.execute(pg_insert(BlockDocument).on_conflict_do_nothing(), documents)
        creators, self.creators = self.creators, set()
        if creators:
            await self.session.execute(
                pg_insert(BlockCreator).on_conflict_do_nothing(),
                [
                    {"block_hash": block_hash, "subject_hash": subject_hash}
                    for block_hash, subject_hash in sorted(creators)
                ],
            )
        self.known_blocks |= pending.keys()
        return inserted


class LedgerIngest:
    """The kv-events batch handler: ``await ingest(events)`` commits before returning.

    Any failure rolls the whole batch back and propagates. The consumer decides what it
    means (:func:`coordinator.handlers.poison.refused_as_data`): a value the database refuses is
    isolated by bisection and dead-lettered, anything else is retried with backoff.
    """

    def __init__(
        self,
        database: Database,
        *,
        inventory_retry_s: float,
        command_signer: EnvelopeSigner,
        on_outbox: Callable[[], None] | None = None,
        on_committed: Callable[[], None] | None = None,
    ) -> None:
        """``on_committed`` is called after every committed batch: nodes' ledger rows moved, so acks
        deferred behind their events may be released (``coordinator.handlers.acks``)."""
        self._database = database
        self._command_signer = command_signer
        self._inventory_retry_s = inventory_retry_s
        self._on_outbox = on_outbox
        self._on_committed = on_committed

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        if not events:
            return
        started = time.perf_counter()
        async with self._database.session() as session:
            with session.no_autoflush:
                async with session.begin():
                    now = await begin_ledger_transaction(session)
                    applier = _BatchApplier(
                        session, self._inventory_retry_s, now, self._command_signer
                    )
                    await applier.apply(events)
        if self._on_committed is not None:
            self._on_committed()
        # Metrics only after the commit: a rolled-back batch is redelivered and counted then.
        for (event_type, outcome), count in applier.outcomes.items():
            metrics.EVENTS_TOTAL.labels(type=event_type, outcome=outcome).inc(count)
        for (state, cause), count in applier.placement_changes.items():
            metrics.PLACEMENT_CHANGES_TOTAL.labels(state=state, cause=cause).inc(count)
        for kind, count in applier.gaps.items():
            metrics.SEQ_GAPS_TOTAL.labels(kind=kind).inc(count)
        metrics.INVENTORY_REQUESTS_TOTAL.inc(len(applier.outbox))
        metrics.INVENTORIES_TOTAL.inc(applier.num_inventories)
        metrics.BATCHES_TOTAL.inc()
        metrics.BATCH_SIZE.observe(len(events))
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        committed_at = datetime.now(UTC)
        for event in events:
            metrics.INGEST_LAG_SECONDS.observe(
                max(0.0, (committed_at - event.envelope.occurred_at).total_seconds())
            )
        for decision in applier.late:
            metrics.INVALIDATIONS_TOTAL.labels(kind=decision.kind, trigger=decision.trigger).inc()
        if (applier.outbox or applier.late) and self._on_outbox is not None:
            self._on_outbox()


class DeadLetterTally:
    """Stands in for the ``dead_letter_counter`` of :class:`events.kafka.consumer.BatchConsumer`.

    Each dead letter increments the process-local Prometheus counter *and* a pending
    tally that :meth:`flush` adds to the ``dead_letters`` table, so ``/metrics`` of any
    replica can report the cluster-wide totals.
    """

    def __init__(self) -> None:
        self._pending: collections.Counter[str] = collections.Counter()

    def labels(self, *, topic: str) -> _TallyChild:
        return _TallyChild(self, topic)

    def _add(self, topic: str, amount: int) -> None:
        DEAD_LETTER_TOTAL.labels(topic=topic).inc(amount)
        self._pending[topic] += amount

    async def flush(self, database: Database) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, collections.Counter()
        try:
            async with database.session() as session, session.begin():
                stmt = pg_insert(DeadLetterCount)
                await session.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[DeadLetterCount.topic],
                        set_={
                            "num_records": DeadLetterCount.num_records + stmt.excluded.num_records,
                            "last_at": func.now(),
                        },
                    ),
                    [
                        {"topic": topic, "num_records": count}
                        for topic, count in sorted(pending.items())
                    ],
                )
        except BaseException:
            self._pending.update(pending)
            raise

    async def run(self, database: Database, stop: asyncio.Event, interval_s: float) -> None:
        """Flush every ``interval_s`` until ``stop``, then once more."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            try:
                await self.flush(database)
            except Exception as exc:  # noqa: BLE001 - counts stay pending and are retried
                log.warning("dead-letter tally flush failed (%s)", type(exc).__name__)


@dataclass(frozen=True, slots=True)
class _TallyChild:
    tally: DeadLetterTally
    topic: str

    def inc(self, amount: int = 1) -> None:
        self.tally._add(self.topic, amount)
