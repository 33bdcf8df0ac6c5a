"""The pool state alone: the memory tier's slots, the provenance index, placement, byte deletion and
records."""

from __future__ import annotations

import torch
from helpers.pool import (
    SPEC,
    FakeClock,
    block_hash,
    building,
    lru_order,
    make_kv,
    make_state,
    placed,
    put,
    scoped_key,
)

from events.tiers import STORAGE_TIERS, Tier
from gpu_node.pool.memory_tier import MemoryTier
from gpu_node.pool.vocabulary import (
    METHOD_OVERWRITE_UNLINK,
    METHOD_ZERO_FILL,
    BlockState,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
)
from prefix_keys.blocks import CacheScope

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


# --- memory tier ----------------------------------------------------------------------------


def test_a_memory_tier_hands_out_the_lowest_free_slot_and_takes_slots_back():
    memory = MemoryTier(torch.zeros((3, *SPEC.block_shape), dtype=SPEC.dtype), SPEC)
    assert (memory.capacity, memory.num_used, memory.has_room()) == (3, 0, True)
    assert [memory.take(), memory.take()] == [0, 1]
    memory.release([0])
    assert [memory.take(), memory.take()] == [0, 2]
    assert (memory.num_used, memory.has_room()) == (3, False)


def test_a_memory_tier_writes_gathers_and_clears_slots():
    memory = MemoryTier(torch.zeros((4, *SPEC.block_shape), dtype=SPEC.dtype), SPEC)
    for slot in (memory.take(), memory.take(), memory.take()):
        memory.write(slot, make_kv(slot))
    out = torch.empty((2, SPEC.num_elements), dtype=SPEC.dtype)
    memory.gather([2, 0], out)
    assert torch.equal(out, torch.stack([make_kv(2), make_kv(0)]).view(2, -1))
    memory.scatter([3], out[:1])
    assert torch.equal(memory.table[3], make_kv(2))
    assert memory.clear(1) is True
    assert torch.count_nonzero(memory.table[1]) == 0 and memory.free == [1, 3]
    assert memory.zero_verified([0, 2]) == [True, True]
    assert torch.count_nonzero(memory.table[:3]) == 0 and memory.free == [
        1,
        3,
    ]  # zeroing frees nothing


# --- entries and the index ------------------------------------------------------------------


def test_admit_and_forget_keep_the_provenance_index_exact(tmp_path):
    state = make_state(tmp_path)
    handbook = put(state, 0, key=scoped_key(0, CacheScope.TENANT, documents=("handbook@v1",)))
    both = put(state, 1, key=scoped_key(1, CacheScope.TENANT, documents=("handbook@v2", "faq@v1")))
    public = put(state, 2)
    assert {key: list(bucket) for key, bucket in state.index.items()} == {
        ("tenant", "acme"): [block_hash(0), block_hash(1)],
        ("policy", "acme", "*"): [block_hash(0), block_hash(1)],
        ("document", "acme", "handbook"): [block_hash(0), block_hash(1)],
        ("document", "acme", "faq"): [block_hash(1)],
        ("tenant", None): [block_hash(2)],
    }
    assert list(state.candidates(("namespace", state.config.namespace))) == [handbook, both, public]
    assert list(state.candidates(("namespace", "another"))) == []
    assert list(state.candidates(("document", "acme", "faq"))) == [both]
    state.unplace(both)
    state.forget(both)
    assert block_hash(1) not in state.entries
    assert ("document", "acme", "faq") not in state.index
    assert list(state.index[("document", "acme", "handbook")]) == [block_hash(0)]


def test_placing_counts_the_tier_and_orders_only_ready_entries(tmp_path):
    state = make_state(tmp_path, device=3, host=1)
    put(state, 0)
    put(state, 1)
    put(state, 2, HOST)
    claimed = building(state, 3)
    state.place(claimed, DEVICE, 2)
    assert state.num_entries == {DEVICE: 3, HOST: 1, DISK: 0}
    assert (lru_order(state, DEVICE), lru_order(state, HOST)) == ([0, 1], [2])
    state.unplace(state.entries[block_hash(0)])
    assert state.num_entries[DEVICE] == 2 and lru_order(state, DEVICE) == [1]
    assert placed(state) == {1: (DEVICE, 1), 2: (HOST, 0), 3: (DEVICE, 2)}


def test_has_room_reads_free_slots_for_memory_and_the_file_count_for_disk(tmp_path):
    state = make_state(tmp_path, device=1, host=0, disk=1)
    assert [state.has_room(tier) for tier in STORAGE_TIERS] == [True, False, True]
    put(state, 0)
    put(state, 1, DISK)
    assert [state.has_room(tier) for tier in STORAGE_TIERS] == [False, False, False]


# --- entry states -----------------------------------------------------------------------------


def test_make_ready_starts_the_ttl_and_reports_the_block_stored_on_the_device(tmp_path):
    clock = FakeClock(50.0)
    state = make_state(
        tmp_path,
        clock=clock,
        ttl={CacheScope.PUBLIC: 30.0, CacheScope.TENANT: None, CacheScope.USER: None},
    )
    entry = building(state, 0)
    clock.now = 60.0
    state.make_ready(entry, state.memory[DEVICE].take())
    assert (entry.state, entry.tier, entry.slot, entry.last_access, entry.expires_at) == (
        BlockState.READY,
        DEVICE,
        0,
        60.0,
        90.0,
    )
    assert state.num_building == 0 and lru_order(state, DEVICE) == [0]
    assert state.events == [StoredInPool(entry.key, DEVICE)]


def test_tombstone_stops_hits_and_leaves_the_eviction_order(tmp_path):
    state = make_state(tmp_path)
    entry = put(state, 0, ref_count=1)
    put(state, 1)
    state.tombstone(entry, RemovalReason.INVALIDATED)
    assert (entry.state, entry.tombstoned, entry.removal_reason) == (
        BlockState.EVICTING,
        True,
        RemovalReason.INVALIDATED,
    )
    assert (
        lru_order(state, DEVICE) == [1] and entry.tier is DEVICE
    )  # bytes stay until the last release


def test_discard_building_forgets_the_claim(tmp_path):
    state = make_state(tmp_path)
    entry = building(state, 0)
    state.discard_building(entry)
    assert (entry.state, state.num_building, state.entries, state.index) == (
        BlockState.FAILED,
        0,
        {},
        {},
    )


def test_expire_entry_drops_an_unreferenced_entry_and_tombstones_a_referenced_one(tmp_path):
    state = make_state(tmp_path)
    held, free = put(state, 0, ref_count=2), put(state, 1)
    state.expire_entry(held)
    state.expire_entry(free)
    assert (held.state, held.removal_reason, held.tier) == (
        BlockState.EVICTING,
        RemovalReason.EXPIRED,
        DEVICE,
    )
    assert list(state.entries) == [block_hash(0)] and state.num_expired == 1
    assert [(event.block_hash, event.reason) for event in state.events] == [
        (block_hash(1), RemovalReason.EXPIRED)
    ]


# --- bytes -------------------------------------------------------------------------------------


def test_store_bytes_takes_the_lowest_free_slot(tmp_path):
    state = make_state(tmp_path, device=3)
    put(state, 0)
    put(state, 1)
    state.drop(state.entries[block_hash(0)], RemovalReason.EVICTED)
    entry = put(state, 2)
    assert entry.slot == 0 and torch.equal(state.memory[DEVICE].table[0], make_kv(2))


def test_drop_zeroes_the_slot_frees_it_counts_and_reports_evidence(tmp_path):
    state = make_state(tmp_path, device=2)
    entry = put(state, 0)
    put(state, 1)
    evidence = state.drop(entry, RemovalReason.RESTORE_FAILED)
    assert evidence == RemovalEvidence(block_hash(0), DEVICE, METHOD_ZERO_FILL, False, True)
    assert state.events == [
        RemovedFromPool(block_hash(0), DEVICE, RemovalReason.RESTORE_FAILED, evidence)
    ]
    assert torch.count_nonzero(state.memory[DEVICE].table[0]) == 0 and state.memory[
        DEVICE
    ].free == [0]
    assert (state.num_restore_failures, state.num_evictions, state.num_entries[DEVICE]) == (1, 0, 1)
    assert (entry.state, entry.tier, entry.slot, list(state.entries)) == (
        BlockState.EVICTING,
        None,
        None,
        [block_hash(1)],
    )


def test_drop_of_a_disk_block_overwrites_and_unlinks_its_file_and_names_its_key(tmp_path):
    state = make_state(tmp_path, device=1, disk=2)
    sealed = put(state, 0, DISK, key=scoped_key(0, CacheScope.USER))
    path = state.disk.path(block_hash(0))
    assert path.exists()
    evidence = state.drop(sealed, RemovalReason.EVICTED)
    assert (evidence.tier, evidence.method, evidence.encrypted, evidence.verified) == (
        DISK,
        METHOD_OVERWRITE_UNLINK,
        True,
        True,
    )
    assert evidence.key_id is not None and not path.exists() and state.disk.num_bytes == 0


def test_read_payload_is_a_view_of_a_memory_slot_and_the_decoded_file_on_disk(tmp_path):
    state = make_state(tmp_path, device=1, disk=1)
    in_memory, on_disk = put(state, 0), put(state, 1, DISK)
    view = state.read_payload(in_memory)
    assert view.data_ptr() == state.memory[DEVICE].table[0].data_ptr()
    assert torch.equal(state.read_payload(on_disk), make_kv(1))


# --- records and clocks ------------------------------------------------------------------------


def test_a_record_carries_the_expiry_on_the_wall_clock_and_converts_back(tmp_path):
    state = make_state(tmp_path)
    entry = put(state, 0)
    entry.expires_at = 1030.0
    record = state.record(entry, make_kv(0))
    assert (record.key, record.kv_format, record.expires_at_wall) == (
        entry.key,
        SPEC.kv_format,
        1_001_030.0,
    )
    assert (
        state.expiry_from_wall(record.expires_at_wall) == 1030.0
        and state.expiry_from_wall(None) is None
    )
