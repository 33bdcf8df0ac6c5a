"""The shared Kafka helpers against a real broker (Tansu by default): delivery, dead letters, commits, groups."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from helpers.ledger import eventually, kafka_client_settings
from prometheus_client import REGISTRY

from events.codec import DeadLetter, encode_event, encode_key
from events.kafka.admin import ensure_topics
from events.kafka.consumer import BatchConsumer, ConsumedEvent, get_fresh_batch
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.schema import DocumentUpdated, make_event
from events.topics import DEAD_LETTER, DOCUMENTS

PARTITIONS = 4


@pytest.fixture
async def settings(kafka_bootstrap: str, unique_name: str) -> KafkaSettings:
    settings = kafka_client_settings(kafka_bootstrap, num_partitions=PARTITIONS)
    await ensure_topics(settings, [unique_name, DEAD_LETTER])
    return settings


@pytest.fixture
async def producer(settings: KafkaSettings) -> AsyncIterator[EventProducer]:
    async with EventProducer(settings) as producer:
        yield producer


class Recorder:
    """A handler that records every batch; ``fail_times`` first calls raise after recording."""

    def __init__(self, fail_times: int = 0) -> None:
        self.calls: list[list[ConsumedEvent]] = []
        self.fail_times = fail_times

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        self.calls.append(events)
        if len(self.calls) <= self.fail_times:
            raise RuntimeError("simulated database failure")

    def delivered(self) -> list[ConsumedEvent]:
        return [event for batch in self.calls[self.fail_times :] for event in batch]


@contextlib.asynccontextmanager
async def running(
    consumer: BatchConsumer, stop_timeout_s: float = 30.0
) -> AsyncIterator[BatchConsumer]:
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    try:
        yield consumer
    finally:
        await consumer.stop(timeout_s=stop_timeout_s)
        await task


def consumer_for(
    settings: KafkaSettings, topic: str, handler, group: str, **options
) -> BatchConsumer:
    return BatchConsumer(settings, [topic], handler, group_id=group, **options)


async def committed(settings: KafkaSettings, group: str, topic: str) -> dict[int, int | None]:
    probe = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap, group_id=group, enable_auto_commit=False
    )
    await probe.start()
    try:
        return {p: await probe.committed(TopicPartition(topic, p)) for p in range(PARTITIONS)}
    finally:
        await probe.stop()


def document_events(count: int, tenant: str = "acme") -> list:
    return [
        make_event(DocumentUpdated(doc_id=f"doc-{i}", version=i), tenant_id=tenant)
        for i in range(count)
    ]


async def test_ensure_topics_is_idempotent(settings: KafkaSettings, unique_name: str) -> None:
    assert await ensure_topics(settings, [unique_name, DEAD_LETTER]) == []
    fresh = f"{unique_name}-fresh"
    assert await ensure_topics(settings, [fresh]) == [fresh]


async def test_round_trip_and_commit(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    events = document_events(20)
    for event in events:
        await producer.send(event, topic=unique_name)
    recorder = Recorder()
    async with running(consumer_for(settings, unique_name, recorder, unique_name)):
        await eventually(lambda: len(recorder.delivered()) == len(events), what="all events")
    delivered = recorder.delivered()
    assert sorted(e.envelope.event_id for e in delivered) == sorted(e.event_id for e in events)
    by_id = {e.event_id: e for e in events}
    for item in delivered:
        assert item.envelope == by_id[item.envelope.event_id]
        assert item.topic == unique_name
        assert item.key == f"acme:{item.envelope.payload.doc_id}"
    # One key, one partition: per-document order is the production order.
    per_partition: dict[int, list[int]] = {}
    for item in delivered:
        per_partition.setdefault(item.partition, []).append(item.offset)
    assert all(offsets == sorted(offsets) for offsets in per_partition.values())
    ends = {p: max(offsets) + 1 for p, offsets in per_partition.items()}
    commits = await committed(settings, unique_name, unique_name)
    assert {p: commits[p] for p in ends} == ends


async def test_send_many_routes_by_type(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    await ensure_topics(settings, [DOCUMENTS])
    events = document_events(5, tenant=unique_name)
    metadata = await producer.send_many(events)
    assert {m.topic for m in metadata} == {DOCUMENTS}
    recorder = Recorder()
    async with running(consumer_for(settings, DOCUMENTS, recorder, unique_name)):
        wanted = {e.event_id for e in events}
        await eventually(
            lambda: wanted <= {e.envelope.event_id for e in recorder.delivered()},
            what="routed events",
        )


async def test_invalid_record_is_dead_lettered_and_consumption_continues(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    counter_labels = {"topic": unique_name}
    before = REGISTRY.get_sample_value("kvledger_dead_letter_total", counter_labels) or 0.0
    good = document_events(2)
    bad_key, bad_value = encode_key("acme:doc-0"), b'{"type": "DocumentUpdated", "oops": '
    # Same key as the good events, so all three share a partition and the bad one sits between them.
    await producer.send(good[0], topic=unique_name, key="acme:doc-0")
    await producer.send_raw(unique_name, bad_value, bad_key)
    await producer.send(good[1], topic=unique_name, key="acme:doc-0")

    letters: list[DeadLetter] = []
    dlq = AIOKafkaConsumer(
        DEAD_LETTER, bootstrap_servers=settings.bootstrap, auto_offset_reset="earliest"
    )
    await dlq.start()
    try:
        recorder = Recorder()
        async with running(consumer_for(settings, unique_name, recorder, unique_name)):
            await eventually(lambda: len(recorder.delivered()) == 2, what="both valid events")
            deadline = time.monotonic() + 30
            while not letters and time.monotonic() < deadline:
                for records in (await dlq.getmany(timeout_ms=500)).values():
                    for record in records:
                        letter = DeadLetter.model_validate_json(record.value)
                        if letter.topic == unique_name:
                            assert record.key == bad_key  # dead letters keep the original key
                            letters.append(letter)
    finally:
        await dlq.stop()

    assert [e.envelope.event_id for e in recorder.delivered()] == [
        good[0].event_id,
        good[1].event_id,
    ]
    assert len(letters) == 1
    letter = letters[0]
    assert letter.raw_value() == bad_value and letter.raw_key() == bad_key
    assert letter.offset == recorder.delivered()[0].offset + 1
    assert letter.partition == recorder.delivered()[0].partition
    assert letter.group_id == unique_name
    assert "Invalid JSON" in letter.error
    assert REGISTRY.get_sample_value("kvledger_dead_letter_total", counter_labels) == before + 1
    commits = await committed(settings, unique_name, unique_name)
    assert commits[letter.partition] == letter.offset + 2  # the bad record is past, not blocking


async def test_handler_failure_redelivers_instead_of_losing(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    failures_before = (
        REGISTRY.get_sample_value(
            "kvledger_consumer_handler_failures_total", {"group": unique_name}
        )
        or 0
    )
    event = document_events(1)[0]
    await producer.send(event, topic=unique_name)
    recorder = Recorder(fail_times=1)
    consumer = consumer_for(settings, unique_name, recorder, unique_name, initial_backoff_s=0.2)
    async with running(consumer):
        await eventually(lambda: len(recorder.calls) >= 2, what="redelivery after the failure")
    first, second = recorder.calls[0], recorder.calls[1]
    assert [e.envelope.event_id for e in first] == [event.event_id]
    assert [(e.partition, e.offset, e.envelope) for e in second] == [
        (e.partition, e.offset, e.envelope) for e in first
    ]
    assert (
        REGISTRY.get_sample_value(
            "kvledger_consumer_handler_failures_total", {"group": unique_name}
        )
        == failures_before + 1
    )
    commits = await committed(settings, unique_name, unique_name)
    assert commits[first[0].partition] == first[0].offset + 1


async def test_offset_is_not_committed_while_the_handler_runs(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    event = document_events(1)[0]
    await producer.send(event, topic=unique_name)
    entered, release = asyncio.Event(), asyncio.Event()
    seen: list[ConsumedEvent] = []

    async def slow_handler(events: list[ConsumedEvent]) -> None:
        seen.extend(events)
        entered.set()
        await release.wait()  # a database transaction that never gets to commit

    # Leaving cancels the stuck handler after the stop timeout; nothing was committed for it.
    async with running(
        consumer_for(settings, unique_name, slow_handler, unique_name), stop_timeout_s=0.5
    ):
        await asyncio.wait_for(entered.wait(), 30)
        assert set((await committed(settings, unique_name, unique_name)).values()) == {None}
    assert set((await committed(settings, unique_name, unique_name)).values()) == {None}

    # The next member of the group gets the same record again.
    recorder = Recorder()
    async with running(consumer_for(settings, unique_name, recorder, unique_name)):
        await eventually(
            lambda: len(recorder.delivered()) == 1, what="redelivery to the next member"
        )
    assert recorder.delivered()[0].envelope == seen[0].envelope
    assert recorder.delivered()[0].offset == seen[0].offset


async def test_stop_does_not_wait_for_an_idle_poll(
    settings: KafkaSettings, unique_name: str
) -> None:
    """A consumer waiting for records (here up to 60 s a poll) stops at once, not when its poll times out."""
    consumer = consumer_for(settings, unique_name, Recorder(), unique_name, poll_timeout_ms=60_000)
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: consumer.consuming, what="the consumer to consume")
    await asyncio.sleep(0.2)  # inside its (empty) poll now
    started = time.monotonic()
    await consumer.stop()
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < 10


async def test_two_consumers_split_partitions_without_duplicates(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    first, second = Recorder(), Recorder()
    phase_one, phase_two = document_events(100), document_events(100)
    async with running(consumer_for(settings, unique_name, first, unique_name)) as a:
        assert len(await a.wait_for_assignment()) == PARTITIONS
        for event in phase_one:
            await producer.send(event, topic=unique_name)
        await eventually(
            lambda: len(first.delivered()) == 100, what="phase one on the single member"
        )

        async with running(consumer_for(settings, unique_name, second, unique_name)) as b:
            await eventually(
                lambda: (
                    a.assignment()
                    and b.assignment()
                    and len(a.assignment() | b.assignment()) == PARTITIONS
                ),
                what="rebalance to two members",
            )
            assert not a.assignment() & b.assignment()
            for event in phase_two:
                await producer.send(event, topic=unique_name)
            await eventually(
                lambda: len(first.delivered()) + len(second.delivered()) == 200,
                what="phase two across both members",
            )
            assignment_a, assignment_b = a.assignment(), b.assignment()

    ids = [e.envelope.event_id for e in first.delivered() + second.delivered()]
    assert len(ids) == len(set(ids)) == 200  # nothing lost, nothing delivered twice
    assert set(ids) == {e.event_id for e in phase_one + phase_two}
    phase_two_ids = {e.event_id for e in phase_two}
    for recorder, assignment in ((first, assignment_a), (second, assignment_b)):
        received = [e for e in recorder.delivered() if e.envelope.event_id in phase_two_ids]
        assert received, "both members received part of phase two"
        assert {TopicPartition(e.topic, e.partition) for e in received} <= assignment


async def test_get_fresh_batch_collects_what_arrived_while_the_previous_batch_was_handled(
    settings: KafkaSettings, unique_name: str
) -> None:
    """aiokafka fetches nothing more from a broker while records it fetched wait to be consumed.

    The control shows that (a plain poll finds only the record buffered while the caller was
    busy); ``get_fresh_batch`` also returns the one produced after it, in partition order.
    """
    tp = TopicPartition(unique_name, 0)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap,
        enable_auto_commit=False,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
    )
    await producer.start()
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)

        async def produce_while_busy() -> tuple[int, int]:
            """One record the consumer buffers, then one produced after it was buffered."""
            buffered = (await producer.send_and_wait(unique_name, b"buffered", partition=0)).offset
            await eventually(
                lambda: (consumer.highwater(tp) or 0) > buffered, what="the first record fetched"
            )
            later = (await producer.send_and_wait(unique_name, b"later", partition=0)).offset
            return buffered, later

        buffered, _ = await produce_while_busy()
        plain = await consumer.getmany(timeout_ms=0)
        assert [record.offset for record in plain[tp]] == [buffered]
        await consumer.getmany(
            timeout_ms=5000
        )  # the later record, so the next round starts from an empty buffer

        buffered, later = await produce_while_busy()
        fresh = await get_fresh_batch(consumer, timeout_ms=0, max_records=100, top_up_ms=5000)
        assert [record.offset for record in fresh[tp]] == [buffered, later]
        assert [record.value for record in fresh[tp]] == [b"buffered", b"later"]
    finally:
        await consumer.stop()
        await producer.stop()


async def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        KafkaSettings(bootstrap="")
    with pytest.raises(ValueError):
        KafkaSettings(bootstrap="x:1", num_partitions=0)
    with pytest.raises(
        ValueError,
        match="heartbeat_interval_ms \\(2000\\) must be below session_timeout_ms \\(2000\\)",
    ):
        KafkaSettings(bootstrap="x:1", session_timeout_ms=2000, heartbeat_interval_ms=2000)
    settings = KafkaSettings(bootstrap="x:1")
    assert (settings.session_timeout_ms, settings.heartbeat_interval_ms) == (
        10_000,
        3_000,
    )  # aiokafka's defaults
    with pytest.raises(ValueError, match="group_id"):
        BatchConsumer(settings, ["t"], Recorder())
    with pytest.raises(ValueError, match="dead-letter"):
        BatchConsumer(settings, [DEAD_LETTER], Recorder(), group_id="g")


class PoisonRefuser:
    """A handler that refuses (ValueError, as the database refusing a value) every batch holding
    ``poison``; records each batch it applied (returned without error)."""

    def __init__(self, poison: str) -> None:
        self.poison = poison
        self.calls: list[list[str]] = []
        self.applied: list[str] = []

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        doc_ids = [event.envelope.payload.doc_id for event in events]
        self.calls.append(doc_ids)
        if self.poison in doc_ids:
            raise ValueError("value refused")
        self.applied.extend(doc_ids)


def _refused(exc: BaseException) -> str | None:
    return "ValueError" if isinstance(exc, ValueError) else None


async def test_a_refused_record_is_isolated_by_bisection_and_the_rest_applied_once(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    events = document_events(8)
    metadata = [
        await producer.send(event, topic=unique_name, key="acme:one-partition") for event in events
    ]
    handler = PoisonRefuser("doc-5")
    before = REGISTRY.get_sample_value("kvledger_dead_letter_total", {"topic": unique_name}) or 0.0
    async with running(
        consumer_for(settings, unique_name, handler, unique_name, is_poison=_refused)
    ):
        await eventually(lambda: len(handler.applied) == 7, what="the seven good records")
        commits = await committed(settings, unique_name, unique_name)
    assert handler.applied == [f"doc-{i}" for i in range(8) if i != 5]  # in order, each once
    assert commits[metadata[0].partition] == metadata[-1].offset + 1
    assert (
        REGISTRY.get_sample_value("kvledger_dead_letter_total", {"topic": unique_name}) - before
        == 1
    )
    consumer = AIOKafkaConsumer(
        DEAD_LETTER, bootstrap_servers=settings.bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        letters = []
        async with asyncio.timeout(30):
            while not letters:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    letters += [
                        letter
                        for letter in (DeadLetter.model_validate_json(r.value) for r in records)
                        if letter.topic == unique_name
                    ]
    finally:
        await consumer.stop()
    (letter,) = letters
    assert (letter.partition, letter.offset) == (metadata[5].partition, metadata[5].offset)
    assert letter.raw_value() == encode_event(events[5])
    assert letter.error == f"refused by the {unique_name} handler: ValueError"


async def test_a_failure_that_is_not_the_datas_is_retried_whole(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    events = document_events(4)
    for event in events:
        await producer.send(event, topic=unique_name, key="acme:one-partition")
    recorder = Recorder(fail_times=2)
    async with running(
        consumer_for(settings, unique_name, recorder, unique_name, is_poison=_refused)
    ):
        await eventually(
            lambda: len(recorder.delivered()) == 4, what="the batch after two transient failures"
        )
    # RuntimeError is not the data's: no bisection, the same records came back until they went
    # through.
    assert [e.envelope.event_id for e in recorder.delivered()] == [e.event_id for e in events]
    assert recorder.calls[0][0].offset == recorder.calls[1][0].offset == recorder.calls[2][0].offset
    assert REGISTRY.get_sample_value("kvledger_dead_letter_total", {"topic": unique_name}) is None


def _keys_on_two_partitions() -> tuple[str, str]:
    """Two record keys the producer's default partitioner sends to different partitions."""
    partitioner = DefaultPartitioner()
    partitions = list(range(PARTITIONS))
    by_partition: dict[int, str] = {}
    for i in range(100):
        key = f"key-{i}"
        by_partition.setdefault(partitioner(key.encode(), partitions, partitions), key)
        if len(by_partition) == 2:
            first, second = by_partition.values()
            return first, second
    raise AssertionError("100 keys all hashed to one partition")


async def test_a_failed_batch_also_rewinds_the_batch_prefetched_meanwhile(
    settings: KafkaSettings, producer: EventProducer, unique_name: str
) -> None:
    """The consumer polls the next batch while the handler runs. When the handler fails, the records
    that prefetch took — here on another partition than the failed batch — must come back too, in
    order."""
    first_key, later_key = _keys_on_two_partitions()
    first = document_events(1)[0]
    later = document_events(3, tenant="later")
    first_partition = (await producer.send(first, topic=unique_name, key=first_key)).partition
    consumer: BatchConsumer

    async def fail_once_after_prefetch(events: list[ConsumedEvent]) -> None:
        recorder.calls.append(events)
        if len(recorder.calls) > 1:
            return
        sent = [await producer.send(event, topic=unique_name, key=later_key) for event in later]
        tp = TopicPartition(unique_name, sent[0].partition)
        assert tp.partition != first_partition, (
            "the prefetched records must be on another partition than the failed batch"
        )

        async def prefetched() -> bool:
            # The consumer's fetch position: past the last record once a poll has returned it.
            return await consumer._consumer.position(tp) > sent[-1].offset

        await eventually(prefetched, what="the prefetch to take the records published meanwhile")
        raise RuntimeError("simulated database failure")

    recorder = Recorder(fail_times=1)
    consumer = consumer_for(
        settings, unique_name, fail_once_after_prefetch, unique_name, initial_backoff_s=0.1
    )
    async with running(consumer):
        await eventually(
            lambda: len(recorder.delivered()) >= 4, what="every record after the failure"
        )
    assert [e.envelope.event_id for e in recorder.calls[0]] == [first.event_id]
    delivered = [e.envelope.event_id for e in recorder.delivered()]
    assert sorted(map(str, delivered)) == sorted(str(e.event_id) for e in [first, *later])
    assert [i for i in delivered if i != first.event_id] == [
        e.event_id for e in later
    ]  # in partition order
