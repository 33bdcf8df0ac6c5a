"""The batched read path alone: rows in entry order, LRU touches, promotion of host/disk hits,
refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.pool import block_hash, lru_order, make_kv, make_state, placed, put

from events.tiers import Tier
from gpu_node.pool.block_records import BlockRestoreError
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.reads import PoolReader
from gpu_node.pool.vocabulary import MovedInPool, RemovalReason

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def reader_of(state) -> PoolReader:
    return PoolReader(state, PoolDemoter(state))


def test_device_hits_come_back_in_entry_order_and_become_most_recently_used(tmp_path):
    state = make_state(tmp_path, device=4)
    entries = [put(state, i, ref_count=1) for i in range(4)]
    state.clock.now = 1005.0
    out = reader_of(state).read([entries[2], entries[0], entries[2]])
    assert torch.equal(out, torch.stack([make_kv(2), make_kv(0), make_kv(2)]))
    assert (
        out.data_ptr() != state.memory[DEVICE].table.data_ptr()
    )  # fresh memory, never a slot view
    assert lru_order(state, DEVICE) == [1, 3, 0, 2]
    assert (entries[2].last_access, entries[1].last_access) == (1005.0, 1000.0)
    assert state.events == []


def test_host_and_disk_hits_are_promoted_to_the_device_in_order(tmp_path):
    state = make_state(tmp_path, device=3, host=2, disk=2)
    device_hit = put(state, 0, ref_count=1)
    host_hit = put(state, 1, HOST, ref_count=1)
    disk_hit = put(state, 2, DISK, ref_count=1)
    out = reader_of(state).read([disk_hit, device_hit, host_hit])
    assert torch.equal(out, torch.stack([make_kv(2), make_kv(0), make_kv(1)]))
    assert placed(state) == {0: (DEVICE, 0), 1: (DEVICE, 2), 2: (DEVICE, 1)}
    assert state.events == [
        MovedInPool(block_hash(2), DISK, DEVICE),
        MovedInPool(block_hash(1), HOST, DEVICE),
    ]
    assert torch.count_nonzero(state.memory[HOST].table) == 0 and state.memory[HOST].free == [0, 1]
    assert not state.disk.path(block_hash(2)).exists()
    assert state.num_promotions == 2 and lru_order(state, DEVICE) == [2, 0, 1]


def test_without_promotion_lower_hits_stay_where_they_are(tmp_path):
    state = make_state(tmp_path, device=2, host=1)
    host_hit = put(state, 0, HOST, ref_count=1)
    assert torch.equal(reader_of(state).read([host_hit], promote=False)[0], make_kv(0))
    assert placed(state) == {0: (HOST, 0)} and state.events == [] and state.num_promotions == 0


def test_promotion_demotes_an_unreferenced_device_block_into_the_host_slot_just_left(tmp_path):
    state = make_state(tmp_path, device=1, host=1)
    put(state, 0)  # unreferenced: the victim
    host_hit = put(state, 1, HOST, ref_count=1)
    out = reader_of(state).read([host_hit])
    assert torch.equal(out[0], make_kv(1))
    assert placed(state) == {0: (HOST, 0), 1: (DEVICE, 0)}  # a swap
    assert torch.equal(state.memory[HOST].table[0], make_kv(0)) and torch.equal(
        state.memory[DEVICE].table[0], make_kv(1)
    )
    assert state.events == [
        MovedInPool(block_hash(0), DEVICE, HOST),
        MovedInPool(block_hash(1), HOST, DEVICE),
    ]


def test_only_as_many_blocks_move_as_the_device_has_room_for(tmp_path):
    state = make_state(tmp_path, device=1, host=2)
    put(state, 0, ref_count=1)  # the device's one slot is held
    lower = [put(state, i, HOST, ref_count=1) for i in (1, 2)]
    out = reader_of(state).read(lower)
    assert torch.equal(out, torch.stack([make_kv(1), make_kv(2)]))
    assert placed(state) == {0: (DEVICE, 0), 1: (HOST, 0), 2: (HOST, 1)} and state.events == []


def test_reads_need_references_and_never_serve_a_tombstoned_block(tmp_path):
    state = make_state(tmp_path)
    unreferenced, held = put(state, 0), put(state, 1, ref_count=1)
    reader = reader_of(state)
    with pytest.raises(ValueError, match="inc_lock_ref"):
        reader.read([held, unreferenced])
    state.tombstone(held, RemovalReason.INVALIDATED)
    with pytest.raises(BlockRestoreError, match="invalidated"):
        reader.read([held])


def test_a_corrupt_disk_file_is_dropped_and_raised_before_anything_moves(tmp_path):
    state = make_state(tmp_path, device=2, host=1, disk=1)
    host_hit = put(state, 0, HOST, ref_count=1)
    disk_hit = put(state, 1, DISK, ref_count=1)
    path = state.disk.path(block_hash(1))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(BlockRestoreError):
        reader_of(state).read([host_hit, disk_hit])
    assert placed(state) == {0: (HOST, 0)} and not path.exists()
    assert [(event.block_hash, event.tier, event.reason) for event in state.events] == [
        (block_hash(1), DISK, RemovalReason.RESTORE_FAILED)
    ]
    assert state.num_restore_failures == 1
