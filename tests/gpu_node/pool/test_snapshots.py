"""Snapshots: consistent write, warm start, crypto-erase by key destruction, rewrite without matches, delete."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from helpers.pool import NO_TTL, NS, SPEC, FakeClock, block_hash, block_key, make_kv

from events.tiers import Tier
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.snapshots import (
    MANIFEST_NAME,
    delete_incomplete,
    delete_snapshot,
    load_snapshot,
    read_manifest,
    remove_from_snapshot,
    write_snapshot,
)
from gpu_node.pool.vocabulary import PoolConfig, StoredInPool
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

PUBLIC, TENANT, USER = CacheScope.PUBLIC, CacheScope.TENANT, CacheScope.USER
DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
TENANT_ID, ALICE, BOB = "acme-corp", "alice@example.com", "bob@example.com"


def make_key(
    i: int, scope: CacheScope = PUBLIC, subject: str = ALICE, namespace: str = NS
) -> BlockKey:
    provenance = CacheProvenance(
        namespace=namespace,
        tenant_id=None if scope == PUBLIC else TENANT_ID,
        scope=scope,
        auth_scopes=(("hr", 2),) if scope == TENANT else (),
        subject_id=subject if scope == USER else None,
        documents=("handbook@7",) if scope == TENANT else (),
        created_at=0.0,
    )
    return block_key(i, provenance)


def make_pool(
    root, keys, *, device=2, host=2, disk=2, namespace=NS, ttl=None, clock=None, wall_clock=None
) -> BlockPool:
    config = PoolConfig(
        namespace, device, host, disk, root / "disk", NO_TTL if ttl is None else ttl
    )
    clock = clock or FakeClock()
    return BlockPool(
        SPEC, config, keys, clock=clock, wall_clock=wall_clock or (lambda: 1e6 + clock())
    )


# Block 0: public, 1: tenant, 2: alice, 3: bob, 4: alice. With 2 device / 2 host / 2 disk
# slots, blocks 0-1 end on disk, 2-3 on host, 4 on device (plus room for one more).
LAYOUT = [
    (0, PUBLIC, ALICE),
    (1, TENANT, ALICE),
    (2, USER, ALICE),
    (3, USER, BOB),
    (4, USER, ALICE),
]


def populated_pool(tmp_path, keys) -> BlockPool:
    pool = make_pool(tmp_path / "node", keys, device=1)
    for i, scope, subject in LAYOUT:
        entry = pool.begin_build(make_key(i, scope, subject))
        assert pool.commit_build(entry, make_kv(i))
    assert {entry.block_hash: entry.tier for entry in pool.ready_entries()} == {
        block_hash(0): DISK,
        block_hash(1): DISK,
        block_hash(2): HOST,
        block_hash(3): HOST,
        block_hash(4): DEVICE,
    }
    pool.take_events()
    return pool


def read_all(pool: BlockPool) -> dict[bytes, torch.Tensor]:
    entries = pool.ready_entries()
    pool.inc_lock_ref(entries)
    try:
        return {
            entry.block_hash: kv
            for entry, kv in zip(entries, pool.read_blocks(entries, promote=False), strict=True)
        }
    finally:
        pool.dec_lock_ref(entries)


def snapshot_bytes(directory) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(directory.iterdir()))


def test_write_snapshot_covers_every_tier_without_disturbing_the_pool(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    pool = populated_pool(tmp_path, keys)
    before = {entry.block_hash: (entry.tier, entry.slot) for entry in pool.ready_entries()}

    manifest = write_snapshot(pool, tmp_path / "snap")

    assert sorted(manifest.block_hashes) == sorted(block_hash(i) for i in range(5))
    assert (manifest.namespace, manifest.kv_format) == (NS, "float32/L1/bs4")
    assert read_manifest(tmp_path / "snap") == manifest
    assert {entry.block_hash: (entry.tier, entry.slot) for entry in pool.ready_entries()} == before
    assert all(entry.ref_count == 0 for entry in pool.ready_entries())
    assert pool.take_events() == []
    files = sorted(path.name for path in (tmp_path / "snap").iterdir())
    assert files == sorted([MANIFEST_NAME, *manifest.shards])
    for path in (tmp_path / "snap").iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert manifest.num_bytes == sum(
        (tmp_path / "snap" / shard).stat().st_size for shard in manifest.shards
    )


def test_snapshot_names_nobody_and_seals_private_blocks(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap")
    everything = snapshot_bytes(tmp_path / "snap")
    for secret in (TENANT_ID, ALICE, BOB, "handbook"):
        assert secret.encode() not in everything
    for i in (1, 2, 3, 4):
        assert make_kv(i).numpy().tobytes() not in everything
    assert make_kv(0).numpy().tobytes() in everything  # public: plaintext with checksum
    manifest = json.loads((tmp_path / "snap" / MANIFEST_NAME).read_text())
    assert set(manifest) == {
        "version",
        "snapshot_id",
        "created_at",
        "namespace",
        "kv_format",
        "blocks",
    }


def test_load_snapshot_warms_host_first_then_disk(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    source = populated_pool(tmp_path, keys)
    expected = read_all(source)
    manifest = write_snapshot(source, tmp_path / "snap")

    target = make_pool(tmp_path / "warm", keys, device=2, host=2, disk=2)
    assert load_snapshot(target, tmp_path / "snap") == 4
    placed = {entry.block_hash: entry.tier for entry in target.ready_entries()}
    order = list(manifest.block_hashes)
    assert placed == {order[0]: HOST, order[1]: HOST, order[2]: DISK, order[3]: DISK}
    assert target.take_events() == [
        StoredInPool(entry.key, placed[entry.block_hash])
        for entry in sorted(target.ready_entries(), key=lambda e: order.index(e.block_hash))
    ]
    for block, kv in read_all(target).items():
        assert torch.equal(kv, expected[block])
    assert load_snapshot(target, tmp_path / "snap") == 0  # present or no room: nothing twice


def test_destroyed_key_crypto_erases_a_subject_from_the_snapshot(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap")
    assert keys.destroy(keys.current_key_id(TENANT_ID, ALICE))

    target = make_pool(tmp_path / "warm", keys, device=1, host=3, disk=3)
    assert load_snapshot(target, tmp_path / "snap") == 3
    assert sorted(entry.block_hash for entry in target.ready_entries()) == sorted(
        [block_hash(0), block_hash(1), block_hash(3)]
    )


def test_remove_from_snapshot_rewrites_shards_without_matches(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    old = write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap", max_shard_bytes=1)
    assert len(old.shards) == 5
    alice_records = [
        (tmp_path / "snap" / block.shard).read_bytes()
        for block in old.blocks
        if block.block_hash in (block_hash(2), block_hash(4))
    ]

    removed = remove_from_snapshot(tmp_path / "snap", lambda p: p.subject_id == ALICE, keys)
    assert sorted((record.block_hash, record.key_id) for record in removed) == sorted(
        (h, keys.current_key_id(TENANT_ID, ALICE)) for h in (block_hash(2), block_hash(4))
    )
    assert all(record.provenance.subject_id == ALICE for record in removed)
    new = read_manifest(tmp_path / "snap")
    assert new.snapshot_id == old.snapshot_id
    assert sorted(new.block_hashes) == sorted([block_hash(0), block_hash(1), block_hash(3)])
    assert not set(old.shards) & set(new.shards)
    assert sorted(path.name for path in (tmp_path / "snap").iterdir()) == sorted(
        [MANIFEST_NAME, *new.shards]
    )
    everything = snapshot_bytes(tmp_path / "snap")
    assert all(record not in everything for record in alice_records)
    assert remove_from_snapshot(tmp_path / "snap", lambda p: p.subject_id == ALICE, keys) == []

    target = make_pool(tmp_path / "warm", keys, device=1, host=3, disk=3)
    assert load_snapshot(target, tmp_path / "snap") == 3


def test_remove_from_snapshot_drops_records_that_can_no_longer_be_read(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap")
    keys.destroy(keys.current_key_id(TENANT_ID, BOB))
    assert (
        len(remove_from_snapshot(tmp_path / "snap", lambda p: "handbook@7" in p.documents, keys))
        == 2
    )
    assert sorted(read_manifest(tmp_path / "snap").block_hashes) == sorted(
        [block_hash(0), block_hash(2), block_hash(4)]
    )


def test_corrupt_shard_skips_only_its_blocks(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    manifest = write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap", max_shard_bytes=1)
    victim = manifest.blocks[0]
    path = tmp_path / "snap" / victim.shard
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (tmp_path / "snap" / manifest.blocks[1].shard).unlink()

    target = make_pool(tmp_path / "warm", keys, device=1, host=3, disk=3)
    assert load_snapshot(target, tmp_path / "snap") == 3
    loaded = {entry.block_hash for entry in target.ready_entries()}
    assert loaded == set(manifest.block_hashes) - {victim.block_hash, manifest.blocks[1].block_hash}


def test_expired_blocks_are_not_warmed(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    wall = FakeClock(5000.0)
    ttl = {PUBLIC: 100.0, TENANT: None, USER: None}
    pool = make_pool(tmp_path / "node", keys, ttl=ttl, wall_clock=wall)
    for i in range(2):
        assert pool.commit_build(pool.begin_build(make_key(i, USER if i else PUBLIC)), make_kv(i))
    write_snapshot(pool, tmp_path / "snap")
    wall.now = 5100.0
    target = make_pool(tmp_path / "warm", keys, ttl=ttl, wall_clock=wall)
    assert load_snapshot(target, tmp_path / "snap") == 1
    assert [entry.block_hash for entry in target.ready_entries()] == [block_hash(1)]


def test_snapshot_refuses_foreign_namespace_and_non_empty_directory(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap")
    with pytest.raises(ValueError, match="namespace"):
        load_snapshot(make_pool(tmp_path / "other", keys, namespace="ns-other"), tmp_path / "snap")
    with pytest.raises(ValueError, match="empty"):
        write_snapshot(make_pool(tmp_path / "again", keys), tmp_path / "snap")


def test_delete_snapshot_removes_every_file(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    write_snapshot(populated_pool(tmp_path, keys), tmp_path / "snap")
    assert delete_snapshot(tmp_path / "snap") is True
    assert not (tmp_path / "snap").exists()
    assert delete_snapshot(tmp_path / "snap") is True


def test_delete_incomplete_removes_only_snapshots_without_a_manifest(tmp_path):
    """A write killed before its manifest (the ``node.during_snapshot_write`` fault point) leaves
    shards nothing reads."""
    keys = LocalKeyStore(tmp_path / "keys.json")
    pool = populated_pool(tmp_path, keys)
    root = tmp_path / "snapshots"
    write_snapshot(pool, root / "complete")
    write_snapshot(pool, root / "interrupted")
    (root / "interrupted" / MANIFEST_NAME).rename(root / "interrupted" / f"{MANIFEST_NAME}.tmp")
    assert [
        path.name for path in (root / "interrupted").iterdir() if path.name.startswith("shard-")
    ]
    assert delete_incomplete(root) == 1
    assert sorted(path.name for path in root.iterdir()) == ["complete"]
    assert read_manifest(root / "complete").block_hashes
    assert delete_incomplete(root) == 0 and delete_incomplete(tmp_path / "absent") == 0


def test_empty_pool_writes_an_empty_snapshot(tmp_path):
    keys = LocalKeyStore(tmp_path / "keys.json")
    manifest = write_snapshot(make_pool(tmp_path / "node", keys), tmp_path / "snap")
    assert manifest.blocks == () and manifest.shards == ()
    assert load_snapshot(make_pool(tmp_path / "warm", keys), tmp_path / "snap") == 0
