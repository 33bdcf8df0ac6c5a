"""``GET /v1/dead-letters`` and ``POST /v1/dead-letters/{id}/replay``: the operator's view of ``kvledger.dead-letter``.

A record any consumer refused (contract violation, unverified signature, a value the
database refused) is put on ``kvledger.dead-letter`` with its source coordinates, its raw
bytes and the reason (``events.kafka.send_to_dead_letter``). Only ``platform-admin`` reads
or replays them.

* The listing never returns a record's content: dead letters hold contract records (ids,
  keyed digests, hashes — no prompt or document text) and, being refused, possibly
  anything a hostile producer wrote. It shows where the record came from, why it was
  refused, its size and the SHA-256 of its bytes (to tell copies apart), and when.
* A replay publishes the record's original key and bytes to its source topic once, so it
  goes through the same decoding, signature check and handlers as any record: a record
  refused for a reason that has since been fixed (e.g. its node's key is now enrolled) is
  applied; one still invalid is dead-lettered again, as a new dead letter, once. Nothing
  replays by itself, so nothing loops.

The id of a dead letter is ``<partition>-<offset>`` on ``kvledger.dead-letter``. The API
reads the topic without a consumer group (nothing is committed) and answers 503
``broker_unavailable`` with ``Retry-After`` when the broker cannot be reached in
``kafka.connect_timeout_s`` (docs/operations.md, "Dead letters").
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import logging
import re
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from coordinator.consumers import kafka_settings
from coordinator.dependencies import PlatformAdmin, Settings
from coordinator.http import error_response
from coordinator.settings import CoordinatorSettings
from events.codec import DeadLetter
from events.kafka import EventProducer, KafkaSettings, kafka_client_kwargs
from events.topics import ALL_TOPICS, DEAD_LETTER

log = logging.getLogger(__name__)

MAX_LIST = 1000
SCAN_LIMIT_S = 20.0
"""The longest one listing reads the topic; what it read by then is answered, marked truncated."""
_ID = re.compile(r"^(0|[1-9][0-9]{0,5})-(0|[1-9][0-9]{0,18})$")
_REPLAYABLE = frozenset(ALL_TOPICS) - {DEAD_LETTER}


class _BrokerUnavailable(Exception):
    pass


def describe(record: ConsumerRecord, letter: DeadLetter) -> dict[str, Any]:
    """What the listing shows of one dead letter: never the record's content."""
    value = letter.raw_value()
    return {
        "id": f"{record.partition}-{record.offset}",
        "topic": letter.topic,
        "partition": letter.partition,
        "offset": letter.offset,
        "reason": letter.error,
        "group_id": letter.group_id,
        "num_value_bytes": 0 if value is None else len(value),
        "value_sha256": None if value is None else hashlib.sha256(value).hexdigest(),
        "record_time": None if letter.timestamp_ms is None else datetime.fromtimestamp(letter.timestamp_ms / 1000, UTC).isoformat(),
        "dead_lettered_at": letter.dead_lettered_at.isoformat(),
    }


router = APIRouter()


def _unavailable(error: BaseException, settings: CoordinatorSettings) -> JSONResponse:
    log.warning("dead letters: broker unavailable (%s)", type(error.__cause__ or error).__name__)
    retry_after = {"Retry-After": str(settings.http.retry_after_s)}
    return error_response(503, "server_error", "broker_unavailable", "the broker cannot be reached; retry later", retry_after)


@router.get("/v1/dead-letters")
async def list_dead_letters(
    _: PlatformAdmin,
    settings: Settings,
    topic: Annotated[str | None, Query(max_length=256)] = None,
    reason: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
) -> JSONResponse:
    """Dead letters, oldest first: of source ``topic``, whose reason contains ``reason`` (case-insensitive),
    dead-lettered at or after ``since``; at most ``limit``, ``truncated`` when more matched or time ran out."""
    if since is not None and since.tzinfo is None:
        return error_response(400, "invalid_request_error", "invalid_parameter", "since: needs a time zone (e.g. 2026-12-01T10:00:00Z)")
    needle = None if reason is None else reason.casefold()

    def wanted(letter: DeadLetter) -> bool:
        return (
            (topic is None or letter.topic == topic)
            and (needle is None or needle in letter.error.casefold())
            and (since is None or letter.dead_lettered_at >= since)
        )

    try:
        found, truncated = await _scan(kafka_settings(settings), settings.kafka.connect_timeout_s, wanted, limit)
    except _BrokerUnavailable as error:
        return _unavailable(error, settings)
    return JSONResponse({"dead_letters": found, "truncated": truncated})


@router.post("/v1/dead-letters/{dead_letter_id}/replay")
async def replay(dead_letter_id: str, _: PlatformAdmin, settings: Settings) -> JSONResponse:
    """Publish the dead letter's original record to its source topic once (see the module docstring)."""
    match = _ID.fullmatch(dead_letter_id)
    if match is None:
        return error_response(400, "invalid_request_error", "invalid_parameter", "a dead letter id is <partition>-<offset>")
    partition, offset = int(match[1]), int(match[2])
    config, connect_timeout_s = kafka_settings(settings), settings.kafka.connect_timeout_s
    try:
        letter = await _read_one(config, connect_timeout_s, partition, offset)
        if letter is None:
            return error_response(404, "invalid_request_error", "dead_letter_not_found", f"no dead letter {dead_letter_id}")
        if letter.topic not in _REPLAYABLE:
            return error_response(409, "invalid_request_error", "not_replayable", "the dead letter's source is not a kvledger topic")
        if letter.value_b64 is None:  # a node's report of a record it never sent: there is nothing to publish
            return error_response(409, "invalid_request_error", "not_replayable", "the dead letter holds no record")
        metadata = await _publish(config, connect_timeout_s, letter)
    except _BrokerUnavailable as error:
        return _unavailable(error, settings)
    log.info("dead letter %s replayed to %s[%d]@%d", dead_letter_id, letter.topic, metadata.partition, metadata.offset)
    return JSONResponse({"id": dead_letter_id, "topic": letter.topic, "partition": metadata.partition, "offset": metadata.offset})


async def _bounded(awaitable, timeout_s: float):
    """``awaitable`` within ``timeout_s``; a broker that fails or does not answer is :class:`_BrokerUnavailable`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except (KafkaError, OSError, TimeoutError) as error:
        raise _BrokerUnavailable from error


async def _started_consumer(config: KafkaSettings, connect_timeout_s: float) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
    # No group, so nothing is committed; a fresh assignment starts at the earliest record by
    # itself (seeking there after assigning raced aiokafka's own reset to "latest").
    consumer = AIOKafkaConsumer(**kafka_client_kwargs(config), group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        await _bounded(consumer.start(), connect_timeout_s)
        await _bounded(consumer.topics(), connect_timeout_s)
        partitions = consumer.partitions_for_topic(DEAD_LETTER) or set()
    except BaseException:
        await consumer.stop()
        raise
    return consumer, [TopicPartition(DEAD_LETTER, partition) for partition in sorted(partitions)]


def _letter(record: ConsumerRecord) -> DeadLetter | None:
    try:
        return DeadLetter.model_validate_json(record.value or b"")
    except ValidationError:
        log.warning("kvledger.dead-letter[%d]@%d is not a dead letter; skipped", record.partition, record.offset)
        return None


def _oldest_first(item: tuple[ConsumerRecord, DeadLetter]) -> tuple:
    record, letter = item
    return letter.dead_lettered_at, record.partition, record.offset


async def _scan(config: KafkaSettings, connect_timeout_s: float, wanted, limit: int) -> tuple[list[dict[str, Any]], bool]:
    consumer, partitions = await _started_consumer(config, connect_timeout_s)
    try:
        if not partitions:
            return [], False
        consumer.assign(partitions)
        ends = await _bounded(consumer.end_offsets(partitions), connect_timeout_s)
        found: list[tuple[ConsumerRecord, DeadLetter]] = []
        deadline = time.monotonic() + SCAN_LIMIT_S
        complete = False
        while not complete and time.monotonic() < deadline:
            batch = await _bounded(consumer.getmany(timeout_ms=200), connect_timeout_s)
            for records in batch.values():
                found.extend((record, letter) for record in records if (letter := _letter(record)) is not None and wanted(letter))
            if len(found) > 2 * (limit + 1):  # memory stays bounded by the page, not by the topic
                found = heapq.nsmallest(limit + 1, found, key=_oldest_first)
            # The end is where a poll finds nothing more: the embedded broker may report an end
            # inside the last record batch (see ``bench.common.start_groups_at_end``).
            complete = not batch and all([await _bounded(consumer.position(tp), connect_timeout_s) >= ends[tp] for tp in partitions])
        found.sort(key=_oldest_first)
        return [describe(record, letter) for record, letter in found[:limit]], not complete or len(found) > limit
    finally:
        await consumer.stop()


async def _read_one(config: KafkaSettings, connect_timeout_s: float, partition: int, offset: int) -> DeadLetter | None:
    consumer, partitions = await _started_consumer(config, connect_timeout_s)
    try:
        tp = TopicPartition(DEAD_LETTER, partition)
        if tp not in partitions:
            return None
        consumer.assign([tp])
        end = (await _bounded(consumer.end_offsets([tp]), connect_timeout_s))[tp]
        consumer.seek(tp, offset)
        deadline = time.monotonic() + connect_timeout_s
        while time.monotonic() < deadline:
            batch = await _bounded(consumer.getmany(timeout_ms=200), connect_timeout_s)
            for record in batch.get(tp, []):
                if record.offset >= offset:
                    return _letter(record) if record.offset == offset else None  # deleted by retention: gone
            if offset >= end:
                return None  # nothing there, and the broker says the partition ends before it
        raise _BrokerUnavailable from TimeoutError(f"kvledger.dead-letter[{partition}]@{offset} not fetched")
    finally:
        await consumer.stop()


async def _publish(config: KafkaSettings, connect_timeout_s: float, letter: DeadLetter):
    producer = EventProducer(config)
    try:
        await _bounded(producer.start(), connect_timeout_s)
        return await _bounded(producer.send_raw(letter.topic, letter.raw_value(), letter.raw_key()), connect_timeout_s)
    finally:
        await producer.stop()
