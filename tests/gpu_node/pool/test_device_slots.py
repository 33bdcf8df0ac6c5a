"""Sequences' own device slots alone: allocation (making room), freeing (zeroed) and committing in
place."""

from __future__ import annotations

import pytest
import torch
from helpers.pool import block_hash, building, make_kv, make_state, placed, put

from events.tiers import Tier
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.device_slots import DeviceSlots
from gpu_node.pool.vocabulary import BlockState, MovedInPool, RemovalReason, StoredInPool

DEVICE, HOST = Tier.DEVICE, Tier.HOST


def slots_of(state) -> DeviceSlots:
    return DeviceSlots(state, PoolDemoter(state))


def test_allocation_takes_the_lowest_free_slots_and_counts_them_in_use(tmp_path):
    state = make_state(tmp_path, device=4)
    put(state, 0)
    slots = slots_of(state)
    assert slots.allocate(2) == [1, 2]
    assert slots.usage() == (3, 4)
    assert slots.allocate(0) == []
    with pytest.raises(ValueError, match=">= 0"):
        slots.allocate(-1)


def test_allocation_demotes_cached_blocks_in_lru_order_or_takes_nothing(tmp_path):
    state = make_state(tmp_path, device=3, host=3)
    put(state, 0)
    put(state, 1, ref_count=1)
    put(state, 2)
    slots = slots_of(state)
    assert slots.allocate(3) is None  # block 1 is held: only two slots can be made
    assert placed(state) == {0: (DEVICE, 0), 1: (DEVICE, 1), 2: (DEVICE, 2)} and state.events == []
    assert slots.allocate(2) == [0, 2]
    assert state.events == [
        MovedInPool(block_hash(0), DEVICE, HOST),
        MovedInPool(block_hash(2), DEVICE, HOST),
    ]
    assert placed(state) == {0: (HOST, 0), 1: (DEVICE, 1), 2: (HOST, 1)}


def test_freed_slots_are_zeroed_and_given_out_again(tmp_path):
    state = make_state(tmp_path, device=3)
    slots = slots_of(state)
    taken = slots.allocate(3)
    for slot in taken:
        state.memory[DEVICE].write(slot, make_kv(slot))
    slots.free([2, 0])
    assert (
        torch.count_nonzero(state.memory[DEVICE].table[0]) == 0
        and torch.count_nonzero(state.memory[DEVICE].table[2]) == 0
    )
    assert torch.equal(state.memory[DEVICE].table[1], make_kv(1))
    assert slots.usage() == (1, 3) and slots.allocate(1) == [0]


def test_commit_makes_the_build_ready_in_the_callers_slot_with_its_reference(tmp_path):
    state = make_state(tmp_path, device=2)
    slots = slots_of(state)
    (slot,) = slots.allocate(1)
    state.memory[DEVICE].write(slot, make_kv(7))
    entry = building(state, 7)
    assert slots.commit(entry, slot) is True
    assert (entry.state, entry.tier, entry.slot, entry.ref_count) == (
        BlockState.READY,
        DEVICE,
        slot,
        1,
    )
    assert torch.equal(state.memory[DEVICE].table[slot], make_kv(7))  # no copy, no zeroing
    assert state.events == [StoredInPool(entry.key, DEVICE)] and state.num_building == 0


def test_a_build_tombstoned_meanwhile_is_discarded_and_the_slot_stays_the_callers(tmp_path):
    state = make_state(tmp_path, device=2)
    slots = slots_of(state)
    (slot,) = slots.allocate(1)
    entry = building(state, 3)
    state.tombstone(entry, RemovalReason.INVALIDATED)
    assert slots.commit(entry, slot) is False
    assert (entry.state, state.entries, state.num_building) == (BlockState.FAILED, {}, 0)
    assert slots.usage() == (1, 2) and state.events == []
