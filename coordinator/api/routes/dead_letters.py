"""``GET /v1/dead-letters`` and ``POST /v1/dead-letters/{id}/replay``: the operator's view of the
dead-letter topics.

A record a coordinator consumer refused (contract violation, unverified signature, a value
the database refused) is put on ``kvledger.dead-letter`` with its source coordinates, its raw
bytes — or, for a record too large for its letter, a reference to them — and the reason
(``events.kafka.dead_letters.send_to_dead_letter``), **signed** with the coordinator's command key
(``identity.signing.sign_dead_letter``). Nodes put what they refused on
``kvledger.node-dead-letter``. Only ``platform-admin`` reads or replays them.

* The listing never returns a record's content: dead letters hold contract records (ids,
  keyed digests, hashes — no prompt or document text) and, being refused, possibly
  anything a hostile producer wrote. It shows where the record came from, why it was
  refused, its size and the SHA-256 of its bytes (to tell copies apart), when, whether the
  letter is *trusted* (signed by this coordinator's key) and whether it can be replayed.
* A replay publishes the record's original key and bytes to its source topic once, so it
  goes through the same decoding, signature check and handlers as any record: a record
  refused for a reason that has since been fixed (e.g. its node's key is now enrolled) is
  applied; one still invalid is dead-lettered again, as a new dead letter, once. Nothing
  replays by itself, so nothing loops. Replay publishes with the coordinator's credentials,
  so it refuses every letter this coordinator did not sign (unsigned, forged, tampered,
  signed by another key: ``409 untrusted_dead_letter``), every node letter, and every
  by-reference letter (``409 held_by_reference``: its bytes are not held).

The id of a dead letter is ``<partition>-<offset>`` on ``kvledger.dead-letter`` and
``node-<partition>-<offset>`` on ``kvledger.node-dead-letter``. The API reads the topics
without a consumer group (nothing is committed) and answers 503 ``broker_unavailable``
with ``Retry-After`` when the broker cannot be reached in ``kafka.connect_timeout_s``
(docs/operations.md, "Dead letters").
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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from coordinator.api.dependencies import PlatformAdmin, Settings
from coordinator.http import error_response
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.codec import DeadLetter
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.topics import ALL_TOPICS, DEAD_LETTER, DEAD_LETTER_TOPICS, NODE_DEAD_LETTER
from identity.signing import dead_letter_signature_problem

log = logging.getLogger(__name__)

MAX_LIST = 1000
SCAN_LIMIT_S = 20.0
"""The longest one listing reads the topic; what it read by then is answered, marked truncated."""
_ID = re.compile(r"^(node-)?(0|[1-9][0-9]{0,5})-(0|[1-9][0-9]{0,18})$")
_REPLAYABLE = frozenset(ALL_TOPICS) - set(DEAD_LETTER_TOPICS)
VERIFIED = "verified"


class _BrokerUnavailable(Exception):
    pass


def letter_id(record: ConsumerRecord) -> str:
    prefix = "node-" if record.topic == NODE_DEAD_LETTER else ""
    return f"{prefix}{record.partition}-{record.offset}"


def trust(record: ConsumerRecord, letter: DeadLetter, command_key: Ed25519PublicKey | None) -> str:
    """``verified`` when ``letter`` (read from ``record``) is signed by this coordinator's command key, else why not.

    Node letters are never trusted, whatever they carry: nodes do not hold the key, and the
    node topic is not one replay reads.
    """
    if record.topic != DEAD_LETTER or command_key is None:
        return "unsigned" if letter.signature is None else "unknown_key"
    return dead_letter_signature_problem(letter, command_key) or VERIFIED


def describe(
    record: ConsumerRecord, letter: DeadLetter, command_key: Ed25519PublicKey | None
) -> dict[str, Any]:
    """What the listing shows of one dead letter: never the record's content."""
    value = letter.raw_value()
    num_value_bytes = (
        letter.num_value_bytes
        if letter.num_value_bytes is not None
        else 0
        if value is None
        else len(value)
    )
    sha256 = letter.value_sha256 or (None if value is None else hashlib.sha256(value).hexdigest())
    signature = trust(record, letter, command_key)
    return {
        "id": letter_id(record),
        "source": "node" if record.topic == NODE_DEAD_LETTER else "coordinator",
        "topic": letter.topic,
        "partition": letter.partition,
        "offset": letter.offset,
        "reason": letter.error,
        "group_id": letter.group_id,
        "num_value_bytes": num_value_bytes,
        "value_sha256": sha256,
        "by_reference": letter.by_reference,
        "signature": signature,
        "trusted": signature == VERIFIED,
        "replayable": signature == VERIFIED and _replay_refusal(letter) is None,
        "record_time": None
        if letter.timestamp_ms is None
        else datetime.fromtimestamp(letter.timestamp_ms / 1000, UTC).isoformat(),
        "dead_lettered_at": letter.dead_lettered_at.isoformat(),
    }


def _replay_refusal(letter: DeadLetter) -> tuple[str, str] | None:
    """Why a trusted ``letter`` cannot be replayed (error code, message), or None when it can."""
    if letter.by_reference:
        return "held_by_reference", (
            f"the dead letter refers to a record of {letter.num_value_bytes} bytes (sha256 {letter.value_sha256}) by"
            " reference: its bytes are not held, so it cannot be replayed; re-publish the record from its source"
        )
    if letter.topic not in _REPLAYABLE:
        return "not_replayable", "the dead letter's source is not a kvledger topic"
    if (
        letter.value_b64 is None
    ):  # a report of a record that was never sent: there is nothing to publish
        return "not_replayable", "the dead letter holds no record"
    return None


def _command_key(settings: CoordinatorSettings) -> Ed25519PublicKey | None:
    """The key this coordinator signs its dead letters with (None when unset: then no letter is
    trusted)."""
    try:
        return settings.command_signer().private_key.public_key()
    except ValueError:
        return None


router = APIRouter()


def _unavailable(error: BaseException, settings: CoordinatorSettings) -> JSONResponse:
    log.warning("dead letters: broker unavailable (%s)", type(error.__cause__ or error).__name__)
    retry_after = {"Retry-After": str(settings.http.retry_after_s)}
    return error_response(
        503,
        "server_error",
        "broker_unavailable",
        "the broker cannot be reached; retry later",
        retry_after,
    )


@router.get("/v1/dead-letters")
async def list_dead_letters(
    _: PlatformAdmin,
    settings: Settings,
    topic: Annotated[str | None, Query(max_length=256)] = None,
    reason: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
) -> JSONResponse:
    """Dead letters, oldest first: of source ``topic``, whose reason contains ``reason``
    (case-insensitive), dead-lettered at or after ``since``; at most ``limit``, ``truncated`` when
    more matched or time ran out."""
    if since is not None and since.tzinfo is None:
        return error_response(
            400,
            "invalid_request_error",
            "invalid_parameter",
            "since: needs a time zone (e.g. 2026-12-01T10:00:00Z)",
        )
    needle = None if reason is None else reason.casefold()

    def wanted(letter: DeadLetter) -> bool:
        return (
            (topic is None or letter.topic == topic)
            and (needle is None or needle in letter.error.casefold())
            and (since is None or letter.dead_lettered_at >= since)
        )

    try:
        found, truncated = await _scan(
            kafka_settings(settings),
            settings.kafka.connect_timeout_s,
            wanted,
            limit,
            _command_key(settings),
        )
    except _BrokerUnavailable as error:
        return _unavailable(error, settings)
    return JSONResponse({"dead_letters": found, "truncated": truncated})


@router.post("/v1/dead-letters/{dead_letter_id}/replay")
async def replay(dead_letter_id: str, _: PlatformAdmin, settings: Settings) -> JSONResponse:
    """Publish the dead letter's original record to its source topic once (see the module
    docstring)."""
    match = _ID.fullmatch(dead_letter_id)
    if match is None:
        return error_response(
            400,
            "invalid_request_error",
            "invalid_parameter",
            "a dead letter id is [node-]<partition>-<offset>",
        )
    if match[1]:
        return error_response(
            409,
            "invalid_request_error",
            "not_replayable",
            "a node's dead letter is listed, never replayed",
        )
    partition, offset = int(match[2]), int(match[3])
    config, connect_timeout_s = kafka_settings(settings), settings.kafka.connect_timeout_s
    try:
        found = await _read_one(config, connect_timeout_s, partition, offset)
        if found is None:
            return error_response(
                404,
                "invalid_request_error",
                "dead_letter_not_found",
                f"no dead letter {dead_letter_id}",
            )
        record, letter = found
        signature = trust(record, letter, _command_key(settings))
        if signature != VERIFIED:
            log.warning("dead letter %s: replay refused, signature %s", dead_letter_id, signature)
            message = (
                f"the dead letter is not signed by this coordinator's key (signature: {signature}): anyone who can"
                " write kvledger.dead-letter could have planted it, so nothing was published"
            )
            return error_response(409, "invalid_request_error", "untrusted_dead_letter", message)
        refusal = _replay_refusal(letter)
        if refusal is not None:
            return error_response(409, "invalid_request_error", *refusal)
        metadata = await _publish(config, connect_timeout_s, letter)
    except _BrokerUnavailable as error:
        return _unavailable(error, settings)
    log.info(
        "dead letter %s replayed to %s[%d]@%d",
        dead_letter_id,
        letter.topic,
        metadata.partition,
        metadata.offset,
    )
    return JSONResponse(
        {
            "id": dead_letter_id,
            "topic": letter.topic,
            "partition": metadata.partition,
            "offset": metadata.offset,
        }
    )


async def _bounded(awaitable, timeout_s: float):
    """``awaitable`` within ``timeout_s``; a broker that fails or does not answer is
    :class:`_BrokerUnavailable`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except (KafkaError, OSError, TimeoutError) as error:
        raise _BrokerUnavailable from error


async def _started_consumer(
    config: KafkaSettings, connect_timeout_s: float, topics: tuple[str, ...] = DEAD_LETTER_TOPICS
) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
    # No group, so nothing is committed; a fresh assignment starts at the earliest record by
    # itself (seeking there after assigning raced aiokafka's own reset to "latest").
    consumer = AIOKafkaConsumer(
        **kafka_client_kwargs(config),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        await _bounded(consumer.start(), connect_timeout_s)
        await _bounded(consumer.topics(), connect_timeout_s)
        partitions = [
            TopicPartition(topic, each)
            for topic in topics
            for each in sorted(consumer.partitions_for_topic(topic) or ())
        ]
    except BaseException:
        await consumer.stop()
        raise
    return consumer, partitions


def _letter(record: ConsumerRecord) -> DeadLetter | None:
    try:
        return DeadLetter.model_validate_json(record.value or b"")
    except ValidationError:
        log.warning(
            "%s[%d]@%d is not a dead letter; skipped", record.topic, record.partition, record.offset
        )
        return None


def _oldest_first(item: tuple[ConsumerRecord, DeadLetter]) -> tuple:
    record, letter = item
    return letter.dead_lettered_at, record.partition, record.offset


async def _scan(
    config: KafkaSettings,
    connect_timeout_s: float,
    wanted,
    limit: int,
    command_key: Ed25519PublicKey | None,
) -> tuple[list[dict[str, Any]], bool]:
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
                found.extend(
                    (record, letter)
                    for record in records
                    if (letter := _letter(record)) is not None and wanted(letter)
                )
            if len(found) > 2 * (limit + 1):  # memory stays bounded by the page, not by the topic
                found = heapq.nsmallest(limit + 1, found, key=_oldest_first)
            # The end is where a poll finds nothing more: the embedded broker may report an end
            # inside the last record batch (see ``bench.common.start_groups_at_end``).
            complete = not batch and all(
                [
                    await _bounded(consumer.position(tp), connect_timeout_s) >= ends[tp]
                    for tp in partitions
                ]
            )
        found.sort(key=_oldest_first)
        return [
            describe(record, letter, command_key) for record, letter in found[:limit]
        ], not complete or len(found) > limit
    finally:
        await consumer.stop()


async def _read_one(
    config: KafkaSettings, connect_timeout_s: float, partition: int, offset: int
) -> tuple[ConsumerRecord, DeadLetter] | None:
    """The dead letter at ``offset`` of ``kvledger.dead-letter[partition]`` with its record; None when there is none."""
    consumer, partitions = await _started_consumer(config, connect_timeout_s, (DEAD_LETTER,))
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
                if record.offset >= offset:  # past it: deleted by retention, gone
                    letter = _letter(record) if record.offset == offset else None
                    return None if letter is None else (record, letter)
            if offset >= end:
                return None  # nothing there, and the broker says the partition ends before it
        raise _BrokerUnavailable from TimeoutError(
            f"kvledger.dead-letter[{partition}]@{offset} not fetched"
        )
    finally:
        await consumer.stop()


async def _publish(config: KafkaSettings, connect_timeout_s: float, letter: DeadLetter):
    producer = EventProducer(config)
    try:
        await _bounded(producer.start(), connect_timeout_s)
        return await _bounded(
            producer.send_raw(letter.topic, letter.raw_value(), letter.raw_key()), connect_timeout_s
        )
    finally:
        await producer.stop()
