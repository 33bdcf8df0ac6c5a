"""Inbox and outbox pruning against the real ledger: rows past their horizon go, the rest stay, unsent never go."""

from __future__ import annotations

import uuid

import pytest
from helpers.ledger import coordinator_settings
from prometheus_client import REGISTRY
from sqlalchemy import text

from coordinator.handlers.pruning import Pruned, Pruner
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorSettings

DAY_S = 24 * 3600.0


@pytest.fixture(scope="module")
def settings(ledger_url: str) -> CoordinatorSettings:
    return coordinator_settings(ledger_url)


async def _inbox_row(database: Database, age_days: float) -> uuid.UUID:
    event_id = uuid.uuid4()
    async with database.session() as session, session.begin():
        await session.execute(
            text(
                "INSERT INTO inbox (event_id, topic, event_type, processed_at)"
                " VALUES (:id, 'kvledger.documents', 'DocumentUpdated', now() - make_interval(secs => :age_s))"
            ),
            {"id": event_id, "age_s": age_days * DAY_S},
        )
    return event_id


async def _outbox_row(database: Database, age_days: float, *, sent: bool) -> int:
    async with database.session() as session, session.begin():
        return await session.scalar(
            text(
                "INSERT INTO outbox (topic, key, payload, created_at, sent_at) VALUES ('kvledger.commands', '*', '{}',"
                " now() - make_interval(secs => :age_s),"
                " CASE WHEN :sent THEN now() - make_interval(secs => :age_s) END) RETURNING id"
            ),
            {"age_s": age_days * DAY_S, "sent": sent},
        )


def _pruned_total(table: str) -> float:
    return REGISTRY.get_sample_value("kvledger_pruned_rows_total", {"table": table}) or 0.0


async def test_rows_past_their_horizon_are_deleted_in_batches_and_the_rest_stay(
    settings: CoordinatorSettings, database: Database
) -> None:
    old_inbox = [await _inbox_row(database, 40) for _ in range(5)]
    kept_inbox = [
        await _inbox_row(database, 36),
        await _inbox_row(database, 20),
        await _inbox_row(database, 0),
    ]
    old_sent = [await _outbox_row(database, 8, sent=True) for _ in range(3)]
    kept_sent = [
        await _outbox_row(database, 6, sent=True),
        await _outbox_row(database, 0, sent=True),
    ]
    unsent = [
        await _outbox_row(database, 100, sent=False),
        await _outbox_row(database, 0, sent=False),
    ]
    ledger = settings.ledger
    pruner = Pruner(
        database,
        inbox_after_s=ledger.prune_inbox_after_s,
        outbox_after_s=ledger.prune_outbox_after_s,
        batch_size=2,
        interval_s=ledger.prune_interval_s,
    )
    inbox_before, outbox_before = _pruned_total("inbox"), _pruned_total("outbox")

    assert await pruner.prune_once() == Pruned(num_inbox_rows=5, num_outbox_rows=3)

    async with database.session() as session:
        inbox = set(await session.scalars(text("SELECT event_id FROM inbox")))
        outbox = set(await session.scalars(text("SELECT id FROM outbox")))
    assert inbox == set(kept_inbox) and not inbox & set(old_inbox)
    assert outbox == set(kept_sent) | set(unsent) and not outbox & set(old_sent)
    assert _pruned_total("inbox") - inbox_before == 5
    assert _pruned_total("outbox") - outbox_before == 3
    assert await pruner.prune_once() == Pruned(num_inbox_rows=0, num_outbox_rows=0)


def test_the_inbox_horizon_must_outlive_the_consumed_topics_retention() -> None:
    with pytest.raises(
        ValueError,
        match="prune_inbox_after_s must exceed the longest retention of a consumed topic",
    ):
        CoordinatorSettings(ledger={"prune_inbox_after_s": 30 * DAY_S})
