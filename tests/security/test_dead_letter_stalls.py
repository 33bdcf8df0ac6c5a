"""No record stalls governance: a record too large for its dead letter goes by reference, a consumer
that cannot advance says so.

Real broker (the session's), real Postgres, the coordinator's consumers in-process
(``run_consumers``).

* The dead letter of a record carries its bytes base64-encoded (a third larger) plus metadata: an ~850 KB record
  fits a 1 MiB producer request, its letter does not. Such a letter used to be refused by the producer on every
  retry, the batch rewound forever, and every later decision of the group waited behind it.
* The size budget is the producer's own ``max_request_size`` (``events.record_size.MAX_REQUEST_BYTES``): a record whose
  letter just fits is carried whole, one byte more goes by reference.
* A consumer whose batch keeps failing is *stalled*: ``/readyz`` answers 503 naming it and
  ``kvledger_consumer_stalled{group}`` is 1, until the batch passes.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from helpers.cli import kvledger, served_stack
from helpers.ledger import (
    COMMAND_KEY,
    RunningConsumers,
    SigningProducer,
    eventually,
    kafka_client_settings,
    operator_headers,
    running_consumers,
    scan_topic,
    settings_at_topic_ends,
)
from prometheus_client import REGISTRY
from sqlalchemy import select

from coordinator.api.ops_app import create_ops_app
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings, kafka_settings
from events import schema
from events.codec import MAX_DEAD_LETTER_ERROR_CHARS, MAX_REFERENCE_PREFIX_BYTES, DeadLetter
from events.kafka.admin import ensure_topics
from events.kafka.consumer import BatchConsumer, ConsumedEvent
from events.kafka.dead_letters import dead_letter_record, send_to_dead_letter
from events.kafka.producer import SIZE_REFUSALS, EventProducer
from events.kafka.settings import MIN_REQUEST_BYTES
from events.record_size import MAX_REQUEST_BYTES, request_bytes
from events.topics import DEAD_LETTER, ERASURES
from identity.signing import EnvelopeSigner, dead_letter_signature_problem

BIG_RECORD_BYTES = 850_000
ADMIN = operator_headers("platform-admin")


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return await settings_at_topic_ends(ledger_url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def consumers(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    async with running_consumers(settings) as running:
        yield running


def by_reference_count(topic: str) -> float:
    return (
        REGISTRY.get_sample_value("kvledger_dead_letter_by_reference_total", {"topic": topic})
        or 0.0
    )


async def letter_of(bootstrap: str, value: bytes) -> DeadLetter:
    """The dead letter on ``kvledger.dead-letter`` of the record whose value is ``value``."""
    digest, found = hashlib.sha256(value).hexdigest(), []

    def visit(record) -> bool:
        letter = DeadLetter.model_validate_json(record.value)
        raw = letter.raw_value()
        if letter.value_sha256 == digest or (
            raw is not None and hashlib.sha256(raw).hexdigest() == digest
        ):
            found.append(letter)
        return bool(found)

    await scan_topic(bootstrap, DEAD_LETTER, visit)
    return found[0]


async def test_an_850_kb_invalid_erasure_is_dead_lettered_by_reference_and_later_decisions_are_decided(
    consumers: RunningConsumers,
    settings: CoordinatorSettings,
    database: Database,
    kafka_bootstrap: str,
    client: httpx.AsyncClient,
    tmp_path,
) -> None:
    since = datetime.now(UTC).isoformat()
    marker = uuid.uuid4().hex
    big = (
        b'{"type": "ErasureRequested", "padding": "'
        + marker.encode()
        + b"x" * BIG_RECORD_BYTES
        + b'"}'
    )
    update = schema.make_event(
        schema.DocumentUpdated(doc_id=f"doc-{marker}", version=2), tenant_id="acme"
    )
    counted_before = by_reference_count(ERASURES)
    raw = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all"
    )  # 1 MiB max_request_size: the record fits
    await raw.start()
    try:
        await raw.send_and_wait(ERASURES, big, key=f"acme:{marker}".encode())
    finally:
        await raw.stop()
    async with SigningProducer(kafka_settings(settings)) as producer:
        await producer.send(update)

    async def decided() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(Invalidation.command_id).where(
                        Invalidation.source_event_id == update.event_id
                    )
                )
                is not None
            )

    await eventually(
        decided, timeout_s=60, what="the DocumentUpdated published after the 850 KB record decided"
    )
    letter = await letter_of(kafka_bootstrap, big)
    assert letter.by_reference and letter.value_b64 is None and letter.topic == ERASURES
    assert (letter.num_value_bytes, letter.value_sha256) == (
        len(big),
        hashlib.sha256(big).hexdigest(),
    )
    assert letter.value_prefix_b64 is not None and len(letter.value_prefix_b64) < 2048
    assert (
        dead_letter_signature_problem(letter, COMMAND_KEY.public_key()) is None
    )  # the coordinator's, replay can tell
    assert by_reference_count(ERASURES) == counted_before + 1
    # Listed as held by reference; its replay is refused, saying why: the bytes are not held.
    answer = await client.get(
        "/v1/dead-letters", params={"since": since, "topic": ERASURES}, headers=ADMIN
    )
    (listed,) = [
        each
        for each in answer.json()["dead_letters"]
        if each["value_sha256"] == letter.value_sha256
    ]
    assert (
        listed["by_reference"]
        and listed["trusted"]
        and not listed["replayable"]
        and listed["num_value_bytes"] == len(big)
    )
    refused = await client.post(f"/v1/dead-letters/{listed['id']}/replay", headers=ADMIN)
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "held_by_reference")
    assert "bytes are not held" in refused.json()["error"]["message"]
    async with served_stack(settings, tmp_path) as stack:
        status, _, err = await kvledger(
            "dead-letters", "replay", listed["id"], "--stack", str(stack)
        )
    assert (
        status != 0
        and "HTTP 409" in err
        and "bytes are not held" in err
        and "cannot be replayed" in err
    )


def _record(num_value_bytes: int) -> ConsumerRecord:
    return ConsumerRecord(
        topic=ERASURES,
        partition=0,
        offset=12345,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=b"acme:subject",
        value=b"v" * num_value_bytes,
        checksum=None,
        serialized_key_size=-1,
        serialized_value_size=-1,
        headers=(),
    )


async def test_a_letter_that_just_fits_the_producers_limit_is_whole_and_one_byte_more_goes_by_reference(
    kafka_bootstrap: str,
) -> None:
    config = kafka_client_settings(kafka_bootstrap)
    seal = EnvelopeSigner(COMMAND_KEY).sign_dead_letter

    def goes_by_reference(num_value_bytes: int) -> bool:
        return dead_letter_record(
            _record(num_value_bytes), "invalid", "g", MAX_REQUEST_BYTES, seal
        )[0].by_reference

    first_by_reference = bisect.bisect_left(range(MAX_REQUEST_BYTES), True, key=goes_by_reference)
    fits, too_large = _record(first_by_reference - 1), _record(first_by_reference)
    whole, whole_value, key = dead_letter_record(fits, "invalid", "g", MAX_REQUEST_BYTES, seal)
    assert not whole.by_reference and whole.raw_value() == fits.value
    # The whole letter of one byte more: over the limit by the producer's own measure, refused by
    # the producer.
    r = too_large
    over = seal(
        DeadLetter.of(
            topic=r.topic,
            partition=r.partition,
            offset=r.offset,
            timestamp_ms=r.timestamp,
            key=r.key,
            value=r.value,
            error="invalid",
            group_id="g",
        )
    )
    assert request_bytes(key, whole_value) <= MAX_REQUEST_BYTES < request_bytes(key, over.encode())
    async with EventProducer(config) as producer:
        with pytest.raises(SIZE_REFUSALS):
            await producer.send_raw(DEAD_LETTER, over.encode(), key)
        await send_to_dead_letter(producer, fits, "invalid", "g", seal=seal)
        await send_to_dead_letter(producer, too_large, "invalid", "g", seal=seal)
    carried = await letter_of(kafka_bootstrap, fits.value)
    referred = await letter_of(kafka_bootstrap, too_large.value)
    assert not carried.by_reference and carried.raw_value() == fits.value
    assert (
        referred.by_reference
        and referred.raw_value() is None
        and referred.num_value_bytes == len(too_large.value)
    )


async def test_a_consumer_whose_batch_keeps_failing_is_stalled_in_readiness_and_the_metric_until_it_passes(
    kafka_bootstrap: str, unique_name: str, settings: CoordinatorSettings
) -> None:
    config = kafka_client_settings(kafka_bootstrap)
    await ensure_topics(config, [unique_name])
    failing = asyncio.Event()
    failing.set()

    async def handler(events: list[ConsumedEvent]) -> None:
        if failing.is_set():
            raise ConnectionError("the database is away")  # transient: retried, never dead-lettered

    consumer = BatchConsumer(
        config, [unique_name], handler, group_id=unique_name, stall_after_s=1.0, max_backoff_s=0.2
    )
    readiness = ConsumerReadiness()
    app = create_ops_app(settings, readiness)

    def stalled_metric() -> float | None:
        return REGISTRY.get_sample_value("kvledger_consumer_stalled", {"group": unique_name})

    async def ready(client: httpx.AsyncClient) -> httpx.Response:
        return await client.get("/readyz")

    async with (
        consumer,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ops") as client,
    ):
        readiness.watch([consumer])
        running = asyncio.create_task(consumer.run())
        await eventually(lambda: consumer.consuming, what="the consumer joined")
        assert (await ready(client)).status_code == 200 and stalled_metric() == 0
        async with EventProducer(config) as producer:
            await producer.send(
                schema.make_event(
                    schema.DocumentUpdated(doc_id="stall", version=1), tenant_id="acme"
                ),
                topic=unique_name,
            )

        async def stalled_503() -> bool:
            answer = await ready(client)
            return (
                answer.status_code == 503
                and "stalled" in answer.json()["reason"]
                and unique_name in answer.json()["reason"]
            )

        await eventually(stalled_503, what="/readyz reporting the stalled group")
        assert stalled_metric() == 1
        failing.clear()

        async def recovered() -> bool:
            return (await ready(client)).status_code == 200 and stalled_metric() == 0

        await eventually(recovered, what="the group advancing again")
        await consumer.stop()
        await running


def test_the_largest_record_with_the_largest_key_and_error_still_has_a_letter_that_fits_the_smallest_limit() -> (
    None
):
    huge = dataclasses.replace(_record(0), key=b"k" * 900_000, value=b"\x00" * 900_000)
    error = "\x00" * 100_000  # each NUL is six bytes of JSON (\u0000)
    letter, value, key = dead_letter_record(
        huge, error, "g" * 256, MIN_REQUEST_BYTES, EnvelopeSigner(COMMAND_KEY).sign_dead_letter
    )
    assert letter.by_reference and request_bytes(key, value) <= MIN_REQUEST_BYTES
    assert (
        len(letter.error) == MAX_DEAD_LETTER_ERROR_CHARS
        and key == huge.key[:MAX_REFERENCE_PREFIX_BYTES]
    )


def test_a_letter_written_before_letters_were_signed_still_parses_and_is_unsigned() -> None:
    old = (
        b'{"topic":"kvledger.documents","partition":1,"offset":2,"timestamp_ms":3,"key_b64":null,"value_b64":"e30=",'
        b'"error":"bad","group_id":"g","dead_lettered_at":"2026-11-29T12:00:00Z"}'
    )
    letter = DeadLetter.model_validate_json(old)
    assert letter.raw_value() == b"{}" and not letter.by_reference
    assert dead_letter_signature_problem(letter, COMMAND_KEY.public_key()) == "unsigned"


async def test_a_letter_the_broker_refuses_for_its_size_is_sent_again_by_reference_not_retried(
    kafka_bootstrap: str,
) -> None:
    """A broker whose message limit is below the producer's refuses a letter the producer let through; injected here
    (the embedded broker has no such limit): the refusal is permanent, so the letter goes by reference at once."""
    refused: list[int] = []
    async with EventProducer(kafka_client_settings(kafka_bootstrap)) as producer:
        real_send_raw = producer.send_raw

        async def broker_refusing_whole_letters(topic: str, value: bytes | None, key: bytes | None):
            if not DeadLetter.model_validate_json(value or b"").by_reference:
                refused.append(len(value or b""))
                raise SIZE_REFUSALS[0]("injected: the broker's message.max.bytes")
            return await real_send_raw(topic, value, key)

        producer.send_raw = broker_refusing_whole_letters
        record = dataclasses.replace(_record(20_000), value=uuid.uuid4().bytes * 1250)
        await send_to_dead_letter(producer, record, "invalid", "g")
    assert len(refused) == 1
    letter = await letter_of(kafka_bootstrap, record.value)
    assert letter.by_reference and letter.num_value_bytes == len(record.value)
