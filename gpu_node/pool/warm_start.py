"""Warm start: blocks in and out of the pool as at-rest records (snapshots) and re-indexing the disk
tier.

Its own part of the pool because it is the one path where blocks enter the
pool READY without being built (snapshot import, files left by an earlier run)
or leave it as records (snapshot export; the disk tier's files are written from
the same :meth:`gpu_node.pool.state.PoolState.record`): it converts expiries
between the pool's monotonic clock and wall-clock time and checks records
(namespace, KV format, expiry) that a build never needs. It runs under the
state's lock and places entries through the state's placement primitives.
"""

from __future__ import annotations

from pathlib import Path

from events.tiers import Tier
from gpu_node.keys.crypto import overwrite_and_unlink
from gpu_node.pool.block_records import (
    BlockRecord,
    BlockRestoreError,
    check_record,
    decode_block_record,
    encode_block_record,
    payload_tensor,
)
from gpu_node.pool.disk_tier import is_sealed
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import (
    METHOD_OVERWRITE_UNLINK,
    BlockState,
    CacheEntry,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
)


class PoolWarmStart:
    """Serves the pool's record export/import and ``load_disk_tier`` on one pool state."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def export_record(self, entry: CacheEntry) -> bytes | bytearray | None:
        """A referenced entry as an at-rest record (snapshots); None if its scope has no data key."""
        state = self._state
        with state.lock:
            return encode_block_record(self.read_record(entry), state.key_provider)

    def read_record(self, entry: CacheEntry) -> BlockRecord:
        """A referenced entry's identity and a copy of its KV, not yet sealed.

        Apart from :meth:`export_record` so that a caller holding the model worker (a peer
        pull) copies the bytes there and seals them elsewhere.
        """
        state = self._state
        with state.lock:
            if entry.ref_count <= 0:
                raise ValueError("a record is read from an entry referenced with inc_lock_ref")
            if entry.tombstoned or entry.tier is None:
                raise BlockRestoreError(
                    entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED)
                )
            return state.record(entry, state.read_payload(entry))

    def import_record(self, data: bytes, tier: Tier) -> bool:
        """Warm one READY block into a free slot of ``tier`` (never evicting).

        False when the block is present, expired or the tier has no free room;
        :class:`BlockRestoreError` when the record is corrupt, undecryptable or
        of another namespace or KV format.
        """
        state = self._state
        record = decode_block_record(data, state.key_provider)
        check_record(record, record.key.block_hash, state.config.namespace, state.spec)
        with state.lock:
            now = state.clock()
            expires_at = state.expiry_from_wall(record.expires_at_wall)
            if record.key.block_hash in state.entries or (
                expires_at is not None and expires_at <= now
            ):
                return False
            if not state.has_room(tier):
                return False
            entry = CacheEntry(
                key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at
            )
            stored, slot = state.store_bytes(
                entry, tier, payload_tensor(record.payload, state.spec)
            )
            if not stored:
                return False
            state.admit(entry)
            state.place(entry, tier, slot)
            state.events.append(StoredInPool(entry.key, tier))
            return True

    def load_disk_tier(self) -> int:
        """Re-index block files left by an earlier run; returns how many became READY.

        Corrupt, undecryptable, foreign-namespace and expired files are deleted (and reported as
        removed), as are files beyond ``max_disk_blocks``. Re-indexed blocks changed no bytes, so
        they produce no event; the node reports them in its inventory. Raises
        :class:`gpu_node.keys.crypto.KeyServiceUnavailable` when a file's key can be neither found
        nor known destroyed now; the files indexed until then stay indexed, so calling again resumes
        (see :meth:`gpu_node.engine.async_engine.AsyncEngine.start`)."""
        state = self._state
        if state.disk is None:
            return 0
        with state.lock:
            num_loaded = 0
            now = state.clock()
            for path, block_hash in state.disk.stored_files():
                if block_hash in state.entries:
                    continue
                data, record, meta = state.disk.open_stored(path, block_hash)
                encrypted = is_sealed(data)
                if record is None:
                    self._delete_stray_file(
                        path, block_hash, encrypted, RemovalReason.RESTORE_FAILED
                    )
                    continue
                expires_at = state.expiry_from_wall(record.expires_at_wall)
                if expires_at is not None and expires_at <= now:
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EXPIRED)
                    continue
                if not state.has_room(Tier.DISK):
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EVICTED)
                    continue
                entry = CacheEntry(
                    key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at
                )
                state.admit(entry)
                state.disk.adopt(block_hash, data, meta)
                state.place(entry, Tier.DISK, None)
                num_loaded += 1
            return num_loaded

    def _delete_stray_file(
        self, path: Path, block_hash: bytes, encrypted: bool, reason: RemovalReason
    ) -> None:
        """Delete an unindexed block file found at start and report it, so the ledger drops its
        placement."""
        state = self._state
        verified = overwrite_and_unlink(path)
        evidence = RemovalEvidence(
            block_hash, Tier.DISK, METHOD_OVERWRITE_UNLINK, encrypted, verified
        )
        state.count_removal(reason)
        state.events.append(RemovedFromPool(block_hash, Tier.DISK, reason, evidence))
