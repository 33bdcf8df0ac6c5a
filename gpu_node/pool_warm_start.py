"""Warm start: blocks in and out of the pool as at-rest records (snapshots) and re-indexing the disk tier.

Split from :class:`gpu_node.block_pool.BlockPool` because it is the one path
where blocks enter the pool READY without being built (snapshot import, files
left by an earlier run) or leave it as records (snapshot export; the disk
tier's files are written from the same :meth:`PoolWarmStart.record`): it
converts expiries between the pool's monotonic clock and wall-clock time and
checks records (namespace, KV format, expiry) that a build never needs. It runs
under the pool's lock and places entries through the pool's own bookkeeping.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpu_node.block_records import (
    BlockRecord,
    BlockRestoreError,
    check_record,
    decode_block_record,
    encode_block_record,
    payload_tensor,
    tensor_bytes,
)
from gpu_node.crypto import overwrite_and_unlink
from gpu_node.disk_tier import is_sealed
from gpu_node.pool_types import (
    METHOD_OVERWRITE_UNLINK,
    BlockState,
    CacheEntry,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
    Tier,
)

if TYPE_CHECKING:
    from gpu_node.block_pool import BlockPool


class PoolWarmStart:
    """Serves the pool's record export/import and :meth:`BlockPool.load_disk_tier`; operates on its pool's state."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def export_record(self, entry: CacheEntry) -> bytes | None:
        """A referenced entry as an at-rest record (snapshots); None if its scope has no data key."""
        pool = self._pool
        with pool._lock:
            if entry.ref_count <= 0:
                raise ValueError("export_record needs an entry referenced with inc_lock_ref")
            if entry.tombstoned or entry.tier is None:
                raise BlockRestoreError(entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED))
            kv = pool._read_payload(entry)
            return encode_block_record(self.record(entry, kv), pool._key_provider)

    def import_record(self, data: bytes, tier: Tier) -> bool:
        """Warm one READY block into a free slot of ``tier`` (never evicting).

        False when the block is present, expired or the tier has no free room;
        :class:`BlockRestoreError` when the record is corrupt, undecryptable or
        of another namespace or KV format.
        """
        pool = self._pool
        record = decode_block_record(data, pool._key_provider)
        check_record(record, record.key.block_hash, pool._config.namespace, pool._spec)
        with pool._lock:
            now = pool._clock()
            expires_at = self._expiry_from_wall(record.expires_at_wall)
            if record.key.block_hash in pool._entries or (expires_at is not None and expires_at <= now):
                return False
            if not pool._has_room(tier):
                return False
            entry = CacheEntry(key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at)
            stored, slot = pool._store_bytes(entry, tier, payload_tensor(record.payload, pool._spec))
            if not stored:
                return False
            pool._admit(entry)
            pool._place(entry, tier, slot)
            pool._events.append(StoredInPool(entry.key, tier))
            return True

    def load_disk_tier(self) -> int:
        """Re-index block files left by an earlier run; returns how many became READY.

        Corrupt, undecryptable, foreign-namespace and expired files are deleted
        (and reported as removed), as are files beyond ``max_disk_blocks``.
        Re-indexed blocks changed no bytes, so they produce no event; the node
        reports them in its inventory. Raises
        :class:`gpu_node.crypto.KeyServiceUnavailable` when a file's key can be
        neither found nor known destroyed now; the files indexed until then stay
        indexed, so calling again resumes (see :meth:`gpu_node.engine.AsyncEngine.start`).
        """
        pool = self._pool
        if pool._disk is None:
            return 0
        with pool._lock:
            num_loaded = 0
            now = pool._clock()
            for path, block_hash in pool._disk.stored_files():
                if block_hash in pool._entries:
                    continue
                data, record, meta = pool._disk.open_stored(path, block_hash)
                encrypted = is_sealed(data)
                if record is None:
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.RESTORE_FAILED)
                    continue
                expires_at = self._expiry_from_wall(record.expires_at_wall)
                if expires_at is not None and expires_at <= now:
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EXPIRED)
                    continue
                if not pool._has_room(Tier.DISK):
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EVICTED)
                    continue
                entry = CacheEntry(key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at)
                pool._admit(entry)
                pool._disk.adopt(block_hash, data, meta)
                pool._place(entry, Tier.DISK, None)
                num_loaded += 1
            return num_loaded

    def _delete_stray_file(self, path: Path, block_hash: bytes, encrypted: bool, reason: RemovalReason) -> None:
        """Delete an unindexed block file found at start and report it, so the ledger drops its placement."""
        pool = self._pool
        verified = overwrite_and_unlink(path)
        evidence = RemovalEvidence(block_hash, Tier.DISK, METHOD_OVERWRITE_UNLINK, encrypted, verified)
        if reason is RemovalReason.EXPIRED:
            pool._num_expired += 1
        elif reason is RemovalReason.RESTORE_FAILED:
            pool._num_restore_failures += 1
        else:
            pool._num_evictions += 1
        pool._events.append(RemovedFromPool(block_hash, Tier.DISK, reason, evidence))

    def record(self, entry: CacheEntry, kv: torch.Tensor) -> BlockRecord:
        """``entry`` with KV ``kv`` as an at-rest record (snapshot shards and the disk tier's files alike)."""
        return BlockRecord(entry.key, self._pool._spec.kv_format, self._wall_expiry(entry), tensor_bytes(kv))

    def _wall_expiry(self, entry: CacheEntry) -> float | None:
        """Expiry in wall-clock time, so a TTL survives a restart (the pool clock is monotonic)."""
        pool = self._pool
        return None if entry.expires_at is None else pool._wall_clock() + (entry.expires_at - pool._clock())

    def _expiry_from_wall(self, expires_at_wall: float | None) -> float | None:
        """A record's wall-clock expiry on the pool's monotonic clock (the inverse of :meth:`_wall_expiry`)."""
        pool = self._pool
        return None if expires_at_wall is None else pool._clock() + (expires_at_wall - pool._wall_clock())
