"""The coordinator's background work: the kv-events consumer, the decisions consumer
(documents, permissions, erasures), the ack consumer, the outbox relay, the erasure
verifier, the command re-sender (``coordinator.handlers.resend``), the dead-letter tally and the
inbox/outbox pruner (``coordinator.handlers.pruning``).

kv-events and acks reach their handlers only through
:class:`coordinator.keys.node_keys.VerifiedRecords`: a record not signed by a key enrolled for its
node is dead-lettered, never applied. Customer events (documents, permissions, erasures) pass the
same step with producer keys (``coordinator.keys.producer_keys``): one not signed by a key bound to
its tenant is never decided. Every command is signed with the command key
(``settings.command_signer()``) before it enters the outbox."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiokafka.errors import KafkaError

from coordinator.audit.audit_log import ReceiptKeys
from coordinator.handlers.erasure import ErasureService
from coordinator.handlers.ingest import DeadLetterTally, LedgerIngest
from coordinator.handlers.invalidation import InvalidationHandler
from coordinator.handlers.outbox import OutboxRelay
from coordinator.handlers.poison import refused_as_data
from coordinator.handlers.pruning import Pruner
from coordinator.handlers.resend import CommandResender
from coordinator.keys.node_keys import NodeKeyRegistry, VerifiedRecords
from coordinator.keys.producer_keys import ProducerKeyRegistry, producer_record_problem
from coordinator.ledger.db import Database
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.kafka.admin import ensure_topics
from events.kafka.consumer import BatchConsumer
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.topics import ACKS, DOCUMENTS, ERASURES, KV_EVENTS, PERMISSIONS
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

DEAD_LETTER_FLUSH_S = 1.0
INVALIDATION_GROUP_SUFFIX = "-invalidations"
"""The decisions consumer has its own group, so a slow kv-events backlog never delays a revocation."""
ACK_GROUP_SUFFIX = "-acks"
"""Acks have their own group too: their batches run concurrently with decisions, which are
then published without waiting for the acks that arrived with them."""


def consumer_groups(group_id: str) -> dict[str, list[str]]:
    """The coordinator's consumer groups for base ``group_id`` and the topics each reads."""
    return {
        group_id: [KV_EVENTS],
        group_id + INVALIDATION_GROUP_SUFFIX: [DOCUMENTS, PERMISSIONS, ERASURES],
        group_id + ACK_GROUP_SUFFIX: [ACKS],
    }


async def run_consumers(
    settings: CoordinatorSettings,
    stop: asyncio.Event,
    assigned: asyncio.Event | None = None,
    readiness: ConsumerReadiness | None = None,
) -> None:
    """Consume kv-events into the ledger and relay the outbox until ``stop`` is set.

    ``assigned`` is set once this member owns kv-events partitions (for tests); ``readiness``
    is told about the consumers once they are started (for ``/readyz``).
    Shutdown finishes the in-flight batch, commits its offsets, leaves the group, then
    flushes the producer, so a SIGTERM loses nothing and replays as little as possible.

    A broker that cannot be reached at start is not fatal: the attempt is abandoned and
    retried after a backoff (``kafka.reconnect_initial_s`` doubling to ``reconnect_max_s``),
    while ``readiness`` names the reason, so a process that also serves the API keeps
    answering (docs/operations.md, "Degraded modes"). Once started, aiokafka reconnects by
    itself and the consumers retry failed batches.
    """
    command_signer = settings.command_signer()
    delay_s = settings.kafka.reconnect_initial_s
    while not stop.is_set():
        try:
            await _run_connected(settings, command_signer, stop, assigned, readiness)
            return
        except BrokerUnreachable as unreachable:
            reason = f"kafka unreachable ({unreachable}); retrying in {delay_s:.1f}s"
            log.warning("coordinator consumers: %s", reason)
            if readiness is not None:
                readiness.wait_for(reason)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)
        delay_s = min(delay_s * 2, settings.kafka.reconnect_max_s)


class BrokerUnreachable(Exception):
    """The consumers could not connect to the broker at start (the message names the error type
    only)."""


async def _started(starting, timeout_s: float) -> None:
    """Await one start step, bounded; a broker that is down or does not answer becomes
    :class:`BrokerUnreachable`."""
    try:
        async with asyncio.timeout(timeout_s):
            await starting
    except (KafkaError, OSError, TimeoutError) as error:
        raise BrokerUnreachable(type(error).__name__) from error


@dataclass(frozen=True)
class _Parts:
    """What one run of the consumers is made of: the database, the producer and the outbox relay they share,
    the three consumer groups (kv-events, decisions, acks) and the background loops."""

    database: Database
    producer: EventProducer
    tally: DeadLetterTally
    relay: OutboxRelay
    consumer: BatchConsumer
    invalidations: BatchConsumer
    acks: BatchConsumer
    erasures: ErasureService
    handler: InvalidationHandler
    resender: CommandResender
    pruner: Pruner

    @classmethod
    def build(
        cls, settings: CoordinatorSettings, config: KafkaSettings, command_signer: EnvelopeSigner
    ) -> _Parts:
        database = Database(settings.database, pre_ping=False)
        producer = EventProducer(config)
        tally = DeadLetterTally()
        relay = OutboxRelay(
            database,
            producer,
            batch_size=settings.ledger.outbox_batch_size,
            poll_s=settings.ledger.outbox_poll_s,
        )
        subject_key = settings.ledger.subject_key
        erasures = ErasureService(
            database,
            subject_key=None if subject_key is None else subject_key.get_secret_value().encode(),
            receipt_keys=ReceiptKeys(
                settings.ledger.receipt_signing_key, settings.keys.master_key_bytes()
            ),
            command_signer=command_signer,
        )
        handler = InvalidationHandler(
            database,
            erasures=erasures,
            command_signer=command_signer,
            on_outbox=relay.wake,
            publish_leased=relay.publish_leased,
            outbox_lease_s=settings.ledger.outbox_lease_s,
        )
        ingest = LedgerIngest(
            database,
            inventory_retry_s=settings.ledger.inventory_retry_s,
            command_signer=command_signer,
            on_outbox=relay.wake,
            on_committed=handler.wake_releases,
        )
        node_keys = NodeKeyRegistry(database, settings.ledger.node_key_cache_s)
        seal = command_signer.sign_dead_letter  # replay trusts only letters the coordinator signed
        consumer = BatchConsumer(
            config.model_copy(
                update={"fetch_max_wait_ms": settings.kafka.ingest_fetch_max_wait_ms}
            ),
            [KV_EVENTS],
            VerifiedRecords(
                ingest,
                node_keys,
                producer,
                group_id=config.group_id,
                dead_letter_counter=tally,
                seal=seal,
            ),
            dead_letter_counter=tally,
            is_poison=refused_as_data,
            max_records=settings.kafka.max_batch_records,
            seal=seal,
            stall_after_s=settings.kafka.stall_after_s,
        )
        resender = CommandResender(
            database,
            command_signer=command_signer,
            resend_after_s=settings.ledger.command_resend_after_s,
            resend_max_s=settings.ledger.command_resend_max_s,
            poll_s=settings.ledger.command_resend_poll_s,
            on_outbox=relay.wake,
        )
        pruner = Pruner(
            database,
            inbox_after_s=settings.ledger.prune_inbox_after_s,
            outbox_after_s=settings.ledger.prune_outbox_after_s,
            batch_size=settings.ledger.prune_batch_size,
            interval_s=settings.ledger.prune_interval_s,
        )
        groups = consumer_groups(config.group_id)
        invalidation_group, ack_group = (
            config.group_id + INVALIDATION_GROUP_SUFFIX,
            config.group_id + ACK_GROUP_SUFFIX,
        )
        decisions = VerifiedRecords(
            handler,
            ProducerKeyRegistry(database, settings.ledger.node_key_cache_s),
            producer,
            group_id=invalidation_group,
            dead_letter_counter=tally,
            seal=seal,
            problem=producer_record_problem,
        )
        invalidations, acks = (
            BatchConsumer(
                config,
                groups[group_id],
                group_handler,
                group_id=group_id,
                dead_letter_counter=tally,
                is_poison=refused_as_data,
                max_records=settings.kafka.max_batch_records,
                seal=seal,
                stall_after_s=settings.kafka.stall_after_s,
            )
            for group_id, group_handler in (
                (invalidation_group, decisions),
                (
                    ack_group,
                    VerifiedRecords(
                        handler,
                        node_keys,
                        producer,
                        group_id=ack_group,
                        dead_letter_counter=tally,
                        seal=seal,
                    ),
                ),
            )
        )
        return cls(
            database,
            producer,
            tally,
            relay,
            consumer,
            invalidations,
            acks,
            erasures,
            handler,
            resender,
            pruner,
        )


async def _run_connected(
    settings: CoordinatorSettings,
    command_signer: EnvelopeSigner,
    stop: asyncio.Event,
    assigned: asyncio.Event | None,
    readiness: ConsumerReadiness | None,
) -> None:
    """One attempt of :func:`run_consumers`: BrokerUnreachable when the broker cannot be reached at
    start."""
    config = kafka_settings(settings)
    connect_timeout_s = settings.kafka.connect_timeout_s
    await _started(ensure_topics(config), connect_timeout_s)
    parts = _Parts.build(settings, config, command_signer)
    started: list[EventProducer | BatchConsumer] = []
    try:
        for part in (parts.producer, parts.consumer, parts.invalidations, parts.acks):
            try:
                await _started(part.start(), connect_timeout_s)
            except BrokerUnreachable:
                # The half-started part too: a failed start may leave connections open.
                await asyncio.gather(
                    *(each.stop() for each in (part, *reversed(started))), return_exceptions=True
                )
                started.clear()
                raise
            started.append(part)
        if readiness is not None:
            readiness.watch([parts.consumer, parts.invalidations, parts.acks])
        tasks = [
            asyncio.create_task(parts.consumer.run(), name="kv-events consumer"),
            asyncio.create_task(parts.invalidations.run(), name="invalidation consumer"),
            asyncio.create_task(parts.acks.run(), name="ack consumer"),
            asyncio.create_task(parts.relay.run(stop), name="outbox relay"),
            asyncio.create_task(
                parts.erasures.run(stop, settings.ledger.erasure_verify_interval_s),
                name="erasure verifier",
            ),
            asyncio.create_task(parts.resender.run(stop), name="command re-sender"),
            asyncio.create_task(
                parts.handler.run_releases(stop, settings.ledger.deferred_ack_poll_s),
                name="deferred-ack release",
            ),
            asyncio.create_task(
                parts.tally.run(parts.database, stop, DEAD_LETTER_FLUSH_S), name="dead-letter tally"
            ),
            asyncio.create_task(parts.pruner.run(stop), name="pruner"),
        ]
        if assigned is not None:
            tasks.append(
                asyncio.create_task(_signal_assignment(parts.consumer, assigned), name="assignment")
            )
        log.info("coordinator consumers running (group %s)", parts.consumer.group_id)
        try:
            await stop.wait()
        finally:
            if readiness is not None:
                readiness.watch([])
            await asyncio.gather(
                parts.consumer.stop(), parts.invalidations.stop(), parts.acks.stop()
            )
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            # The last decision batches handed their commands over while the relay was stopping.
            await parts.relay.finish_leased()
    finally:
        if parts.producer in started:
            await parts.producer.stop()
        await parts.database.dispose()
        log.info("coordinator consumers stopped")


async def _signal_assignment(consumer: BatchConsumer, assigned: asyncio.Event) -> None:
    while True:
        try:
            await consumer.wait_for_assignment(timeout_s=3600)
        except TimeoutError:
            continue
        assigned.set()
        return
