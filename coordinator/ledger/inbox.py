"""The inbox: one row per applied event id, written in the transaction that applies the event.

A redelivered record (consumer restart, rebalance, a batch retried after a failure)
finds its row and is skipped, so every effect happens once (docs/design.md §5).
"""

from __future__ import annotations

import collections

from sqlalchemy import Text, Uuid, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from events.kafka.consumer import ConsumedEvent
from events.schema import Envelope

DUPLICATE = "duplicate"

_CLAIM = (
    text(
        "INSERT INTO inbox (event_id, topic, event_type)"
        " SELECT * FROM unnest(:event_ids, :topics, :types) ON CONFLICT DO NOTHING RETURNING event_id"
    )
    .bindparams(
        bindparam("event_ids", type_=ARRAY(Uuid())),
        bindparam("topics", type_=ARRAY(Text())),
        bindparam("types", type_=ARRAY(Text())),
    )
    .columns(event_id=Uuid())
)


async def claim(
    session: AsyncSession,
    events: list[ConsumedEvent],
    outcomes: collections.Counter[tuple[str, str]],
) -> list[Envelope]:
    """Inbox rows for a batch's events in one statement; returns the ones not applied before, in order.

    Every event left out (repeated within the batch, or applied by an earlier batch) is
    counted in ``outcomes`` as ``(type, "duplicate")``.
    """
    unique: dict = {}
    for event in events:
        if event.envelope.event_id in unique:
            outcomes[(event.envelope.type, DUPLICATE)] += 1
        else:
            unique[event.envelope.event_id] = event
    if not unique:
        return []
    parameters = {
        "event_ids": list(unique),
        "topics": [event.topic for event in unique.values()],
        "types": [event.envelope.type for event in unique.values()],
    }
    claimed = set((await session.scalars(_CLAIM, parameters)).all())
    fresh = []
    for event_id, event in unique.items():
        if event_id in claimed:
            fresh.append(event.envelope)
        else:
            outcomes[(event.envelope.type, DUPLICATE)] += 1
    return fresh
