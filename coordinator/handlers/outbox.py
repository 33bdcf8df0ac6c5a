"""Transactional outbox: commands decided in a ledger transaction, published to Kafka afterwards.

A decision (e.g. "ask node X for an inventory") and the record that carries it are
written in the *same* database transaction (:func:`outbox_row`), so neither exists
without the other. :class:`OutboxRelay` stamps unsent rows ``sent_at`` and publishes
them before it commits. Rows are claimed with ``FOR UPDATE SKIP LOCKED``, so any number of
coordinator replicas relay concurrently without publishing a row twice in the
normal case; after a crash between publish and commit a row is published again,
which consumers absorb through the envelope's ``event_id`` (their inbox).

Invalidation decisions skip the relay's round trip: their transaction leases its rows
(``lease_until``) and, once it committed, hands them to :meth:`OutboxRelay.publish_leased`,
which publishes them from memory and then stamps them sent. The relay leaves a leased
row alone until its lease ran out, so only a process that died in between leaves the
row to the relay — published a lease later, never lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy import BigInteger, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from coordinator.ledger.db import Database
from coordinator.metrics import OUTBOX_PUBLISHED_TOTAL
from events.fault_points import fault_point
from events.kafka.producer import EventProducer
from events.schema import Envelope
from events.topics import route

log = logging.getLogger(__name__)

_CLAIM_UNSENT = (
    text(
        "UPDATE outbox SET sent_at = now() WHERE id IN ("
        " SELECT id FROM outbox WHERE sent_at IS NULL AND (lease_until IS NULL OR lease_until < now())"
        " ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED)"
        " RETURNING id, topic, key, payload"
    )
    .bindparams(bindparam("limit", type_=BigInteger()))
    .columns(id=BigInteger(), topic=Text(), key=Text(), payload=JSONB())
)
"""Claims and stamps a batch in one statement; the stamp is undone if publishing fails (rollback)."""
_STAMP_LEASED = text(
    "UPDATE outbox SET sent_at = now() WHERE id = ANY(:ids) AND sent_at IS NULL"
).bindparams(bindparam("ids", type_=ARRAY(BigInteger())))


def outbox_row(envelope: Envelope) -> dict[str, Any]:
    """Column values for an outbox insert carrying ``envelope`` under its routed topic and key.

    Only signed commands enter the outbox (``CoordinatorSettings.command_signer``): the row
    holds the signed bytes, so the deciding process, the relay and a node's replay all see
    the same signature, and a row written to the table by anyone without the command key
    is refused by every node.
    """
    assert envelope.signature is not None, (
        f"{envelope.type} command {envelope.event_id} entered the outbox unsigned"
    )
    topic, key = route(envelope)
    return {"topic": topic, "key": key, "payload": envelope.model_dump(mode="json")}


class OutboxRelay:
    """Publishes pending outbox rows in id order; woken early by :meth:`wake` after a local commit."""

    def __init__(
        self, database: Database, producer: EventProducer, *, batch_size: int, poll_s: float
    ) -> None:
        if batch_size < 1 or poll_s <= 0:
            raise ValueError("batch_size must be >= 1 and poll_s > 0")
        self._database = database
        self._producer = producer
        self._batch_size = batch_size
        self._poll_s = poll_s
        self._wakeup = asyncio.Event()
        self._publishing_leased: asyncio.Task | None = None

    def wake(self) -> None:
        self._wakeup.set()

    async def relay_once(self) -> int:
        """Publish one batch of unsent rows and mark them sent; returns how many were published."""
        async with self._database.session() as session, session.begin():
            claimed = await session.execute(_CLAIM_UNSENT, {"limit": self._batch_size})
            rows = sorted(claimed.all(), key=lambda row: row.id)
            if not rows:
                return 0
            envelopes = [Envelope.model_validate(row.payload) for row in rows]
            for row, envelope in zip(rows, envelopes, strict=True):
                assert route(envelope) == (row.topic, row.key), (
                    f"outbox row {row.id} is not routed as its envelope"
                )
            await self._producer.send_many(envelopes)
            fault_point("coordinator.after_publish")
        for row in rows:
            OUTBOX_PUBLISHED_TOTAL.labels(topic=row.topic).inc()
        return len(rows)

    def publish_leased(self, rows: list[tuple[int, Envelope]]) -> None:
        """Publish (id, envelope) rows a transaction of this process leased and committed, in the
        background.

        Each call's rows go out after the previous call's, so commands keep their
        decision order. A failure only logs: the rows stay unsent and the relay
        publishes them when their lease runs out.
        """
        if rows:
            self._publishing_leased = asyncio.create_task(
                self._publish_leased_after(self._publishing_leased, rows)
            )

    async def _publish_leased_after(
        self, previous: asyncio.Task | None, rows: list[tuple[int, Envelope]]
    ) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            await self._producer.send_many([envelope for _, envelope in rows])
            fault_point("coordinator.after_publish")
            async with self._database.session() as session, session.begin():
                await session.execute(_STAMP_LEASED, {"ids": [row_id for row_id, _ in rows]})
        except Exception as exc:  # noqa: BLE001 - the relay takes the rows over once their lease ran out
            log.warning(
                "publishing %d leased outbox rows failed (%s); the relay will",
                len(rows),
                type(exc).__name__,
            )
            return
        for _, envelope in rows:
            OUTBOX_PUBLISHED_TOTAL.labels(topic=route(envelope)[0]).inc()

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set. Failures (broker or database down) are retried, never fatal."""
        while not stop.is_set():
            self._wakeup.clear()
            try:
                if await self.relay_once() == self._batch_size:
                    continue  # more may be waiting
            except Exception as exc:  # noqa: BLE001 - the relay must outlive transient outages
                log.warning("outbox relay failed (%s); retrying", type(exc).__name__)
            waiters = {
                asyncio.ensure_future(self._wakeup.wait()),
                asyncio.ensure_future(stop.wait()),
            }
            await asyncio.wait(waiters, timeout=self._poll_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    async def finish_leased(self) -> None:
        """Wait until every row handed to :meth:`publish_leased` was published (or given up on)."""
        if self._publishing_leased is not None:
            await asyncio.gather(self._publishing_leased, return_exceptions=True)
