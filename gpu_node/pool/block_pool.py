"""The storage pool: tiers, entry states, refcounts, eviction, TTL and governed removal.

This is kvledger's vLLM ``block_pool.py``: it only allocates, frees, moves,
looks up and deletes blocks. What a request needs (longest prefix, singleflight,
miss reasons) lives in the cache manager on top. What it builds on has a module
each: its vocabulary (:mod:`gpu_node.pool.vocabulary`), the at-rest record format
(:mod:`gpu_node.pool.block_records`), the disk tier's files (:mod:`gpu_node.pool.disk_tier`),
the memory tiers over batched slot I/O (:mod:`gpu_node.pool.memory_tier`,
:mod:`gpu_node.pool.slot_io`) and the eviction order (:mod:`gpu_node.pool.eviction`).

The pool is made of parts that share one state object,
:class:`gpu_node.pool.state.PoolState` (every field, and the placement
primitives that keep them consistent), which each receives explicitly: the
batched read and promotion path (:class:`gpu_node.pool.reads.PoolReader`),
demotion and making room (:class:`gpu_node.pool.demotion.PoolDemoter`),
governed removal (:class:`gpu_node.pool.removal.PoolRemover`), warm start and
disk re-index (:class:`gpu_node.pool.warm_start.PoolWarmStart`) and sequences'
own device slots (:class:`gpu_node.pool.device_slots.DeviceSlots`). None of them
imports this module. This module is the entry state machine's public face:
lookups, references and builds, and one delegating method per part.

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
(reasoning and its one residual in :meth:`gpu_node.pool.reads.PoolReader._promote_batch`).

Entry states (docs/design.md §3)::

    ABSENT → BUILDING → READY (read under ref_count) → EVICTING → ABSENT
             BUILDING → FAILED → ABSENT

Only READY entries are returned by lookups. An entry whose bytes must go while a
reader holds it (invalidation, TTL) is *tombstoned*: it turns EVICTING, is never
returned again, and its bytes are deleted when the last reference is released —
memory referenced by a reader is never freed, overwritten or moved by the pool.

Every change of bytes is reported exactly once through :meth:`BlockPool.take_events`,
which the node publishes to the ledger.

One ``threading.RLock`` (:attr:`PoolState.lock`) guards all state: the pool is
called from the engine's worker thread and from the asyncio thread. Callers that
must look up and lock atomically hold :attr:`BlockPool.lock` across both calls. Disk-tier file I/O
happens under the lock too (one block file per demotion or disk hit), which
keeps every tier change atomic with its event. Reads are batched
(:meth:`BlockPool.read_blocks`): per-entry bookkeeping, one tensor op per tier.

TTL runs from commit and is not extended by hits: it bounds how long data may
live, and expiry deletes bytes, not just the index entry.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from threading import RLock

import torch

from events.tiers import STORAGE_TIERS, Tier
from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool.block_records import BlockRecord
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.device_slots import DeviceSlots
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.reads import PoolReader
from gpu_node.pool.removal import PoolRemover
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import (
    BlockState,
    CacheEntry,
    IndexKey,
    PoolConfig,
    PoolEvent,
    PoolStats,
    RemovalReason,
    RemovalReport,
    ReplicaSource,
)
from gpu_node.pool.warm_start import PoolWarmStart
from prefix_keys.blocks import HASH_BYTES, BlockKey, CacheProvenance


class BlockPool:
    """Three-tier block store with the entry state machine of docs/design.md §3 (see module
    docstring)."""

    def __init__(
        self,
        spec: KVBlockSpec,
        config: PoolConfig,
        key_provider: DataKeyProvider,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        state = PoolState(spec, config, key_provider, clock, wall_clock)
        self._state = state
        self._demoter = PoolDemoter(state)
        self._reader = PoolReader(state, self._demoter)
        self._remover = PoolRemover(state)
        self._warm_start = PoolWarmStart(state)
        self._device_slots = DeviceSlots(state, self._demoter)

    # --- properties ------------------------------------------------------------------

    @property
    def state(self) -> PoolState:
        """The pool's state, for inspection (tests, diagnostics); change it only through the pool's
        methods."""
        return self._state

    @property
    def lock(self) -> RLock:
        """The pool's re-entrant lock; hold it to look up and ``inc_lock_ref`` atomically."""
        return self._state.lock

    @property
    def spec(self) -> KVBlockSpec:
        return self._state.spec

    def wall_time(self) -> float:
        """Now on the pool's wall clock (seconds since the epoch): the one clock block keys'
        ``created_at`` and the application of invalidation commands are read from, so a node
        compares its blocks only with its own clock."""
        return self._state.wall_clock()

    @property
    def config(self) -> PoolConfig:
        return self._state.config

    @property
    def key_provider(self) -> DataKeyProvider:
        return self._state.key_provider

    # --- lookup ------------------------------------------------------------------------

    def state_of(self, block_hash: bytes) -> BlockState | None:
        """State of the entry for ``block_hash``; None when ABSENT."""
        state = self._state
        with state.lock:
            entry = state.entries.get(block_hash)
            return None if entry is None else entry.state

    def get_ready(self, block_hash: bytes) -> CacheEntry | None:
        """The READY entry for a hash, or None. An expired entry is expired here (bytes deleted)."""
        state = self._state
        with state.lock:
            entry = state.entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY:
                return None
            if state.is_expired(entry, state.clock()):
                state.expire_entry(entry)
                return None
            return entry

    def longest_ready_prefix(self, block_hashes: Sequence[bytes]) -> list[CacheEntry]:
        """The consecutive READY, unexpired run from index 0. Takes no references and updates
        nothing."""
        state = self._state
        with state.lock:
            now = state.clock()
            entries = state.entries
            prefix: list[CacheEntry] = []
            for block_hash in block_hashes:
                entry = entries.get(block_hash)
                if (
                    entry is None
                    or entry.state is not BlockState.READY
                    or state.is_expired(entry, now)
                ):
                    break
                prefix.append(entry)
            return prefix

    def ready_entries(self) -> list[CacheEntry]:
        """Every READY, unexpired entry (all tiers), for snapshots and inventories. Updates nothing."""
        state = self._state
        with state.lock:
            now = state.clock()
            return [
                entry
                for entry in state.entries.values()
                if entry.state is BlockState.READY and not state.is_expired(entry, now)
            ]

    # --- references --------------------------------------------------------------------

    def inc_lock_ref(self, entries: Iterable[CacheEntry]) -> None:
        """Reference READY entries so their bytes are neither freed, overwritten nor moved by the
        pool."""
        entries = list(entries)
        state = self._state
        with state.lock:
            for entry in entries:
                if (
                    state.entries.get(entry.block_hash) is not entry
                    or entry.state is not BlockState.READY
                ):
                    raise ValueError(
                        f"block {entry.block_hash.hex()[:16]} is not a READY entry of this pool"
                    )
            now = state.clock()
            lru = state.lru
            for entry in entries:
                entry.ref_count += 1
                entry.last_access = now
                lru[entry.tier].touch(entry)

    def dec_lock_ref(self, entries: Iterable[CacheEntry]) -> None:
        """Release references; a tombstoned entry's bytes are deleted when its last reference goes."""
        entries = list(entries)
        state = self._state
        with state.lock:
            counts = Counter(id(entry) for entry in entries)
            for entry in entries:
                if entry.ref_count < counts[id(entry)]:
                    raise ValueError(
                        f"block {entry.block_hash.hex()[:16]} released more often than referenced"
                    )
            for entry in entries:
                entry.ref_count -= 1
                if entry.ref_count == 0 and entry.tombstoned and entry.tier is not None:
                    assert entry.removal_reason is not None, "a tombstoned entry records why"
                    state.drop(entry, entry.removal_reason)

    # --- building --------------------------------------------------------------------------

    def guard_builds(self, predicate: Callable[[CacheProvenance], bool], duration_s: float) -> None:
        """Refuse to build blocks matching ``predicate`` for ``duration_s`` (why:
        :meth:`PoolRemover.guard_builds`)."""
        self._remover.guard_builds(predicate, duration_s)

    def begin_build(self, key: BlockKey) -> CacheEntry | None:
        """Claim a hash for building; None when it is already present in any state or a guard refuses it.

        A refused block is simply not cached: the request computes it and goes on.
        """
        state = self._state
        if len(key.block_hash) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes, got {len(key.block_hash)}")
        if key.provenance.namespace != state.config.namespace:
            raise ValueError("block key belongs to another namespace")
        if key.block_size != state.spec.block_size:
            raise ValueError(
                f"block key is for block size {key.block_size}, pool stores {state.spec.block_size}"
            )
        with state.lock:
            existing = state.entries.get(key.block_hash)
            now = state.clock()
            if (
                existing is not None
                and existing.state is BlockState.READY
                and state.is_expired(existing, now)
            ):
                state.expire_entry(existing)
                existing = state.entries.get(key.block_hash)
            if existing is not None or any(
                until > now and guard(key.provenance) for guard, until in state.build_guards
            ):
                return None
            entry = CacheEntry(key=key, state=BlockState.BUILDING, last_access=now)
            state.admit(entry)
            state.num_building += 1
            return entry

    def commit_build(
        self, entry: CacheEntry, kv: torch.Tensor, source: ReplicaSource | None = None
    ) -> bool:
        """Store a built (or, with ``source``, pulled) block on the device tier and make it READY.

        False (entry discarded) when it was tombstoned while building or the
        device tier has no slot to give. Bad ``kv`` raises ValueError and leaves
        the entry BUILDING for the caller to :meth:`fail_build`. A pulled block
        lands in the BUILDING entry its request claimed, so an invalidation or
        erasure that ran during the pull tombstoned it and it is discarded here.
        """
        state = self._state
        with state.lock:
            assert (
                state.entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING
            ), "commit_build takes the BUILDING entry begin_build returned"
            assert entry.provenance.namespace == state.config.namespace, (
                "begin_build admits only this namespace"
            )
            if tuple(kv.shape) != state.spec.block_shape:
                raise ValueError(
                    f"kv shape {tuple(kv.shape)} != block shape {state.spec.block_shape}"
                )
            if kv.dtype != state.spec.dtype:
                raise ValueError(f"kv dtype {kv.dtype} != pool dtype {state.spec.dtype}")
            if entry.tombstoned or not self._demoter.make_room(Tier.DEVICE):
                state.discard_building(entry)
                return False
            stored, slot = state.store_bytes(entry, Tier.DEVICE, kv)
            assert stored and slot is not None, "a memory tier with room always stores"
            state.make_ready(entry, slot, source)
            return True

    def fail_build(self, entry: CacheEntry) -> None:
        """BUILDING → FAILED → ABSENT: the hash may be built again."""
        state = self._state
        with state.lock:
            assert (
                state.entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING
            ), "fail_build takes the BUILDING entry begin_build returned"
            state.discard_building(entry)

    # --- paged KV: device slots owned by running sequences (gpu_node.engine.paged_kv)
    # ---------------

    @property
    def device_kv(self) -> torch.Tensor:
        """The device tier ``[num_device_blocks, *block_shape]``; attention reads and writes slots it was given."""
        return self._state.memory[Tier.DEVICE].table

    def device_usage(self) -> tuple[int, int]:
        """``(slots in use, slots in total)`` of the device tier: cached entries plus sequences' own
        slots."""
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

    def export_record(self, entry: CacheEntry) -> bytes | bytearray | None:
        """A referenced entry as an at-rest record (snapshots); None if its scope has no data key."""
        return self._warm_start.export_record(entry)

    def read_record(self, entry: CacheEntry) -> BlockRecord:
        """A referenced entry's record before sealing (:meth:`PoolWarmStart.read_record`)."""
        return self._warm_start.read_record(entry)

    def import_record(self, data: bytes, tier: Tier) -> bool:
        """Warm one READY block into a free slot of ``tier`` (never evicting); see
        :meth:`PoolWarmStart.import_record`."""
        if tier not in STORAGE_TIERS:
            raise ValueError(
                f"blocks are imported into one of {[tier.value for tier in STORAGE_TIERS]}, not {tier}"
            )
        return self._warm_start.import_record(data, tier)

    def load_disk_tier(self) -> int:
        """Re-index block files left by an earlier run; returns how many became READY
        (:class:`PoolWarmStart`)."""
        return self._warm_start.load_disk_tier()

    # --- tier management ---------------------------------------------------------------

    def demote(self, block_hash: bytes, to_tier: Tier) -> bool:
        """Move an unreferenced READY block down to ``to_tier``; False when not possible now
        (:class:`PoolDemoter`)."""
        return self._demoter.demote(block_hash, to_tier)

    def evict(self, block_hash: bytes) -> bool:
        """Drop an unreferenced READY block from whatever tier holds it; False when not possible
        now."""
        state = self._state
        with state.lock:
            entry = state.entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY or entry.ref_count > 0:
                return False
            state.drop(entry, RemovalReason.EVICTED)
            return True

    def disk_path(self, block_hash: bytes) -> Path:
        """Where the disk tier keeps (or would keep) a block's file."""
        disk = self._state.disk
        assert disk is not None, "disk paths exist only with a disk tier"
        return disk.path(block_hash)

    def expire(self) -> int:
        """Expire every READY entry past its TTL; returns how many (referenced ones are deleted on
        release)."""
        state = self._state
        with state.lock:
            now = state.clock()
            expired = [
                entry
                for entry in state.entries.values()
                if entry.state is BlockState.READY and state.is_expired(entry, now)
            ]
            for entry in expired:
                state.expire_entry(entry)
            return len(expired)

    # --- removal ------------------------------------------------------------------------

    def remove_where(
        self,
        predicate: Callable[[CacheProvenance], bool],
        reason: RemovalReason,
        candidates: IndexKey | None = None,
    ) -> RemovalReport:
        """Delete every block whose provenance matches, in every tier, with evidence
        (:meth:`PoolRemover.remove_where`)."""
        return self._remover.remove_where(predicate, reason, candidates)

    def remove_many(
        self,
        requests: Sequence[tuple[Callable[[CacheProvenance], bool], IndexKey | None]],
        reason: RemovalReason,
    ) -> list[RemovalReport]:
        """:meth:`remove_where` for each ``(predicate, candidates)``, with one bulk deletion
        (:class:`PoolRemover`)."""
        return self._remover.remove_many(requests, reason)

    # --- events and stats ------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, in order; each change of bytes appears exactly once."""
        state = self._state
        with state.lock:
            events, state.events = state.events, []
            return events

    def stats(self) -> PoolStats:
        state = self._state
        with state.lock:
            block_bytes = state.spec.block_bytes
            tier_bytes = {
                Tier.DEVICE: state.num_entries[Tier.DEVICE] * block_bytes,
                Tier.HOST: state.num_entries[Tier.HOST] * block_bytes,
                Tier.DISK: 0 if state.disk is None else state.disk.num_bytes,
            }
            return PoolStats(
                num_entries=dict(state.num_entries),
                tier_bytes=tier_bytes,
                num_building=state.num_building,
                num_evictions=state.num_evictions,
                num_expired=state.num_expired,
                num_demotions=state.num_demotions,
                num_promotions=state.num_promotions,
                num_restore_failures=state.num_restore_failures,
            )
