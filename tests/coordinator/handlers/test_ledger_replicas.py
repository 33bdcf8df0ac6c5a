"""Two coordinator replicas in one consumer group share the kv-events partitions and the outbox.

Each replica is a full ``run_consumers`` (consumer + outbox relay) on the same ledger.
The ledger must come out exactly as from one replica, every InventoryRequested must
be published exactly once (outbox rows claimed with SKIP LOCKED), and when one replica
leaves, the other takes over its partitions without losing or double-applying events.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import AsyncIterator

import pytest
from helpers.ledger import (
    RunningConsumers,
    SigningProducer,
    coordinator_settings,
    eventually,
    fresh_database,
    read_topic,
    stored,
)
from sqlalchemy import func, select

from coordinator.ledger.db import Database
from coordinator.ledger.models import Node, OutboxEntry, Placement
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.schema import (
    BlockRemoved,
    BlockStored,
    EventValidationError,
    InventoryRequested,
    NodeStarted,
    RemovedBlock,
    make_event,
    parse_event,
)
from events.topics import COMMANDS

NUM_NODES = 12


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap, ledger={"inventory_retry_s": 3600})


async def _last_seqs(database: Database, node_ids: list[str]) -> dict[str, int]:
    async with database.session() as session:
        rows = await session.execute(
            select(Node.node_id, Node.last_seq).where(Node.node_id.in_(node_ids))
        )
        return dict(rows.all())


async def _live(database: Database, node_ids: list[str]) -> dict[str, set[str]]:
    async with database.session() as session:
        rows = await session.execute(
            select(Placement.node_id, Placement.block_hash).where(
                Placement.node_id.in_(node_ids), Placement.state == "live"
            )
        )
        live: dict[str, set[str]] = collections.defaultdict(set)
        for node_id, block_hash in rows:
            live[node_id].add(block_hash.hex())
        return live


async def _inventory_requests(bootstrap: str, node_ids: set[str]) -> list[InventoryRequested]:
    """Every InventoryRequested for ``node_ids`` on the commands topic.

    Called once the outbox rows are marked sent, i.e. after the broker acknowledged the
    records, so reading the topic up to its end sees all of them.
    """
    found: list[InventoryRequested] = []
    for record in await read_topic(bootstrap, COMMANDS):
        try:
            payload = parse_event(record.value).payload
        except EventValidationError:
            continue  # shared topics hold malformed records other tests put there on purpose
        if isinstance(payload, InventoryRequested) and payload.node_id in node_ids:
            found.append(payload)
    return found


async def test_two_replicas_share_the_work_exactly_once(settings: CoordinatorSettings) -> None:
    first, second = RunningConsumers(settings), RunningConsumers(settings)
    first.launch()
    second.launch()
    database = Database(settings.database)
    try:
        await first.wait_assigned()
        await second.wait_assigned()
        prefix = uuid.uuid4().hex[:6]
        node_ids = [f"replica-{prefix}-{i}" for i in range(NUM_NODES)]
        gapped = set(node_ids[::2])
        expected: dict[str, set[str]] = {}
        async with SigningProducer(
            kafka_settings(settings), settings.database.url.get_secret_value()
        ) as producer:
            envelopes = []
            for node_id in node_ids:
                blocks = [stored(f"{node_id}/{i}", "device") for i in range(3)]
                removed = RemovedBlock(block_hash=blocks[0].block_hash, tier="device")
                after_removal = 4 if node_id in gapped else 3  # seq 3 "lost" for half the nodes
                envelopes += [
                    make_event(NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-test")),
                    make_event(BlockStored(node_id=node_id, epoch=1, seq=1, blocks=blocks[:2])),
                    make_event(BlockStored(node_id=node_id, epoch=1, seq=2, blocks=blocks[2:])),
                    make_event(
                        BlockRemoved(
                            node_id=node_id,
                            epoch=1,
                            seq=after_removal,
                            blocks=[removed],
                            reason="evicted",
                        )
                    ),
                ]
                expected[node_id] = {block.block_hash for block in blocks[1:]}
            await producer.send_many(envelopes)

            async def all_applied() -> bool:
                seqs = await _last_seqs(database, node_ids)
                return all(seqs.get(n) == (4 if n in gapped else 3) for n in node_ids)

            await eventually(all_applied, timeout_s=60, what="every node's events to be applied")
            assert await _live(database, node_ids) == expected

            async def outbox_drained() -> bool:
                async with database.session() as session:
                    rows = (
                        await session.scalars(
                            select(OutboxEntry).where(OutboxEntry.key.in_(node_ids))
                        )
                    ).all()
                return len(rows) == len(gapped) and all(row.sent_at is not None for row in rows)

            await eventually(outbox_drained, what="both relays to drain the outbox")
            requests = await _inventory_requests(settings.kafka.bootstrap, set(node_ids))
            assert collections.Counter(r.node_id for r in requests) == dict.fromkeys(gapped, 1)

            # One replica leaves; the survivor takes over every partition and nothing is lost.
            await first.stop()
            more = []
            for node_id in node_ids:
                block = stored(f"{node_id}/late", "host")
                seq = 5 if node_id in gapped else 4
                more.append(
                    make_event(BlockStored(node_id=node_id, epoch=1, seq=seq, blocks=[block]))
                )
                expected[node_id].add(block.block_hash)
            await producer.send_many(more)

            async def survivor_applied() -> bool:
                seqs = await _last_seqs(database, node_ids)
                return all(seqs.get(n) == (5 if n in gapped else 4) for n in node_ids)

            await eventually(
                survivor_applied, timeout_s=60, what="the surviving replica to apply the new events"
            )
            assert await _live(database, node_ids) == expected
            async with database.session() as session:
                num_outbox = await session.scalar(
                    select(func.count())
                    .select_from(OutboxEntry)
                    .where(OutboxEntry.key.in_(node_ids))
                )
            assert num_outbox == len(gapped)  # no new gaps: the takeover replayed nothing as a hole
    finally:
        for replica in (first, second):
            if not replica.task.done():
                await replica.stop()
        await database.dispose()
