"""The batch consumer every coordinator consumer runs on: validate, hand over, commit after the
handler's commit.

Also :class:`StallClock` (how a consumer that stopped advancing becomes visible) and
:func:`get_fresh_batch` (the poll that does not leave newly arrived records a batch behind).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter

from events.codec import decode_event, decode_key
from events.kafka.dead_letters import Seal, send_to_dead_letter
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.metrics import (
    CONSUMER_STALLED,
    DEAD_LETTER_TOTAL,
    HANDLER_FAILURES_TOTAL,
    MISROUTED_RECORDS_TOTAL,
)
from events.schema import Envelope, EventValidationError
from events.topics import DEAD_LETTER_TOPICS, ROUTING_ERROR, routing_problem

log = logging.getLogger(__name__)


async def get_fresh_batch(
    consumer: AIOKafkaConsumer, *, timeout_ms: int, max_records: int, top_up_ms: int
) -> dict[TopicPartition, list[ConsumerRecord]]:
    """``consumer.getmany``, topped up with what reached the broker while the caller was busy.

    aiokafka prefetches, but stops fetching from a broker while records fetched from it
    wait to be consumed. A consumer whose handling takes longer than a fetch therefore
    finds, at its next poll, only what arrived in the first moments of the previous
    batch; everything after waits one more whole batch. So when records are already
    buffered (a zero-timeout poll returns some), one more poll of at most ``top_up_ms``
    collects the newer ones: the buffer was just drained, so aiokafka fetches at once.
    Records a poll had to wait for are fresh and returned as they are. Per partition the
    top-up's records continue the first poll's, so order holds.
    """
    batch = await consumer.getmany(timeout_ms=0, max_records=max_records)
    if not batch:
        return await consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
    num_records = sum(len(records) for records in batch.values())
    if top_up_ms == 0 or num_records >= max_records:
        return batch
    more = await consumer.getmany(timeout_ms=top_up_ms, max_records=max_records - num_records)
    for tp, records in more.items():
        batch[tp] = batch.get(tp, []) + records
    return batch


class StallClock:
    """How long a consumer's fetched records have waited without it committing past them: when that
    exceeds ``stall_after_s`` the consumer is *stalled* (its partitions do not advance; every later
    record waits).

    The consumer calls :meth:`waiting` when it takes records in hand and :meth:`advanced` once it
    committed past them (or gave them up to another member). A batch that keeps failing is
    retried forever by design (nothing is skipped); this is how that becomes visible instead
    of silent. Shared by :class:`BatchConsumer` and the node's command consumer.
    """

    def __init__(self, stall_after_s: float) -> None:
        if stall_after_s <= 0:
            raise ValueError("stall_after_s must be positive")
        self.stall_after_s = stall_after_s
        self._since: float | None = None

    def waiting(self) -> None:
        """Records are in hand; the clock runs from the first such call since the last
        :meth:`advanced`."""
        if self._since is None:
            self._since = time.monotonic()

    def advanced(self) -> None:
        self._since = None

    @property
    def stalled_for_s(self) -> float:
        """How long records have waited (0 when none wait)."""
        return 0.0 if self._since is None else time.monotonic() - self._since

    @property
    def stalled(self) -> bool:
        return self.stalled_for_s > self.stall_after_s


@dataclass(frozen=True, slots=True)
class ConsumedEvent:
    """A validated record handed to a handler, with its coordinates (for logs and inbox rows)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int
    envelope: Envelope


Handler = Callable[[list[ConsumedEvent]], Awaitable[None]]
PoisonTest = Callable[[BaseException], str | None]
"""Classifies a handler failure: a one-line reason (without record content) when the failure is
caused by the data of the events handed over — retrying cannot help — or ``None`` when it may
be transient (connection lost, serialization failure, deadlock, timeout) and is retried."""


@dataclass(frozen=True, slots=True)
class _Fetched:
    """A polled batch and, per (partition, offset), its record decoded or the reason it is invalid."""

    batch: dict[TopicPartition, list[ConsumerRecord]]
    decoded: dict[tuple[TopicPartition, int], ConsumedEvent | str]


def _decode_batch(
    batch: dict[TopicPartition, list[ConsumerRecord]],
) -> dict[tuple[TopicPartition, int], ConsumedEvent | str]:
    """Decode and validate every record of ``batch`` (pure CPU: runs on a worker thread)."""
    decoded: dict[tuple[TopicPartition, int], ConsumedEvent | str] = {}
    for tp, records in batch.items():
        for record in records:
            try:
                key = decode_key(record.key)
                envelope = decode_event(record.value)
            except EventValidationError as exc:
                decoded[(tp, record.offset)] = str(exc)
                continue
            misrouted = routing_problem(record.topic, key, envelope)
            if misrouted is not None:
                decoded[(tp, record.offset)] = ROUTING_ERROR + misrouted
                continue
            decoded[(tp, record.offset)] = ConsumedEvent(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=key,
                timestamp_ms=record.timestamp,
                envelope=envelope,
            )
    return decoded


class _CommitOnRevoke(ConsumerRebalanceListener):
    def __init__(self, owner: BatchConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._on_assigned(set(assigned))


class BatchConsumer:
    """Consumes batches, validates them against the contract and hands them to ``handler``.

    Guarantees (see the module docstring for why they add up to effectively-once):

    * offsets are committed (``offset + 1`` per partition) only after ``handler`` returned;
      ``handler`` must commit its database transaction before returning;
    * a record that fails validation is published to ``kvledger.dead-letter`` (raw bytes,
      coordinates, error) and counted, then skipped — one bad record never blocks a partition; on
      :data:`events.topics.ALERT_TOPICS` it is also logged as an error;
    * a handler exception that ``is_poison`` classifies as caused by the data (the database refused
      a value) is narrowed down by bisection — the handler is called on halves of the batch, in
      order, until the single refused event is isolated; that record goes to the dead-letter topic
      with the reason, the others are applied once — so one poison record never blocks its
      partition;
    * any other handler exception re-delivers the whole batch (the consumer seeks back) after an
      exponential, jittered backoff (``initial_backoff_s`` doubling up to ``max_backoff_s``):
      nothing is skipped and the process keeps running;
    * on a rebalance the revoke callback waits for the in-flight batch and commits what was
      processed, so the next owner does not replay more than necessary;
    * batches are handled one at a time, in order, but the next one is polled and decoded while the
      handler runs (:meth:`run`); a failed batch takes the prefetched one back with it (both
      rewound), so nothing after a failure is handled before it;
    * a member whose fetched records stay uncommitted for longer than ``stall_after_s`` (a batch
      that keeps failing or never returns) is stalled (:attr:`stall`, a :class:`StallClock`): the
      ``kvledger_consumer_stalled{group}`` gauge and the coordinator's ``/readyz`` say so;
    * dead letters are sealed with ``seal`` (the coordinator signs its own), so that replay can tell
      them from letters anyone else wrote.

    A batch may mix partitions; order is kept within each partition (i.e. per key). The
    handler must return within the group's ``max_poll_interval_ms`` (aiokafka default
    300 s), or the member is dropped from the group and its partitions are reassigned.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topics: Sequence[str],
        handler: Handler,
        *,
        group_id: str | None = None,
        dead_letter_counter: Counter = DEAD_LETTER_TOTAL,
        is_poison: PoisonTest | None = None,
        max_records: int = 500,
        poll_timeout_ms: int = 500,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 30.0,
        auto_offset_reset: str = "earliest",
        seal: Seal | None = None,
        stall_after_s: float = 60.0,
    ) -> None:
        group = group_id or settings.group_id
        if not group:
            raise ValueError("BatchConsumer needs a group_id (argument or KafkaSettings.group_id)")
        if not topics:
            raise ValueError("BatchConsumer needs at least one topic")
        if set(DEAD_LETTER_TOPICS) & set(topics):
            raise ValueError(
                "the dead-letter topics are not consumed with BatchConsumer (their records are not envelopes)"
            )
        if max_records < 1 or poll_timeout_ms < 1 or not 0 < initial_backoff_s <= max_backoff_s:
            raise ValueError(
                "max_records, poll_timeout_ms and backoffs must be positive, initial <= max"
            )
        self.group_id = group
        self._topics = list(topics)
        self._handler = handler
        self._dead_letter_counter = dead_letter_counter
        self._is_poison = is_poison
        self._max_records = max_records
        self._poll_timeout_ms = poll_timeout_ms
        self._top_up_ms = settings.top_up_ms
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._seal = seal
        self.stall = StallClock(stall_after_s)
        CONSUMER_STALLED.labels(group=group).set_function(lambda: float(self.stall.stalled))
        self._consumer = AIOKafkaConsumer(
            **kafka_client_kwargs(settings),
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            **settings.timing_fields(),
        )
        self._dead_letters = EventProducer(settings)
        # Held while a batch is handled and committed; the revoke callback takes it too,
        # so a rebalance never hands a partition over in the middle of a batch.
        self._lock = asyncio.Lock()
        self._pending: dict[TopicPartition, int] = {}  # processed, not yet committed
        # Offsets already dead-lettered and not yet committed past: a re-delivered batch skips them.
        self._dead_lettered: dict[TopicPartition, set[int]] = {}
        self._assigned = asyncio.Event()
        # Generation of the current assignment, and whether its positions are known (see
        # ``consuming``).
        self._generation = 0
        self._positioned_generation: int | None = None
        self._positioning: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._run_task: asyncio.Task | None = None
        self._cancelled_by_stop = False
        self._started = False

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Connect the dead-letter producer and join the group (assignment completes
        asynchronously)."""
        await self._dead_letters.start()
        try:
            self._consumer.subscribe(self._topics, listener=_CommitOnRevoke(self))
            await self._consumer.start()
        except BaseException:
            await self._dead_letters.stop()
            raise
        self._started = True

    async def run(self) -> None:
        """Poll, validate, handle and commit until :meth:`stop`; then return. Never raises for handler errors.

        Pipelined: while the handler applies one batch (mostly waiting for its database), the next
        batch is polled and decoded on a worker thread (:meth:`_fetch`), so the consumer's
        decoding and the database's work on the previous batch overlap instead of taking turns.
        Batches are still handled one at a time and in order; a prefetched batch is only decoded,
        never dead-lettered or handed over, until its turn comes.
        """
        assert self._started, "BatchConsumer.start() must complete before run()"
        assert self._run_task is None, "BatchConsumer.run() is already running"
        self._run_task = asyncio.current_task()
        backoff = self._initial_backoff_s
        prefetch: asyncio.Task[_Fetched] | None = None
        try:
            while not self._stopping.is_set():
                fetched: _Fetched | None = None
                try:
                    if prefetch is None:
                        prefetch = asyncio.ensure_future(self._fetch(None))
                    fetched, prefetch = await self._unless_stopping(prefetch), None
                    if fetched is not None and fetched.batch:
                        handled = asyncio.Event()
                        prefetch = asyncio.ensure_future(self._fetch(handled))
                        try:
                            async with self._lock:
                                await self._process(fetched)
                        finally:
                            handled.set()
                except Exception as exc:  # noqa: BLE001 - any failure means: back off, re-deliver, keep running
                    # Nothing after the failed batch may be handled before it: the prefetched batch
                    # is dropped and every partition of both goes back to its first unhandled
                    # record.
                    dropped = await self._settle(prefetch)
                    prefetch = None
                    self._rewind(*(each.batch for each in (fetched, dropped) if each is not None))
                    HANDLER_FAILURES_TOTAL.labels(group=self.group_id).inc()
                    # The exception text may quote record data; log only its type here. Full jitter
                    # on the upper half: replicas that failed together do not retry together.
                    delay = random.uniform(backoff / 2, backoff)
                    log.warning(
                        "consumer group %s: batch failed (%s); retrying in %.2fs",
                        self.group_id,
                        type(exc).__name__,
                        delay,
                    )
                    log.debug("batch failure detail", exc_info=True)
                    await self._sleep_unless_stopping(delay)
                    backoff = min(backoff * 2, self._max_backoff_s)
                else:
                    backoff = self._initial_backoff_s
        except asyncio.CancelledError:
            if not self._cancelled_by_stop:
                raise
            # stop() gave up waiting for the batch: the caller of run() sees a normal return.
            task = asyncio.current_task()
            assert task is not None, "run() is awaited inside a task"
            task.uncancel()
        finally:
            if prefetch is not None:
                # Records a dropped prefetch took are not handled, so their offsets are not
                # committed: the group's next owner of their partitions (or this member, restarted)
                # reads them again.
                prefetch.cancel()
                await asyncio.gather(prefetch, return_exceptions=True)
            self._run_task = None

    async def _fetch(self, handled: asyncio.Event | None) -> _Fetched:
        """The next batch, polled while the previous one is handled (until ``handled`` is set; None:
        nothing in flight), each chunk decoded on a worker thread as it arrives: the decoding
        overlaps the handler's database waits, and the batch takes what reached the broker meanwhile
        (up to ``max_records``), as a poll after the handler would. With nothing in flight it is one
        poll, as before; ``top_up_ms`` 0 takes the first records that come, without collecting
        more."""
        batch: dict[TopicPartition, list[ConsumerRecord]] = {}
        decoded: dict[tuple[TopicPartition, int], ConsumedEvent | str] = {}
        num_records = 0
        try:
            while True:
                more = await get_fresh_batch(
                    self._consumer,
                    timeout_ms=self._top_up_ms if num_records else self._poll_timeout_ms,
                    max_records=self._max_records - num_records,
                    top_up_ms=self._top_up_ms,
                )
                if more:
                    for tp, records in more.items():
                        batch[tp] = batch.get(tp, []) + records
                        num_records += len(records)
                    decoded.update(await asyncio.to_thread(_decode_batch, more))
                idle = handled is None or handled.is_set()
                if (
                    idle
                    or num_records >= self._max_records
                    or (num_records and not self._top_up_ms)
                ):
                    return _Fetched(batch, decoded)
        except BaseException:
            # The records taken so far are never handed over: back to the first of them.
            self._rewind(batch)
            raise

    async def _unless_stopping(self, fetching: asyncio.Task[_Fetched]) -> _Fetched | None:
        """``fetching``'s result, or None as soon as :meth:`stop` is called: an idle poll does not hold a stop up.

        Records an abandoned poll fetched are not handled, so their offsets are not committed: the
        group's next owner of their partitions reads them again.
        """
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({fetching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            fetching.cancel()
            raise
        finally:
            stopping.cancel()
        if not fetching.done():
            fetching.cancel()
            await asyncio.gather(fetching, return_exceptions=True)
            return None
        return fetching.result()

    async def _settle(self, prefetch: asyncio.Task[_Fetched] | None) -> _Fetched | None:
        """Let an in-flight prefetch finish (cancelling a poll could lose records it took) and return what it fetched."""
        if prefetch is None:
            return None
        try:
            return await prefetch
        except Exception:  # noqa: BLE001 - a failed poll took no records
            return None

    def _rewind(self, *batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Seek every still-assigned partition of ``batches`` back to its earliest record among
        them."""
        first: dict[TopicPartition, int] = {}
        for batch in batches:
            for tp, records in batch.items():
                if records:
                    first[tp] = min(first.get(tp, records[0].offset), records[0].offset)
        assigned = self._consumer.assignment()
        for tp, offset in first.items():
            if tp in assigned:
                self._consumer.seek(tp, offset)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the in-flight batch (up to ``timeout_s``, then cancel it), commit, leave the group.

        A cancelled batch is safe: its transaction rolls back and its offsets were not committed.
        """
        self._stopping.set()
        task = self._run_task
        if task is not None and task is not asyncio.current_task():
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                self._cancelled_by_stop = True
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        try:
            if self._started:
                async with self._lock:
                    await self._commit_pending(None)
        finally:
            self._started = False
            self.stall.advanced()
            if self._positioning is not None:
                self._positioning.cancel()
                await asyncio.gather(self._positioning, return_exceptions=True)
            try:
                await self._consumer.stop()
            finally:
                await self._dead_letters.stop()

    async def __aenter__(self) -> BatchConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- assignment ----------------------------------------------------------------

    def assignment(self) -> frozenset[TopicPartition]:
        return frozenset(self._consumer.assignment())

    async def wait_for_assignment(self, timeout_s: float = 30.0) -> frozenset[TopicPartition]:
        """Wait until the group gave this member at least one partition (e.g. for readiness)."""
        await asyncio.wait_for(self._assigned.wait(), timeout_s)
        return self.assignment()

    @property
    def consuming(self) -> bool:
        """This member joined its group and knows where it resumes on every partition it was assigned.

        From then on a record published to its partitions is fetched by the next poll. An
        empty assignment counts (a replica with more peers than partitions is consuming
        nothing, correctly); a rebalance in progress does not.
        """
        return self._positioned_generation == self._generation

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        # Which member owns which partitions: how an operator (and the takeover test) sees a
        # rebalance.
        log.info(
            "consumer group %s: assigned %s",
            self.group_id,
            " ".join(sorted(f"{tp.topic}/{tp.partition}" for tp in assigned)) or "nothing",
        )
        if assigned:
            self._assigned.set()
        self._generation += 1
        # Resolving positions waits for the committed offsets, which the rebalance callback must
        # not.
        self._positioning = asyncio.create_task(self._find_positions(self._generation, assigned))

    async def _find_positions(self, generation: int, assigned: set[TopicPartition]) -> None:
        for tp in sorted(assigned):
            try:
                await self._consumer.position(tp)
            except Exception:  # noqa: BLE001 - revoked meanwhile: the next assignment looks again
                return
        self._positioned_generation = generation

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._assigned.clear()
        self._generation += 1
        self.stall.advanced()  # the partitions' next owner keeps its own clock
        async with self._lock:  # let an in-flight batch finish its transaction and commit first
            await self._commit_pending(revoked)
            for tp in revoked:
                self._pending.pop(tp, None)
                self._dead_lettered.pop(tp, None)

    # -- one batch -------------------------------------------------------------

    async def _process(self, fetched: _Fetched) -> None:
        """Dead-letter the batch's invalid records, hand the rest over, commit. A failure propagates; :meth:`run` rewinds."""
        assigned = self._consumer.assignment()
        # A partition revoked while we were fetching belongs to another member now; it
        # resumes from the committed offset, so dropping these records loses nothing.
        owned = {tp: records for tp, records in fetched.batch.items() if records and tp in assigned}
        if not owned:
            return
        self.stall.waiting()
        events = await self._validate(owned, fetched.decoded)
        if events:
            await self._handle_isolating(events, owned)
        for tp, records in owned.items():
            self._pending[tp] = records[-1].offset + 1
        await self._commit_pending(None)
        self.stall.advanced()

    async def _handle_isolating(
        self, events: list[ConsumedEvent], batch: dict[TopicPartition, list[ConsumerRecord]]
    ) -> None:
        """Hand ``events`` to the handler; bisect a failure caused by the data down to its one record.

        Halves run in order (the first half completes before the second starts), so per
        partition every event before a dead-lettered one was applied or dead-lettered first.
        A failure that is not the data's propagates: the whole batch is re-delivered, and
        the halves already committed are no-ops the second time (the handler's inbox).
        """
        try:
            await self._handler(events)
            return
        except Exception as exc:
            reason = self._is_poison(exc) if self._is_poison is not None else None
            if reason is None:
                raise
        if len(events) > 1:
            middle = len(events) // 2
            await self._handle_isolating(events[:middle], batch)
            await self._handle_isolating(events[middle:], batch)
            return
        (event,) = events
        tp = TopicPartition(event.topic, event.partition)
        record = next(record for record in batch[tp] if record.offset == event.offset)
        await self._dead_letter(tp, record, f"refused by the {self.group_id} handler: {reason}")

    async def _validate(
        self,
        batch: dict[TopicPartition, list[ConsumerRecord]],
        decoded: dict[tuple[TopicPartition, int], ConsumedEvent | str],
    ) -> list[ConsumedEvent]:
        """The batch's valid events, in order; each invalid record is dead-lettered in its place."""
        events: list[ConsumedEvent] = []
        for tp, records in batch.items():
            for record in records:
                if record.offset in self._dead_lettered.get(tp, ()):
                    continue  # a re-delivered batch: already on the dead-letter topic
                event = decoded[(tp, record.offset)]
                if isinstance(event, str):
                    await self._dead_letter(tp, record, event)
                    if event.startswith(ROUTING_ERROR):
                        MISROUTED_RECORDS_TOTAL.labels(
                            topic=record.topic, reason=event.removeprefix(ROUTING_ERROR)
                        ).inc()
                else:
                    events.append(event)
        return events

    async def _dead_letter(self, tp: TopicPartition, record: ConsumerRecord, error: str) -> None:
        """Publish (and wait for the broker's ack) before the offset can be committed past the
        record."""
        await send_to_dead_letter(
            self._dead_letters,
            record,
            error,
            self.group_id,
            self._dead_letter_counter,
            seal=self._seal,
        )
        # A re-delivered batch (after a handler failure) must not dead-letter or count twice.
        self._dead_lettered.setdefault(tp, set()).add(record.offset)

    async def _commit_pending(self, only: set[TopicPartition] | None) -> None:
        assigned = self._consumer.assignment()
        for tp in [tp for tp in self._pending if tp not in assigned]:
            # Already handed to another member, which resumes from the committed offset.
            del self._pending[tp]
        offsets = {tp: offset for tp, offset in self._pending.items() if only is None or tp in only}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # Membership changed: another member owns these partitions now and resumes from
            # the last committed offset; the handlers' inbox turns that replay into no-ops.
            log.warning(
                "consumer group %s: commit skipped after rebalance (%s)",
                self.group_id,
                type(exc).__name__,
            )
            for tp in offsets:
                self._pending.pop(tp, None)
            return
        # Any other KafkaError propagates with the offsets still pending: the next
        # successful commit (or the revoke callback) carries them.
        for tp, offset in offsets.items():
            if self._pending.get(tp) == offset:
                del self._pending[tp]
            if (
                tp in self._dead_lettered
            ):  # committed past: the group never re-delivers these offsets
                self._dead_lettered[tp] = {o for o in self._dead_lettered[tp] if o >= offset}

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass
