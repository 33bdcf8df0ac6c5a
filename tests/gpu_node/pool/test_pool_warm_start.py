"""Warm start alone: records out of and into a pool state, and re-indexing the disk files of an earlier run."""

from __future__ import annotations

import pytest
import torch
from helpers.pool import FakeClock, block_hash, make_kv, make_state, placed, put, scoped_key

from events.tiers import Tier
from gpu_node.pool.block_records import BlockRestoreError
from gpu_node.pool.vocabulary import BlockState, CacheEntry, RemovalReason, StoredInPool
from gpu_node.pool.warm_start import PoolWarmStart
from prefix_keys.blocks import CacheScope

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def test_a_record_exported_from_one_state_is_imported_ready_into_another(tmp_path):
    source = make_state(tmp_path / "a")
    entry = put(source, 0, key=scoped_key(0, CacheScope.USER), ref_count=1)
    entry.expires_at = 1060.0
    record = PoolWarmStart(source).export_record(entry)
    # The record says "until wall time 1,001,060"; the target's clock reads 50.0 at wall time
    # 1,001,000.
    target = make_state(
        tmp_path / "b",
        host=2,
        clock=FakeClock(50.0),
        wall_clock=lambda: 1_001_000.0,
        keys=source.key_provider,
    )
    assert PoolWarmStart(target).import_record(record, HOST) is True
    imported = target.entries[block_hash(0)]
    assert (imported.state, imported.tier, imported.slot, imported.ref_count) == (
        BlockState.READY,
        HOST,
        0,
        0,
    )
    assert imported.expires_at == 110.0  # the same 60 s left, on the target's own clock
    assert torch.equal(target.memory[HOST].table[0], make_kv(0))
    assert target.events == [StoredInPool(entry.key, HOST)]


def test_import_refuses_a_present_an_expired_or_a_roomless_block(tmp_path):
    source = make_state(tmp_path / "a")
    entries = [put(source, i, ref_count=1) for i in range(3)]
    entries[1].expires_at = 999.0  # already past on the target's clock
    records = [PoolWarmStart(source).export_record(entry) for entry in entries]
    target = make_state(tmp_path / "b", device=1, host=0, keys=source.key_provider)
    warm_start = PoolWarmStart(target)
    assert warm_start.import_record(records[0], DEVICE) is True
    assert warm_start.import_record(records[0], DEVICE) is False  # present
    assert warm_start.import_record(records[1], DEVICE) is False  # expired
    assert (
        warm_start.import_record(records[2], DEVICE) is False
    )  # no free slot, and import never evicts
    assert placed(target) == {0: (DEVICE, 0)} and len(target.events) == 1


def test_export_needs_a_reference_and_a_live_entry(tmp_path):
    state = make_state(tmp_path)
    entry = put(state, 0)
    warm_start = PoolWarmStart(state)
    with pytest.raises(ValueError, match="inc_lock_ref"):
        warm_start.export_record(entry)
    entry.ref_count = 1
    state.tombstone(entry, RemovalReason.INVALIDATED)
    with pytest.raises(BlockRestoreError):
        warm_start.export_record(entry)


def test_the_disk_files_of_an_earlier_run_are_re_indexed_without_events(tmp_path):
    earlier = make_state(tmp_path, device=1, disk=3)
    for i in range(3):
        put(earlier, i, DISK)
    restarted = make_state(tmp_path, device=1, disk=3, keys=earlier.key_provider)
    assert PoolWarmStart(restarted).load_disk_tier() == 3
    assert placed(restarted) == {i: (DISK, None) for i in range(3)}
    assert restarted.events == [] and restarted.num_entries[DISK] == 3
    assert PoolWarmStart(restarted).load_disk_tier() == 0  # already indexed


def test_corrupt_expired_and_surplus_files_are_deleted_and_reported_in_file_name_order(tmp_path):
    earlier = make_state(tmp_path, device=1, disk=4)
    for i in (0, 2, 3):
        put(earlier, i, DISK)
    expiring = CacheEntry(key=scoped_key(1), state=BlockState.READY, expires_at=1010.0)
    assert earlier.store_bytes(expiring, DISK, make_kv(1)) == (True, None)
    earlier.disk.path(block_hash(0)).write_bytes(b"not a block record")
    restarted = make_state(
        tmp_path, device=1, disk=1, clock=FakeClock(2000.0), keys=earlier.key_provider
    )
    assert PoolWarmStart(restarted).load_disk_tier() == 1
    in_name_order = sorted(range(4), key=lambda i: block_hash(i).hex())
    kept = next(i for i in in_name_order if i in (2, 3))
    expected = {
        0: RemovalReason.RESTORE_FAILED,
        1: RemovalReason.EXPIRED,
        2: RemovalReason.EVICTED,
        3: RemovalReason.EVICTED,
    }
    assert [(event.block_hash, event.tier, event.reason) for event in restarted.events] == [
        (block_hash(i), DISK, expected[i]) for i in in_name_order if i != kept
    ]
    assert all(event.evidence.verified for event in restarted.events)
    assert placed(restarted) == {kept: (DISK, None)}
    assert list(restarted.disk.directory.iterdir()) == [restarted.disk.path(block_hash(kept))]
    assert (restarted.num_restore_failures, restarted.num_expired, restarted.num_evictions) == (
        1,
        1,
        1,
    )
