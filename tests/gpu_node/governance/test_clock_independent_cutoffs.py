"""Erasure cutoffs do not depend on node clocks agreeing with the database (docs/design.md §5,
"Cutoffs").

A node whose clock runs 60 s ahead of or behind the ledger database (injected as the
pool's wall clock, the clock its blocks' ``created_at`` and its command application are
read from) caches a subject's blocks; the subject is erased. Whatever the skew:

* every block of the subject built before the request is removed by the node and named
  in its ack, and the erasure turns ``verified`` only once the ledger holds none of them
  (60 s ahead, a comparison of the node's ``created_at`` with the database's cutoff
  spared them all and verified the erasure with every copy left);
* a block the subject builds after the node applied the command survives — no late-block
  re-send, nothing refused — (60 s behind, that comparison took it for one built before
  the request and had it deleted).

Real coordinator (consumers and HTTP API, own thread), real node, the session's broker
and Postgres.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    JWT_SECRET,
    SUBJECT_KEY,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
    operator_headers,
)
from helpers.node import CoordinatorThread, ServedNode, demote_to_disk, node_settings
from sqlalchemy import func, select

from bench.common import start_groups_at_end
from coordinator.consumers import consumer_groups
from coordinator.ledger.db import Database
from coordinator.ledger.models import Block, Invalidation, InvalidationTarget, Placement
from coordinator.settings import DatabaseSettings, kafka_settings
from events import schema
from events.kafka.admin import ensure_topics
from events.tiers import Tier
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.server import make_command_consumer, make_publisher
from gpu_node.metrics import NodeMetrics
from gpu_node.pool.block_pool import BlockPool
from gpu_node.settings import CacheSettings
from identity.tokens import issue_token

TIMEOUT_S = 60.0
SYSTEM = "You are the assistant of the people team. Answer briefly."
MASTER_KEY = base64.b64encode(os.urandom(32)).decode()
PLATFORM_ADMIN = operator_headers("platform-admin", "platform")


class SkewedNode(ServedNode):
    """A node as ``serve`` assembles it whose pool reads a wall clock ``skew_s`` away from the real
    one."""

    def __init__(self, settings, skew_s: float) -> None:
        super().__init__(settings)
        self.skew_s = skew_s

    def assemble(self) -> None:
        built = AsyncEngine.from_settings(self.settings)
        pool = BlockPool(
            built.runner.kv_spec,
            built.pool.config,
            built.pool.key_provider,
            wall_clock=lambda: time.time() + self.skew_s,
        )
        self.engine = AsyncEngine(built.runner, built.namespace, pool, self.settings, NodeMetrics())
        self.publisher = make_publisher(self.engine, self.settings)
        self.commands = make_command_consumer(self.engine, self.publisher, self.settings)

    async def start(self) -> SkewedNode:
        self.assemble()
        await self.engine.start(ready=False)
        await self.serve_http()
        await self.start_replay()
        await asyncio.wait_for(self.commands.replayed.wait(), TIMEOUT_S)
        return self

    async def stop(self) -> None:
        await self.http.stop()
        await self.stop_replay()
        await self.engine.stop()
        self.engine.pool.key_provider.close()

    def holdings(self, tenant: str, subject: str) -> set[tuple[str, str]]:
        return {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in self.engine.pool.ready_entries()
            if entry.provenance.tenant_id == tenant and entry.provenance.subject_id == subject
        }


@pytest.fixture
async def coordinator(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[dict]:
    """A coordinator on a fresh ledger per test: a node of an earlier test, stopped, would be a target that never acks."""
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(
            url,
            kafka_bootstrap,
            ledger={"erasure_verify_interval_s": 0.5},
            keys={"master_key": MASTER_KEY},
        )
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(kafka_bootstrap, consumer_groups(settings.kafka.group_id))
        running = await CoordinatorThread(settings).start()
        database = Database(DatabaseSettings(url=url), pre_ping=False)
        try:
            yield {"url": running.url, "database_url": url, "database": database}
        finally:
            await database.dispose()
            await running.stop()


def history(subject: str, topic: str) -> list[dict]:
    text = f"About {topic}: " + " ".join(
        f"{subject} wrote note {i}: my leave started on day {i}" for i in range(10)
    )
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {"role": "user", "content": text},
    ]


def user_token(tenant: str, subject: str) -> str:
    return issue_token(tenant=tenant, sub=subject, scopes=[], ttl_s=600, secret=JWT_SECRET)


async def live_in_ledger(database: Database, node_id: str, digest: str) -> dict[str, set[str]]:
    """Block hash → tiers of the subject's live copies on ``node_id`` the ledger records."""
    async with database.session() as session:
        rows = await session.execute(
            select(Placement.block_hash, Placement.tier)
            .join(Block, Block.block_hash == Placement.block_hash)
            .where(
                Placement.node_id == node_id,
                Placement.state == "live",
                Block.subject_hash == bytes.fromhex(digest),
            )
        )
        found: dict[str, set[str]] = {}
        for block_hash, tier in rows:
            found.setdefault(block_hash.hex(), set()).add(tier)
        return found


@pytest.mark.parametrize("skew_s", [60.0, -60.0], ids=["node-clock-ahead", "node-clock-behind"])
async def test_an_erasure_removes_every_block_built_before_it_and_spares_those_built_after_whatever_the_node_clock(
    coordinator, tiny_model_dir: Path, tmp_path, kafka_bootstrap: str, skew_s: float
):
    url, database = coordinator["url"], coordinator["database"]
    node_id = f"clock-{'ahead' if skew_s > 0 else 'behind'}-{uuid.uuid4().hex[:6]}"
    await enroll_nodes(coordinator["database_url"], [node_id])
    cache = CacheSettings(num_device_blocks=48, num_host_blocks=16, max_disk_blocks=128)
    settings = node_settings(
        node_id, tiny_model_dir, tmp_path / "node", kafka_bootstrap, cache, coordinator_url=url
    )
    node = await SkewedNode(settings, skew_s).start()
    try:
        tenant = f"acme-{uuid.uuid4().hex[:6]}"
        alice = f"alice-{uuid.uuid4().hex[:8]}"
        digest = schema.subject_digest(SUBJECT_KEY.encode(), tenant, alice)
        assert (await node.cached(user_token(tenant, alice), history(alice, "spring"))) == 0
        before = node.holdings(tenant, alice)
        assert len(before) >= 3
        # One copy on host and one on disk, so every tier the erasure must clear is covered.
        device = sorted(block for block, _ in before)
        assert await asyncio.to_thread(node.engine.pool.demote, bytes.fromhex(device[0]), Tier.HOST)
        await demote_to_disk(node.engine, device[1])
        node.engine.manager.drain_events()
        before = node.holdings(tenant, alice)
        built_before = {block for block, _ in before}
        # Her request was the first: the public system block is hers too, and goes with her.
        shared = {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in node.engine.pool.ready_entries()
            if entry.provenance.creator_subject_id == digest and entry.provenance.subject_id is None
        }
        assert shared

        async def ledger_has_them() -> bool:
            return set(await live_in_ledger(database, node_id, digest)) == built_before

        await eventually(
            ledger_has_them, timeout_s=TIMEOUT_S, what="the ledger to record the subject's blocks"
        )
        async with database.session() as session:
            skew = await session.scalar(
                select(func.max(Block.created_at) - func.now()).where(
                    Block.subject_hash == bytes.fromhex(digest)
                )
            )
        assert abs(skew - timedelta(seconds=skew_s)) < timedelta(seconds=30), (
            "the node's blocks carry its skewed clock"
        )

        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = await client.post(
                "/v1/erasures",
                json={"tenant_id": tenant, "subject_id": alice, "reason": "GDPR art. 17 request"},
                headers=operator_headers("privacy-officer", tenant),
            )
            assert started.status_code == 202, started.text
            erasure_id = started.json()["id"]

            async def status() -> str:
                return (
                    await client.get(f"/v1/erasures/{erasure_id}", headers=PLATFORM_ADMIN)
                ).json()["status"]

            async def verified() -> bool:
                return await status() == "verified"

            await eventually(verified, timeout_s=TIMEOUT_S, what="the erasure verified")

        # Verified only with every block built before the request gone, from the node and the
        # ledger, and acked as such.
        assert node.holdings(tenant, alice) == set()
        assert await live_in_ledger(database, node_id, digest) == {}
        assert not any(
            node.engine.pool.disk_path(bytes.fromhex(block)).exists() for block in built_before
        )
        async with database.session() as session:
            command_id = await session.scalar(
                select(Invalidation.command_id).where(
                    Invalidation.kind == "subject",
                    Invalidation.predicate["subject_id"].astext == digest,
                )
            )
            target = await session.get(InvalidationTarget, (command_id, node_id))
        assert target.status == "acked"
        assert {
            (block, item["tier"]) for item in target.evidence for block in item["block_hashes"]
        } == before | shared

        # Built after the node applied the command: cached, recorded, never re-sent against, still
        # served from the cache.
        await node.cached(user_token(tenant, alice), history(alice, "summer"))
        built_after = {block for block, _ in node.holdings(tenant, alice)}
        assert built_after and not built_after & built_before

        async def ledger_has_new() -> bool:
            return set(await live_in_ledger(database, node_id, digest)) == built_after

        await eventually(
            ledger_has_new, timeout_s=TIMEOUT_S, what="the ledger to record the blocks built after"
        )
        async with database.session() as session:
            resends = await session.scalar(
                select(func.count())
                .select_from(Invalidation)
                .where(Invalidation.parent_command_id == command_id)
            )
        assert resends == 0
        assert await node.cached(user_token(tenant, alice), history(alice, "summer")) > 0
        assert {block for block, _ in node.holdings(tenant, alice)} == built_after
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get(f"/v1/erasures/{erasure_id}", headers=PLATFORM_ADMIN)).json()[
                "status"
            ] == "verified"
    finally:
        await node.stop()
