"""Dead letters: how a record that cannot be processed is set aside, whole or by reference, and
counted.

A letter always fits the transport (by reference when the record's own bytes would not), so a
bad record can never stall its partition by failing to be dead-lettered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter

from events.codec import DeadLetter
from events.kafka.producer import SIZE_REFUSALS, EventProducer
from events.metrics import DEAD_LETTER_BY_REFERENCE_TOTAL, DEAD_LETTER_TOTAL
from events.record_size import request_bytes
from events.topics import ALERT_TOPICS, DEAD_LETTER, DEAD_LETTER_TOPICS

log = logging.getLogger(__name__)


Seal = Callable[[DeadLetter], DeadLetter]
"""Signs a dead letter before it is sent (the coordinator's ``EnvelopeSigner.sign_dead_letter``)."""


def dead_letter_record(
    record: ConsumerRecord,
    error: str,
    group_id: str | None,
    max_request_size: int,
    seal: Seal | None = None,
    *,
    by_reference: bool = False,
) -> tuple[DeadLetter, bytes, bytes | None]:
    """The dead letter of ``record``, its encoded value and its key: whole when it fits
    ``max_request_size``.

    A letter carries the record's bytes base64-encoded (a third larger) plus metadata, so a record
    well under the limit can have a letter over it; such a record, or one whose letter the broker
    refused for size (``by_reference``), is dead-lettered *by reference*: coordinates, size, SHA-256
    and bounded prefixes, which always fit (:data:`MIN_REQUEST_BYTES`). The size checked is the
    producer's own (:func:`~events.record_size.request_bytes`), signature included."""

    def encoded(reference: bool) -> tuple[DeadLetter, bytes, bytes | None]:
        letter = DeadLetter.of(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp,
            key=record.key,
            value=record.value,
            error=error,
            group_id=group_id,
            by_reference=reference,
        )
        if seal is not None:
            letter = seal(letter)
        return letter, letter.encode(), letter.raw_key()

    letter, value, key = encoded(by_reference)
    if not by_reference and request_bytes(key, value) > max_request_size:
        letter, value, key = encoded(True)
    assert request_bytes(key, value) <= max_request_size, (
        "a by-reference dead letter always fits MIN_REQUEST_BYTES"
    )
    return letter, value, key


async def send_to_dead_letter(
    producer: EventProducer,
    record: ConsumerRecord,
    error: str,
    group_id: str | None,
    counter: Counter = DEAD_LETTER_TOTAL,
    *,
    topic: str = DEAD_LETTER,
    seal: Seal | None = None,
) -> None:
    """Put a record that failed validation on a dead-letter ``topic``, with its error, and count it.

    Never dropped, never a crash loop: the raw bytes (or, for a record too large for its
    letter, a reference to them, :func:`dead_letter_record`) and coordinates travel with the
    error so an operator can inspect, and replay, it. A letter the broker refuses for its
    size is sent again by reference; no size refusal is retried. Invalid records on
    alerting topics (erasures, permissions) are logged at ERROR.
    """
    assert topic in DEAD_LETTER_TOPICS, f"{topic} is not a dead-letter topic"
    letter, value, key = dead_letter_record(
        record, error, group_id, producer.max_request_size, seal
    )
    try:
        await producer.send_raw(topic, value, key)
    except SIZE_REFUSALS:
        if letter.by_reference:
            raise
        letter, value, key = dead_letter_record(
            record, error, group_id, producer.max_request_size, seal, by_reference=True
        )
        await producer.send_raw(topic, value, key)
    counter.labels(topic=record.topic).inc()
    if letter.by_reference:
        DEAD_LETTER_BY_REFERENCE_TOTAL.labels(topic=record.topic).inc()
    level = logging.ERROR if record.topic in ALERT_TOPICS else logging.WARNING
    log.log(
        level,
        "dead-lettered %s[%d]@%d%s: %s",
        record.topic,
        record.partition,
        record.offset,
        f" by reference ({letter.num_value_bytes} bytes)" if letter.by_reference else "",
        letter.error,
    )
