"""How large a record the system may write, and splitting a set of items into records that fit.

Every producer of this system (:class:`events.kafka.producer.EventProducer`) refuses a record whose
request size is above its ``max_request_size`` (:data:`MAX_REQUEST_BYTES`), with
``MessageSizeTooLargeError``, before anything reaches the broker: a record over it is never
delivered, however often it is re-sent. So every writer of a record that lists a set of
items (block events, inventories, snapshots, command acks) cuts the set by *encoded size*
as well as by count: :func:`split_to_fit` over the exact size of the signed record
(:func:`envelope_bytes`), against :data:`MAX_RECORD_BYTES`, the largest record value the
producer accepts under the longest key this system writes. The limits are derived here
from the producer's check itself (aiokafka's record size estimate), nowhere else.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from events.codec import encode_event
from events.schema import (
    MAX_ID_CHARS,
    MAX_SAFE_INT,
    Envelope,
    EventPayload,
    NodeEvent,
    RecordSignature,
)

T = TypeVar("T")

MAX_REQUEST_BYTES = 1_048_576
"""The producer's ``max_request_size`` (aiokafka's default, which
:class:`events.kafka.producer.EventProducer` keeps): the largest record, key and framing included,
it sends. The broker's default ``message.max.bytes`` (1 MiB plus 12 bytes of batch framing) admits
every such record."""

MAX_KEY_BYTES = 4 * MAX_ID_CHARS
"""The longest record key this system writes: a node id (a ``Name``, at most 256 code points of
at most 4 UTF-8 bytes each) keys block events, inventories and acks."""


def request_bytes(key: bytes | None, value: bytes) -> int:
    """The size the producer checks against ``max_request_size`` for one record (its own estimate)."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])


def _largest_value_bytes(max_request_bytes: int, max_key_bytes: int) -> int:
    key = bytes(max_key_bytes)
    value_bytes = max_request_bytes - (
        request_bytes(key, bytes(max_request_bytes)) - max_request_bytes
    )
    # Length prefixes are varints: a shorter value may have a shorter prefix, leaving room for more.
    while request_bytes(key, bytes(value_bytes + 1)) <= max_request_bytes:
        value_bytes += 1
    assert request_bytes(key, bytes(value_bytes)) <= max_request_bytes, (
        "the largest record value must fit"
    )
    return value_bytes


MAX_RECORD_BYTES = _largest_value_bytes(MAX_REQUEST_BYTES, MAX_KEY_BYTES)
"""The largest record value any writer produces: with the longest key it still passes the
producer's check, exactly (one byte more does not)."""

_MEASURE_EVENT_ID = uuid.UUID(int=0)
_MEASURE_OCCURRED_AT = datetime(2000, 1, 1, 0, 0, 0, 1, tzinfo=UTC)
"""A timestamp with microseconds: the longest form ``occurred_at`` takes (``…:00.000001Z``)."""
_MEASURE_SIGNATURE = RecordSignature(kid="0" * 32, sig="A" * 86)
"""Signatures have one length (32 hex digits of key id, 86 base64url characters)."""


def envelope_bytes(payload: EventPayload, tenant_id: str | None = None) -> int:
    """The size of ``payload``'s record once stamped and signed, at its largest.

    Measured on an envelope whose fields filled in later take their longest form: a fresh
    event id (fixed length), an ``occurred_at`` with microseconds, a node event's ``seq`` of
    2^53-1 and a signature (fixed length). What a writer sends is at most this long.
    """
    if isinstance(payload, NodeEvent):
        payload = payload.model_copy(update={"seq": MAX_SAFE_INT})
    envelope = Envelope.model_construct(
        event_id=_MEASURE_EVENT_ID,
        type=payload.TYPE,
        schema_version=1,
        occurred_at=_MEASURE_OCCURRED_AT,
        tenant_id=tenant_id,
        payload=payload,
        signature=_MEASURE_SIGNATURE,
    )
    return len(encode_event(envelope))


def split_to_fit(
    items: Sequence[T],
    size_of: Callable[[Sequence[T]], int],
    *,
    max_items: int,
    max_bytes: int = MAX_RECORD_BYTES,
) -> list[Sequence[T]]:
    """``items`` cut into consecutive runs, each as long as it can be: at most ``max_items`` items and
    ``size_of(run) <= max_bytes``.

    ``size_of`` is the encoded size of the record a run becomes (e.g. :func:`envelope_bytes`
    of its payload); it must not shrink when a run grows. Each cut is found by interpolating
    between the sizes measured so far, alternating with bisection, so a run costs a few
    encodings whatever its length. A run of one item is returned even when it alone is over
    ``max_bytes`` (the writer's own size check refuses that record); an empty ``items`` gives
    no runs.
    """
    if max_items < 1 or max_bytes < 1:
        raise ValueError("max_items and max_bytes must be positive")
    runs: list[Sequence[T]] = []
    start = 0
    while start < len(items):
        length = _longest_fitting(
            items, start, size_of, min(max_items, len(items) - start), max_bytes
        )
        runs.append(items[start : start + length])
        start += length
    return runs


def _longest_fitting(
    items: Sequence[T], start: int, size_of: Callable[[Sequence[T]], int], most: int, max_bytes: int
) -> int:
    """The longest run from ``start`` of at most ``most`` items that fits (at least 1)."""
    too_long_bytes = size_of(items[start : start + most])
    if too_long_bytes <= max_bytes:
        return most
    fits, too_long = 0, most
    fits_bytes = 0
    bisect = False
    while too_long - fits > 1:
        if bisect:
            guess = (fits + too_long) // 2
        else:
            slope = (too_long_bytes - fits_bytes) / (too_long - fits)
            guess = (
                fits + int((max_bytes - fits_bytes) / slope)
                if slope > 0
                else (fits + too_long) // 2
            )
        guess = min(max(guess, fits + 1), too_long - 1)
        bisect = not bisect
        measured = size_of(items[start : start + guess])
        if measured <= max_bytes:
            fits, fits_bytes = guess, measured
        else:
            too_long, too_long_bytes = guess, measured
    return max(fits, 1)
