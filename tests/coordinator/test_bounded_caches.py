"""The coordinator's node key cache is bounded: least recently used keys leave memory first (real
ledger)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import coordinator_settings

from coordinator.keys.node_keys import NodeKeyRegistry, enroll, revoke
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorSettings


@pytest.fixture(scope="module")
def settings(ledger_url: str) -> CoordinatorSettings:
    return coordinator_settings(ledger_url)


async def test_the_node_key_cache_keeps_only_the_most_recently_used_keys(
    database: Database,
) -> None:
    kids = []
    async with database.session() as session, session.begin():
        for node_id in ("node-a", "node-b", "node-c"):
            kids.append(
                (await enroll(session, node_id, Ed25519PrivateKey.generate().public_key())).key_id
            )
    registry = NodeKeyRegistry(database, cache_s=3600, max_cached=2)
    for kid in kids:  # a, b, c: a is the least recently used when c arrives
        assert set(await registry.lookup([kid])) == {kid}
    async with database.session() as session, session.begin():
        for node_id in ("node-a", "node-b", "node-c"):
            await revoke(session, node_id)
    # Cached keys are trusted from memory for cache_s; the evicted one is read again and found
    # revoked.
    assert set(await registry.lookup(kids)) == {kids[1], kids[2]}
