"""The node's side of the ledger: block events and inventories out.

Every change of bytes in the pool becomes a ``kvledger.kv-events`` record keyed by
node id (so one partition keeps them in order), stamped with the node's restart
``epoch`` and a per-epoch ``seq`` the coordinator uses to detect gaps. Events are
batched: consecutive pool events of one kind (and one removal reason) become one
record, flushed every ``publish_interval_s``. At start the node announces its new
epoch and a full inventory; :class:`gpu_node.commands.CommandConsumer` calls
:meth:`NodePublisher.publish_inventory` to answer ``InventoryRequested``.

Subjects never leave the node in clear: provenance carries the keyed
:func:`events.schema.subject_digest` shared with the coordinator.

Every record is signed with the node's own key (``signer``; ``docs/security.md``):
the coordinator applies only kv-events signed by the key enrolled for their node id.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime
from itertools import groupby
from pathlib import Path

from events import schema
from events.kafka import EventProducer, KafkaSettings, ensure_topics
from gpu_node import block_pool
from gpu_node.kv_cache_utils import BlockKey, BlockProvenance
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

# A stored block with its provenance is ~450 bytes of JSON; 1000 per record keeps every
# record well under the broker's default 1 MiB message limit. One oversized record would
# be retried forever and wedge everything queued behind it.
MAX_BLOCKS_PER_RECORD = 1000


def next_epoch(data_dir: Path) -> int:
    """A restart counter persisted beside the node's data: each start is a new epoch."""
    path = data_dir / "epoch"
    epoch = int(path.read_text()) + 1 if path.exists() else 1
    temporary = path.with_suffix(".tmp")
    temporary.write_text(str(epoch))
    temporary.replace(path)
    return epoch


class NodePublisher:
    def __init__(
        self,
        engine,
        kafka: KafkaSettings,
        node_id: str,
        subject_key: bytes,
        publish_interval_s: float = 0.05,
        heartbeat_interval_s: float = 5.0,
        *,
        signer: EnvelopeSigner,
    ) -> None:
        self.engine = engine
        self.kafka = kafka
        self.node_id = node_id
        self.subject_key = subject_key
        self.publish_interval_s = publish_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.epoch = 0
        self.seq = 0
        self._pending: deque[block_pool.PoolEvent | tuple[str, str, tuple[bytes, ...]]] = deque()
        self.signer = signer
        self._producer = EventProducer(kafka, sign=signer)
        self._tasks: list[asyncio.Task] = []
        self._send_lock = asyncio.Lock()

    async def start(self, data_dir: Path) -> None:
        """Announce the new epoch and a full inventory before block events flow."""
        await ensure_topics(self.kafka)
        await self._producer.start()
        self.epoch = next_epoch(data_dir)
        await self._send_node_events(
            [schema.NodeStarted(node_id=self.node_id, epoch=self.epoch, seq=0, namespace=self.engine.namespace.namespace)]
        )
        await self.publish_inventory(request_id=None)
        self._tasks = [
            asyncio.create_task(self._flush_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.flush()
        await self._producer.stop()

    def on_pool_events(self, events: list[block_pool.PoolEvent]) -> None:
        """Sink for the cache manager; called on the event loop, never blocks."""
        self._pending.extend(events)

    def on_snapshot_written(self, snapshot_id: str, block_hashes: Iterable[bytes]) -> None:
        self._pending.append(("snapshot", snapshot_id, tuple(block_hashes)))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.publish_interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - a broker hiccup must not stop publishing; the next flush retries
                log.exception("publishing block events failed; will retry")

    async def flush(self) -> None:
        """Publish everything pending, in order; on failure the events stay queued."""
        async with self._send_lock:
            if not self._pending:
                return
            pending = list(self._pending)
            payloads = []
            for kind, group in groupby(pending, key=_batch_kind):
                events = list(group)
                for start in range(0, len(events), MAX_BLOCKS_PER_RECORD):
                    payloads.append(self._payload(kind, events[start : start + MAX_BLOCKS_PER_RECORD]))
            await self._send_node_events(payloads)
            for _ in pending:
                self._pending.popleft()

    def _payload(self, kind: tuple, group) -> schema.EventPayload:
        events = list(group)
        common = {"node_id": self.node_id, "epoch": self.epoch, "seq": 0}
        if kind[0] == "stored":
            return schema.BlockStored(**common, blocks=[self._stored_block(e.key, e.tier.value) for e in events])
        if kind[0] == "removed":
            return schema.BlockRemoved(
                **common, reason=kind[1], blocks=[schema.RemovedBlock(block_hash=e.block_hash.hex(), tier=e.tier.value) for e in events]
            )
        if kind[0] == "moved":
            return schema.BlockMoved(
                **common,
                blocks=[
                    schema.MovedBlock(block_hash=e.block_hash.hex(), from_tier=e.from_tier.value, to_tier=e.to_tier.value)
                    for e in events
                ],
            )
        assert kind[0] == "snapshot", f"unknown batch kind {kind}"
        (_, snapshot_id, block_hashes), = events
        return schema.SnapshotWritten(**common, snapshot_id=snapshot_id, block_hashes=[h.hex() for h in block_hashes])

    async def _send_node_events(self, payloads: list[schema.EventPayload]) -> None:
        """Stamp consecutive seqs and send in order; seq only advances once the broker acked."""
        envelopes = []
        seq = self.seq
        for payload in payloads:
            if payload.TYPE != "NodeStarted":
                seq += 1
                payload = payload.model_copy(update={"seq": seq})
            envelopes.append(schema.make_event(payload))
        await self._producer.send_many(envelopes)
        self.seq = seq

    def provenance_event(self, block_hash: bytes, parent_hash: bytes, token_offset: int, provenance: BlockProvenance) -> dict:
        subject = (
            schema.subject_digest(self.subject_key, provenance.tenant_id, provenance.subject_id)
            if provenance.subject_id is not None
            else None
        )
        return {
            "block_hash": block_hash.hex(),
            "parent_hash": parent_hash.hex(),
            "namespace": provenance.namespace,
            "tenant_id": provenance.tenant_id,
            "scope": provenance.scope.label,
            "auth_scopes": [(scope, version) for scope, version in provenance.auth_scopes],
            "subject_id": subject,
            "documents": list(provenance.documents),
            "token_offset": token_offset,
            "created_at": datetime.fromtimestamp(provenance.created_at, UTC),
        }

    def _stored_block(self, key: BlockKey, tier: str) -> schema.StoredBlock:
        return schema.StoredBlock(**self.provenance_event(key.block_hash, key.parent_hash, key.token_offset, key.provenance), tier=tier)

    async def publish_inventory(self, request_id: uuid.UUID | None) -> None:
        """Everything this node holds, chunked; queued events are flushed first so seq stays ordered."""
        await self.flush()
        snapshot_inventory = await asyncio.to_thread(self.engine.snapshot_inventory)
        async with self._send_lock:
            held: list[tuple[BlockKey, str, str | None]] = [(e.key, e.tier.value, None) for e in self.engine.pool.ready_entries()]
            for snapshot_id, keys in snapshot_inventory.items():
                held.extend((key, "snapshot", snapshot_id) for key in keys)
            chunks = [held[i : i + MAX_BLOCKS_PER_RECORD] for i in range(0, len(held), MAX_BLOCKS_PER_RECORD)] or [[]]
            payloads = []
            for index, chunk in enumerate(chunks):
                described = {key.block_hash: key for key, _, _ in chunk}
                payloads.append(
                    schema.Inventory(
                        node_id=self.node_id,
                        epoch=self.epoch,
                        seq=0,
                        request_id=request_id,
                        placements=[
                            schema.Placement(block_hash=key.block_hash.hex(), tier=tier, snapshot_id=snapshot_id)
                            for key, tier, snapshot_id in chunk
                        ],
                        blocks=[
                            schema.BlockProvenance(**self.provenance_event(key.block_hash, key.parent_hash, key.token_offset, key.provenance))
                            for key in described.values()
                        ],
                        chunk=index,
                        chunks=len(chunks),
                    )
                )
            await self._send_node_events(payloads)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                heartbeat = schema.NodeHeartbeat(node_id=self.node_id, epoch=self.epoch, seq=self.seq)
                await self._producer.send(schema.make_event(heartbeat))
            except Exception:  # noqa: BLE001 - liveness is best effort; the coordinator notices silence
                log.exception("heartbeat failed")


def _batch_kind(event) -> tuple:
    if isinstance(event, block_pool.BlockStored):
        return ("stored",)
    if isinstance(event, block_pool.BlockRemoved):
        return ("removed", event.reason.value)
    if isinstance(event, block_pool.BlockMoved):
        return ("moved",)
    return ("snapshot", id(event))
