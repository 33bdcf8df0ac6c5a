"""The node's side of ``kvledger.commands``: invalidations in, verified deletions and acks out
(docs/design.md §5).

For every ``Invalidate`` the node

1. moves its :class:`~prefix_keys.versions.VersionRegistry`, so the API refuses
   requests that name a superseded document or policy version;
2. tombstones and deletes every matching block that exists when it applies the
   command — whatever the command's cutoff says (docs/design.md §5, "Cutoffs"):
   device/host slots are zeroed and read back, disk files overwritten
   and unlinked (:meth:`BlockPool.remove_where`), blocks a reader still holds are
   deleted when released (waited for, bounded), BUILDING matches are discarded
   at commit by the pool, and for an erasure matching builds keyed before the
   application (on the node's own clock) but claimed after the removal are
   refused for a bounded window (:meth:`BlockPool.guard_builds`);
   then every snapshot of the node is rewritten without the matches;
3. for a subject (erasure) command, crypto-erases: destroys the subject's data
   keys in the node's key provider — the ones it resolved for the subject and
   the ones named by the sealed copies it removed — so any copy of those
   blocks, including one copied off the node, no longer decrypts here;
4. publishes a ``CommandAck`` to ``kvledger.acks`` with one ``TierEvidence`` per
   tier touched — also when nothing matched, so the coordinator can complete. An ack
   too large for one record goes out as several signed parts (:mod:`events.ack_parts`),
   which the coordinator assembles before it counts the evidence.

The pool's removals still reach ``kvledger.kv-events`` as ``BlockRemoved`` records through
the publisher, as for every other change of bytes.

Ordering and restarts. Invalidations share one key, so they sit in one partition
and every node applies them in the coordinator's order. A node with a coordinator
URL (``coordinator_url``) does not depend on how long the broker keeps the topic: at
every start it notes the topic's end offsets, then fetches the governance state from
the coordinator (:mod:`gpu_node.governance.sync`) — the decisions its version registry
must hold and the commands still pending for it — applies the decisions to the
registry, applies and acks the pending commands exactly as commands from the topic,
and only then consumes the topic, from the offsets it noted: every decision missing
from the state was committed after the fetch, so its command lies past them. Until
the state is fetched and applied the node stays not ready and retries with capped
backoff. A node without a coordinator URL reads the topic from the beginning instead:
commands below its group's committed offset were applied in an earlier life and only
rebuild the registry; later ones are applied and acked now — complete only as long as
the topic's retention. Either way the node reports ready only once it has consumed up
to the end offsets it saw at start, so a node that was down applies what it missed
before it serves.

Re-sent commands. The coordinator re-sends a command to a node that has not acked it
(``coordinator.handlers.resend``): a new record, same ``command_id``. A command this node already
applied in this run is not applied again: its ack — the same envelope, same ``event_id`` and
evidence, every part of it — is published again, so a lost ack is recovered and an ack that did
arrive is a duplicate the coordinator's inbox drops. A command applied in an earlier life (its ack
and evidence are gone with the process) is applied again: that is idempotent, removes what matches
now, and acks that. The registry keeps, per document and policy, the latest decision by its time
(:mod:`prefix_keys.versions`), so a re-sent older command never moves it back.

Trust. Only commands signed by the coordinator's command key, which the node pins
(``identity.coordinator_public_key_file``), are applied, remembered or answered —
also during the replay at start. An unsigned, tampered or otherwise-signed record is
dead-lettered and counted (the node's ``kvledger_unverified_commands_total``) the first time it
is met and ignored on every later replay. Acks leave signed with the node's own key
(the publisher's signer). See ``docs/security.md``, "Node identity and signed records".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from events import schema, topics
from events.ack_parts import TierReport, ack_parts
from events.codec import decode_event, decode_key
from events.fault_points import fault_point
from events.kafka.consumer import StallClock, get_fresh_batch
from events.kafka.dead_letters import send_to_dead_letter
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.metrics import HANDLER_FAILURES_TOTAL
from gpu_node.governance.sync import (
    GovernanceClient,
    GovernanceRefused,
    GovernanceState,
    GovernanceUnavailable,
)
from identity.signing import SIGNATURE_ERROR, signature_problem

if TYPE_CHECKING:
    from gpu_node.governance.publisher import NodePublisher

from gpu_node.governance.applier import InvalidationApplier

log = logging.getLogger(__name__)

MAX_REMEMBERED_ACKS = 10_000
"""Acks kept per node for re-sent commands (a few hundred bytes each): the coordinator re-sends a
command within minutes of its decision, so only the most recent commands need theirs."""


AckRecords = tuple[schema.Envelope, ...]
"""One command's ack as the records that carry it: one, or the parts of
:func:`events.ack_parts.ack_parts`."""


def ack_records(
    command: schema.Invalidate,
    node_id: str,
    epoch: int,
    evidence: Sequence[TierReport],
    after_seq: int,
) -> AckRecords:
    """The envelopes of the ack of ``command``, each small enough to be sent once signed.

    Built once per application and kept: a re-sent command gets these same envelopes (same
    event ids, same parts) again, so the coordinator's inbox drops the parts it holds and
    stages the ones it missed. ``after_seq`` is the publisher's fence
    (:meth:`gpu_node.governance.publisher.NodePublisher.fence`).
    """
    parts = ack_parts(command.command_id, node_id, epoch, evidence, after_seq=after_seq)
    return tuple(schema.make_event(part) for part in parts)


# --------------------------------------------------------------------------- consumer


class CommandConsumer:
    """Consumes ``kvledger.commands`` for one node, applies them in order, acks, and gates readiness.

    Its own consumer group (``kvledger-node-{node_id}``) holds the node's
    progress; every partition is assigned to it directly (the node is the
    group's only member, so there is nothing to balance and no join to wait
    for). At start it reads the end offsets; with ``governance`` it fetches and
    applies the governance state and consumes from those offsets, without it it
    seeks to the beginning (see the module docstring); once it has consumed up to
    them, it sets ``engine.ready`` — never earlier. The
    commands of one poll are applied in order, each ack published (batched by
    the producer) once its command is applied, and the offsets committed once
    per poll after all its acks — in the background, while the next poll's
    commands are applied; a failure acks what was applied, seeks back and
    retries after a backoff, never skipping a command (see :meth:`_handle`). Malformed records go to the dead-letter topic.
    """

    def __init__(
        self,
        handler: InvalidationApplier,
        publisher: NodePublisher,
        kafka: KafkaSettings,
        *,
        command_key: Ed25519PublicKey,
        governance: GovernanceClient | None = None,
        poll_timeout_ms: int = 200,
        max_records: int = 100,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        stall_after_s: float = 60.0,
    ) -> None:
        self.handler = handler
        self.engine = handler.engine
        self.publisher = publisher
        self.node_id = publisher.node_id
        self.group_id = f"kvledger-node-{self.node_id}"
        self.replayed = asyncio.Event()
        self._command_key = command_key
        self.governance = governance
        self._poll_timeout_ms = poll_timeout_ms
        self._top_up_ms = kafka.top_up_ms
        self._max_records = max_records
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        # Commands that keep failing are retried forever (never skipped): the clock makes that
        # visible.
        self.stall = StallClock(stall_after_s)
        self.engine.metrics.consumer_stalled.labels(group=self.group_id).set_function(
            lambda: float(self.stall.stalled)
        )
        self._consumer = AIOKafkaConsumer(
            **kafka_client_kwargs(kafka),
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **kafka.timing_fields(),
        )
        self._producer = EventProducer(kafka, sign=publisher.signer)
        self._committed: dict[TopicPartition, int] = {}
        # Records handled in this run whose offsets are not committed yet → the ack's parts to
        # publish (None: no ack).
        self._unacked: dict[tuple[TopicPartition, int], AckRecords | None] = {}
        # command_id → its ack's parts, for commands applied in this run (a re-send is re-acked, not
        # re-applied).
        self._acks: collections.OrderedDict[uuid.UUID, AckRecords] = collections.OrderedDict()
        self._end_offsets: dict[TopicPartition, int] = {}
        # Per partition, the offset after the last record handled in this run (see _rewind).
        self._handled_upto: dict[TopicPartition, int] = {}
        self._task: asyncio.Task | None = None
        # The latest poll's acks and offset commit, chained after the previous poll's (see _handle).
        self._flushing: asyncio.Task | None = None

    async def start(self) -> None:
        """Assign every partition, note what was applied before and where the log ends, start
        consuming.

        The topic must exist (the publisher's start creates it).
        """
        await self._producer.start()
        try:
            await self._consumer.start()
            await self._consumer.topics()
            partitions = self._consumer.partitions_for_topic(topics.COMMANDS)
            if not partitions:
                raise RuntimeError(
                    f"topic {topics.COMMANDS} has no partitions; create the topics first"
                )
            assigned = [
                TopicPartition(topics.COMMANDS, partition) for partition in sorted(partitions)
            ]
            self._consumer.assign(assigned)
            for tp in assigned:
                self._committed[tp] = await self._consumer.committed(tp) or 0
            self._end_offsets = await self._consumer.end_offsets(assigned)
            if self.governance is None:
                await self._consumer.seek_to_beginning(*assigned)
                self._handled_upto = await self._consumer.beginning_offsets(assigned)
            else:
                # Read before the governance state is fetched (in _run): every decision whose
                # command lies below these offsets is in that state, so the records below them are
                # never read.
                for tp, end in self._end_offsets.items():
                    self._consumer.seek(tp, end)
                    self._committed[tp] = max(self._committed[tp], end)
                self._handled_upto = dict(self._end_offsets)
        except BaseException:
            await self._consumer.stop()
            await self._producer.stop()
            raise
        self._task = asyncio.create_task(self._run(), name=f"commands-{self.node_id}")

    async def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Stop consuming; the acks and commit in flight get ``flush_timeout_s`` to finish (else they are redone next start)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._flushing is not None:
            await asyncio.wait({self._flushing}, timeout=flush_timeout_s)
            self._flushing.cancel()
            await asyncio.gather(self._flushing, return_exceptions=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def _run(self) -> None:
        if self.governance is not None:
            await self._sync_governance()
        backoff = self._initial_backoff_s
        while True:
            try:
                self._raise_if_flush_failed()
                batch = await get_fresh_batch(
                    self._consumer,
                    timeout_ms=self._poll_timeout_ms,
                    max_records=self._max_records,
                    top_up_ms=self._top_up_ms,
                )
                if any(batch.values()):
                    self.stall.waiting()
                await self._handle(batch)
                self.stall.advanced()
                if not self.replayed.is_set() and not any(batch.values()):
                    await self._check_replayed()
                backoff = self._initial_backoff_s
            except Exception as exc:  # noqa: BLE001 - a failed command is retried, never skipped
                HANDLER_FAILURES_TOTAL.labels(group=self.group_id).inc()
                # Exception text may quote record data; only its type is logged.
                log.warning(
                    "node %s: command failed (%s); retrying in %.1fs",
                    self.node_id,
                    type(exc).__name__,
                    backoff,
                )
                log.debug("command failure detail", exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    async def _sync_governance(self) -> None:
        """Fetch and apply the governance state, retrying with capped backoff until it is applied; the node stays not ready."""
        backoff = self._initial_backoff_s
        while True:
            try:
                state = await self.governance.fetch()
                await self._apply_governance(state)
                return
            except Exception as exc:  # noqa: BLE001 - never ready on a partial or unverified state, never a crash loop
                reason = (
                    str(exc)
                    if isinstance(exc, (GovernanceUnavailable, GovernanceRefused))
                    else type(exc).__name__
                )
                kind = "apply_failed"
                if isinstance(exc, (GovernanceUnavailable, GovernanceRefused)):
                    kind = "unavailable" if isinstance(exc, GovernanceUnavailable) else "refused"
                self.engine.metrics.governance_failures.labels(reason=kind).inc()
                log.warning(
                    "node %s: governance state not applied (%s); not ready, retrying in %.1fs",
                    self.node_id,
                    reason,
                    backoff,
                )
                log.debug("governance failure detail", exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    async def _apply_governance(self, state: GovernanceState) -> None:
        """The registry decisions, then the pending commands as from the topic: applied (once in this run) and acked."""
        for predicate, decided_at in state.decisions:
            self.handler.remember_decision(predicate, decided_at)
        sending = [
            asyncio.create_task(self._producer.send_many(self._acks[command.command_id]))
            for command in state.pending
            if command.command_id in self._acks
        ]
        to_apply = [command for command in state.pending if command.command_id not in self._acks]
        try:
            async with contextlib.aclosing(self.handler.apply_batch(to_apply)) as applied:
                async for command, evidence in applied:
                    ack = await self._ack(command, evidence)
                    self._remember_ack(command.command_id, ack)
                    sending.append(asyncio.create_task(self._producer.send_many(ack)))
        finally:
            results = await asyncio.gather(*sending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        log.info(
            "node %s: governance state applied (as of decision %d): %d decisions, %d pending commands",
            self.node_id,
            state.as_of_decision,
            len(state.decisions),
            len(state.pending),
        )

    async def _ack(self, command: schema.Invalidate, evidence: list[TierReport]) -> AckRecords:
        """The ack of an applied command, whether it came from the topic or from the governance state at start.

        Fenced: the block events of the command's removals (and the ``SnapshotWritten`` of every
        snapshot it rewrote) are on the broker before the ack is built, and the ack names the
        last seq among them, so the coordinator never applies the ack ahead of them (they
        travel on another topic, to another consumer group).
        """
        fault_point("node.between_delete_and_ack")
        after_seq = await self.publisher.fence()
        return ack_records(command, self.node_id, self.publisher.epoch, evidence, after_seq)

    async def _check_replayed(self) -> None:
        """Ready once an empty poll finds the position at or past the end noted at start.

        The empty poll matters: some brokers (Tansu) report the end offset as the start
        of the last record batch, so a position past it alone does not prove that the
        rest of that batch was applied.
        """
        for tp, end in self._end_offsets.items():
            if await self._consumer.position(tp) < end:
                return
        self.engine.ready = True
        self.replayed.set()
        log.info("node %s: commands replayed; ready", self.node_id)

    async def _handle(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Apply a batch in order per partition, publishing each ack once its command is applied;
        commit once.

        Consecutive commands to apply are applied together
        (:meth:`InvalidationApplier.apply_batch`). An ack is handed to the
        producer right after its command was applied (never before), without
        waiting for the broker: the producer batches those that accumulate. Then a
        flush task awaits the batch's acks and commits its offsets once per
        partition, after the previous batch's flush — so an offset is committed
        only after every ack below it was published — while the node goes on to
        the next poll: waiting for the broker twice per batch would hold back
        every command behind it. A failed flush is raised at the next poll
        (:meth:`_raise_if_flush_failed`). On a failed command the acks of the
        commands applied before it are still awaited and committed. After any
        failure every partition rewinds to its first record neither handled in this
        run nor committed (:meth:`_rewind`): the failed command is retried, none is
        skipped. A command applied but not acked (its
        ack could not be published) is not applied again on the retry; its ack,
        kept in ``_unacked`` with the evidence of the application, is sent again.
        """
        handled: dict[TopicPartition, int] = {}
        sending: list[asyncio.Task] = []
        try:
            for tp, records in batch.items():
                await self._handle_partition(tp, records, handled, sending)
        except Exception:
            self._handled_upto.update(handled)
            try:
                await self._flush_after(self._flushing, sending, handled)
            except Exception:  # noqa: BLE001 - the command's failure is the one raised
                log.debug("acks after a failed command could not be published", exc_info=True)
            self._flushing = None
            self._rewind()
            raise
        except BaseException:  # cancelled (stop): earlier batches' flushes are left to stop()
            for task in sending:
                task.cancel()
            raise
        self._handled_upto.update(handled)
        if sending or handled:
            self._flushing = asyncio.create_task(
                self._flush_after(self._flushing, sending, handled)
            )

    def _raise_if_flush_failed(self) -> None:
        """Raise the failure of the last flush, if it failed, after rewinding to what is committed."""
        if self._flushing is None or not self._flushing.done():
            return
        flushing, self._flushing = self._flushing, None
        if flushing.exception() is not None:
            self._rewind()
            raise flushing.exception()

    async def _handle_partition(
        self,
        tp: TopicPartition,
        records: list[ConsumerRecord],
        handled: dict[TopicPartition, int],
        sending: list[asyncio.Task],
    ) -> None:
        """Handle one partition's records in order; ``handled[tp]`` follows the last one done, acks go to ``sending``."""
        to_apply: list[tuple[int, schema.Invalidate]] = []
        for record in records:
            envelope, error = self._verified(record)
            key = (tp, record.offset)
            # A command already waiting in ``to_apply`` (re-sent while this node was down or slow,
            # so several copies arrive in one batch) is not applied twice: the commands before it
            # are applied first, then this copy is answered with that application's ack
            # (_handle_record).
            if (
                envelope is not None
                and isinstance(envelope.payload, schema.Invalidate)
                and record.offset >= self._committed[tp]
                and key not in self._unacked
                and envelope.payload.command_id not in self._acks
                and all(
                    envelope.payload.command_id != waiting.command_id for _, waiting in to_apply
                )
            ):
                to_apply.append((record.offset, envelope.payload))
                continue
            await self._apply(tp, to_apply, handled, sending)
            to_apply = []
            ack = await self._handle_record(tp, record, envelope, error)
            if ack is not None:
                sending.append(asyncio.create_task(self._producer.send_many(ack)))
            handled[tp] = record.offset + 1
        await self._apply(tp, to_apply, handled, sending)

    def _verified(self, record: ConsumerRecord) -> tuple[schema.Envelope | None, str | None]:
        """(envelope, None) for a valid command signed by the pinned coordinator key; (None, why)
        otherwise."""
        try:
            envelope = decode_event(record.value)
            key = decode_key(record.key)
        except schema.EventValidationError as exc:
            return None, str(exc)
        misrouted = topics.routing_problem(record.topic, key, envelope)
        if misrouted is not None:
            return None, topics.ROUTING_ERROR + misrouted
        problem = signature_problem(envelope, self._command_key)
        if problem is not None:
            return None, SIGNATURE_ERROR + problem
        return envelope, None

    async def _apply(
        self,
        tp: TopicPartition,
        commands: list[tuple[int, schema.Invalidate]],
        handled: dict[TopicPartition, int],
        sending: list[asyncio.Task],
    ) -> None:
        """Apply consecutive commands of ``tp`` (offset, command) together, handing each ack to the
        producer as it completes."""
        if not commands:
            return
        offsets = iter(commands)
        async with contextlib.aclosing(
            self.handler.apply_batch([command for _, command in commands])
        ) as applied:
            async for command, evidence in applied:
                offset, expected = next(offsets)
                assert command is expected, "apply_batch yields the commands in order"
                ack = await self._ack(command, evidence)
                self._unacked[(tp, offset)] = ack
                self._remember_ack(command.command_id, ack)
                sending.append(asyncio.create_task(self._producer.send_many(ack)))
                handled[tp] = offset + 1
                log.info(
                    "node %s: applied %s command, %d blocks removed",
                    self.node_id,
                    command.predicate.kind,
                    sum(item.removed for item in evidence),
                )

    def _remember_ack(self, command_id: uuid.UUID, ack: AckRecords) -> None:
        self._acks[command_id] = ack
        self._acks.move_to_end(command_id)
        while len(self._acks) > MAX_REMEMBERED_ACKS:
            self._acks.popitem(last=False)

    def _rewind(self) -> None:
        """After a failure, seek every partition back to its first record neither handled in this run nor committed.

        Records from the committed offset on are handled again: the applied ones are only
        acked again (``_unacked``). One still being replayed below its committed offset
        resumes at its first record not yet handled, so none of those is skipped either.
        """
        for tp, handled_upto in self._handled_upto.items():
            self._handled_upto[tp] = min(handled_upto, self._committed[tp])
            self._consumer.seek(tp, self._handled_upto[tp])

    async def _flush_after(
        self,
        previous: asyncio.Task | None,
        sending: list[asyncio.Task],
        handled: dict[TopicPartition, int],
    ) -> None:
        """:meth:`_flush` once ``previous`` (the flush of the batch before) succeeded; its failure
        fails this one too."""
        if previous is not None:
            try:
                await previous
            except BaseException:
                await asyncio.gather(*sending, return_exceptions=True)
                raise
        await self._flush(sending, handled)

    async def _flush(self, sending: list[asyncio.Task], handled: dict[TopicPartition, int]) -> None:
        """Wait until every ack in flight was published, then commit what was handled."""
        if sending:
            results = await asyncio.gather(*sending, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        offsets = {
            tp: offset for tp, offset in handled.items() if offset > self._committed.get(tp, 0)
        }
        if offsets:
            await self._consumer.commit(offsets)
            self._committed.update(offsets)
        for tp, offset in offsets.items():
            for done in [key for key in self._unacked if key[0] == tp and key[1] < offset]:
                del self._unacked[done]

    async def _handle_record(
        self,
        tp: TopicPartition,
        record: ConsumerRecord,
        envelope: schema.Envelope | None,
        error: str | None,
    ) -> AckRecords | None:
        """Everything but applying a command: dead letters, replays, acks to resend, inventory
        requests.

        Returns the ack's parts to publish (None when there is none). Commits nothing.
        """
        applied_before = record.offset < self._committed[tp]
        if envelope is None:
            if not applied_before and (tp, record.offset) not in self._unacked:
                await self._dead_letter(record, error)
                self._unacked[(tp, record.offset)] = None
            return None
        payload = envelope.payload
        assert isinstance(payload, schema.Command), (
            f"routing admits only commands on this topic, got {envelope.type}"
        )
        if isinstance(payload, schema.Invalidate):
            # Applied in an earlier life, or in this run with its ack not yet published, or a
            # re-send of a command applied in this run: remember, never apply again; a re-send gets
            # the command's ack again.
            self.handler.remember(payload)
            if applied_before:
                return None
            key = (tp, record.offset)
            if key not in self._unacked:
                assert payload.command_id in self._acks, (
                    f"command {payload.command_id} neither applied nor remembered"
                )
                self._unacked[key] = self._acks[payload.command_id]
                self.engine.metrics.commands_reacked.inc()
                log.info(
                    "node %s: re-acking a re-sent %s command", self.node_id, payload.predicate.kind
                )
            return self._unacked[key]
        if (
            isinstance(payload, schema.InventoryRequested)
            and payload.node_id == self.node_id
            and not applied_before
        ):
            if (tp, record.offset) not in self._unacked:
                await self.publisher.publish_inventory(payload.request_id)
                self._unacked[(tp, record.offset)] = None
        return None

    async def _dead_letter(self, record: ConsumerRecord, error: str) -> None:
        # The node's own topic: nodes never write kvledger.dead-letter, whose letters replay
        # republishes.
        await send_to_dead_letter(
            self._producer, record, error, self.group_id, topic=topics.NODE_DEAD_LETTER
        )
        if error.startswith(topics.ROUTING_ERROR):
            self.engine.metrics.misrouted_commands.labels(
                reason=error.removeprefix(topics.ROUTING_ERROR)
            ).inc()
        if error.startswith(SIGNATURE_ERROR):
            self.engine.metrics.unverified_commands.labels(
                reason=error.removeprefix(SIGNATURE_ERROR)
            ).inc()
