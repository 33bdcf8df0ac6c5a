"""The cache manager's pool-event fan-out: named subscribers, one batch for all, in order, failures
isolated."""

from __future__ import annotations

import logging

import pytest
from helpers.pool import NO_TTL, NS, SPEC, FakeClock, block_hash, block_key, make_kv

from events.tiers import Tier
from gpu_node.cache.kv_cache_manager import KVCacheManager
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.metrics import NodeMetrics
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.vocabulary import (
    METHOD_ZERO_FILL,
    MovedInPool,
    PoolConfig,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
)
from prefix_keys.blocks import CacheProvenance, CacheScope

PUBLIC_PROVENANCE = CacheProvenance(NS, None, CacheScope.PUBLIC, (), None, (), 0.0)


@pytest.fixture
def manager(tmp_path) -> KVCacheManager:
    config = PoolConfig(
        namespace=NS,
        num_device_blocks=1,
        num_host_blocks=1,
        max_disk_blocks=0,
        disk_dir=None,
        ttl_s=NO_TTL,
    )
    pool = BlockPool(SPEC, config, LocalKeyStore(tmp_path / "keys.json"), clock=FakeClock(1000.0))
    return KVCacheManager(pool, NodeMetrics())


def store(pool: BlockPool, i: int) -> None:
    entry = pool.begin_build(block_key(i, PUBLIC_PROVENANCE))
    assert entry is not None and pool.commit_build(entry, make_kv(i))


def churn(manager: KVCacheManager) -> list:
    """Store block 0, store block 1 (demoting 0 to host), evict 0: the pool events that causes, in
    order."""
    store(manager.pool, 0)
    store(manager.pool, 1)
    assert manager.pool.evict(block_hash(0))
    return [
        StoredInPool(block_key(0, PUBLIC_PROVENANCE), Tier.DEVICE),
        MovedInPool(block_hash(0), Tier.DEVICE, Tier.HOST),
        StoredInPool(block_key(1, PUBLIC_PROVENANCE), Tier.DEVICE),
        RemovedFromPool(
            block_hash(0),
            Tier.HOST,
            RemovalReason.EVICTED,
            RemovalEvidence(block_hash(0), Tier.HOST, METHOD_ZERO_FILL, False, True),
        ),
    ]


def failures(manager: KVCacheManager, name: str) -> float:
    return (
        manager.metrics.registry.get_sample_value(
            "kvledger_pool_event_subscriber_failures_total", {"subscriber": name}
        )
        or 0.0
    )


def test_every_subscriber_receives_the_same_batch_in_pool_order(manager):
    calls: list[tuple[str, tuple]] = []
    manager.subscribe("first", lambda events: calls.append(("first", tuple(events))))
    manager.subscribe("second", lambda events: calls.append(("second", tuple(events))))
    expected = churn(manager)

    drained = manager.drain_events()

    assert drained == tuple(expected)
    assert calls == [("first", drained), ("second", drained)]
    assert manager.drain_events() == ()
    assert len(calls) == 2, "an empty drain reaches no subscriber"


def test_a_failing_subscriber_is_logged_and_counted_and_the_others_still_receive(manager, caplog):
    received: list = []

    def broken(events) -> None:
        raise RuntimeError(f"cannot take {events[0]}")

    manager.subscribe("broken", broken)
    manager.subscribe("evidence", received.extend)
    churn(manager)

    with caplog.at_level(logging.ERROR, logger="gpu_node.cache.kv_cache_manager"):
        drained = manager.drain_events()

    assert received == list(drained) and len(drained) == 4
    assert failures(manager, "broken") == 1.0
    assert failures(manager, "evidence") == 0.0
    (record,) = caplog.records
    assert record.getMessage() == "pool-event subscriber 'broken' failed on 4 events: RuntimeError"
    assert block_hash(0).hex() not in caplog.text, "the failure names no block"

    store(manager.pool, 2)
    manager.drain_events()
    assert failures(manager, "broken") == 2.0, (
        "a failing subscriber stays subscribed and is counted each time"
    )
    assert received[-1] == StoredInPool(block_key(2, PUBLIC_PROVENANCE), Tier.DEVICE)


def test_subscriptions_are_named_once_and_an_unsubscribed_one_receives_nothing_more(manager):
    gone: list = []
    kept: list = []
    manager.subscribe("gone", gone.extend)
    manager.subscribe("kept", kept.extend)
    with pytest.raises(ValueError, match="already subscribed"):
        manager.subscribe("gone", kept.extend)
    with pytest.raises(ValueError, match="needs a name"):
        manager.subscribe("", kept.extend)

    store(manager.pool, 0)
    manager.drain_events()
    manager.unsubscribe("gone")
    with pytest.raises(ValueError, match="no pool-event subscriber named 'gone'"):
        manager.unsubscribe("gone")
    store(manager.pool, 1)
    manager.drain_events()

    assert gone == [StoredInPool(block_key(0, PUBLIC_PROVENANCE), Tier.DEVICE)]
    assert kept == [
        StoredInPool(block_key(0, PUBLIC_PROVENANCE), Tier.DEVICE),
        MovedInPool(block_hash(0), Tier.DEVICE, Tier.HOST),
        StoredInPool(block_key(1, PUBLIC_PROVENANCE), Tier.DEVICE),
    ]
