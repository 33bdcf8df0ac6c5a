"""The one producer every component publishes through: routed topic and key, ``acks=all``, sizes
checked first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from aiokafka.structs import RecordMetadata

from events.codec import encode_event, encode_key
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.record_size import MAX_REQUEST_BYTES
from events.schema import Envelope
from events.topics import route

SIZE_REFUSALS: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
"""How a producer or broker refuses a record for its size: permanent, retrying cannot help."""


class EventProducer:
    """Publishes envelopes under their routed topic and key, waiting for ``acks=all``.

    No linger by default: callers that publish many events hand them over together
    (:meth:`send_many`, or sends issued before any is awaited), and the producer
    batches whatever accumulated while its previous request was in flight.

    ``sign`` (e.g. ``identity.signing.EnvelopeSigner``) is applied to every envelope
    right before it is encoded: a node's producers sign everything they publish.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        linger_ms: int = 0,
        sign: Callable[[Envelope], Envelope] | None = None,
    ) -> None:
        self._settings = settings
        self._sign = sign
        self._producer = AIOKafkaProducer(
            **kafka_client_kwargs(settings),
            acks="all",
            enable_idempotence=settings.enable_idempotence,
            linger_ms=linger_ms,
            max_request_size=MAX_REQUEST_BYTES,
        )

    @property
    def max_request_size(self) -> int:
        """The largest record this producer sends (by :func:`~events.record_size.request_bytes`)."""
        return MAX_REQUEST_BYTES

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush what is buffered, then close."""
        await self._producer.stop()

    async def __aenter__(self) -> EventProducer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def send(
        self, envelope: Envelope, *, topic: str | None = None, key: str | None = None
    ) -> RecordMetadata:
        """Publish one event and wait until the broker acknowledged it.

        ``topic``/``key`` override :func:`events.topics.route` (e.g. to target one node).
        """
        routed_topic, routed_key = route(envelope)
        return await self.send_raw(
            topic or routed_topic, self._encode(envelope), encode_key(key or routed_key)
        )

    async def send_many(self, envelopes: Iterable[Envelope]) -> list[RecordMetadata]:
        """Publish many events as one pipelined batch; returns when all are acknowledged.

        Order is kept per key (per partition), which is the only order Kafka defines.
        """
        pending = []
        for envelope in envelopes:
            topic, key = route(envelope)
            pending.append(
                await self._producer.send(topic, self._encode(envelope), key=encode_key(key))
            )
        return list(await asyncio.gather(*pending))

    def _encode(self, envelope: Envelope) -> bytes:
        return encode_event(envelope if self._sign is None else self._sign(envelope))

    async def send_raw(self, topic: str, value: bytes | None, key: bytes | None) -> RecordMetadata:
        return await self._producer.send_and_wait(topic, value, key=key)

    async def send_raw_many(
        self, records: Sequence[tuple[str, bytes, bytes]]
    ) -> list[RecordMetadata | KafkaError]:
        """Publish already-encoded ``(topic, value, key)`` records as one pipelined batch.

        Returns each record's metadata or the exception that refused it, in order, so the
        caller can tell which records the broker holds when only some failed.
        """
        sent: list[asyncio.Future | KafkaError] = []
        for topic, value, key in records:
            try:
                sent.append(await self._producer.send(topic, value, key=key))
            except KafkaError as exc:  # refused before sending (e.g. larger than max_request_size)
                sent.append(exc)
        results: list[RecordMetadata | KafkaError] = []
        for item in sent:  # all are in flight already: awaiting in turn costs no extra round trips
            if isinstance(item, KafkaError):
                results.append(item)
                continue
            try:
                results.append(await item)
            except KafkaError as exc:
                results.append(exc)
        return results
