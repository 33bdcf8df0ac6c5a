"""The outbox relay against the real ledger and broker: a batch is stamped sent only once all of it was published."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka.errors import KafkaConnectionError
from helpers.ledger import (
    COMMAND_KEY,
    coordinator_settings,
    fresh_database,
    scan_topic,
    sign_command,
)
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from coordinator.handlers.outbox import OutboxRelay, outbox_row
from coordinator.ledger.db import Database
from coordinator.ledger.models import OutboxEntry
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.codec import decode_event
from events.kafka.producer import EventProducer
from events.schema import DocumentPredicate, Invalidate, make_event
from events.topics import COMMANDS
from identity.signing import verify_envelope

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap)


class _LostMidBatch(EventProducer):
    """Publishes a batch's first envelope, then fails as a connection lost in the middle of a batch
    does."""

    async def send_many(self, envelopes):
        await super().send_many(list(envelopes)[:1])
        raise KafkaConnectionError("connection to the broker lost")


def _commands(tenant: str, num_commands: int) -> list:
    now = datetime.now(UTC)
    return [
        sign_command(
            make_event(
                Invalidate(
                    command_id=uuid.uuid4(),
                    predicate=DocumentPredicate(tenant=tenant, doc_id=f"doc-{i}", below_version=2),
                    cutoff=now,
                ),
                tenant_id=tenant,
            )
        )
        for i in range(num_commands)
    ]


async def _sent_at(database: Database, ids: list[int]) -> list[datetime | None]:
    async with database.session() as session:
        rows = await session.execute(
            select(OutboxEntry.id, OutboxEntry.sent_at).where(OutboxEntry.id.in_(ids))
        )
        return [sent_at for _, sent_at in sorted(rows.all())]


async def test_a_batch_that_cannot_be_published_stays_unsent_and_is_relayed_in_order_later(
    database: Database, settings: CoordinatorSettings, unique_name: str
) -> None:
    commands = _commands(unique_name, 3)
    async with database.session() as session, session.begin():
        ids = (
            await session.scalars(
                pg_insert(OutboxEntry)
                .values([outbox_row(command) for command in commands])
                .returning(OutboxEntry.id)
            )
        ).all()

    async with _LostMidBatch(kafka_settings(settings)) as failing:
        with pytest.raises(KafkaConnectionError):
            await OutboxRelay(database, failing, batch_size=10, poll_s=1.0).relay_once()
    assert await _sent_at(database, ids) == [None, None, None]

    async with EventProducer(kafka_settings(settings)) as producer:
        relay = OutboxRelay(database, producer, batch_size=2, poll_s=1.0)
        assert [await relay.relay_once() for _ in range(3)] == [2, 1, 0]
    assert None not in await _sent_at(database, ids)

    command_ids = [command.payload.command_id for command in commands]
    # At least once: the record published before the failure is published again with its batch
    # (nodes absorb the repeat by command id). One tenant's commands share a key, hence a
    # partition, so their order is the outbox's id order.
    expected = command_ids[:1] + command_ids
    published: list[uuid.UUID] = []

    def visit(record) -> bool:
        envelope = decode_event(record.value)
        if isinstance(envelope.payload, Invalidate) and envelope.payload.command_id in command_ids:
            # The relay publishes the signed bytes the decision wrote; nodes verify them against the
            # pinned key.
            assert verify_envelope(envelope, COMMAND_KEY.public_key())
            published.append(envelope.payload.command_id)
        return len(published) == len(expected)

    await scan_topic(settings.kafka.bootstrap, COMMANDS, visit)
    assert published == expected


async def _insert_leased(database: Database, commands: list, lease: timedelta) -> list[int]:
    async with database.session() as session, session.begin():
        return list(
            (
                await session.scalars(
                    pg_insert(OutboxEntry)
                    .values(
                        [
                            {**outbox_row(command), "lease_until": func.now() + lease}
                            for command in commands
                        ]
                    )
                    .returning(OutboxEntry.id)
                )
            ).all()
        )


async def _published_in_order(
    settings: CoordinatorSettings, command_ids: list[uuid.UUID]
) -> list[uuid.UUID]:
    published: list[uuid.UUID] = []

    def visit(record) -> bool:
        payload = decode_event(record.value).payload
        if isinstance(payload, Invalidate) and payload.command_id in command_ids:
            published.append(payload.command_id)
        return len(published) >= len(command_ids)

    await scan_topic(settings.kafka.bootstrap, COMMANDS, visit)
    return published


async def test_leased_rows_are_published_from_memory_in_order_then_stamped_sent(
    database: Database, settings: CoordinatorSettings, unique_name: str
) -> None:
    commands = _commands(unique_name, 4)
    ids = await _insert_leased(database, commands, timedelta(hours=1))
    async with EventProducer(kafka_settings(settings)) as producer:
        relay = OutboxRelay(database, producer, batch_size=10, poll_s=1.0)
        relay.publish_leased(list(zip(ids[:2], commands[:2], strict=True)))
        relay.publish_leased(list(zip(ids[2:], commands[2:], strict=True)))
        await relay.finish_leased()
        assert None not in await _sent_at(database, ids)
        assert await relay.relay_once() == 0
    command_ids = [command.payload.command_id for command in commands]
    assert await _published_in_order(settings, command_ids) == command_ids


async def test_a_leased_row_its_process_failed_to_publish_is_relayed_once_the_lease_ran_out(
    database: Database, settings: CoordinatorSettings, unique_name: str
) -> None:
    (command,) = _commands(unique_name, 1)
    ids = await _insert_leased(database, [command], timedelta(hours=1))
    async with _LostMidBatch(kafka_settings(settings)) as failing:
        relay = OutboxRelay(database, failing, batch_size=10, poll_s=1.0)
        relay.publish_leased(list(zip(ids, [command], strict=True)))
        await relay.finish_leased()
    assert await _sent_at(database, ids) == [None]
    async with EventProducer(kafka_settings(settings)) as producer:
        relay = OutboxRelay(database, producer, batch_size=10, poll_s=1.0)
        assert await relay.relay_once() == 0, (
            "a leased row belongs to its process until the lease ran out"
        )
        async with database.session() as session, session.begin():
            await session.execute(
                update(OutboxEntry)
                .where(OutboxEntry.id.in_(ids))
                .values(lease_until=func.now() - timedelta(seconds=1))
            )
        assert await relay.relay_once() == 1
    assert None not in await _sent_at(database, ids)
    # The failing producer got the record out before failing: published twice, absorbed by command
    # id.
    published = await _published_in_order(settings, [command.payload.command_id] * 2)
    assert published == [command.payload.command_id] * 2
