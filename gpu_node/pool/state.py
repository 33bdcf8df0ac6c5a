"""The block pool's state and the placement primitives every path changes it through.

One object holds everything the pool knows — entries by hash, the provenance
index, the memory tiers' slot tables and free slots, the disk tier, the LRU
order per tier, the events not yet taken and the counters — so that the pool
(:class:`gpu_node.pool.block_pool.BlockPool`) and its parts (reads, demotion,
removal, warm start, device slots) each receive it explicitly and none reaches
into another's private members. The primitives here are the ones more than one
part needs: enter and forget an entry, place and unplace it in a tier, store,
read and delete its bytes, tombstone and drop it. Each keeps the invariants
that tie the fields together (an entry is in ``lru[tier]`` exactly while READY
and placed, ``num_entries`` counts placed entries, every slot or file a block
leaves is zeroed or removed, every change of bytes appends one event).

Nothing here takes the lock: every caller holds :attr:`PoolState.lock` around
a whole change, so a change is atomic with its event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from events.tiers import STORAGE_TIERS, Tier
from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool.block_records import BlockRecord, BlockRestoreError, payload_tensor, tensor_bytes
from gpu_node.pool.disk_tier import DiskTier
from gpu_node.pool.eviction import LRUEvictionStrategy
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.memory_tier import MemoryTier, lazy_zeros
from gpu_node.pool.vocabulary import (
    METHOD_OVERWRITE_UNLINK,
    METHOD_ZERO_FILL,
    BlockState,
    CacheEntry,
    IndexKey,
    PoolConfig,
    PoolEvent,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
    ReplicaSource,
    StoredInPool,
    provenance_index_keys,
)
from prefix_keys.blocks import CacheProvenance, CacheScope

BuildGuard = tuple[Callable[[CacheProvenance], bool], float]
"""``(predicate, until on the pool clock)``: builds of matching blocks are refused until then."""


class PoolState:
    """Everything one block pool holds (see module docstring); callers hold :attr:`lock` around every change."""

    def __init__(
        self,
        spec: KVBlockSpec,
        config: PoolConfig,
        key_provider: DataKeyProvider,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.config = config
        self.key_provider = key_provider
        self.clock = clock
        self.wall_clock = wall_clock
        self.lock = threading.RLock()
        on_cuda = torch.device(config.device).type == "cuda"
        device_shape = (config.num_device_blocks, *spec.block_shape)
        host_shape = (config.num_host_blocks, *spec.block_shape)
        # CPU tiers are backed page by page as slots are first written (lowest free slot first); a
        # pinned host tier (CUDA) is page-locked, so it is committed in full.
        self.memory = {
            Tier.DEVICE: MemoryTier(
                torch.zeros(device_shape, dtype=spec.dtype, device=config.device)
                if on_cuda
                else lazy_zeros(device_shape, spec.dtype),
                spec,
            ),
            Tier.HOST: MemoryTier(
                torch.zeros(host_shape, dtype=spec.dtype, pin_memory=True)
                if on_cuda
                else lazy_zeros(host_shape, spec.dtype),
                spec,
            ),
        }
        disk_dir = config.disk_dir if config.max_disk_blocks > 0 else None
        self.disk = (
            None if disk_dir is None else DiskTier(disk_dir, config.namespace, spec, key_provider)
        )
        self.capacity = {
            Tier.DEVICE: config.num_device_blocks,
            Tier.HOST: config.num_host_blocks,
            Tier.DISK: config.max_disk_blocks if self.disk is not None else 0,
        }
        self.build_guards: list[BuildGuard] = []
        self.entries: dict[bytes, CacheEntry] = {}
        # Provenance index: key → entries filed under it, in ``entries`` order (both are inserted
        # into and deleted from together, see admit/forget), so a narrowed removal visits its
        # matches in the order a full scan would.
        self.index: dict[IndexKey, dict[bytes, CacheEntry]] = {}
        self.lru = {tier: LRUEvictionStrategy() for tier in STORAGE_TIERS}
        self.num_entries = dict.fromkeys(STORAGE_TIERS, 0)
        # Kept as a running total so stats() is O(1): the engine reads it after every request.
        self.num_building = 0
        self.events: list[PoolEvent] = []
        self.num_evictions = 0
        self.num_expired = 0
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_restore_failures = 0

    # --- entries and the provenance index ----------------------------------------------------

    def admit(self, entry: CacheEntry) -> None:
        """Enter an entry under its hash and in the provenance index."""
        block_hash = entry.block_hash
        self.entries[block_hash] = entry
        index = self.index
        for key in provenance_index_keys(entry.provenance):
            bucket = index.get(key)
            if bucket is None:
                index[key] = {block_hash: entry}
            else:
                bucket[block_hash] = entry

    def forget(self, entry: CacheEntry) -> None:
        """Remove an entry (the one under its hash) from ``entries`` and the provenance index."""
        block_hash = entry.block_hash
        del self.entries[block_hash]
        index = self.index
        for key in provenance_index_keys(entry.provenance):
            bucket = index.get(key)
            if bucket is not None and bucket.pop(block_hash, None) is not None and not bucket:
                del index[key]

    def candidates(self, key: IndexKey) -> Iterable[CacheEntry]:
        """Entries filed under ``key``, in ``entries`` order (a live view: materialize before changing the pool)."""
        if key[0] == "namespace":
            return self.entries.values() if key[1] == self.config.namespace else ()
        bucket = self.index.get(key)
        return () if bucket is None else bucket.values()

    # --- entry states --------------------------------------------------------------------------

    def is_expired(self, entry: CacheEntry, now: float) -> bool:
        return entry.expires_at is not None and entry.expires_at <= now

    def expire_entry(self, entry: CacheEntry) -> None:
        """Delete an expired entry's bytes now, or on its last release when it is referenced."""
        if entry.ref_count > 0:
            self.tombstone(entry, RemovalReason.EXPIRED)
        else:
            self.drop(entry, RemovalReason.EXPIRED)

    def tombstone(self, entry: CacheEntry, reason: RemovalReason) -> None:
        """No further hits: a READY entry turns EVICTING and leaves the eviction order."""
        entry.tombstoned = True
        entry.removal_reason = reason
        if entry.state is BlockState.READY:
            entry.state = BlockState.EVICTING
            self.lru[entry.tier].remove(entry)

    def make_ready(self, entry: CacheEntry, slot: int, source: ReplicaSource | None = None) -> None:
        """BUILDING → READY in device ``slot`` (its KV already there); the TTL starts now. ``source``: a pulled replica's."""
        now = self.clock()
        ttl_s = self.config.ttl_s[entry.provenance.scope]
        entry.state = BlockState.READY
        self.num_building -= 1
        entry.last_access = now
        entry.expires_at = None if ttl_s is None else now + ttl_s
        self.place(entry, Tier.DEVICE, slot)
        self.events.append(StoredInPool(entry.key, Tier.DEVICE, source))

    def discard_building(self, entry: CacheEntry) -> None:
        """BUILDING → FAILED → ABSENT."""
        entry.state = BlockState.FAILED
        self.num_building -= 1
        self.forget(entry)

    # --- placement -----------------------------------------------------------------------------

    def place(self, entry: CacheEntry, tier: Tier, slot: int | None) -> None:
        """Record that the entry's bytes are in ``tier`` (``slot`` of a memory tier; None on disk)."""
        entry.tier = tier
        entry.slot = slot
        self.num_entries[tier] += 1
        if entry.state is BlockState.READY:
            self.lru[tier].insert(entry)

    def unplace(self, entry: CacheEntry) -> None:
        """Record that the entry's bytes left its tier (the caller moved or deleted them)."""
        assert entry.tier is not None, "only placed entries leave a tier"
        if entry.state is BlockState.READY:
            self.lru[entry.tier].remove(entry)
        self.num_entries[entry.tier] -= 1
        entry.tier = None
        entry.slot = None

    def has_room(self, tier: Tier) -> bool:
        if tier is Tier.DISK:
            return self.num_entries[Tier.DISK] < self.capacity[Tier.DISK]
        return self.memory[tier].has_room()

    # --- bytes ---------------------------------------------------------------------------------

    def read_payload(self, entry: CacheEntry) -> torch.Tensor:
        """The entry's KV: a view of its slot, or the decoded file (a corrupt one is dropped and
        raises)."""
        if entry.tier is not Tier.DISK:
            return self.memory[entry.tier].table[entry.slot]
        try:
            record = self.disk.read_record(entry.block_hash)
        except BlockRestoreError as error:
            self.drop(entry, RemovalReason.RESTORE_FAILED)
            raise BlockRestoreError(entry.block_hash, error.reason) from None
        return payload_tensor(record.payload, self.spec)

    def store_bytes(
        self, entry: CacheEntry, tier: Tier, kv: torch.Tensor
    ) -> tuple[bool, int | None]:
        """Write ``kv`` into ``tier``, which has room: a free device/host slot (the lowest) or the
        block's file.

        Returns ``(stored, slot)``: ``slot`` is the slot taken (None on disk); not
        stored only when the disk tier cannot seal the block (its scope has no
        data key). Placing the entry is the caller's: a build, a demotion or an import.
        """
        if tier is Tier.DISK:
            return self.disk.write(self.record(entry, kv)), None
        memory = self.memory[tier]
        slot = memory.take()
        memory.write(slot, kv)
        return True, slot

    def drop(
        self, entry: CacheEntry, reason: RemovalReason, cleared: bool | None = None
    ) -> RemovalEvidence:
        """Delete the bytes of an entry in its tier, forget it, count it and report it (EVICTING →
        ABSENT).

        ``cleared``: see :meth:`delete_bytes`.
        """
        tier = entry.tier
        assert tier is not None, "only placed entries can be dropped"
        if entry.state is BlockState.READY:
            self.lru[tier].remove(entry)
        entry.state = BlockState.EVICTING
        entry.tombstoned = True
        entry.removal_reason = reason
        evidence = self.delete_bytes(entry, cleared)
        self.num_entries[tier] -= 1
        entry.tier = None
        entry.slot = None
        if self.entries.get(entry.block_hash) is entry:
            self.forget(entry)
        self.count_removal(reason)
        self.events.append(RemovedFromPool(entry.block_hash, tier, reason, evidence))
        return evidence

    def count_removal(self, reason: RemovalReason) -> None:
        """Count a block whose data was deleted for ``reason`` (an invalidation has no counter)."""
        if reason is RemovalReason.EVICTED:
            self.num_evictions += 1
        elif reason is RemovalReason.EXPIRED:
            self.num_expired += 1
        elif reason is RemovalReason.RESTORE_FAILED:
            self.num_restore_failures += 1

    def delete_bytes(self, entry: CacheEntry, cleared: bool | None = None) -> RemovalEvidence:
        """Zero the entry's slot (read back as zero) and free it, or zero+unlink its file (checked
        absent).

        ``cleared`` is the outcome of that deletion when the caller already did
        it (a batch removal, :class:`gpu_node.pool.removal.PoolRemover`); None: delete now.
        """
        if entry.tier is Tier.DISK:
            file_absent = self.disk.delete(entry.block_hash) if cleared is None else cleared
            key_id = self.disk.forget(entry.block_hash)
            encrypted = entry.provenance.scope != CacheScope.PUBLIC
            return RemovalEvidence(
                entry.block_hash, Tier.DISK, METHOD_OVERWRITE_UNLINK, encrypted, file_absent, key_id
            )
        memory = self.memory[entry.tier]
        if cleared is None:
            cleared = memory.clear(entry.slot)
        else:
            memory.release((entry.slot,))
        return RemovalEvidence(entry.block_hash, entry.tier, METHOD_ZERO_FILL, False, cleared)

    # --- at-rest records and the two clocks ------------------------------------------------------

    def record(self, entry: CacheEntry, kv: torch.Tensor) -> BlockRecord:
        """``entry`` with KV ``kv`` as an at-rest record (snapshot shards and the disk tier's files
        alike)."""
        return BlockRecord(
            entry.key, self.spec.kv_format, self.wall_expiry(entry), tensor_bytes(kv)
        )

    def wall_expiry(self, entry: CacheEntry) -> float | None:
        """Expiry in wall-clock time, so a TTL survives a restart (the pool clock is monotonic)."""
        return (
            None
            if entry.expires_at is None
            else self.wall_clock() + (entry.expires_at - self.clock())
        )

    def expiry_from_wall(self, expires_at_wall: float | None) -> float | None:
        """A record's wall-clock expiry on the pool's monotonic clock (the inverse of
        :meth:`wall_expiry`)."""
        return (
            None
            if expires_at_wall is None
            else self.clock() + (expires_at_wall - self.wall_clock())
        )
