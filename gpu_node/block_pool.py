"""The storage pool: tiers, entry states, refcounts, eviction, TTL and governed removal.

This is kvledger's vLLM ``block_pool.py``: it only allocates, frees, moves,
looks up and deletes blocks. What a request needs (longest prefix, singleflight,
miss reasons) lives in the cache manager on top. What it builds on has a module
each: its vocabulary (:mod:`gpu_node.pool_types`), the at-rest record format
(:mod:`gpu_node.block_records`), the disk tier's files (:mod:`gpu_node.disk_tier`),
batched slot I/O (:mod:`gpu_node.slot_io`) and the eviction order
(:mod:`gpu_node.eviction`). This module is the entry state machine; the paths
that work on that state have a collaborator class each, owned by the pool and
run under its lock: the batched read and promotion path
(:class:`gpu_node.pool_reads.PoolReader`), demotion and making room
(:class:`gpu_node.pool_demotion.PoolDemoter`), governed removal
(:class:`gpu_node.pool_removal.PoolRemover`), warm start and disk re-index
(:class:`gpu_node.pool_warm_start.PoolWarmStart`) and sequences' own device
slots (:class:`gpu_node.device_slots.DeviceSlots`). They reach the pool's state
directly rather than through accessors: splitting the code must not add a call
per block on the hot read path or loosen the one lock around each change.

Tiers (docs/design.md §3): the *device* tier is one preallocated tensor
``[num_device_blocks, *block_shape]`` on the model's device, the *host* tier the
same on CPU (pinned under CUDA), the *disk* tier one file per block. Tenant and
user blocks on disk are sealed with AES-256-GCM under their scope's data key;
public blocks are plaintext with a sha256 checksum. Every block lives in exactly
one tier at a time, and every slot it leaves is zeroed and every file it leaves
removed, so deleting a block in its current tier deletes all of its bytes held
by the pool. A file whose block's data is deleted (eviction, expiry,
invalidation, restore failure) is zero-overwritten before the unlink; a file
left by a promotion to the device is only unlinked, since the block stays cached
(reasoning and its one residual in :meth:`gpu_node.pool_reads.PoolReader._promote_batch`).

Entry states (docs/design.md §3)::

    ABSENT → BUILDING → READY (read under ref_count) → EVICTING → ABSENT
             BUILDING → FAILED → ABSENT

Only READY entries are returned by lookups. An entry whose bytes must go while a
reader holds it (invalidation, TTL) is *tombstoned*: it turns EVICTING, is never
returned again, and its bytes are deleted when the last reference is released —
memory referenced by a reader is never freed, overwritten or moved by the pool.

Every change of bytes is reported exactly once through :meth:`BlockPool.take_events`,
which the node publishes to the ledger.

One ``threading.RLock`` guards all state: the pool is called from the engine's
worker thread and from the asyncio thread. Callers that must look up and lock
atomically hold :attr:`BlockPool.lock` across both calls. Disk-tier file I/O
happens under the lock too (one block file per demotion or disk hit), which
keeps every tier change atomic with its event. Reads are batched
(:meth:`BlockPool.read_blocks`): per-entry bookkeeping, one tensor op per tier.

TTL runs from commit and is not extended by hits: it bounds how long data may
live, and expiry deletes bytes, not just the index entry.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from gpu_node.block_records import BlockRecord, BlockRestoreError, decode_block_record, encode_block_record, payload_tensor
from gpu_node.crypto import DataKeyProvider
from gpu_node.device_slots import DeviceSlots
from gpu_node.disk_tier import DiskTier
from gpu_node.eviction import LRUEvictionStrategy
from gpu_node.kv_memory import lazy_zeros
from gpu_node.kv_spec import KVBlockSpec
from gpu_node.pool_demotion import PoolDemoter
from gpu_node.pool_reads import PoolReader
from gpu_node.pool_removal import PoolRemover
from gpu_node.pool_types import (
    METHOD_OVERWRITE_UNLINK,
    METHOD_ZERO_FILL,
    BlockState,
    CacheEntry,
    IndexKey,
    MovedInPool,
    PoolConfig,
    PoolEvent,
    PoolStats,
    RemovalEvidence,
    RemovalReason,
    RemovalReport,
    RemovedFromPool,
    StoredInPool,
    Tier,
    provenance_index_keys,
)
from gpu_node.pool_warm_start import PoolWarmStart
from prefix_keys.blocks import HASH_BYTES, BlockKey, CacheProvenance, CacheScope

# The pool's vocabulary and record format are defined in their own modules; callers import them from here.
__all__ = [
    "METHOD_OVERWRITE_UNLINK",
    "METHOD_ZERO_FILL",
    "BlockPool",
    "BlockRecord",
    "BlockRestoreError",
    "BlockState",
    "CacheEntry",
    "IndexKey",
    "MovedInPool",
    "PoolConfig",
    "PoolEvent",
    "PoolStats",
    "RemovalEvidence",
    "RemovalReason",
    "RemovalReport",
    "RemovedFromPool",
    "StoredInPool",
    "Tier",
    "decode_block_record",
    "encode_block_record",
    "provenance_index_keys",
]


class BlockPool:
    """Three-tier block store with the entry state machine of docs/design.md §3 (see module docstring)."""

    def __init__(
        self,
        spec: KVBlockSpec,
        config: PoolConfig,
        key_provider: DataKeyProvider,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._spec = spec
        self._config = config
        self._key_provider = key_provider
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.RLock()
        on_cuda = torch.device(config.device).type == "cuda"
        device_shape = (config.num_device_blocks, *spec.block_shape)
        host_shape = (config.num_host_blocks, *spec.block_shape)
        # CPU tiers are backed page by page as slots are first written (lowest free slot first, below); a
        # pinned host tier (CUDA) is page-locked, so it is committed in full.
        self._slots = {
            Tier.DEVICE: torch.zeros(device_shape, dtype=spec.dtype, device=config.device)
            if on_cuda
            else lazy_zeros(device_shape, spec.dtype),
            Tier.HOST: torch.zeros(host_shape, dtype=spec.dtype, pin_memory=True) if on_cuda else lazy_zeros(host_shape, spec.dtype),
        }
        # Sorted lists are valid heaps: the lowest free slot is reused first, which keeps layouts deterministic.
        # Two-dimensional views ``[slots, block_elements]`` of the same storage for batched slot I/O.
        self._flat_slots = {tier: table.view(table.shape[0], spec.num_elements) for tier, table in self._slots.items()}
        self._free_slots = {Tier.DEVICE: list(range(config.num_device_blocks)), Tier.HOST: list(range(config.num_host_blocks))}
        disk_dir = config.disk_dir if config.max_disk_blocks > 0 else None
        self._disk = None if disk_dir is None else DiskTier(disk_dir, config.namespace, spec, key_provider)
        # (predicate, until on the pool clock): builds of matching blocks are refused until then.
        self._build_guards: list[tuple[Callable[[CacheProvenance], bool], float]] = []
        self._capacity = {
            Tier.DEVICE: config.num_device_blocks,
            Tier.HOST: config.num_host_blocks,
            Tier.DISK: config.max_disk_blocks if self._disk is not None else 0,
        }
        self._entries: dict[bytes, CacheEntry] = {}
        # Provenance index: key → entries filed under it, in ``_entries`` order (both are inserted
        # into and deleted from together, see _admit/_forget), so a narrowed removal visits its
        # matches in the order a full scan would.
        self._index: dict[IndexKey, dict[bytes, CacheEntry]] = {}
        self._lru = {tier: LRUEvictionStrategy() for tier in Tier}
        self._num_entries = dict.fromkeys(Tier, 0)
        # Kept as a running total so stats() is O(1): the engine reads it after every request.
        self._num_building = 0
        self._events: list[PoolEvent] = []
        self._num_evictions = 0
        self._num_expired = 0
        self._num_demotions = 0
        self._num_promotions = 0
        self._num_restore_failures = 0
        self._reader = PoolReader(self)
        self._demoter = PoolDemoter(self)
        self._remover = PoolRemover(self)
        self._warm_start = PoolWarmStart(self)
        self._device_slots = DeviceSlots(self)

    # --- properties ------------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """The pool's re-entrant lock; hold it to look up and ``inc_lock_ref`` atomically."""
        return self._lock

    @property
    def spec(self) -> KVBlockSpec:
        return self._spec

    def wall_time(self) -> float:
        """Now on the pool's wall clock (seconds since the epoch): the one clock block keys' ``created_at`` and the
        application of invalidation commands are read from, so a node compares its blocks only with its own clock."""
        return self._wall_clock()

    @property
    def config(self) -> PoolConfig:
        return self._config

    @property
    def key_provider(self) -> DataKeyProvider:
        return self._key_provider

    # --- lookup ------------------------------------------------------------------------

    def state_of(self, block_hash: bytes) -> BlockState | None:
        """State of the entry for ``block_hash``; None when ABSENT."""
        with self._lock:
            entry = self._entries.get(block_hash)
            return None if entry is None else entry.state

    def get_ready(self, block_hash: bytes) -> CacheEntry | None:
        """The READY entry for a hash, or None. An expired entry is expired here (bytes deleted)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY:
                return None
            if self._is_expired(entry, self._clock()):
                self._expire_entry(entry)
                return None
            return entry

    def longest_ready_prefix(self, block_hashes: Sequence[bytes]) -> list[CacheEntry]:
        """The consecutive READY, unexpired run from index 0. Takes no references and updates nothing."""
        with self._lock:
            now = self._clock()
            prefix: list[CacheEntry] = []
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is None or entry.state is not BlockState.READY or self._is_expired(entry, now):
                    break
                prefix.append(entry)
            return prefix

    def ready_entries(self) -> list[CacheEntry]:
        """Every READY, unexpired entry (all tiers), for snapshots and inventories. Updates nothing."""
        with self._lock:
            now = self._clock()
            return [entry for entry in self._entries.values() if entry.state is BlockState.READY and not self._is_expired(entry, now)]

    # --- references --------------------------------------------------------------------

    def inc_lock_ref(self, entries: Iterable[CacheEntry]) -> None:
        """Reference READY entries so their bytes are neither freed, overwritten nor moved by the pool."""
        entries = list(entries)
        with self._lock:
            for entry in entries:
                if self._entries.get(entry.block_hash) is not entry or entry.state is not BlockState.READY:
                    raise ValueError(f"block {entry.block_hash.hex()[:16]} is not a READY entry of this pool")
            now = self._clock()
            for entry in entries:
                entry.ref_count += 1
                entry.last_access = now
                self._lru[entry.tier].touch(entry)

    def dec_lock_ref(self, entries: Iterable[CacheEntry]) -> None:
        """Release references; a tombstoned entry's bytes are deleted when its last reference goes."""
        entries = list(entries)
        with self._lock:
            counts = Counter(id(entry) for entry in entries)
            for entry in entries:
                if entry.ref_count < counts[id(entry)]:
                    raise ValueError(f"block {entry.block_hash.hex()[:16]} released more often than referenced")
            for entry in entries:
                entry.ref_count -= 1
                if entry.ref_count == 0 and entry.tombstoned and entry.tier is not None:
                    assert entry.removal_reason is not None, "a tombstoned entry records why"
                    self._drop(entry, entry.removal_reason)

    # --- building --------------------------------------------------------------------------

    def guard_builds(self, predicate: Callable[[CacheProvenance], bool], duration_s: float) -> None:
        """Refuse to build blocks matching ``predicate`` for ``duration_s`` (why: :meth:`PoolRemover.guard_builds`)."""
        self._remover.guard_builds(predicate, duration_s)

    def begin_build(self, key: BlockKey) -> CacheEntry | None:
        """Claim a hash for building; None when it is already present in any state or a guard refuses it.

        A refused block is simply not cached: the request computes it and goes on.
        """
        if len(key.block_hash) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes, got {len(key.block_hash)}")
        if key.provenance.namespace != self._config.namespace:
            raise ValueError("block key belongs to another namespace")
        if key.block_size != self._spec.block_size:
            raise ValueError(f"block key is for block size {key.block_size}, pool stores {self._spec.block_size}")
        with self._lock:
            existing = self._entries.get(key.block_hash)
            now = self._clock()
            if existing is not None and existing.state is BlockState.READY and self._is_expired(existing, now):
                self._expire_entry(existing)
                existing = self._entries.get(key.block_hash)
            if existing is not None or any(until > now and guard(key.provenance) for guard, until in self._build_guards):
                return None
            entry = CacheEntry(key=key, state=BlockState.BUILDING, last_access=now)
            self._admit(entry)
            self._num_building += 1
            return entry

    def commit_build(self, entry: CacheEntry, kv: torch.Tensor) -> bool:
        """Store a built block on the device tier and make it READY.

        False (entry discarded) when it was tombstoned while building or the
        device tier has no slot to give. Bad ``kv`` raises ValueError and leaves
        the entry BUILDING for the caller to :meth:`fail_build`.
        """
        with self._lock:
            assert self._entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING, (
                "commit_build takes the BUILDING entry begin_build returned"
            )
            assert entry.provenance.namespace == self._config.namespace, "begin_build admits only this namespace"
            if tuple(kv.shape) != self._spec.block_shape:
                raise ValueError(f"kv shape {tuple(kv.shape)} != block shape {self._spec.block_shape}")
            if kv.dtype != self._spec.dtype:
                raise ValueError(f"kv dtype {kv.dtype} != pool dtype {self._spec.dtype}")
            if entry.tombstoned or not self._demoter.make_room(Tier.DEVICE):
                self._discard_building(entry)
                return False
            stored, slot = self._store_bytes(entry, Tier.DEVICE, kv)
            assert stored and slot is not None, "a memory tier with room always stores"
            self._make_ready(entry, slot)
            return True

    def fail_build(self, entry: CacheEntry) -> None:
        """BUILDING → FAILED → ABSENT: the hash may be built again."""
        with self._lock:
            assert self._entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING, (
                "fail_build takes the BUILDING entry begin_build returned"
            )
            self._discard_building(entry)

    # --- paged KV: device slots owned by running sequences (gpu_node.paged_kv) ---------------

    @property
    def device_kv(self) -> torch.Tensor:
        """The device tier ``[num_device_blocks, *block_shape]``; attention reads and writes slots it was given."""
        return self._slots[Tier.DEVICE]

    def device_usage(self) -> tuple[int, int]:
        """``(slots in use, slots in total)`` of the device tier: cached entries plus sequences' own slots."""
        return self._device_slots.usage()

    def allocate_device_slots(self, num_slots: int) -> list[int] | None:
        """Take ``num_slots`` device slots for a sequence's own KV, demoting cached blocks; None when there is no room."""
        return self._device_slots.allocate(num_slots)

    def free_device_slots(self, slots: Sequence[int]) -> None:
        """Zero and return slots taken with :meth:`allocate_device_slots`."""
        self._device_slots.free(slots)

    def commit_slot(self, entry: CacheEntry, slot: int) -> bool:
        """Make a BUILDING entry READY in the caller's own device ``slot``, referenced once; False if tombstoned."""
        return self._device_slots.commit(entry, slot)

    # --- reading and warm start -----------------------------------------------------------

    def read_blocks(self, entries: Sequence[CacheEntry], promote: bool = True) -> torch.Tensor:
        """KV of referenced entries as ``[n, *block_shape]`` (fresh memory), promoting host/disk hits (:class:`PoolReader`)."""
        return self._reader.read(entries, promote)

    def export_record(self, entry: CacheEntry) -> bytes | None:
        """A referenced entry as an at-rest record (snapshots); None if its scope has no data key."""
        return self._warm_start.export_record(entry)

    def import_record(self, data: bytes, tier: Tier) -> bool:
        """Warm one READY block into a free slot of ``tier`` (never evicting); see :meth:`PoolWarmStart.import_record`."""
        return self._warm_start.import_record(data, tier)

    def load_disk_tier(self) -> int:
        """Re-index block files left by an earlier run; returns how many became READY (:class:`PoolWarmStart`)."""
        return self._warm_start.load_disk_tier()

    # --- tier management ---------------------------------------------------------------

    def demote(self, block_hash: bytes, to_tier: Tier) -> bool:
        """Move an unreferenced READY block down to ``to_tier``; False when not possible now (:class:`PoolDemoter`)."""
        return self._demoter.demote(block_hash, to_tier)

    def evict(self, block_hash: bytes) -> bool:
        """Drop an unreferenced READY block from whatever tier holds it; False when not possible now."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY or entry.ref_count > 0:
                return False
            self._drop(entry, RemovalReason.EVICTED)
            return True

    def disk_path(self, block_hash: bytes) -> Path:
        """Where the disk tier keeps (or would keep) a block's file."""
        assert self._disk is not None, "disk paths exist only with a disk tier"
        return self._disk.path(block_hash)

    def expire(self) -> int:
        """Expire every READY entry past its TTL; returns how many (referenced ones are deleted on release)."""
        with self._lock:
            now = self._clock()
            expired = [entry for entry in self._entries.values() if entry.state is BlockState.READY and self._is_expired(entry, now)]
            for entry in expired:
                self._expire_entry(entry)
            return len(expired)

    # --- removal ------------------------------------------------------------------------

    def remove_where(
        self, predicate: Callable[[CacheProvenance], bool], reason: RemovalReason, candidates: IndexKey | None = None
    ) -> RemovalReport:
        """Delete every block whose provenance matches, in every tier, with evidence (:meth:`PoolRemover.remove_where`)."""
        return self._remover.remove_where(predicate, reason, candidates)

    def remove_many(
        self, requests: Sequence[tuple[Callable[[CacheProvenance], bool], IndexKey | None]], reason: RemovalReason
    ) -> list[RemovalReport]:
        """:meth:`remove_where` for each ``(predicate, candidates)``, with one bulk deletion (:class:`PoolRemover`)."""
        return self._remover.remove_many(requests, reason)

    # --- events and stats ------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, in order; each change of bytes appears exactly once."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def stats(self) -> PoolStats:
        with self._lock:
            tier_bytes = {
                Tier.DEVICE: self._num_entries[Tier.DEVICE] * self._spec.block_bytes,
                Tier.HOST: self._num_entries[Tier.HOST] * self._spec.block_bytes,
                Tier.DISK: 0 if self._disk is None else self._disk.num_bytes,
            }
            return PoolStats(
                num_entries=dict(self._num_entries),
                tier_bytes=tier_bytes,
                num_building=self._num_building,
                num_evictions=self._num_evictions,
                num_expired=self._num_expired,
                num_demotions=self._num_demotions,
                num_promotions=self._num_promotions,
                num_restore_failures=self._num_restore_failures,
            )

    # --- internals ---------------------------------------------------------------------------

    def _is_expired(self, entry: CacheEntry, now: float) -> bool:
        return entry.expires_at is not None and entry.expires_at <= now

    def _expire_entry(self, entry: CacheEntry) -> None:
        if entry.ref_count > 0:
            self._tombstone(entry, RemovalReason.EXPIRED)
        else:
            self._drop(entry, RemovalReason.EXPIRED)

    def _tombstone(self, entry: CacheEntry, reason: RemovalReason) -> None:
        """No further hits: a READY entry turns EVICTING and leaves the eviction order."""
        entry.tombstoned = True
        entry.removal_reason = reason
        if entry.state is BlockState.READY:
            entry.state = BlockState.EVICTING
            self._lru[entry.tier].remove(entry)

    def _make_ready(self, entry: CacheEntry, slot: int) -> None:
        """BUILDING → READY in device ``slot`` (its KV already there); the TTL starts now."""
        now = self._clock()
        ttl_s = self._config.ttl_s[entry.provenance.scope]
        entry.state = BlockState.READY
        self._num_building -= 1
        entry.last_access = now
        entry.expires_at = None if ttl_s is None else now + ttl_s
        self._place(entry, Tier.DEVICE, slot)
        self._events.append(StoredInPool(entry.key, Tier.DEVICE))

    def _discard_building(self, entry: CacheEntry) -> None:
        entry.state = BlockState.FAILED
        self._num_building -= 1
        self._forget(entry)

    def _admit(self, entry: CacheEntry) -> None:
        """Enter an entry under its hash and in the provenance index."""
        block_hash = entry.block_hash
        self._entries[block_hash] = entry
        index = self._index
        for key in provenance_index_keys(entry.provenance):
            bucket = index.get(key)
            if bucket is None:
                index[key] = {block_hash: entry}
            else:
                bucket[block_hash] = entry

    def _forget(self, entry: CacheEntry) -> None:
        """Remove an entry (the one under its hash) from ``_entries`` and the provenance index."""
        block_hash = entry.block_hash
        del self._entries[block_hash]
        index = self._index
        for key in provenance_index_keys(entry.provenance):
            bucket = index.get(key)
            if bucket is not None and bucket.pop(block_hash, None) is not None and not bucket:
                del index[key]

    def _candidates(self, key: IndexKey) -> Iterable[CacheEntry]:
        """Entries filed under ``key``, in ``_entries`` order (a live view: materialize before changing the pool)."""
        if key[0] == "namespace":
            return self._entries.values() if key[1] == self._config.namespace else ()
        bucket = self._index.get(key)
        return () if bucket is None else bucket.values()

    def _place(self, entry: CacheEntry, tier: Tier, slot: int | None) -> None:
        entry.tier = tier
        entry.slot = slot
        self._num_entries[tier] += 1
        if entry.state is BlockState.READY:
            self._lru[tier].insert(entry)

    def _unplace(self, entry: CacheEntry) -> None:
        assert entry.tier is not None, "only placed entries leave a tier"
        if entry.state is BlockState.READY:
            self._lru[entry.tier].remove(entry)
        self._num_entries[entry.tier] -= 1
        entry.tier = None
        entry.slot = None

    def _has_room(self, tier: Tier) -> bool:
        if tier is Tier.DISK:
            return self._num_entries[Tier.DISK] < self._capacity[Tier.DISK]
        return bool(self._free_slots[tier])

    def _read_payload(self, entry: CacheEntry) -> torch.Tensor:
        """The entry's KV: a view of its slot, or the decoded file (a corrupt one is dropped and raises)."""
        if entry.tier is not Tier.DISK:
            return self._slots[entry.tier][entry.slot]
        try:
            record = self._disk.read_record(entry.block_hash)
        except BlockRestoreError as error:
            self._drop(entry, RemovalReason.RESTORE_FAILED)
            raise BlockRestoreError(entry.block_hash, error.reason) from None
        return payload_tensor(record.payload, self._spec)

    def _store_bytes(self, entry: CacheEntry, tier: Tier, kv: torch.Tensor) -> tuple[bool, int | None]:
        """Write ``kv`` into ``tier``, which has room: a free device/host slot (the lowest) or the block's file.

        Returns ``(stored, slot)``: ``slot`` is the slot taken (None on disk); not
        stored only when the disk tier cannot seal the block (its scope has no
        data key). Placing the entry is the caller's: a build, a demotion or an import.
        """
        if tier is Tier.DISK:
            return self._disk.write(self._warm_start.record(entry, kv)), None
        slot = heapq.heappop(self._free_slots[tier])
        self._slots[tier][slot].copy_(kv)
        return True, slot

    def _drop(self, entry: CacheEntry, reason: RemovalReason, cleared: bool | None = None) -> RemovalEvidence:
        """Delete the bytes of an entry in its tier, forget it, count it and report it (EVICTING → ABSENT).

        ``cleared``: see :meth:`_delete_bytes`.
        """
        tier = entry.tier
        assert tier is not None, "only placed entries can be dropped"
        if entry.state is BlockState.READY:
            self._lru[tier].remove(entry)
        entry.state = BlockState.EVICTING
        entry.tombstoned = True
        entry.removal_reason = reason
        evidence = self._delete_bytes(entry, cleared)
        self._num_entries[tier] -= 1
        entry.tier = None
        entry.slot = None
        if self._entries.get(entry.block_hash) is entry:
            self._forget(entry)
        if reason is RemovalReason.EVICTED:
            self._num_evictions += 1
        elif reason is RemovalReason.EXPIRED:
            self._num_expired += 1
        elif reason is RemovalReason.RESTORE_FAILED:
            self._num_restore_failures += 1
        self._events.append(RemovedFromPool(entry.block_hash, tier, reason, evidence))
        return evidence

    def _delete_bytes(self, entry: CacheEntry, cleared: bool | None = None) -> RemovalEvidence:
        """Zero the entry's slot (read back as zero) or zero+unlink its file (checked absent).

        ``cleared`` is the outcome of that deletion when the caller already did
        it (:meth:`PoolRemover._clear_bytes`, for a batch removal); None: delete now.
        """
        if entry.tier is Tier.DISK:
            file_absent = self._disk.delete(entry.block_hash) if cleared is None else cleared
            key_id = self._disk.forget(entry.block_hash)
            encrypted = entry.provenance.scope != CacheScope.PUBLIC
            return RemovalEvidence(entry.block_hash, Tier.DISK, METHOD_OVERWRITE_UNLINK, encrypted, file_absent, key_id)
        if cleared is None:
            slot_tensor = self._slots[entry.tier][entry.slot]
            slot_tensor.zero_()
            cleared = not bool(slot_tensor.any())
        heapq.heappush(self._free_slots[entry.tier], entry.slot)
        return RemovalEvidence(entry.block_hash, entry.tier, METHOD_ZERO_FILL, False, cleared)
