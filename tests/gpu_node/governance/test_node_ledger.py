"""Real nodes → real broker → real coordinator consumers → real Postgres: the ledger is exact."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import pytest
from helpers.ledger import (
    RunningConsumers,
    connect,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
)
from helpers.node import NodeServices, node_settings

from gpu_node.engine.async_engine import AsyncEngine, GenerationRequest, SamplingParams
from gpu_node.settings import CacheSettings, NodeSettings
from prefix_keys.blocks import CacheScope, DocumentRef, Principal
from prefix_keys.prompt import ChatMessage

PRINCIPALS = [
    Principal("acme", "alice", frozenset({"hr"}), {"hr": 1}),
    Principal("acme", "carol", frozenset({"hr"}), {"hr": 1}),
    Principal("globex", "bob", frozenset({"hr"}), {"hr": 2}),
]
WORDS = "ledger block tier node tenant handbook policy document cache prefix".split()


def text(num_words: int, seed: int) -> str:
    return " ".join(
        f"{WORDS[(seed + i) % len(WORDS)]}{(seed * 31 + i) % 53}" for i in range(num_words)
    )


def random_messages(rng: random.Random) -> list[ChatMessage]:
    """A few shared prefixes (so requests hit and share) and fresh tails (so pools overflow)."""
    messages = [ChatMessage("system", text(30, rng.randrange(3)), CacheScope.PUBLIC)]
    if rng.random() < 0.6:
        messages.append(
            ChatMessage(
                "user",
                text(40, rng.randrange(4)),
                CacheScope.TENANT,
                DocumentRef(f"doc-{rng.randrange(3)}", 1, "hr"),
            )
        )
    messages.append(
        ChatMessage("user", text(rng.randrange(5, 40), rng.randrange(10_000)), CacheScope.USER)
    )
    return messages


async def generate(engine: AsyncEngine, messages, principal) -> None:
    request = GenerationRequest(
        uuid.uuid4().hex, tuple(messages), SamplingParams(max_tokens=1), principal
    )
    async for _ in engine.generate(request):
        pass


def settings_for(
    node_id: str, model_dir: Path, data_dir: Path, kafka_bootstrap: str
) -> NodeSettings:
    # small tiers so a few hundred requests evict and demote through every tier
    cache = CacheSettings(num_device_blocks=24, num_host_blocks=24, max_disk_blocks=48)
    return node_settings(node_id, model_dir, data_dir, kafka_bootstrap, cache)


class Node(NodeServices):
    def __init__(self, settings: NodeSettings) -> None:
        super().__init__(settings)
        self.assemble()

    async def start(self) -> Node:
        await self.engine.start(ready=False)
        await self.start_replay()
        await asyncio.wait_for(self.commands.replayed.wait(), 60)
        return self

    async def stop(self) -> None:
        await self.stop_replay()
        await self.engine.stop()

    def inventory(self) -> set[tuple[str, str]]:
        """What the node itself holds: (block hash, tier) with snapshots as ``snapshot:<id>``."""
        held = {
            (entry.block_hash.hex(), entry.tier.value) for entry in self.engine.pool.ready_entries()
        }
        for snapshot_id, keys in self.engine.snapshot_inventory().items():
            held.update((key.block_hash.hex(), f"snapshot:{snapshot_id}") for key in keys)
        return held


async def ledger_placements(database_url: str, node_id: str) -> set[tuple[str, str]]:
    connection = await connect(database_url)
    try:
        rows = await connection.fetch(
            "SELECT block_hash, tier, snapshot_id FROM placements WHERE node_id = $1 AND state = 'live'",
            node_id,
        )
    finally:
        await connection.close()
    return {
        (
            bytes(row["block_hash"]).hex(),
            row["tier"] if row["snapshot_id"] is None else f"snapshot:{row['snapshot_id']}",
        )
        for row in rows
    }


@pytest.fixture(scope="module")
async def coordinator(database_url, ledger_template, kafka_bootstrap):
    """One coordinator for the module's tests (each plays nodes of its own); yields its ledger's
    URL."""
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(url, kafka_bootstrap)
        consumers = await RunningConsumers(settings).start()
        yield url
        await consumers.stop()


async def test_ledger_equals_every_node_inventory_after_random_traffic(
    coordinator, kafka_bootstrap, tiny_model_dir, tmp_path
):
    suffix = uuid.uuid4().hex[:6]
    node_ids = [f"n{i}-{suffix}" for i in range(2)]
    await enroll_nodes(coordinator, node_ids)
    nodes = [
        await Node(
            settings_for(node_id, tiny_model_dir, tmp_path / node_id, kafka_bootstrap)
        ).start()
        for node_id in node_ids
    ]
    try:
        rng = random.Random(7)
        for _ in range(240):
            node = rng.choice(nodes)
            await generate(node.engine, random_messages(rng), rng.choice(PRINCIPALS))
        for node in nodes:
            stats = node.engine.pool.stats()
            assert stats.num_evictions > 0 and stats.num_demotions > 0, (
                "traffic must exercise eviction and demotion"
            )
            await node.publisher.flush()
        for node in nodes:
            expected = node.inventory()
            assert expected
            await eventually(
                lambda node=node, expected=expected: _equal(
                    coordinator, node.settings.node_id, expected
                ),
                timeout_s=60,
                what=f"ledger == inventory of {node.settings.node_id}",
            )
    finally:
        for node in nodes:
            await node.stop()


async def _equal(database_url: str, node_id: str, expected: set[tuple[str, str]]) -> bool:
    return await ledger_placements(database_url, node_id) == expected


async def test_node_restart_drops_memory_placements_and_keeps_verified_disk(
    coordinator, kafka_bootstrap, tiny_model_dir, tmp_path
):
    node_id = f"restart-{uuid.uuid4().hex[:6]}"
    settings = settings_for(node_id, tiny_model_dir, tmp_path / "node", kafka_bootstrap)
    await enroll_nodes(coordinator, [node_id])
    node = await Node(settings).start()
    rng = random.Random(11)
    try:
        for _ in range(40):
            await generate(node.engine, random_messages(rng), rng.choice(PRINCIPALS))
        await node.engine.write_snapshot()
        await node.publisher.flush()
        before = node.inventory()
        assert {tier.split(":")[0] for _, tier in before} == {"device", "host", "disk", "snapshot"}
        await eventually(
            lambda: _equal(coordinator, node_id, before), timeout_s=60, what="ledger before restart"
        )
    finally:
        await node.stop()

    restarted = await Node(settings).start()
    try:
        # device and host bytes died with the process; disk and snapshot copies survive
        survivors = {
            (block, tier)
            for block, tier in before
            if tier == "disk" or tier.startswith("snapshot:")
        }
        assert restarted.inventory() == survivors
        assert restarted.publisher.epoch == node.publisher.epoch + 1
        await eventually(
            lambda: _equal(coordinator, node_id, survivors),
            timeout_s=60,
            what="ledger after restart",
        )
    finally:
        await restarted.stop()
