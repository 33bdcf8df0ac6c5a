"""Demotion alone: the LRU unreferenced victim moves one tier down, the chain device → host → disk →
drop."""

from __future__ import annotations

import pytest
import torch
from helpers.pool import block_hash, lru_order, make_kv, make_state, placed, put, scoped_key

from events.tiers import Tier
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.vocabulary import MovedInPool, RemovalReason, RemovedFromPool
from prefix_keys.blocks import CacheScope

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def test_make_room_moves_the_least_recently_used_block_down_and_reports_it(tmp_path):
    state = make_state(tmp_path, device=2, host=2)
    for i in range(2):
        put(state, i)
    state.lru[DEVICE].touch(state.entries[block_hash(0)])  # block 1 is now the LRU one
    assert PoolDemoter(state).make_room(DEVICE) is True
    assert placed(state) == {0: (DEVICE, 0), 1: (HOST, 0)}
    assert torch.equal(state.memory[HOST].table[0], make_kv(1))
    assert torch.count_nonzero(state.memory[DEVICE].table[1]) == 0 and state.memory[
        DEVICE
    ].free == [1]
    assert state.events == [MovedInPool(block_hash(1), DEVICE, HOST)]
    assert (state.num_demotions, lru_order(state, HOST)) == (1, [1])


def test_make_room_skips_referenced_blocks(tmp_path):
    state = make_state(tmp_path, device=3, host=1)
    put(state, 0, ref_count=1)
    put(state, 1, ref_count=2)
    put(state, 2)
    assert PoolDemoter(state).make_room(DEVICE) is True
    assert placed(state) == {0: (DEVICE, 0), 1: (DEVICE, 1), 2: (HOST, 0)}


def test_make_room_refuses_when_every_block_of_the_full_tier_is_referenced(tmp_path):
    state = make_state(tmp_path, device=2, host=2)
    put(state, 0, ref_count=1)
    put(state, 1, ref_count=1)
    assert PoolDemoter(state).make_room(DEVICE) is False
    assert placed(state) == {0: (DEVICE, 0), 1: (DEVICE, 1)} and state.events == []


def test_room_is_made_down_the_chain_and_the_last_tier_drops_its_victim(tmp_path):
    state = make_state(tmp_path, device=1, host=1)
    put(state, 0, HOST)
    put(state, 1)
    assert PoolDemoter(state).make_room(DEVICE) is True
    assert placed(state) == {1: (HOST, 0)}
    assert [type(event) for event in state.events] == [RemovedFromPool, MovedInPool]
    dropped, moved = state.events
    assert (dropped.block_hash, dropped.tier, dropped.reason, dropped.evidence.verified) == (
        block_hash(0),
        HOST,
        RemovalReason.EVICTED,
        True,
    )
    assert moved == MovedInPool(block_hash(1), DEVICE, HOST)
    assert (state.num_evictions, state.num_demotions) == (1, 1)


def test_a_tier_without_capacity_is_skipped_on_the_way_down(tmp_path):
    state = make_state(tmp_path, device=1, host=0, disk=2)
    put(state, 0)
    assert PoolDemoter(state).make_room(DEVICE) is True
    assert placed(state) == {0: (DISK, None)} and state.disk.path(block_hash(0)).exists()
    assert state.events == [MovedInPool(block_hash(0), DEVICE, DISK)]


class NoKeys:
    """A key provider with no data key for any scope: tenant and user blocks cannot be sealed."""

    def key_for(self, provenance):
        return None

    def key_by_id(self, key_id):
        return None


def test_a_block_that_cannot_be_sealed_for_disk_is_dropped_instead(tmp_path):
    state = make_state(tmp_path, device=1, host=0, disk=2, keys=NoKeys())
    put(state, 0, key=scoped_key(0, CacheScope.TENANT))
    assert PoolDemoter(state).make_room(DEVICE) is True
    assert placed(state) == {} and list(state.disk.directory.iterdir()) == []
    assert [(event.block_hash, event.tier, event.reason) for event in state.events] == [
        (block_hash(0), DEVICE, RemovalReason.EVICTED)
    ]


def test_demote_moves_an_unreferenced_block_down_only(tmp_path):
    state = make_state(tmp_path, device=2, host=1, disk=1)
    put(state, 0)
    put(state, 1, ref_count=1)
    demoter = PoolDemoter(state)
    assert demoter.demote(block_hash(1), HOST) is False  # referenced
    assert demoter.demote(block_hash(9), HOST) is False  # absent
    assert demoter.demote(block_hash(0), DISK) is True
    assert demoter.demote(block_hash(0), HOST) is False  # that would be up
    assert placed(state) == {0: (DISK, None), 1: (DEVICE, 1)}
    with pytest.raises(ValueError, match="device tier"):
        demoter.demote(block_hash(0), DEVICE)
    with pytest.raises(ValueError, match="host or disk"):
        demoter.demote(block_hash(0), Tier.SNAPSHOT)
