"""The node's side of the ledger: block events and inventories out.

Every change of bytes in the pool becomes a ``kvledger.kv-events`` record keyed by
node id (so one partition keeps them in order), stamped with the node's restart
``epoch`` and a per-epoch ``seq`` the coordinator uses to detect gaps. Events are
batched: consecutive pool events of one kind (and one removal reason) become one
record, flushed every ``publish_interval_s``. At start the node announces its new
epoch and a full inventory; :class:`gpu_node.governance.commands.CommandConsumer` calls
:meth:`NodePublisher.publish_inventory` to answer ``InventoryRequested``.

Subjects never leave the node in clear: provenance carries the keyed
:func:`events.schema.subject_digest` shared with the coordinator.

No event can wedge the publisher (docs/security.md, "Bounded input and poison records"): a block
whose provenance the contract refuses, a record larger than
:data:`~events.record_size.MAX_RECORD_BYTES`, or a record the broker refuses for good is
*dead-lettered locally* — counted in ``kvledger_node_dead_letters``, logged without content and
reported on ``kvledger.node-dead-letter`` — and everything else keeps flowing. A record left out
before it was stamped consumes no ``seq``, so the sequence stays gap-free; one the broker refused
after later records were stamped leaves a gap, which the coordinator notices and answers with an
``InventoryRequested``. A send whose outcome is unknown (timeout, lost connection) is retried with
the *same bytes*: a seq the broker may already hold is never reused for different content.

A served block must never be one the contract refuses, since the ledger would never know
it: a block with more documents or auth scopes than a kv-event lists is refused where its
key is computed (:func:`prefix_keys.blocks.compute_block_keys`, an error, never a
shortened list), and the API refuses such a prompt with 400 before that.

Every record is signed with the node's own key (``signer``; ``docs/security.md``):
the coordinator applies only kv-events signed by the key enrolled for their node id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import groupby
from pathlib import Path
from typing import TypeVar

from aiokafka.errors import (
    CorruptRecordException,
    InvalidMessageError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from pydantic import ValidationError

from events import schema
from events.codec import DeadLetter, encode_event, encode_key
from events.fault_points import fault_triggered
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.record_size import MAX_RECORD_BYTES, envelope_bytes, split_to_fit
from events.topics import KV_EVENTS, NODE_DEAD_LETTER, route
from gpu_node.governance.usage import usage_meter
from gpu_node.keys.crypto import until_key_service_answers
from gpu_node.pool import vocabulary
from identity.signing import EnvelopeSigner
from prefix_keys.blocks import BlockKey, CacheProvenance

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_RECORD = schema.MAX_BLOCKS_PER_EVENT
"""Most blocks one record lists; a record is also cut short of
:data:`~events.record_size.MAX_RECORD_BYTES` (one block's provenance may name 256 auth scopes and
256 documents: 1000 such blocks are far over it)."""
PERMANENT_SEND_ERRORS = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    InvalidMessageError,
)
"""Broker answers that say the record itself is refused: resending the same bytes cannot succeed."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Record:
    """One stamped, encoded record: resent byte-identical until the broker acknowledges it."""

    topic: str
    key: bytes
    value: bytes
    event_type: str
    seq: int


def next_epoch(data_dir: Path) -> int:
    """A restart counter persisted beside the node's data: each start is a new epoch."""
    path = data_dir / "epoch"
    epoch = int(path.read_text()) + 1 if path.exists() else 1
    temporary = path.with_suffix(".tmp")
    temporary.write_text(str(epoch))
    temporary.replace(path)
    return epoch


KV_EVENTS_SUBSCRIBER = "kv-events"
"""The publisher's name among the cache manager's pool-event subscribers
(:meth:`NodePublisher.on_pool_events`)."""


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
        self._pending: deque[vocabulary.PoolEvent | tuple[str, str, tuple[bytes, ...]]] = deque()
        self._unacked: list[_Record] = []
        """Stamped records whose send failed ambiguously; they go out again, identical, before anything new."""
        self._letters: list[DeadLetter] = []
        self.signer = signer
        self._producer = EventProducer(kafka)
        self._tasks: list[asyncio.Task] = []
        self._send_lock = asyncio.Lock()

    def _encode(self, envelope: schema.Envelope) -> bytes:
        """The bytes of one kv-events record, signed with the node's key: the single place an envelope of
        this node becomes bytes, so every record the coordinator receives is signed (retries resend these bytes)."""
        return encode_event(self.signer(envelope))

    async def start(self, data_dir: Path) -> None:
        """Announce the new epoch and a full inventory before block events flow."""
        await ensure_topics(self.kafka)
        await self._producer.start()
        self.epoch = next_epoch(data_dir)
        await self._send_node_events(
            [
                schema.NodeStarted(
                    node_id=self.node_id,
                    epoch=self.epoch,
                    seq=0,
                    namespace=self.engine.namespace.namespace,
                )
            ]
        )
        # The ledger replaces the node's placements with an inventory: one that left out a
        # snapshot's sealed blocks because their keys could not be asked for would make it drop
        # copies still on disk.
        await until_key_service_answers(
            lambda: self.publish_inventory(request_id=None), f"node {self.node_id}: start inventory"
        )
        self._tasks = [
            asyncio.create_task(self._flush_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.flush()
        await self.publish_usage()
        await self._producer.stop()

    def on_pool_events(self, events: Sequence[vocabulary.PoolEvent]) -> None:
        """The cache manager's ``kv-events`` subscriber (:meth:`KVCacheManager.subscribe`); on the
        event loop, never blocks."""
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

    async def fence(self) -> int:
        """Publish every pool event handed over so far; returns the last seq of this epoch the broker took.

        A command ack carries it (``CommandAck.after_seq``): every block event that happened
        before the call is at or below it. Raises what :meth:`flush` raises (the broker did not
        take them): the command is then applied again and acked later, never acked ahead of its
        events.
        """
        self.engine.manager.drain_events()
        await self.flush()
        return self.seq

    async def flush(self) -> None:
        """Publish everything pending, in order; records whose send failed are resent, identical, next time."""
        async with self._send_lock:
            await self._flush_pending()

    async def _flush_pending(self) -> None:
        """:meth:`flush`'s work; call with the send lock held."""
        await self._resend_unacked()
        if not self._pending:
            return
        pending = list(self._pending)
        payloads = []
        for kind, group in groupby(pending, key=_batch_kind):
            payloads.extend(self._payloads(kind, list(group)))
        # The events are records now: a failed send leaves them in ``_unacked``, to go out
        # again byte-identical, never rebuilt under a new event id.
        for _ in pending:
            self._pending.popleft()
        await self._send_node_events(payloads)

    def _payloads(self, kind: tuple, events: list) -> list[schema.EventPayload]:
        """The records for one run of pool events, each within the count and size limits; none for what the contract refuses.

        The one place pool events (:mod:`gpu_node.pool.vocabulary`) become kv-events records (:mod:`events.schema`)::

            StoredInPool(key, tier, source)                → BlockStored(blocks=[StoredBlock: provenance, tier, replica_of])
            RemovedFromPool(block_hash, tier, reason, ev)  → BlockRemoved(reason, blocks=[RemovedBlock: block_hash, tier])
            MovedInPool(block_hash, from_tier, to_tier)    → BlockMoved(blocks=[MovedBlock: block_hash, from_tier, to_tier])
            ("snapshot", snapshot_id, block_hashes)        → SnapshotWritten(snapshot_id, block_hashes, part, parts)

        A run is consecutive events of one kind (one reason, for removals; :func:`_batch_kind`).
        Provenance leaves with the subject as its keyed digest; removal evidence stays on the
        node (it goes into command acks, :mod:`gpu_node.governance.commands`).
        """
        common = {"node_id": self.node_id, "epoch": self.epoch, "seq": 0}
        if kind[0] == "stored":
            built = (
                self._built(
                    "BlockStored", lambda e=e: self._stored_block(e.key, e.tier.value, e.source)
                )
                for e in events
            )
            return self._split(
                schema.BlockStored, common, [block for block in built if block is not None]
            )
        if kind[0] == "removed":
            removed = [
                schema.RemovedBlock(block_hash=e.block_hash.hex(), tier=e.tier.value)
                for e in events
            ]
            return self._split(schema.BlockRemoved, {**common, "reason": kind[1]}, removed)
        if kind[0] == "moved":
            moved = [
                schema.MovedBlock(
                    block_hash=e.block_hash.hex(),
                    from_tier=e.from_tier.value,
                    to_tier=e.to_tier.value,
                )
                for e in events
            ]
            return self._split(schema.BlockMoved, common, moved)
        assert kind[0] == "snapshot", f"unknown batch kind {kind}"
        ((_, snapshot_id, block_hashes),) = events
        return self._snapshot_parts(common, snapshot_id, [h.hex() for h in block_hashes])

    def _split(
        self, model: type[schema.NodeEvent], fields: dict, blocks: list
    ) -> list[schema.EventPayload]:
        """``model`` records listing ``blocks``, as few as the count and size limits allow."""
        runs = split_to_fit(
            blocks,
            lambda run: envelope_bytes(model.model_construct(**fields, blocks=list(run))),
            max_items=MAX_BLOCKS_PER_RECORD,
        )
        return [
            payload
            for payload in (
                self._built(model.TYPE, lambda run=run: model(**fields, blocks=list(run)))
                for run in runs
            )
            if payload
        ]

    def _snapshot_parts(
        self, common: dict, snapshot_id: str, block_hashes: list[str]
    ) -> list[schema.EventPayload]:
        """A snapshot's ``SnapshotWritten`` as parts within the limits (``part``/``parts``, one when it fits)."""

        def size_of(run) -> int:
            payload = schema.SnapshotWritten.model_construct(
                **common,
                snapshot_id=snapshot_id,
                block_hashes=list(run),
                part=schema.MAX_INT32 - 1,
                parts=schema.MAX_INT32,
            )
            return envelope_bytes(payload)

        runs = split_to_fit(block_hashes, size_of, max_items=schema.MAX_HASHES_PER_EVENT) or [[]]
        built = (
            self._built(
                "SnapshotWritten",
                lambda number=number, run=run: schema.SnapshotWritten(
                    **common,
                    snapshot_id=snapshot_id,
                    block_hashes=list(run),
                    part=number,
                    parts=len(runs),
                ),
            )
            for number, run in enumerate(runs)
        )
        return [payload for payload in built if payload is not None]

    def _built(self, event_type: str, build: Callable[[], T]) -> T | None:
        """``build()``, or ``None`` after dead-lettering what the contract refused (it would never be accepted)."""
        try:
            return build()
        except ValidationError as exc:
            self._dead_letter_locally(event_type, "invalid", schema.describe_validation_error(exc))
            return None

    async def _send_node_events(self, payloads: list[schema.EventPayload]) -> None:
        """Stamp consecutive seqs, encode and send in order; ``self.seq`` follows the broker's acks.

        A record too large to send is left out before it takes a seq. Records that failed
        ambiguously stay in ``_unacked`` (byte-identical) and the failure propagates, so the
        caller's next flush resends them first.
        """
        records = []
        seq = self.seq
        for payload in payloads:
            stamped_seq = seq if payload.TYPE == "NodeStarted" else seq + 1
            envelope = schema.make_event(payload.model_copy(update={"seq": stamped_seq}))
            value = self._encode(envelope)
            if len(value) > MAX_RECORD_BYTES:
                self._dead_letter_locally(
                    payload.TYPE,
                    "too_large",
                    f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}",
                )
                continue
            seq = stamped_seq
            topic, key = route(envelope)
            records.append(_Record(topic, encode_key(key), value, payload.TYPE, seq))
        self._unacked.extend(records)
        try:
            await self._resend_unacked()
        finally:
            await self._report_dead_letters()

    async def _resend_unacked(self) -> None:
        if not self._unacked:
            return
        records, self._unacked = self._unacked, []
        results = await self._producer.send_raw_many([(r.topic, r.value, r.key) for r in records])
        if fault_triggered(
            "node.kv_events_send_timed_out"
        ):  # tests only: the broker took them, the client saw a timeout
            results = [KafkaTimeoutError() for _ in records]
        failed: KafkaError | None = None
        for record, result in zip(records, results, strict=True):
            if isinstance(result, PERMANENT_SEND_ERRORS):
                # Its seq is spent: the coordinator sees the gap and asks for an inventory.
                self._dead_letter_locally(record.event_type, "refused", type(result).__name__)
            elif isinstance(result, KafkaError):
                self._unacked.append(record)
                failed = failed or result
            else:
                self.seq = max(self.seq, record.seq)
        if failed is not None:
            raise failed

    def _dead_letter_locally(self, event_type: str, cause: str, error: str) -> None:
        """Count, log (no content: the error names fields, never values) and report a record that
        cannot be sent."""
        self.engine.metrics.dead_letters.labels(type=event_type, cause=cause).inc()
        log.error(
            "node %s: %s record dead-lettered locally (%s): %s",
            self.node_id,
            event_type,
            cause,
            error,
        )
        letter = DeadLetter.of(
            topic=KV_EVENTS,
            partition=-1,
            offset=-1,
            timestamp_ms=int(time.time() * 1000),
            key=encode_key(self.node_id),
            value=None,
            error=f"{event_type} from node {self.node_id} never sent ({cause}): {error}",
            group_id=None,
        )
        self._letters.append(letter)

    async def _report_dead_letters(self) -> None:
        """Best effort: the metric and the log line already recorded each one."""
        letters, self._letters = self._letters, []
        for letter in letters:
            try:
                await self._producer.send_raw(NODE_DEAD_LETTER, letter.encode(), letter.raw_key())
            except Exception as exc:  # noqa: BLE001 - a broker hiccup must not stop publishing
                log.warning(
                    "node %s: reporting a dead letter failed (%s)", self.node_id, type(exc).__name__
                )

    def provenance_event(
        self, block_hash: bytes, parent_hash: bytes, token_offset: int, provenance: CacheProvenance
    ) -> dict:
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
            "creator_subject_id": provenance.creator_subject_id,
        }

    def _stored_block(
        self, key: BlockKey, tier: str, source: vocabulary.ReplicaSource | None = None
    ) -> schema.StoredBlock:
        replica_of = (
            None
            if source is None
            else schema.ReplicaOrigin(
                source_node_id=source.node_id,
                pulled_at=datetime.fromtimestamp(source.pulled_at_wall, UTC),
            )
        )
        provenance = self.provenance_event(
            key.block_hash, key.parent_hash, key.token_offset, key.provenance
        )
        return schema.StoredBlock(**provenance, tier=tier, replica_of=replica_of)

    async def publish_inventory(self, request_id: uuid.UUID | None) -> None:
        """Everything this node holds, chunked; the events behind it are published first so seq stays ordered.

        Raises :class:`gpu_node.keys.crypto.KeyServiceUnavailable`, publishing nothing, when a snapshot's blocks cannot be told readable
        or gone now (:func:`gpu_node.pool.snapshots.readable_blocks`); the command consumer retries an
        ``InventoryRequested`` with backoff, :meth:`start` its own inventory.
        """
        snapshot_inventory = await asyncio.to_thread(self.engine.snapshot_inventory)
        async with self._send_lock:
            pool = self.engine.pool
            with pool.lock:
                # The pool's events and the state they led to, taken at one instant: every change
                # the inventory shows goes out before it (lower seq), none after. A step's changes
                # are in the pool before its events are drained on this loop; an inventory read
                # between the two showed moves whose records followed it, and the ledger, read
                # before the inventory, looked stale.
                self.engine.manager.drain_events()
                held: list[tuple[BlockKey, str, str | None]] = [
                    (e.key, e.tier.value, None) for e in pool.ready_entries()
                ]
            await self._flush_pending()
            for snapshot_id, keys in snapshot_inventory.items():
                held.extend((key, "snapshot", snapshot_id) for key in keys)
            described: dict[bytes, schema.BlockProvenance | None] = {}
            for key, _, _ in held:
                if key.block_hash not in described:
                    described[key.block_hash] = self._built(
                        "Inventory",
                        lambda key=key: schema.BlockProvenance(
                            **self.provenance_event(
                                key.block_hash, key.parent_hash, key.token_offset, key.provenance
                            )
                        ),
                    )
            # A block the contract refuses is left out with its placements (dead-lettered above).
            listed = [
                (
                    schema.Placement(
                        block_hash=key.block_hash.hex(), tier=tier, snapshot_id=snapshot_id
                    ),
                    provenance,
                )
                for key, tier, snapshot_id in held
                if (provenance := described[key.block_hash]) is not None
            ]
            common = {
                "node_id": self.node_id,
                "epoch": self.epoch,
                "seq": 0,
                "request_id": request_id,
            }

            def chunk_fields(run) -> dict:
                blocks = {provenance.block_hash: provenance for _, provenance in run}
                return {
                    **common,
                    "placements": [placement for placement, _ in run],
                    "blocks": list(blocks.values()),
                }

            runs = split_to_fit(
                listed,
                lambda run: envelope_bytes(
                    schema.Inventory.model_construct(
                        **chunk_fields(run), chunk=schema.MAX_INT32 - 1, chunks=schema.MAX_INT32
                    )
                ),
                max_items=MAX_BLOCKS_PER_RECORD,
            ) or [[]]
            payloads = [
                schema.Inventory(**chunk_fields(run), chunk=index, chunks=len(runs))
                for index, run in enumerate(runs)
            ]
            await self._send_node_events(payloads)

    async def publish_usage(self) -> None:
        """What this node served each tenant since the last report: one ``UsageReported`` per tenant.

        Drained counts become stamped records at once, so a failed send resends the same
        records (same event ids: the coordinator counts them once) on the next flush.
        """
        async with self._send_lock:
            payloads = [
                payload
                for payload in (
                    self._built(
                        "UsageReported",
                        lambda usage=usage: schema.UsageReported(
                            node_id=self.node_id,
                            epoch=self.epoch,
                            seq=0,
                            tenant_id=usage.tenant_id,
                            window_start=usage.window_start,
                            window_end=usage.window_end,
                            num_requests=usage.num_requests,
                            num_prompt_tokens=usage.num_prompt_tokens,
                            num_cached_tokens=usage.num_cached_tokens,
                            num_output_tokens=usage.num_output_tokens,
                        ),
                    )
                    for usage in usage_meter(self.engine).drain()
                )
                if payload is not None
            ]
            if payloads:
                await self._send_node_events(payloads)

    async def _heartbeat_loop(self) -> None:
        """Usage and then liveness, every ``heartbeat_interval_s`` (the heartbeat's seq then covers the usage records)."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self.publish_usage()
            except Exception:  # noqa: BLE001 - unsent usage records stay queued and go out with the next flush
                log.exception("publishing usage failed; will retry")
            try:
                envelope = schema.make_event(
                    schema.NodeHeartbeat(node_id=self.node_id, epoch=self.epoch, seq=self.seq)
                )
                topic, key = route(envelope)
                await self._producer.send_raw(topic, self._encode(envelope), encode_key(key))
            except Exception:  # noqa: BLE001 - liveness is best effort; the coordinator notices silence
                log.exception("heartbeat failed")


def _batch_kind(event) -> tuple:
    if isinstance(event, vocabulary.StoredInPool):
        return ("stored",)
    if isinstance(event, vocabulary.RemovedFromPool):
        return ("removed", event.reason.value)
    if isinstance(event, vocabulary.MovedInPool):
        return ("moved",)
    return ("snapshot", id(event))
