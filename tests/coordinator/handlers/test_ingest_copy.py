"""The batch handler's bulk path: blocks new to the ledger and their placements are copied in (binary ``COPY``),
known blocks go through the conflict-settling statements; the ledger must be the same either way.

Real PostgreSQL; the handler is called directly so each test chooses batch boundaries and interleavings.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import FakeNode, eventually, fresh_database, stored
from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert

from coordinator.handlers.ingest import LedgerIngest
from coordinator.ledger.db import Database
from coordinator.ledger.models import Block, Namespace, Node, Placement
from coordinator.ledger.transactions import begin_ledger_transaction, generic_plans
from coordinator.settings import DatabaseSettings
from events.kafka.consumer import ConsumedEvent
from events.schema import BlockRemoved, BlockStored, Envelope, NodeStarted, RemovedBlock
from events.topics import KV_EVENTS
from identity.signing import EnvelopeSigner


def _consumed(envelopes: Sequence[Envelope], first_offset: int = 0) -> list[ConsumedEvent]:
    return [
        ConsumedEvent(
            topic=KV_EVENTS,
            partition=0,
            offset=first_offset + i,
            key=envelope.payload.node_id,
            timestamp_ms=0,
            envelope=envelope,
        )
        for i, envelope in enumerate(envelopes)
    ]


def _ingest(database: Database) -> LedgerIngest:
    return LedgerIngest(
        database,
        inventory_retry_s=3600,
        command_signer=EnvelopeSigner(Ed25519PrivateKey.generate()),
    )


async def _ledger(database: Database) -> tuple:
    """Placement and block rows and node positions, comparable across databases (ids and times left
    out)."""
    async with database.session() as session:
        placement_rows = await session.execute(
            select(
                Placement.block_hash,
                Placement.node_id,
                Placement.tier,
                Placement.state,
                Placement.epoch,
                Placement.reason,
            )
        )
        block_rows = await session.execute(
            select(Block.block_hash, Block.namespace, Block.scope, Block.token_offset)
        )
        node_rows = await session.execute(
            select(Node.node_id, Node.epoch, Node.last_seq, Node.status)
        )
        return (
            sorted(tuple(row) for row in placement_rows),
            sorted(tuple(row) for row in block_rows),
            sorted(tuple(row) for row in node_rows),
        )


def _history(node_ids: tuple[str, str]) -> tuple[list[Envelope], list[Envelope]]:
    """(prelude, batch): the prelude stores blocks on the first node; the batch stores them again on
    the second node (known blocks) together with new ones, repeats one record (a duplicate within
    the batch), skips a seq (a gap: the node is asked for an inventory) and removes a block it
    stored in the same batch."""
    first, second = (FakeNode(None, node_id, epoch=1) for node_id in node_ids)  # type: ignore[arg-type]  # builds envelopes only
    known = [stored(f"{node_ids[0]}/known-{i}", "device") for i in range(3)]
    new = [stored(f"{node_ids[1]}/new-{i}", "device") for i in range(3)]
    prelude = [
        first.event(NodeStarted, seq=0, namespace="ns-test"),
        first.event(BlockStored, blocks=known),
    ]
    store_mixed = second.event(BlockStored, seq=1, blocks=[known[0], new[0], known[1], new[1]])
    batch = [
        second.event(NodeStarted, seq=0, namespace="ns-test"),
        store_mixed,
        store_mixed,  # the same record twice in one batch
        second.event(
            BlockStored, seq=3, blocks=[new[2], known[2].model_copy(update={"tier": "host"})]
        ),  # seq 2 never came
        second.event(
            BlockRemoved,
            seq=4,
            blocks=[RemovedBlock(block_hash=new[2].block_hash, tier="device")],
            reason="evicted",
        ),
    ]
    return prelude, batch


async def test_known_and_new_blocks_in_one_batch_build_the_ledger_of_one_event_per_batch(
    database_url: str, ledger_template: str
) -> None:
    """New blocks take the copy path, known ones the upsert; a duplicate, a gap and a removal of a
    block stored in the same batch are in the batch too. Batch boundaries must not change a single
    row."""
    node_ids = (f"node-{uuid.uuid4().hex[:8]}", f"node-{uuid.uuid4().hex[:8]}")
    prelude, batch = _history(node_ids)
    results = []
    for batches in ([prelude, batch], [prelude, *([event] for event in batch)]):
        async with fresh_database(database_url, ledger_template) as url:
            database = Database(DatabaseSettings(url=url))
            try:
                ingest, offset = _ingest(database), 0
                for events in batches:
                    await ingest(_consumed(events, offset))
                    offset += len(events)
                results.append(await _ledger(database))
            finally:
                await database.dispose()
    as_one, one_by_one = results
    assert as_one == one_by_one
    placement_rows, block_rows, node_rows = as_one
    assert len(block_rows) == 6
    second_node = {
        (h.hex(), tier, state, reason)
        for h, node, tier, state, _, reason in placement_rows
        if node == node_ids[1]
    }
    assert second_node == {
        (stored(f"{node_ids[0]}/known-0", "device").block_hash, "device", "live", None),
        (stored(f"{node_ids[0]}/known-1", "device").block_hash, "device", "live", None),
        (stored(f"{node_ids[0]}/known-2", "device").block_hash, "host", "live", None),
        (stored(f"{node_ids[1]}/new-0", "device").block_hash, "device", "live", None),
        (stored(f"{node_ids[1]}/new-1", "device").block_hash, "device", "live", None),
        (stored(f"{node_ids[1]}/new-2", "device").block_hash, "device", "deleted", "evicted"),
    }
    assert (node_ids[1], 1, 4, "reconciling") in node_rows  # the gap was seen


async def test_block_inserted_by_a_concurrent_transaction_falls_back_to_the_conflict_path(
    database_url: str, ledger_template: str
) -> None:
    """Another replica inserts one of the batch's new blocks after the batch looked its blocks up and before it
    copies them: the copy waits for that transaction, fails on the key once it commits, is rolled back to its
    savepoint, and the batch inserts its blocks with ``ON CONFLICT DO NOTHING`` instead — nothing lost, nothing twice."""
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    node = FakeNode(None, node_id, epoch=1)  # type: ignore[arg-type]  # builds envelopes only
    contested, own = stored(f"{node_id}/contested", "device"), stored(f"{node_id}/own", "device")
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url))
        try:
            ingest = _ingest(database)
            await ingest(_consumed([node.event(NodeStarted, seq=0, namespace="ns-test")]))
            async with database.session() as other, other.begin():
                await other.execute(
                    pg_insert(Namespace).values(namespace="ns-test").on_conflict_do_nothing()
                )
                await other.execute(
                    pg_insert(Block).values(
                        block_hash=bytes.fromhex(contested.block_hash),
                        namespace="ns-test",
                        scope="public",
                        token_offset=0,
                        created_at=contested.created_at,
                    )
                )
                batch = asyncio.create_task(
                    ingest(_consumed([node.event(BlockStored, blocks=[own, contested])], 1))
                )

                async def copy_waits() -> bool:
                    async with database.session() as session:
                        waiting = await session.scalar(
                            text(
                                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                " AND wait_event_type = 'Lock' AND query LIKE 'COPY%blocks%'"
                            )
                        )
                        return waiting == 1

                await eventually(
                    copy_waits, what="the batch's COPY to wait for the other transaction's block"
                )
            await asyncio.wait_for(batch, 30)
            async with database.session() as session:
                rows = (
                    await session.execute(
                        select(Placement.block_hash, Placement.tier, Placement.state).where(
                            Placement.node_id == node_id
                        )
                    )
                ).all()
                num_blocks = await session.scalar(select(func.count()).select_from(Block))
            assert sorted((h.hex(), tier, state) for h, tier, state in rows) == sorted(
                [(contested.block_hash, "device", "live"), (own.block_hash, "device", "live")]
            )
            assert num_blocks == 2
        finally:
            await database.dispose()


async def test_bulk_writes_run_with_default_plan_caching_and_the_rest_with_custom_plans(
    database_url: str, ledger_template: str
) -> None:
    """A ledger transaction forces custom plans (array statements need them); the bulk writes switch to
    PostgreSQL's default for their foreign-key checks and switch back, so the statements after them do not."""
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url))
        try:
            async with database.session() as session, session.begin():

                async def mode() -> str:
                    return await session.scalar(text("SELECT current_setting('plan_cache_mode')"))

                await begin_ledger_transaction(session)
                assert await mode() == "force_custom_plan"
                async with generic_plans(session):
                    assert await mode() == "auto"
                assert await mode() == "force_custom_plan"
        finally:
            await database.dispose()
