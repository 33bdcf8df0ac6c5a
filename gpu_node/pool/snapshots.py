"""Consistent snapshots of a node's READY blocks, and warm start from one.

A snapshot is a directory: ``manifest.json`` (snapshot id, creation time,
namespace, KV format, and where each block hash lies) plus shard files of
concatenated at-rest block records (the disk-tier format of ``block_pool``).
Tenant and user blocks are sealed under their scope's data key, with their
provenance inside the ciphertext, so destroying a subject's key crypto-erases
that subject from every snapshot; :func:`remove_from_snapshot` additionally
rewrites shards without the matching blocks. The ledger tracks snapshots as a tier.

Consistency: every READY block is referenced at one instant under the pool
lock, so none can be evicted or moved while its bytes are copied; a block
invalidated meanwhile is left out rather than written.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from events.fault_points import fault_point
from events.tiers import Tier
from gpu_node.keys.crypto import DataKeyProvider, overwrite_and_unlink
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import (
    MAX_CLEAR_HEADER_BYTES,
    BlockRestoreError,
    decode_block_record,
    record_key_id,
)
from prefix_keys.blocks import BlockKey, CacheProvenance

MANIFEST_NAME = "manifest.json"
MAX_SHARD_BYTES = 64 * 1024 * 1024
_MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """Where one block's record lies: ``length`` bytes at ``offset`` in ``shard``."""

    block_hash: bytes
    shard: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class SnapshotManifest:
    snapshot_id: str
    created_at: float
    namespace: str
    kv_format: str
    blocks: tuple[SnapshotBlock, ...]

    @property
    def block_hashes(self) -> tuple[bytes, ...]:
        return tuple(block.block_hash for block in self.blocks)

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(block.shard for block in self.blocks))

    @property
    def num_bytes(self) -> int:
        return sum(block.length for block in self.blocks)

    def to_dict(self) -> dict:
        return {
            "version": _MANIFEST_VERSION,
            "snapshot_id": self.snapshot_id,
            "created_at": self.created_at,
            "namespace": self.namespace,
            "kv_format": self.kv_format,
            "blocks": [
                {
                    "block_hash": block.block_hash.hex(),
                    "shard": block.shard,
                    "offset": block.offset,
                    "length": block.length,
                }
                for block in self.blocks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> SnapshotManifest:
        if data.get("version") != _MANIFEST_VERSION:
            raise ValueError(f"unsupported snapshot manifest version {data.get('version')!r}")
        return cls(
            snapshot_id=data["snapshot_id"],
            created_at=float(data["created_at"]),
            namespace=data["namespace"],
            kv_format=data["kv_format"],
            blocks=tuple(
                SnapshotBlock(
                    bytes.fromhex(item["block_hash"]),
                    item["shard"],
                    int(item["offset"]),
                    int(item["length"]),
                )
                for item in data["blocks"]
            ),
        )


def read_manifest(directory: Path) -> SnapshotManifest:
    return SnapshotManifest.from_dict(json.loads((Path(directory) / MANIFEST_NAME).read_text()))


def _new_shard_name() -> str:
    # Fresh names on every write: a rewritten shard never replaces the one the live manifest points
    # at.
    return f"shard-{secrets.token_hex(8)}.bin"


def _write_file(path: Path, chunks: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(directory: Path, manifest: SnapshotManifest) -> None:
    """Atomic switch: readers see the old manifest or the new one, never a partial file."""
    tmp = directory / f"{MANIFEST_NAME}.tmp"
    if tmp.exists():
        tmp.unlink()
    _write_file(tmp, [json.dumps(manifest.to_dict(), indent=1).encode()])
    os.replace(tmp, directory / MANIFEST_NAME)


class _ShardWriter:
    """Appends records to shard files of at most ``max_shard_bytes`` (one record may exceed it
    alone)."""

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self._directory = directory
        self._max_shard_bytes = max_shard_bytes
        self._name: str | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self.blocks: list[SnapshotBlock] = []

    def add(self, block_hash: bytes, record: bytes) -> None:
        if self._name is None or (self._size and self._size + len(record) > self._max_shard_bytes):
            self.flush()
            self._name = _new_shard_name()
        self.blocks.append(SnapshotBlock(block_hash, self._name, self._size, len(record)))
        self._chunks.append(record)
        self._size += len(record)

    def flush(self) -> None:
        if self._name is not None and self._chunks:
            _write_file(self._directory / self._name, self._chunks)
        self._name, self._chunks, self._size = None, [], 0

    def discard(self) -> None:
        """Overwrite and unlink the shards written so far: a rewrite that failed leaves no file no
        manifest names."""
        self._name, self._chunks, self._size = None, [], 0
        for name in dict.fromkeys(block.shard for block in self.blocks):
            path = self._directory / name
            if path.exists():
                overwrite_and_unlink(path)
        self.blocks = []


def write_snapshot(
    pool: BlockPool, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> SnapshotManifest:
    """Write every READY block of the pool to a new snapshot directory; the manifest is written
    last."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError("snapshot directory must be new or empty")
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with pool.lock:
        entries = pool.ready_entries()
        pool.inc_lock_ref(entries)
    writer = _ShardWriter(directory, max_shard_bytes)
    try:
        for entry in entries:
            try:
                record = pool.export_record(entry)
            except BlockRestoreError:
                continue
            if record is not None:
                writer.add(entry.block_hash, record)
    finally:
        pool.dec_lock_ref(entries)
    writer.flush()
    fault_point("node.during_snapshot_write")
    manifest = SnapshotManifest(
        snapshot_id=uuid.uuid4().hex,
        created_at=time.time(),
        namespace=pool.config.namespace,
        kv_format=pool.spec.kv_format,
        blocks=tuple(writer.blocks),
    )
    _write_manifest(directory, manifest)
    return manifest


def _iter_records(
    directory: Path, manifest: SnapshotManifest
) -> Iterator[tuple[SnapshotBlock, bytes | None]]:
    """Every block's record bytes in manifest order, one shard in memory at a time; None where
    unreadable."""
    shard_name: str | None = None
    shard: bytes | None = None
    for block in manifest.blocks:
        if block.shard != shard_name:
            shard_name = block.shard
            path = directory / shard_name
            shard = path.read_bytes() if path.is_file() else None
        if shard is None or block.offset + block.length > len(shard):
            yield block, None
        else:
            yield block, shard[block.offset : block.offset + block.length]


def load_snapshot(pool: BlockPool, directory: Path) -> int:
    """Warm the pool from a snapshot into free host slots, then free disk room; returns blocks loaded.

    Blocks that are corrupt or fail to decrypt (their key destroyed) are
    skipped, as are blocks already present or expired.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.namespace != pool.config.namespace:
        raise ValueError("snapshot belongs to another namespace")
    if manifest.kv_format != pool.spec.kv_format:
        raise ValueError(
            f"snapshot KV format {manifest.kv_format} != pool KV format {pool.spec.kv_format}"
        )
    num_loaded = 0
    for _, record in _iter_records(directory, manifest):
        if record is None:
            continue
        for tier in (Tier.HOST, Tier.DISK):
            try:
                if pool.import_record(record, tier):
                    num_loaded += 1
                    break
            except BlockRestoreError:
                break
    return num_loaded


def readable_blocks(directory: Path, key_provider: DataKeyProvider) -> list[BlockKey]:
    """Identity and provenance of every block of a snapshot that can still be read.

    This is what the node reports to the ledger as its snapshot tier: a block
    whose data key was destroyed (crypto-erased) or whose bytes are corrupt is
    no longer held in any meaningful sense, so it is left out. A key the
    provider cannot ask for now is another matter: the block is still held, and
    an inventory that left it out would make the ledger drop a copy that is on
    disk — so :class:`gpu_node.keys.crypto.KeyServiceUnavailable` (from a blocking
    provider) propagates and the caller asks again later.
    """
    keys = []
    for _, record in _iter_records(directory, read_manifest(directory)):
        if record is None:
            continue
        try:
            keys.append(decode_block_record(record, key_provider).key)
        except BlockRestoreError:
            continue
    return keys


def sealing_key_ids(directory: Path) -> set[str]:
    """Ids of the data keys that sealed a snapshot's records, from their clear headers (no record is
    read whole).

    Lets a caller fetch those keys outside the model worker before a pass that
    unseals every record (:func:`remove_from_snapshot`), so the pass finds them
    in memory instead of waiting on the key service between engine steps.
    """
    directory = Path(directory)
    key_ids = set()
    by_shard: dict[str, list[SnapshotBlock]] = {}
    for block in read_manifest(directory).blocks:
        by_shard.setdefault(block.shard, []).append(block)
    for name, blocks in by_shard.items():
        try:
            shard = (directory / name).open("rb")
        except FileNotFoundError:
            continue
        with shard:
            for block in blocks:
                shard.seek(block.offset)
                key_id = record_key_id(shard.read(min(block.length, MAX_CLEAR_HEADER_BYTES)))
                if key_id is not None:
                    key_ids.add(key_id)
    return key_ids


class RemovedRecord(NamedTuple):
    """One record :func:`remove_from_snapshot` dropped.

    ``key_id`` is read from the clear header of a record removed because it
    *matched* (None for plaintext), so an erasure can destroy exactly the keys
    that sealed the removed copies. A record removed as unreadable has neither
    a trusted ``key_id`` nor a ``provenance``.
    """

    block_hash: bytes
    key_id: str | None
    provenance: CacheProvenance | None


def remove_from_snapshot(
    directory: Path,
    predicate: Callable[[CacheProvenance], bool],
    key_provider: DataKeyProvider,
) -> list[RemovedRecord]:
    """Rewrite the snapshot without blocks whose provenance matches; returns what was removed.
    Records that cannot be decoded any more (key destroyed, corrupt) are
    removed too: they can never be loaded, and their predicate cannot be
    evaluated, so keeping them could only keep data that should be gone. That
    needs ``key_provider`` to tell "destroyed" from "cannot ask now": pass a
    blocking view (:meth:`gpu_node.keys.crypto.DataKeyProvider.blocking`), whose
    :class:`gpu_node.keys.crypto.KeyServiceUnavailable` ends the pass with the
    snapshot unchanged — a node restarted without its keys in memory would
    otherwise drop every sealed record of other scopes as unreadable. New
    shards are written under new names, the manifest switched atomically, and
    only then are the old shards overwritten and unlinked.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    writer = _ShardWriter(directory, MAX_SHARD_BYTES)
    removed: list[RemovedRecord] = []
    try:
        for block, record in _iter_records(directory, manifest):
            if record is None:
                removed.append(RemovedRecord(block.block_hash, None, None))
                continue
            try:
                provenance = decode_block_record(record, key_provider).key.provenance
            except BlockRestoreError:
                removed.append(RemovedRecord(block.block_hash, None, None))
                continue
            if predicate(provenance):
                removed.append(RemovedRecord(block.block_hash, record_key_id(record), provenance))
            else:
                writer.add(block.block_hash, record)
    except BaseException:
        writer.discard()
        raise
    if not removed:
        writer.discard()
        return removed
    writer.flush()
    rewritten = SnapshotManifest(
        manifest.snapshot_id,
        manifest.created_at,
        manifest.namespace,
        manifest.kv_format,
        tuple(writer.blocks),
    )
    _write_manifest(directory, rewritten)
    for name in manifest.shards:
        overwrite_and_unlink(directory / name)
    return removed


def delete_snapshot(directory: Path) -> bool:
    """Overwrite and unlink every file of a snapshot, then the directory; True when verifiably gone."""
    directory = Path(directory)
    if not directory.exists():
        return True
    for path in directory.iterdir():
        overwrite_and_unlink(path)
    directory.rmdir()
    return not directory.exists()


def complete_snapshots(root: Path) -> list[Path]:
    """Every snapshot directory under ``root`` whose manifest is written, in name order (none if
    ``root`` is absent).

    The manifest is written last: a directory without one is a write in progress or one a crash
    interrupted (:func:`delete_incomplete`), which nothing reads.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return [
        directory for directory in sorted(root.iterdir()) if (directory / MANIFEST_NAME).is_file()
    ]


def delete_incomplete(root: Path) -> int:
    """Delete every snapshot directory under ``root`` that has no manifest; returns how many.

    The manifest is written last, so such a directory is a write a crash interrupted. Nothing
    reads it — the node's inventory, warm starts and invalidations all skip it — so left there,
    its shards would be bytes neither the ledger nor any command could reach. Call at start,
    before any write can be in progress.
    """
    root = Path(root)
    if not root.is_dir():
        return 0
    incomplete = [
        directory
        for directory in root.iterdir()
        if directory.is_dir() and not (directory / MANIFEST_NAME).is_file()
    ]
    for directory in incomplete:
        delete_snapshot(directory)
    return len(incomplete)
