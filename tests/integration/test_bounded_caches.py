"""The coordinator's node key cache is bounded: least recently used keys leave memory first (real ledger)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ledger_helpers import COMMAND_SIGNING_KEY, fresh_database

from coordinator import migrate
from coordinator.db import Database
from coordinator.node_keys import NodeKeyRegistry, enroll, revoke
from coordinator.settings import CoordinatorSettings


@pytest.fixture(scope="module")
async def settings(database_url: str, kafka_bootstrap: str) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        yield CoordinatorSettings(
            database={"url": url}, kafka={"bootstrap": kafka_bootstrap}, ledger={"command_signing_key": COMMAND_SIGNING_KEY}
        )


async def test_the_node_key_cache_keeps_only_the_most_recently_used_keys(database: Database) -> None:
    kids = []
    async with database.session() as session, session.begin():
        for node_id in ("node-a", "node-b", "node-c"):
            kids.append((await enroll(session, node_id, Ed25519PrivateKey.generate().public_key())).key_id)
    registry = NodeKeyRegistry(database, cache_s=3600, max_cached=2)
    for kid in kids:  # a, b, c: a is the least recently used when c arrives
        assert set(await registry.lookup([kid])) == {kid}
    async with database.session() as session, session.begin():
        for node_id in ("node-a", "node-b", "node-c"):
            await revoke(session, node_id)
    # Cached keys are trusted from memory for cache_s; the evicted one is read again and found revoked.
    assert set(await registry.lookup(kids)) == {kids[1], kids[2]}
