"""Storage pool: entry states, refcounts, LRU demotion across tiers, TTL, governed removal, events."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from helpers.pool import NO_TTL, NS, SPEC, FakeClock, block_hash, block_key, make_kv
from hypothesis import HealthCheck, given, settings

from events.tiers import Tier
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import BlockRestoreError
from gpu_node.pool.disk_tier import is_sealed
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.vocabulary import (
    METHOD_OVERWRITE_UNLINK,
    METHOD_ZERO_FILL,
    BlockState,
    MovedInPool,
    PoolConfig,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
    provenance_index_keys,
)
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

PUBLIC, TENANT, USER = CacheScope.PUBLIC, CacheScope.TENANT, CacheScope.USER
DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def make_key(
    i: int,
    scope: CacheScope = PUBLIC,
    tenant: str = "acme",
    subject: str = "alice",
    documents: tuple[str, ...] = (),
    namespace: str = NS,
) -> BlockKey:
    provenance = CacheProvenance(
        namespace=namespace,
        tenant_id=None if scope == PUBLIC else tenant,
        scope=scope,
        auth_scopes=(("*", 1),) if scope == TENANT else (),
        subject_id=subject if scope == USER else None,
        documents=documents,
        created_at=0.0,
    )
    return block_key(i, provenance)


def make_pool(
    tmp_path,
    *,
    device: int = 4,
    host: int = 0,
    disk: int = 0,
    ttl=None,
    clock=None,
    wall_clock=None,
    keys=None,
) -> BlockPool:
    config = PoolConfig(
        namespace=NS,
        num_device_blocks=device,
        num_host_blocks=host,
        max_disk_blocks=disk,
        disk_dir=tmp_path / "disk",
        ttl_s=NO_TTL if ttl is None else ttl,
    )
    clock = clock or FakeClock(1000.0)
    return BlockPool(
        SPEC,
        config,
        keys or LocalKeyStore(tmp_path / "keys.json"),
        clock=clock,
        wall_clock=wall_clock or (lambda: clock() + 1_000_000.0),
    )


def store(pool: BlockPool, i: int, **key_fields):
    entry = pool.begin_build(make_key(i, **key_fields))
    assert entry is not None
    assert pool.commit_build(entry, make_kv(i)) is True
    return entry


def read(pool: BlockPool, entries, promote: bool = True) -> torch.Tensor:
    pool.inc_lock_ref(entries)
    try:
        return pool.read_blocks(entries, promote=promote)
    finally:
        pool.dec_lock_ref(entries)


def tiers(pool: BlockPool) -> dict[int, Tier]:
    index = {block_hash(i): i for i in range(64)}
    return {index[entry.block_hash]: entry.tier for entry in pool.ready_entries()}


# --- spec --------------------------------------------------------------------------------


def test_spec_geometry():
    assert SPEC.block_shape == (2, 2, 1, 4, 4)
    assert SPEC.block_bytes == 64 * 4
    assert SPEC.kv_format == "float32/L1/bs4"
    assert KVBlockSpec(28, 8, 128, 16, torch.bfloat16).block_bytes == 28 * 2 * 8 * 16 * 128 * 2
    assert KVBlockSpec(1, 1, 1, 16, torch.bfloat16).kv_format == "bfloat16/L1/bs16"


@pytest.mark.parametrize(
    "fields", [dict(num_layers=0), dict(head_dim=-1), dict(block_size=0), dict(dtype=torch.int8)]
)
def test_spec_rejects_bad_geometry(fields):
    base = (
        dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32) | fields
    )
    with pytest.raises(ValueError):
        KVBlockSpec(**base)


def test_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError):
        PoolConfig(NS, -1, 0, 0, None, NO_TTL)
    with pytest.raises(ValueError, match="positive"):
        PoolConfig(NS, 1, 0, 0, None, NO_TTL | {PUBLIC: 0.0})
    with pytest.raises(ValueError, match="missing"):
        PoolConfig(NS, 1, 0, 0, None, {PUBLIC: 10.0, TENANT: 10.0})
    with pytest.raises(ValueError):
        PoolConfig("", 1, 0, 0, None, NO_TTL)


# --- build / commit ------------------------------------------------------------------------


def test_commit_makes_block_ready_on_device_with_exact_bytes(tmp_path):
    pool = make_pool(tmp_path)
    entry = pool.begin_build(make_key(0))
    assert entry.state is BlockState.BUILDING
    assert pool.get_ready(block_hash(0)) is None
    assert pool.longest_ready_prefix([block_hash(0)]) == []

    assert pool.commit_build(entry, make_kv(0)) is True
    assert (entry.state, entry.tier, entry.slot, entry.ref_count) == (
        BlockState.READY,
        DEVICE,
        0,
        0,
    )
    assert pool.get_ready(block_hash(0)) is entry
    assert torch.equal(read(pool, [entry]), make_kv(0).unsqueeze(0))
    assert pool.take_events() == [StoredInPool(make_key(0), DEVICE)]
    assert pool.take_events() == []
    stats = pool.stats()
    assert stats.num_entries == {DEVICE: 1, HOST: 0, DISK: 0}
    assert stats.tier_bytes == {DEVICE: 256, HOST: 0, DISK: 0}


def test_begin_build_refuses_a_hash_present_in_any_state(tmp_path):
    pool = make_pool(tmp_path)
    building = pool.begin_build(make_key(0))
    assert pool.begin_build(make_key(0)) is None
    assert pool.state_of(block_hash(0)) is BlockState.BUILDING
    pool.commit_build(building, make_kv(0))
    assert pool.begin_build(make_key(0)) is None
    assert pool.state_of(block_hash(0)) is BlockState.READY


def test_fail_build_goes_failed_then_absent_and_allows_retry(tmp_path):
    pool = make_pool(tmp_path)
    entry = pool.begin_build(make_key(0))
    pool.fail_build(entry)
    assert entry.state is BlockState.FAILED
    assert pool.state_of(block_hash(0)) is None
    assert pool.begin_build(make_key(0)) is not None
    assert pool.take_events() == []


def test_commit_validates_caller_input_and_leaves_entry_building(tmp_path):
    pool = make_pool(tmp_path)
    entry = pool.begin_build(make_key(0))
    with pytest.raises(ValueError, match="shape"):
        pool.commit_build(entry, torch.zeros(2, 2, 1, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        pool.commit_build(entry, make_kv(0).to(torch.float64))
    assert entry.state is BlockState.BUILDING
    pool.fail_build(entry)
    with pytest.raises(AssertionError):
        pool.commit_build(entry, make_kv(0))


def test_begin_build_rejects_foreign_namespace_and_block_size(tmp_path):
    pool = make_pool(tmp_path)
    with pytest.raises(ValueError, match="namespace"):
        pool.begin_build(make_key(0, namespace="other"))
    with pytest.raises(ValueError, match="block size"):
        pool.begin_build(make_key(0)._replace(block_size=16))


def test_commit_without_room_discards(tmp_path):
    pool = make_pool(tmp_path, device=1)
    held = store(pool, 0)
    pool.inc_lock_ref([held])
    entry = pool.begin_build(make_key(1))
    assert pool.commit_build(entry, make_kv(1)) is False
    assert entry.state is BlockState.FAILED
    assert pool.state_of(block_hash(1)) is None
    assert torch.equal(pool.read_blocks([held])[0], make_kv(0))
    assert pool.take_events() == [StoredInPool(make_key(0), DEVICE)]


# --- lookup and references --------------------------------------------------------------------


def test_longest_ready_prefix_stops_at_the_first_gap_and_updates_nothing(tmp_path):
    clock = FakeClock(1000.0)
    pool = make_pool(tmp_path, device=3, clock=clock)
    entries = [store(pool, i) for i in range(3)]
    hashes = [block_hash(i) for i in range(4)]
    assert pool.longest_ready_prefix(hashes) == entries
    pool.inc_lock_ref(entries[:2])
    pool.dec_lock_ref(entries[:2])
    pool.take_events()

    # Block 2 is now least recently used: storing block 3 evicts it although its child stays.
    child = store(pool, 3)
    assert pool.take_events() == [
        RemovedFromPool(
            block_hash(2),
            DEVICE,
            RemovalReason.EVICTED,
            RemovalEvidence(block_hash(2), DEVICE, METHOD_ZERO_FILL, False, True),
        ),
        StoredInPool(make_key(3), DEVICE),
    ]
    assert child.slot == 2
    before = [(entry.last_access, entry.ref_count) for entry in entries[:2]]
    clock.now += 10
    assert pool.longest_ready_prefix(hashes) == entries[:2]
    assert [(entry.last_access, entry.ref_count) for entry in entries[:2]] == before
    assert pool.take_events() == []


def test_refcounts_are_symmetric_and_never_negative(tmp_path):
    pool = make_pool(tmp_path)
    first, second = store(pool, 0), store(pool, 1)
    pool.inc_lock_ref([first, second])
    pool.inc_lock_ref([first])
    assert (first.ref_count, second.ref_count) == (2, 1)
    with pytest.raises(ValueError):
        pool.dec_lock_ref([second, second])
    assert (first.ref_count, second.ref_count) == (2, 1)
    pool.dec_lock_ref([first, first, second])
    assert (first.ref_count, second.ref_count) == (0, 0)
    with pytest.raises(ValueError):
        pool.dec_lock_ref([first])
    assert first.ref_count == 0


def test_only_ready_entries_of_this_pool_can_be_referenced_and_read(tmp_path):
    pool = make_pool(tmp_path)
    building = pool.begin_build(make_key(0))
    with pytest.raises(ValueError):
        pool.inc_lock_ref([building])
    other = make_pool(tmp_path / "other")
    with pytest.raises(ValueError):
        pool.inc_lock_ref([store(other, 1)])
    with pytest.raises(ValueError):
        pool.read_blocks([store(pool, 2)])


# --- tiers ------------------------------------------------------------------------------------


def test_lru_demotes_device_to_host_to_disk_then_drops(tmp_path):
    pool = make_pool(tmp_path, device=2, host=1, disk=1)
    for i in range(3):
        store(pool, i)
    assert tiers(pool) == {0: HOST, 1: DEVICE, 2: DEVICE}
    store(pool, 3)
    assert tiers(pool) == {0: DISK, 1: HOST, 2: DEVICE, 3: DEVICE}
    store(pool, 4)
    assert tiers(pool) == {1: DISK, 2: HOST, 3: DEVICE, 4: DEVICE}
    unlinked = RemovalEvidence(block_hash(0), DISK, METHOD_OVERWRITE_UNLINK, False, True)
    assert pool.take_events() == [
        StoredInPool(make_key(0), DEVICE),
        StoredInPool(make_key(1), DEVICE),
        MovedInPool(block_hash(0), DEVICE, HOST),
        StoredInPool(make_key(2), DEVICE),
        MovedInPool(block_hash(0), HOST, DISK),
        MovedInPool(block_hash(1), DEVICE, HOST),
        StoredInPool(make_key(3), DEVICE),
        RemovedFromPool(block_hash(0), DISK, RemovalReason.EVICTED, unlinked),
        MovedInPool(block_hash(1), HOST, DISK),
        MovedInPool(block_hash(2), DEVICE, HOST),
        StoredInPool(make_key(4), DEVICE),
    ]
    stats = pool.stats()
    assert (stats.num_evictions, stats.num_demotions, stats.num_promotions) == (1, 5, 0)
    assert sorted(path.name for path in (tmp_path / "disk").iterdir()) == [
        f"{block_hash(1).hex()}.kvb"
    ]
    for i in (1, 2, 3, 4):
        assert torch.equal(
            read(pool, [pool.get_ready(block_hash(i))], promote=False)[0], make_kv(i)
        )


def test_a_hit_refreshes_lru_order(tmp_path):
    pool = make_pool(tmp_path, device=2)
    first = store(pool, 0)
    store(pool, 1)
    read(pool, [first])
    store(pool, 2)
    assert tiers(pool) == {0: DEVICE, 2: DEVICE}


def test_referenced_blocks_are_never_moved_or_freed(tmp_path):
    pool = make_pool(tmp_path, device=2, host=1)
    held = store(pool, 0)
    pool.inc_lock_ref([held])
    store(pool, 1)
    store(pool, 2)  # block 1 (unreferenced) goes to host; block 0 stays
    assert (held.tier, held.slot) == (DEVICE, 0)
    assert pool.demote(block_hash(0), HOST) is False
    store(pool, 3)  # host is full: block 1 is dropped, block 2 demoted
    assert tiers(pool) == {0: DEVICE, 2: HOST, 3: DEVICE}
    assert torch.equal(pool.read_blocks([held])[0], make_kv(0))
    pool.dec_lock_ref([held])


def test_host_hit_is_promoted_by_swapping_with_the_device_victim(tmp_path):
    pool = make_pool(tmp_path, device=1, host=1)
    store(pool, 0)
    store(pool, 1)
    pool.take_events()
    entry = pool.get_ready(block_hash(0))
    assert entry.tier is HOST
    assert torch.equal(read(pool, [entry])[0], make_kv(0))
    assert (entry.tier, entry.slot) == (DEVICE, 0)
    assert tiers(pool) == {0: DEVICE, 1: HOST}
    assert pool.take_events() == [
        MovedInPool(block_hash(1), DEVICE, HOST),
        MovedInPool(block_hash(0), HOST, DEVICE),
    ]
    assert pool.stats().num_promotions == 1


def test_no_promotion_when_every_device_slot_is_referenced(tmp_path):
    pool = make_pool(tmp_path, device=1, host=1)
    store(pool, 0)
    device_entry = store(pool, 1)
    pool.take_events()
    host_entry = pool.get_ready(block_hash(0))
    pool.inc_lock_ref([device_entry, host_entry])
    assert torch.equal(
        pool.read_blocks([device_entry, host_entry]), torch.stack([make_kv(1), make_kv(0)])
    )
    pool.dec_lock_ref([device_entry, host_entry])
    assert tiers(pool) == {0: HOST, 1: DEVICE}
    assert pool.take_events() == []


def test_read_without_promotion_keeps_tiers(tmp_path):
    pool = make_pool(tmp_path, device=1, host=1, disk=1)
    for i in range(3):
        store(pool, i)
    pool.take_events()
    entries = [pool.get_ready(block_hash(i)) for i in range(3)]
    assert torch.equal(
        read(pool, entries, promote=False), torch.stack([make_kv(i) for i in range(3)])
    )
    assert tiers(pool) == {0: DISK, 1: HOST, 2: DEVICE}
    assert pool.take_events() == []


def test_disk_hit_is_promoted_and_its_file_deleted(tmp_path):
    pool = make_pool(tmp_path, device=1, disk=1)
    store(pool, 0, scope=USER)
    store(pool, 1)
    disk = tmp_path / "disk"
    assert [path.name for path in disk.iterdir()] == [f"{block_hash(0).hex()}.kvb"]
    pool.take_events()
    entry = pool.get_ready(block_hash(0))
    assert torch.equal(read(pool, [entry])[0], make_kv(0))
    assert entry.tier is DEVICE
    assert [path.name for path in disk.iterdir()] == [f"{block_hash(1).hex()}.kvb"]
    assert pool.take_events() == [
        MovedInPool(block_hash(1), DEVICE, DISK),
        MovedInPool(block_hash(0), DISK, DEVICE),
    ]


def test_explicit_demotion_zeroes_the_slot_it_leaves(tmp_path):
    pool = make_pool(tmp_path, device=2, host=1, disk=2)
    store(pool, 0)
    pool.take_events()
    with pytest.raises(ValueError):
        pool.demote(block_hash(0), DEVICE)
    assert pool.demote(block_hash(9), HOST) is False
    assert pool.demote(block_hash(0), HOST) is True
    assert torch.count_nonzero(pool.state.memory[DEVICE].table[0]) == 0
    assert pool.demote(block_hash(0), HOST) is False
    assert pool.demote(block_hash(0), DISK) is True
    assert torch.count_nonzero(pool.state.memory[HOST].table[0]) == 0
    assert pool.take_events() == [
        MovedInPool(block_hash(0), DEVICE, HOST),
        MovedInPool(block_hash(0), HOST, DISK),
    ]
    assert pool.stats().num_entries == {DEVICE: 0, HOST: 0, DISK: 1}


def test_byte_accounting_per_tier(tmp_path):
    pool = make_pool(tmp_path, device=2, host=2, disk=2)
    for i in range(5):
        store(pool, i, scope=USER if i % 2 else PUBLIC)
    stats = pool.stats()
    assert stats.num_entries == {DEVICE: 2, HOST: 2, DISK: 1}
    file_bytes = sum(path.stat().st_size for path in (tmp_path / "disk").iterdir())
    assert stats.tier_bytes == {DEVICE: 2 * 256, HOST: 2 * 256, DISK: file_bytes}
    assert stats.num_building == 0
    pool.begin_build(make_key(7))
    assert pool.stats().num_building == 1


# --- TTL -------------------------------------------------------------------------------------


def test_ttl_is_checked_lazily_and_deletes_bytes(tmp_path):
    clock = FakeClock(0.0)
    pool = make_pool(tmp_path, device=2, ttl={PUBLIC: 10.0, TENANT: 5.0, USER: None}, clock=clock)
    public = store(pool, 0)
    tenant = store(pool, 1, scope=TENANT)
    assert (public.expires_at, tenant.expires_at) == (10.0, 5.0)
    pool.take_events()

    clock.now = 5.0
    assert pool.longest_ready_prefix([block_hash(1)]) == []
    assert pool.take_events() == []
    assert pool.get_ready(block_hash(1)) is None
    assert pool.take_events() == [
        RemovedFromPool(
            block_hash(1),
            DEVICE,
            RemovalReason.EXPIRED,
            RemovalEvidence(block_hash(1), DEVICE, METHOD_ZERO_FILL, False, True),
        )
    ]
    assert torch.count_nonzero(pool.state.memory[DEVICE].table[1]) == 0
    assert pool.get_ready(block_hash(0)) is public
    assert pool.stats().num_expired == 1
    assert store(pool, 1, scope=TENANT).slot == 1


def test_expire_sweeps_and_defers_referenced_blocks(tmp_path):
    clock = FakeClock(0.0)
    pool = make_pool(tmp_path, device=3, ttl={PUBLIC: 10.0, TENANT: None, USER: None}, clock=clock)
    held, other = store(pool, 0), store(pool, 1)
    store(pool, 2, scope=USER)
    pool.inc_lock_ref([held])
    pool.take_events()

    clock.now = 10.0
    assert pool.expire() == 2
    zero = lambda i: RemovalEvidence(block_hash(i), DEVICE, METHOD_ZERO_FILL, False, True)  # noqa: E731
    assert pool.take_events() == [
        RemovedFromPool(block_hash(1), DEVICE, RemovalReason.EXPIRED, zero(1))
    ]
    assert (held.state, held.tombstoned, other.state) == (
        BlockState.EVICTING,
        True,
        BlockState.EVICTING,
    )
    assert pool.get_ready(block_hash(0)) is None
    assert pool.begin_build(make_key(0)) is None
    with pytest.raises(BlockRestoreError) as raised:
        pool.read_blocks([held])
    assert raised.value.reason == "expired"
    assert torch.equal(
        pool.state.memory[DEVICE].table[0], make_kv(0)
    )  # still referenced: not freed

    pool.dec_lock_ref([held])
    assert pool.take_events() == [
        RemovedFromPool(block_hash(0), DEVICE, RemovalReason.EXPIRED, zero(0))
    ]
    assert pool.expire() == 0
    assert pool.stats().num_expired == 2
    assert pool.stats().num_entries == {DEVICE: 1, HOST: 0, DISK: 0}


# --- governed removal
# ------------------------------------------------------------------------------


def test_remove_where_tombstones_first_and_deletes_every_tier_with_evidence(tmp_path):
    pool = make_pool(tmp_path, device=3, host=1, disk=1)
    for i in range(3):
        store(pool, i, scope=USER)
    assert pool.demote(block_hash(0), DISK) and pool.demote(block_hash(1), HOST)
    bob = store(pool, 4, scope=USER, subject="bob")
    held = pool.get_ready(block_hash(2))
    pool.inc_lock_ref([held])
    building = pool.begin_build(make_key(3, scope=USER))
    host_slot = pool.get_ready(block_hash(1)).slot
    disk_file = tmp_path / "disk" / f"{block_hash(0).hex()}.kvb"
    pool.take_events()

    report = pool.remove_where(
        lambda provenance: provenance.subject_id == "alice", RemovalReason.INVALIDATED
    )

    evidence = (
        # the sealed file's key id, read from its header before the overwrite, names the key to
        # crypto-erase
        RemovalEvidence(
            block_hash(0),
            DISK,
            METHOD_OVERWRITE_UNLINK,
            True,
            True,
            pool.key_provider.current_key_id("acme", "alice"),
        ),
        RemovalEvidence(block_hash(1), HOST, METHOD_ZERO_FILL, False, True),
    )
    assert report.num_removed == {DEVICE: 0, HOST: 1, DISK: 1}
    assert report.removed == (block_hash(0), block_hash(1))
    assert report.deferred == (block_hash(2),)
    assert report.discarded_building == (block_hash(3),)
    assert report.evidence == evidence and report.all_verified
    assert not disk_file.exists()
    assert torch.count_nonzero(pool.state.memory[HOST].table[host_slot]) == 0
    assert pool.take_events() == [
        RemovedFromPool(block_hash(0), DISK, RemovalReason.INVALIDATED, evidence[0]),
        RemovedFromPool(block_hash(1), HOST, RemovalReason.INVALIDATED, evidence[1]),
    ]
    # No further hits, even for the reader that still holds block 2.
    assert pool.longest_ready_prefix([block_hash(2)]) == []
    assert pool.get_ready(block_hash(2)) is None
    with pytest.raises(BlockRestoreError):
        pool.read_blocks([held])
    assert pool.commit_build(building, make_kv(3)) is False
    assert building.state is BlockState.FAILED
    assert pool.take_events() == []

    pool.dec_lock_ref([held])
    assert pool.take_events() == [
        RemovedFromPool(
            block_hash(2),
            DEVICE,
            RemovalReason.INVALIDATED,
            RemovalEvidence(block_hash(2), DEVICE, METHOD_ZERO_FILL, False, True),
        )
    ]
    assert pool.get_ready(block_hash(4)) is bob
    assert pool.stats().num_entries == {DEVICE: 1, HOST: 0, DISK: 0}
    assert pool.begin_build(make_key(2, scope=USER)) is not None


def test_remove_where_on_a_referenced_entry_twice_reports_it_deferred_once_deleted_once(tmp_path):
    pool = make_pool(tmp_path)
    held = store(pool, 0, scope=TENANT, documents=("handbook@7",))
    pool.inc_lock_ref([held])
    first = pool.remove_where(lambda p: "handbook@7" in p.documents, RemovalReason.INVALIDATED)
    second = pool.remove_where(lambda p: p.tenant_id == "acme", RemovalReason.INVALIDATED)
    assert first.deferred == second.deferred == (block_hash(0),)
    pool.take_events()
    pool.dec_lock_ref([held])
    assert [event.reason for event in pool.take_events()] == [RemovalReason.INVALIDATED]


# --- provenance index
# -------------------------------------------------------------------------------


def index_is_consistent(pool: BlockPool) -> None:
    """The provenance index files exactly the pool's entries under their keys, in ``_entries``
    order."""
    expected: dict = {}
    for block, entry in pool.state.entries.items():
        for key in provenance_index_keys(entry.provenance):
            expected.setdefault(key, {})[block] = entry
    assert {key: list(bucket.items()) for key, bucket in pool.state.index.items()} == {
        key: list(bucket.items()) for key, bucket in expected.items()
    }


TENANTS = ("acme", "globex")
DOC_TAGS = ("d1@1", "d1@2", "d2@1", "d3@4")
AUTH_SCOPES = (("hr", 1), ("hr", 2), ("kb", 1))


def random_provenance(draw) -> CacheProvenance:
    scope = draw(st.sampled_from([PUBLIC, TENANT, USER]))
    return CacheProvenance(
        namespace=NS,
        tenant_id=None if scope == PUBLIC else draw(st.sampled_from(TENANTS)),
        scope=scope,
        auth_scopes=tuple(draw(st.lists(st.sampled_from(AUTH_SCOPES), max_size=2, unique=True))),
        subject_id=draw(st.sampled_from(["alice", "bob"])) if scope == USER else None,
        documents=tuple(draw(st.lists(st.sampled_from(DOC_TAGS), max_size=3, unique=True))),
        created_at=float(draw(st.integers(0, 3))),
    )


def random_removal(draw):
    """An index key and a predicate whose matches are all filed under it (plus a random extra
    condition)."""
    kind = draw(st.sampled_from(["tenant", "document", "policy", "namespace"]))
    tenant = draw(st.sampled_from(TENANTS))
    cutoff = draw(st.integers(0, 4))
    if kind == "tenant":
        key, matches = ("tenant", tenant), lambda p: p.tenant_id == tenant
    elif kind == "document":
        doc, below = draw(st.sampled_from(["d1", "d2", "d3", "d9"])), draw(st.integers(1, 5))
        key = ("document", tenant, doc)

        def matches(p):
            return p.tenant_id == tenant and any(
                t.rpartition("@")[0] == doc and int(t.rpartition("@")[2]) < below
                for t in p.documents
            )
    elif kind == "policy":
        scope, below = draw(st.sampled_from(["hr", "kb", "zz"])), draw(st.integers(1, 3))
        key = ("policy", tenant, scope)

        def matches(p):
            return p.tenant_id == tenant and any(s == scope and v < below for s, v in p.auth_scopes)
    else:
        namespace = draw(st.sampled_from([NS, "ns-other"]))
        key, matches = ("namespace", namespace), lambda p: p.namespace == namespace
    return key, lambda p: p.created_at < cutoff and matches(p)


@st.composite
def pool_scenarios(draw):
    """Blocks with random provenances, each left BUILDING, on the device, host or disk, maybe
    referenced."""
    blocks = [
        (
            random_provenance(draw),
            draw(st.sampled_from(["building", DEVICE, HOST, DISK])),
            draw(st.booleans()),
        )
        for _ in range(draw(st.integers(0, 12)))
    ]
    drops = draw(st.lists(st.integers(0, 11), max_size=4))
    return blocks, drops, random_removal(draw)


def build_scenario(pool: BlockPool, blocks, drops) -> None:
    for i, (provenance, where, held) in enumerate(blocks):
        key = BlockKey(block_hash(i), block_hash(i - 1), i, SPEC.block_size, provenance)
        entry = pool.begin_build(key)
        if where == "building":
            continue
        assert pool.commit_build(entry, make_kv(i))
        if where is not DEVICE:
            assert pool.demote(block_hash(i), where)
        if held:
            pool.inc_lock_ref([entry])
    for i in drops:  # evictions and failed builds reorder nothing but leave holes
        entry = pool.state.entries.get(block_hash(i))
        if entry is not None and entry.state is BlockState.BUILDING:
            pool.fail_build(entry)
        else:
            pool.evict(block_hash(i))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=pool_scenarios())
def test_narrowed_remove_where_removes_exactly_what_the_full_scan_removes(scenario):
    blocks, drops, (key, predicate) = scenario
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        keys = LocalKeyStore(root / "keys.json")
        full, narrowed = (
            make_pool(root / name, device=16, host=16, disk=16, keys=keys)
            for name in ("full", "narrowed")
        )
        for pool in (full, narrowed):
            build_scenario(pool, blocks, drops)
            pool.take_events()
            index_is_consistent(pool)
        expected = full.remove_where(predicate, RemovalReason.INVALIDATED)
        report = narrowed.remove_where(predicate, RemovalReason.INVALIDATED, candidates=key)
        assert report == expected
        assert narrowed.take_events() == full.take_events()
        assert [(b, e.state, e.tombstoned, e.tier) for b, e in narrowed.state.entries.items()] == [
            (b, e.state, e.tombstoned, e.tier) for b, e in full.state.entries.items()
        ]
        index_is_consistent(narrowed)


@st.composite
def batched_removals(draw):
    """A pool scenario and one to four removals to apply to it as one batch."""
    blocks, drops, first = draw(pool_scenarios())
    return blocks, drops, [first, *(random_removal(draw) for _ in range(draw(st.integers(0, 3))))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=batched_removals())
def test_remove_many_reports_and_deletes_exactly_what_removing_one_by_one_does(scenario):
    """Bulk byte deletion changes nothing observable: same reports, events, entries, and every freed
    slot is zero."""
    blocks, drops, removals = scenario
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        keys = LocalKeyStore(root / "keys.json")
        one_by_one, batched = (
            make_pool(root / name, device=16, host=16, disk=16, keys=keys)
            for name in ("seq", "batch")
        )
        for pool in (one_by_one, batched):
            build_scenario(pool, blocks, drops)
            pool.take_events()
        expected = [
            one_by_one.remove_where(predicate, RemovalReason.INVALIDATED, candidates=key)
            for key, predicate in removals
        ]
        reports = batched.remove_many(
            [(predicate, key) for key, predicate in removals], RemovalReason.INVALIDATED
        )
        assert reports == expected
        assert batched.take_events() == one_by_one.take_events()
        assert [
            (b, e.state, e.tombstoned, e.tier, e.slot) for b, e in batched.state.entries.items()
        ] == [
            (b, e.state, e.tombstoned, e.tier, e.slot) for b, e in one_by_one.state.entries.items()
        ]
        for tier in (DEVICE, HOST):
            for slot in batched.state.memory[tier].free:
                assert torch.count_nonzero(batched.state.memory[tier].table[slot]) == 0, (
                    f"freed {tier.value} slot {slot} still holds bytes"
                )
        index_is_consistent(batched)


def test_the_index_follows_every_admission_and_removal(tmp_path):
    clock = FakeClock(1000.0)
    pool = make_pool(
        tmp_path,
        device=2,
        host=1,
        disk=2,
        ttl={PUBLIC: None, TENANT: 10.0, USER: None},
        clock=clock,
    )
    docs = ("handbook@7", "faq@1")
    for i in range(3):
        store(pool, i, scope=TENANT, documents=docs)
        index_is_consistent(pool)
    held = pool.get_ready(block_hash(2))
    pool.inc_lock_ref([held])
    building = pool.begin_build(make_key(3, scope=USER, documents=docs))
    failing = pool.begin_build(make_key(4, scope=TENANT, documents=docs))
    pool.fail_build(failing)
    index_is_consistent(pool)
    assert set(pool.state.index[("document", "acme", "handbook")]) == {
        block_hash(i) for i in range(4)
    }
    assert pool.demote(block_hash(0), DISK) and pool.evict(block_hash(1))
    index_is_consistent(pool)
    read(pool, [pool.get_ready(block_hash(0))])  # promoted back from disk
    index_is_consistent(pool)
    pool.remove_where(
        lambda p: "faq@1" in p.documents,
        RemovalReason.INVALIDATED,
        candidates=("document", "acme", "faq"),
    )
    index_is_consistent(pool)
    assert list(pool.state.index[("document", "acme", "faq")]) == [
        block_hash(2),
        block_hash(3),
    ]  # held and building
    assert pool.commit_build(building, make_kv(3)) is False
    pool.dec_lock_ref([held])
    index_is_consistent(pool)
    assert pool.state.index == {}
    store(pool, 5, scope=TENANT)
    clock.now += 11.0
    assert pool.expire() == 1
    index_is_consistent(pool)
    assert pool.state.index == {}
    # Blocks left on disk are filed again when a restarted pool re-indexes them.
    store(pool, 6, scope=TENANT, documents=docs)
    assert pool.demote(block_hash(6), DISK)
    restarted = make_pool(tmp_path, device=2, host=1, disk=2, keys=pool.key_provider)
    assert restarted.load_disk_tier() == 1
    index_is_consistent(restarted)
    assert list(restarted.state.index[("document", "acme", "handbook")]) == [block_hash(6)]


def test_remove_where_refuses_an_unknown_index_key(tmp_path):
    pool = make_pool(tmp_path)
    store(pool, 0)
    with pytest.raises(ValueError):
        pool.remove_where(
            lambda p: True, RemovalReason.INVALIDATED, candidates=("subject", "acme", "alice")
        )
    assert pool.get_ready(block_hash(0)) is not None
    assert (
        pool.remove_where(
            lambda p: True, RemovalReason.INVALIDATED, candidates=("namespace", "ns-other")
        ).removed
        == ()
    )


# --- at rest
# ---------------------------------------------------------------------------------------


def test_disk_files_are_private_and_tenant_blocks_are_sealed(tmp_path):
    pool = make_pool(tmp_path, device=1, disk=3)
    store(pool, 0, scope=USER, tenant="acme-corp", subject="alice@example.com")
    store(pool, 1, scope=TENANT, tenant="acme-corp", documents=("handbook@7",))
    store(pool, 2)
    store(pool, 3)
    disk = tmp_path / "disk"
    assert stat.S_IMODE(os.stat(disk).st_mode) == 0o700
    files = {path.name: path.read_bytes() for path in disk.iterdir()}
    assert sorted(files) == sorted(f"{block_hash(i).hex()}.kvb" for i in range(3))
    for name, data in files.items():
        assert stat.S_IMODE(os.stat(disk / name).st_mode) == 0o600
        assert (
            b"acme-corp" not in data
            and b"alice@example.com" not in data
            and b"handbook" not in data
        )
    # Public blocks are stored in clear (with a checksum): their KV bytes appear verbatim.
    assert make_kv(2).numpy().tobytes() in files[f"{block_hash(2).hex()}.kvb"]
    assert make_kv(0).numpy().tobytes() not in files[f"{block_hash(0).hex()}.kvb"]
    assert make_kv(1).numpy().tobytes() not in files[f"{block_hash(1).hex()}.kvb"]
    assert pool.stats().tier_bytes[DISK] == sum(len(data) for data in files.values())


def test_tenant_block_without_a_data_key_is_dropped_not_written_in_clear(tmp_path):
    class NoKeys:
        def key_for(self, provenance):
            return None

        def key_by_id(self, key_id):
            return None

        def destroy(self, key_id):
            return False

    pool = make_pool(tmp_path, device=1, disk=2, keys=NoKeys())
    store(pool, 0, scope=TENANT)
    store(pool, 1)
    assert list((tmp_path / "disk").iterdir()) == []
    assert pool.take_events() == [
        StoredInPool(make_key(0, scope=TENANT), DEVICE),
        RemovedFromPool(
            block_hash(0),
            DEVICE,
            RemovalReason.EVICTED,
            RemovalEvidence(block_hash(0), DEVICE, METHOD_ZERO_FILL, False, True),
        ),
        StoredInPool(make_key(1), DEVICE),
    ]


def test_corrupt_disk_block_raises_and_is_gone(tmp_path):
    pool = make_pool(tmp_path, device=1, disk=2)
    store(pool, 0)
    store(pool, 1)
    path = tmp_path / "disk" / f"{block_hash(0).hex()}.kvb"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    pool.take_events()

    entry = pool.get_ready(block_hash(0))
    pool.inc_lock_ref([entry])
    with pytest.raises(BlockRestoreError) as raised:
        pool.read_blocks([entry])
    assert (raised.value.block_hash, raised.value.reason) == (block_hash(0), "checksum_mismatch")
    pool.dec_lock_ref([entry])
    assert pool.get_ready(block_hash(0)) is None
    assert pool.state_of(block_hash(0)) is None
    assert not path.exists()
    assert pool.take_events() == [
        RemovedFromPool(
            block_hash(0),
            DISK,
            RemovalReason.RESTORE_FAILED,
            RemovalEvidence(block_hash(0), DISK, METHOD_OVERWRITE_UNLINK, False, True),
        )
    ]
    assert pool.stats().num_restore_failures == 1
    assert pool.stats().num_entries == {DEVICE: 1, HOST: 0, DISK: 0}


def test_destroyed_key_raises_and_block_is_gone(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    pool = make_pool(tmp_path, device=1, disk=2, keys=keys)
    store(pool, 0, scope=USER)
    store(pool, 1)
    key_id = keys.current_key_id("acme", "alice")
    assert keys.destroy(key_id) is True
    pool.take_events()

    entry = pool.get_ready(block_hash(0))
    pool.inc_lock_ref([entry])
    with pytest.raises(BlockRestoreError) as raised:
        pool.read_blocks([entry])
    assert raised.value.reason == "key_unavailable"
    with pytest.raises(BlockRestoreError):
        pool.read_blocks([entry])  # never served again
    pool.dec_lock_ref([entry])
    assert pool.get_ready(block_hash(0)) is None
    assert not (tmp_path / "disk" / f"{block_hash(0).hex()}.kvb").exists()
    assert pool.take_events() == [
        RemovedFromPool(
            block_hash(0),
            DISK,
            RemovalReason.RESTORE_FAILED,
            RemovalEvidence(block_hash(0), DISK, METHOD_OVERWRITE_UNLINK, True, True, key_id),
        )
    ]


def test_restart_reindexes_the_disk_tier(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    pool = make_pool(tmp_path, device=1, disk=4, keys=keys)
    for i, scope in enumerate([USER, TENANT, PUBLIC, PUBLIC]):
        store(pool, i, scope=scope, subject=f"s{i}")
    corrupt = tmp_path / "disk" / f"{block_hash(2).hex()}.kvb"
    corrupt.write_bytes(corrupt.read_bytes()[:-1])
    (tmp_path / "disk" / "notes.txt").write_text("not a block")

    restarted = make_pool(tmp_path, device=1, disk=4, keys=LocalKeyStore(tmp_path / "keys.json"))
    assert restarted.load_disk_tier() == 2
    assert tiers(restarted) == {0: DISK, 1: DISK}
    assert restarted.get_ready(block_hash(0)).key == make_key(0, scope=USER, subject="s0")
    assert torch.equal(
        read(restarted, [restarted.get_ready(block_hash(1))], promote=False)[0], make_kv(1)
    )
    assert restarted.take_events() == [
        RemovedFromPool(
            block_hash(2),
            DISK,
            RemovalReason.RESTORE_FAILED,
            RemovalEvidence(block_hash(2), DISK, METHOD_OVERWRITE_UNLINK, False, True),
        )
    ]
    assert not corrupt.exists()
    assert (tmp_path / "disk" / "notes.txt").exists()
    assert restarted.load_disk_tier() == 0


def test_restart_deletes_blocks_of_destroyed_keys_and_expired_blocks(tmp_path):
    clock, wall = FakeClock(10.0), FakeClock(5000.0)
    keys = LocalKeyStore(tmp_path / "keys.json")
    ttl = {PUBLIC: 100.0, TENANT: None, USER: None}
    pool = make_pool(tmp_path, device=1, disk=4, keys=keys, ttl=ttl, clock=clock, wall_clock=wall)
    store(pool, 0, scope=USER)
    store(pool, 1)  # public: expires at wall time 5100
    store(pool, 2, scope=TENANT)
    store(pool, 3, scope=TENANT)
    keys.destroy(keys.current_key_id("acme", "alice"))

    wall.now = 5101.0
    restarted = make_pool(
        tmp_path, device=1, disk=4, keys=keys, ttl=ttl, clock=FakeClock(0.0), wall_clock=wall
    )
    assert restarted.load_disk_tier() == 1
    assert tiers(restarted) == {2: DISK}
    expected = sorted(
        [(block_hash(0), RemovalReason.RESTORE_FAILED), (block_hash(1), RemovalReason.EXPIRED)],
        key=lambda item: item[0].hex(),
    )
    assert [(event.block_hash, event.reason) for event in restarted.take_events()] == expected
    assert sorted(path.name for path in (tmp_path / "disk").iterdir()) == [
        f"{block_hash(2).hex()}.kvb"
    ]


def test_export_and_import_records(tmp_path):
    source = make_pool(tmp_path / "a", device=2)
    entry = store(source, 0, scope=USER)
    source.inc_lock_ref([entry])
    record = source.export_record(entry)
    source.dec_lock_ref([entry])
    with pytest.raises(ValueError):
        source.export_record(entry)

    target = make_pool(tmp_path / "b", device=1, host=1, keys=source.key_provider)
    assert target.import_record(record, HOST) is True
    assert target.import_record(record, HOST) is False
    assert target.take_events() == [StoredInPool(make_key(0, scope=USER), HOST)]
    assert torch.equal(
        read(target, [target.get_ready(block_hash(0))], promote=False)[0], make_kv(0)
    )
    with pytest.raises(BlockRestoreError):
        target.import_record(record[:-1], HOST)
    stranger = make_pool(tmp_path / "c", device=1, host=1)
    with pytest.raises(BlockRestoreError) as raised:
        stranger.import_record(record, HOST)
    assert raised.value.reason == "key_unavailable"


def test_import_stores_into_every_tier_and_refuses_a_disk_copy_it_cannot_seal(tmp_path):
    source = make_pool(tmp_path / "a", device=3)
    records = {}
    for i in range(3):
        entry = store(source, i, scope=USER)
        source.inc_lock_ref([entry])
        records[i] = source.export_record(entry)
        source.dec_lock_ref([entry])

    target = make_pool(tmp_path / "b", device=1, host=1, disk=1, keys=source.key_provider)
    tiers = (DEVICE, HOST, DISK)
    for i, tier in enumerate(tiers):
        assert target.import_record(records[i], tier) is True
    assert target.take_events() == [
        StoredInPool(make_key(i, scope=USER), tier) for i, tier in enumerate(tiers)
    ]
    entries = [target.get_ready(block_hash(i)) for i in range(3)]
    target.inc_lock_ref(entries)
    assert all(
        torch.equal(kv, make_kv(i)) for i, kv in enumerate(read(target, entries, promote=False))
    )
    target.dec_lock_ref(entries)
    assert is_sealed((tmp_path / "b" / "disk" / f"{block_hash(2).hex()}.kvb").read_bytes()), (
        "the disk copy is sealed"
    )

    class ReadOnlyKeys:
        """Opens records sealed under existing keys but has no key to seal new ones."""

        def key_for(self, provenance):
            return None

        def key_by_id(self, key_id):
            return source.key_provider.key_by_id(key_id)

        def destroy(self, key_id):
            return False

    unsealable = make_pool(tmp_path / "c", device=1, disk=1, keys=ReadOnlyKeys())
    assert unsealable.import_record(records[0], DISK) is False
    assert unsealable.state_of(block_hash(0)) is None
    assert list((tmp_path / "c" / "disk").iterdir()) == []
    assert unsealable.take_events() == []
    assert unsealable.stats().num_entries == {DEVICE: 0, HOST: 0, DISK: 0}


def test_two_threads_share_the_pool_safely(tmp_path):
    pool = make_pool(tmp_path, device=3, host=3)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for step in range(60):
                i = (offset + step) % 10
                entry = pool.begin_build(make_key(i))
                if entry is not None:
                    pool.commit_build(entry, make_kv(i))
                with pool.lock:
                    prefix = pool.longest_ready_prefix([block_hash(i)])
                    pool.inc_lock_ref(prefix)
                try:
                    if prefix:
                        assert torch.equal(pool.read_blocks(prefix)[0], make_kv(i))
                finally:
                    pool.dec_lock_ref(prefix)
        except BaseException as error:  # noqa: BLE001 - surfaced in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = pool.stats()
    assert stats.num_entries[DEVICE] + stats.num_entries[HOST] == len(pool.ready_entries()) == 6


# --- batched reads ---------------------------------------------------------------------------


BATCH = 24  # more blocks than _MAX_SLICE_RUNS, so a shuffled order takes the indexed (gather/scatter) path


def _batch_order(order: str) -> list[int]:
    return list(range(BATCH)) if order == "ordered" else [(i * 7) % BATCH for i in range(BATCH)]


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_batched_promotion_of_host_blocks(tmp_path, order):
    pool = make_pool(tmp_path, device=BATCH, host=BATCH)
    for i in range(BATCH):
        store(pool, i)
        assert pool.demote(block_hash(i), HOST)
    pool.take_events()
    assert (
        pool.stats().num_entries[HOST] == BATCH
        and torch.count_nonzero(pool.state.memory[DEVICE].table) == 0
    )
    indices = _batch_order(order)
    entries = [pool.get_ready(block_hash(i)) for i in indices]
    out = read(pool, entries)
    assert torch.equal(out, torch.stack([make_kv(i) for i in indices]))
    assert pool.take_events() == [MovedInPool(block_hash(i), HOST, DEVICE) for i in indices]
    for i, entry in zip(indices, entries, strict=True):
        assert entry.tier is DEVICE and torch.equal(
            pool.state.memory[DEVICE].table[entry.slot], make_kv(i)
        )
    assert (
        torch.count_nonzero(pool.state.memory[HOST].table) == 0
    )  # every slot the blocks left is zeroed
    assert sorted(pool.state.memory[HOST].free) == list(range(BATCH))
    stats = pool.stats()
    assert stats.num_entries == {DEVICE: BATCH, HOST: 0, DISK: 0}
    assert stats.tier_bytes == {DEVICE: BATCH * SPEC.block_bytes, HOST: 0, DISK: 0}
    assert stats.num_promotions == BATCH
    out.zero_()  # the result is the reader's own memory, not a view of a slot
    assert torch.equal(pool.state.memory[DEVICE].table[entries[0].slot], make_kv(indices[0]))
    # Device hits in an order that breaks every slot run take the indexed gather; nothing moves.
    assert torch.equal(read(pool, entries[::-1]), torch.stack([make_kv(i) for i in indices[::-1]]))
    assert pool.take_events() == []


@pytest.mark.parametrize("scope", [PUBLIC, TENANT, USER])
@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_batched_promotion_of_disk_blocks(tmp_path, scope, order):
    pool = make_pool(tmp_path, device=BATCH, disk=BATCH)
    for i in range(BATCH):
        store(pool, i, scope=scope)
        assert pool.demote(block_hash(i), DISK)
    pool.take_events()
    assert len(list((tmp_path / "disk").iterdir())) == BATCH
    indices = _batch_order(order)
    entries = [pool.get_ready(block_hash(i)) for i in indices]
    out = read(pool, entries)
    assert torch.equal(out, torch.stack([make_kv(i) for i in indices]))
    assert pool.take_events() == [MovedInPool(block_hash(i), DISK, DEVICE) for i in indices]
    for i, entry in zip(indices, entries, strict=True):
        assert entry.tier is DEVICE and torch.equal(
            pool.state.memory[DEVICE].table[entry.slot], make_kv(i)
        )
        assert not pool.disk_path(block_hash(i)).exists()
    assert list((tmp_path / "disk").iterdir()) == []
    stats = pool.stats()
    assert stats.num_entries == {DEVICE: BATCH, HOST: 0, DISK: 0}
    assert stats.tier_bytes == {DEVICE: BATCH * SPEC.block_bytes, HOST: 0, DISK: 0}
    assert pool.state.disk.known_meta == {}


def test_batched_read_mixes_tiers_and_repeated_entries(tmp_path):
    pool = make_pool(tmp_path, device=4, host=4, disk=4)
    for i in range(4):
        store(pool, i, scope=TENANT)
    assert pool.demote(block_hash(1), HOST)
    assert pool.demote(block_hash(2), DISK) and pool.demote(block_hash(3), DISK)
    pool.take_events()
    e0, e1, e2, e3 = (pool.get_ready(block_hash(i)) for i in range(4))
    entries = [e2, e0, e1, e2, e3]
    out = read(pool, entries)
    assert torch.equal(
        out, torch.stack([make_kv(2), make_kv(0), make_kv(1), make_kv(2), make_kv(3)])
    )
    assert pool.take_events() == [
        MovedInPool(block_hash(2), DISK, DEVICE),
        MovedInPool(block_hash(1), HOST, DEVICE),
        MovedInPool(block_hash(3), DISK, DEVICE),
    ]
    assert tiers(pool) == {0: DEVICE, 1: DEVICE, 2: DEVICE, 3: DEVICE}
    assert (
        torch.count_nonzero(pool.state.memory[HOST].table) == 0
        and list((tmp_path / "disk").iterdir()) == []
    )
    assert e2.ref_count == 0


def test_batched_promotion_swaps_with_device_victims_and_stops_when_device_is_held(tmp_path):
    pool = make_pool(tmp_path, device=2, host=4)
    for i in (0, 1):
        store(pool, i)
        assert pool.demote(block_hash(i), HOST)
    held, victim = store(pool, 2), store(pool, 3)
    pool.take_events()
    host_slots = {i: pool.get_ready(block_hash(i)).slot for i in (0, 1)}
    pool.inc_lock_ref([held])  # another reader: only the victim's device slot can be taken
    entries = [pool.get_ready(block_hash(i)) for i in (0, 1)]
    out = read(pool, entries)
    pool.dec_lock_ref([held])
    assert torch.equal(out, torch.stack([make_kv(0), make_kv(1)]))
    # Block 0 takes the victim's device slot; the victim takes the host slot block 0 left (a swap);
    # block 1 finds no device slot and stays on the host, served from there.
    assert pool.take_events() == [
        MovedInPool(block_hash(3), DEVICE, HOST),
        MovedInPool(block_hash(0), HOST, DEVICE),
    ]
    assert tiers(pool) == {0: DEVICE, 1: HOST, 2: DEVICE, 3: HOST}
    assert victim.slot == host_slots[0]
    assert torch.equal(
        pool.state.memory[HOST].table[victim.slot], make_kv(3)
    )  # the batched zero-fill ran before the swap
    assert torch.equal(pool.state.memory[HOST].table[host_slots[1]], make_kv(1))
    assert torch.equal(pool.state.memory[DEVICE].table[entries[0].slot], make_kv(0))
    assert torch.count_nonzero(pool.state.memory[HOST].table[2:]) == 0


def test_batched_read_with_a_corrupt_file_moves_nothing(tmp_path):
    pool = make_pool(tmp_path, device=4, host=4, disk=4)
    for i in range(3):
        store(pool, i, scope=USER)
    assert pool.demote(block_hash(0), HOST)
    assert pool.demote(block_hash(1), DISK) and pool.demote(block_hash(2), DISK)
    pool.take_events()
    path = pool.disk_path(block_hash(2))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    entries = [pool.get_ready(block_hash(i)) for i in range(3)]
    pool.inc_lock_ref(entries)
    with pytest.raises(BlockRestoreError, match="decrypt_failed"):
        pool.read_blocks(entries)
    pool.dec_lock_ref(entries)
    events = pool.take_events()
    assert [type(event) for event in events] == [RemovedFromPool]
    assert (events[0].block_hash, events[0].reason) == (block_hash(2), RemovalReason.RESTORE_FAILED)
    assert tiers(pool) == {0: HOST, 1: DISK}
    assert torch.equal(pool.state.memory[HOST].table[entries[0].slot], make_kv(0))
    assert not path.exists()


def test_disk_hit_without_known_meta_is_fully_checked(tmp_path):
    """A file indexed at start (no meta remembered) is parsed and checked, and still restores."""
    pool = make_pool(tmp_path, device=2, disk=2)
    store(pool, 0, scope=TENANT)
    assert pool.demote(block_hash(0), DISK)
    pool.state.disk.known_meta.clear()
    assert torch.equal(read(pool, [pool.get_ready(block_hash(0))])[0], make_kv(0))


def test_guarded_builds_are_refused_until_the_guard_expires(tmp_path):
    clock = FakeClock(1000.0)
    pool = make_pool(tmp_path, clock=clock)
    pool.guard_builds(lambda provenance: provenance.subject_id == "alice", duration_s=10)
    assert pool.begin_build(make_key(0, scope=USER)) is None
    assert pool.state_of(block_hash(0)) is None
    store(pool, 1, scope=USER, subject="bob")
    clock.now += 10
    store(pool, 0, scope=USER)
    with pytest.raises(ValueError):
        pool.guard_builds(lambda provenance: True, duration_s=0)
