"""The storage pool: tiers, entry states, refcounts, eviction, TTL and governed removal.

This is kvledger's vLLM ``block_pool.py``: it only allocates, frees, moves,
looks up and deletes blocks. What a request needs (longest prefix, singleflight,
miss reasons) lives in the cache manager on top. What it builds on has a module
each: the at-rest record format (:mod:`gpu_node.block_records`), the disk tier's
files (:mod:`gpu_node.disk_tier`), batched slot I/O (:mod:`gpu_node.slot_io`) and
the eviction order (:mod:`gpu_node.eviction`).

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
(reasoning and its one residual in :meth:`BlockPool._promote_batch`).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from events.fault_points import fault_point
from gpu_node.block_records import (
    BlockRecord,
    BlockRestoreError,
    check_record,
    decode_block_record,
    encode_block_record,
    payload_tensor,
    tensor_bytes,
)
from gpu_node.crypto import DataKeyProvider, overwrite_and_unlink
from gpu_node.disk_tier import DiskTier, is_sealed
from gpu_node.eviction import LRUEvictionStrategy
from gpu_node.kv_cache_utils import HASH_BYTES, BlockKey, BlockProvenance, CacheScope
from gpu_node.kv_spec import KVBlockSpec
from gpu_node.slot_io import gather_slots, scatter_slots, zero_slots, zero_slots_verified


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


_TIER_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}


class BlockState(Enum):
    """Lifecycle of a pool entry; ABSENT is "not in the pool" and has no member."""

    BUILDING = "building"
    READY = "ready"
    EVICTING = "evicting"
    FAILED = "failed"


class RemovalReason(StrEnum):
    EVICTED = "evicted"
    EXPIRED = "expired"
    INVALIDATED = "invalidated"
    RESTORE_FAILED = "restore_failed"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Capacities per tier and per-scope TTLs (None: no TTL) for one namespace."""

    namespace: str
    num_device_blocks: int
    num_host_blocks: int
    max_disk_blocks: int
    disk_dir: Path | None
    ttl_s: Mapping[CacheScope, float | None]
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        for name in ("num_device_blocks", "num_host_blocks", "max_disk_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        missing = [scope.label for scope in CacheScope if scope not in self.ttl_s]
        if missing:
            # A forgotten scope must not silently mean "keep forever": retention is a privacy limit.
            raise ValueError(f"ttl_s needs an entry (seconds or None) for every scope; missing {missing}")
        for scope, ttl_s in self.ttl_s.items():
            if ttl_s is not None and ttl_s <= 0:
                raise ValueError(f"ttl for {CacheScope(scope).label} scope must be positive or None, got {ttl_s}")


@dataclass(eq=False, slots=True)
class CacheEntry:
    """One block in the pool. ``tier``/``slot`` say where its bytes are (slot: device/host index)."""

    key: BlockKey
    state: BlockState
    tier: Tier | None = None
    slot: int | None = None
    ref_count: int = 0
    last_access: float = 0.0
    expires_at: float | None = None
    tombstoned: bool = False
    removal_reason: RemovalReason | None = None

    @property
    def block_hash(self) -> bytes:
        return self.key.block_hash

    @property
    def provenance(self) -> BlockProvenance:
        return self.key.provenance


METHOD_ZERO_FILL = "zero_fill"
METHOD_OVERWRITE_UNLINK = "overwrite_unlink"


@dataclass(frozen=True, slots=True)
class RemovalEvidence:
    """How one block's bytes were deleted and the post-check result.

    ``zero_fill``: the memory slot was overwritten with zeros and read back as
    zero (NIST 800-88 Clear). ``overwrite_unlink``: the file was zeroed and
    unlinked and its path checked absent; ``encrypted`` says whether it held
    ciphertext, which destroying the scope key additionally purges, and
    ``key_id`` names that key (as written in the file's header; None for
    plaintext), so an erasure knows which keys to destroy.
    """

    block_hash: bytes
    tier: Tier
    method: str
    encrypted: bool
    verified: bool
    key_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockStored:
    key: BlockKey
    tier: Tier


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Bytes of a block were deleted; ``evidence`` is set by the pool for every removal."""

    block_hash: bytes
    tier: Tier
    reason: RemovalReason
    evidence: RemovalEvidence | None = None


@dataclass(frozen=True, slots=True)
class BlockMoved:
    block_hash: bytes
    from_tier: Tier
    to_tier: Tier


PoolEvent = BlockStored | BlockRemoved | BlockMoved

IndexKey = tuple
"""Names the entries that may match a removal predicate (:meth:`BlockPool.remove_where`'s ``candidates``).

One of ``("tenant", tenant_id)``, ``("document", tenant_id, doc_id)`` (any
version of the document), ``("policy", tenant_id, auth_scope)`` (any policy
version) or ``("namespace", namespace)``. The entries under a key are a
superset of what a predicate on it can match; the predicate still decides.
"""

INDEX_KINDS = frozenset({"tenant", "document", "policy", "namespace"})


def provenance_index_keys(provenance: BlockProvenance) -> list[IndexKey]:
    """The provenance index keys a block is filed under (every key but ``namespace``, which is the whole pool)."""
    tenant = provenance.tenant_id
    keys: list[IndexKey] = [("tenant", tenant)]
    for tag in provenance.documents:
        keys.append(("document", tenant, tag.rpartition("@")[0]))
    for scope, _ in provenance.auth_scopes:
        keys.append(("policy", tenant, scope))
    return keys


@dataclass(frozen=True, slots=True)
class RemovalReport:
    """Outcome of :meth:`BlockPool.remove_where`, the basis of a command ack.

    ``removed`` had their bytes deleted now (``num_removed`` per tier,
    ``evidence`` one per block); ``deferred`` are held by readers, tombstoned,
    and deleted when released (their ``BlockRemoved`` event carries evidence);
    ``discarded_building`` will be discarded at commit and never become READY.
    """

    reason: RemovalReason
    num_removed: Mapping[Tier, int]
    removed: tuple[bytes, ...]
    deferred: tuple[bytes, ...]
    discarded_building: tuple[bytes, ...]
    evidence: tuple[RemovalEvidence, ...]

    @property
    def all_verified(self) -> bool:
        return all(item.verified for item in self.evidence)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Entries and bytes per tier (disk bytes are file sizes), plus lifetime counters."""

    num_entries: Mapping[Tier, int]
    tier_bytes: Mapping[Tier, int]
    num_building: int
    num_evictions: int
    num_expired: int
    num_demotions: int
    num_promotions: int
    num_restore_failures: int


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
        pin = torch.device(config.device).type == "cuda"
        self._slots = {
            Tier.DEVICE: torch.zeros((config.num_device_blocks, *spec.block_shape), dtype=spec.dtype, device=config.device),
            Tier.HOST: torch.zeros((config.num_host_blocks, *spec.block_shape), dtype=spec.dtype, pin_memory=pin),
        }
        # Sorted lists are valid heaps: the lowest free slot is reused first, which keeps layouts deterministic.
        # Two-dimensional views ``[slots, block_elements]`` of the same storage for batched slot I/O.
        self._flat_slots = {tier: table.view(table.shape[0], spec.num_elements) for tier, table in self._slots.items()}
        self._free_slots = {Tier.DEVICE: list(range(config.num_device_blocks)), Tier.HOST: list(range(config.num_host_blocks))}
        disk_dir = config.disk_dir if config.max_disk_blocks > 0 else None
        self._disk = None if disk_dir is None else DiskTier(disk_dir, config.namespace, spec, key_provider)
        # (predicate, until on the pool clock): builds of matching blocks are refused until then.
        self._build_guards: list[tuple[Callable[[BlockProvenance], bool], float]] = []
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

    def guard_builds(self, predicate: Callable[[BlockProvenance], bool], duration_s: float) -> None:
        """Refuse to build blocks matching ``predicate`` for ``duration_s`` (see :meth:`begin_build`).

        :meth:`remove_where` tombstones the matching builds it finds, but a
        request whose keys were computed before an invalidation's cutoff may
        claim its blocks only after the removal ran (it was waiting on another
        request's build). Registered *before* the removal, a guard closes that
        gap: every matching build is either found by the removal or refused
        here. The predicate carries the cutoff, so later blocks still build.
        """
        if duration_s <= 0:
            raise ValueError("duration_s must be positive")
        with self._lock:
            now = self._clock()
            self._build_guards = [(guard, until) for guard, until in self._build_guards if until > now]
            self._build_guards.append((predicate, now + duration_s))

    def _build_refused(self, provenance: BlockProvenance, now: float) -> bool:
        return any(until > now and guard(provenance) for guard, until in self._build_guards)

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
            if existing is not None or (self._build_guards and self._build_refused(key.provenance, now)):
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
            if entry.tombstoned or not self._make_room(Tier.DEVICE):
                self._discard_building(entry)
                return False
            slot = heapq.heappop(self._free_slots[Tier.DEVICE])
            self._slots[Tier.DEVICE][slot].copy_(kv)
            now = self._clock()
            ttl_s = self._config.ttl_s[entry.provenance.scope]
            entry.state = BlockState.READY
            self._num_building -= 1
            entry.last_access = now
            entry.expires_at = None if ttl_s is None else now + ttl_s
            self._place(entry, Tier.DEVICE, slot)
            self._events.append(BlockStored(entry.key, Tier.DEVICE))
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
        with self._lock:
            return self._capacity[Tier.DEVICE] - len(self._free_slots[Tier.DEVICE]), self._capacity[Tier.DEVICE]

    def allocate_device_slots(self, num_slots: int) -> list[int] | None:
        """Take ``num_slots`` device slots for a sequence's own KV; None (nothing taken) when there is no room.

        Room is made like for any new block: unreferenced READY device entries
        are demoted (or dropped) in LRU order. The slots belong to the caller
        until :meth:`free_device_slots` or :meth:`commit_slot`; the pool never
        reads, moves or zeroes them meanwhile.
        """
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        with self._lock:
            available = len(self._free_slots[Tier.DEVICE])
            if available < num_slots:
                for candidate in self._lru[Tier.DEVICE].candidates():
                    if candidate.ref_count == 0:
                        available += 1
                        if available >= num_slots:
                            break
            if available < num_slots:
                return None
            slots = []
            for _ in range(num_slots):
                made_room = self._make_room(Tier.DEVICE)
                assert made_room, "counted victims always yield slots"
                slots.append(heapq.heappop(self._free_slots[Tier.DEVICE]))
            return slots

    def free_device_slots(self, slots: Sequence[int]) -> None:
        """Zero and return slots taken with :meth:`allocate_device_slots`: a request's KV never outlives it in a free slot."""
        if not slots:
            return
        with self._lock:
            ordered = sorted(slots)
            zero_slots(self._flat_slots[Tier.DEVICE], ordered)
            for slot in ordered:
                heapq.heappush(self._free_slots[Tier.DEVICE], slot)

    def commit_slot(self, entry: CacheEntry, slot: int) -> bool:
        """Make a BUILDING entry READY in the caller's own device ``slot`` (its KV is already there): no copy.

        The entry starts with one reference, the committing sequence's, since
        its attention keeps reading the block; release it with
        :meth:`dec_lock_ref`. False when the entry was tombstoned while
        building: it is discarded and the slot stays the caller's.
        """
        with self._lock:
            assert self._entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING, (
                "commit_slot takes the BUILDING entry begin_build returned"
            )
            # Range only: a membership scan of the free-slot heap cost ~20 µs per committed block, on every miss.
            assert 0 <= slot < self._capacity[Tier.DEVICE], "the slot must be a device slot the caller allocated"
            if entry.tombstoned:
                self._discard_building(entry)
                return False
            now = self._clock()
            ttl_s = self._config.ttl_s[entry.provenance.scope]
            entry.state = BlockState.READY
            self._num_building -= 1
            entry.last_access = now
            entry.expires_at = None if ttl_s is None else now + ttl_s
            entry.ref_count = 1
            self._place(entry, Tier.DEVICE, slot)
            self._events.append(BlockStored(entry.key, Tier.DEVICE))
            return True

    # --- reading -------------------------------------------------------------------------

    def read_blocks(self, entries: Sequence[CacheEntry], promote: bool = True) -> torch.Tensor:
        """KV of referenced entries as ``[n, *block_shape]`` on the pool device (fresh memory, never a slot view).

        Host and disk hits are promoted to the device tier when ``promote`` and
        there is room. A corrupt or undecryptable block is removed
        (RESTORE_FAILED) and :class:`BlockRestoreError` raised; an entry
        tombstoned while referenced raises it too, so invalidated bytes are never served.
        Both are checked before any block moves.

        The tensor work is batched: one gather of all host hits and one
        decode pass over the disk hits into a staging tensor, one zero-fill of
        the host slots they leave, one write into the device slots, one gather
        of device hits (each a slice copy per run of consecutive slots, or one
        indexed op when the slots are fragmented). Bookkeeping (LRU, events, counters)
        stays per entry and in entry order, exactly as one-by-one promotion
        would produce it: a device victim's demotion may take a host slot a
        promoted block just left (a swap). Memory of referenced entries is
        never freed or moved by anyone but their reader's own promotion.
        """
        with self._lock:
            for entry in entries:
                if entry.ref_count <= 0:
                    raise ValueError("read_blocks needs entries referenced with inc_lock_ref")
            for entry in entries:
                if entry.tombstoned or entry.tier is None:
                    raise BlockRestoreError(entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED))
            num = len(entries)
            device = torch.device(self._config.device)
            shape = self._spec.block_shape
            now = self._clock()
            first_row: dict[int, int] = {}
            duplicates: list[tuple[int, int]] = []
            device_rows: list[int] = []
            device_slots: list[int] = []
            lower: list[CacheEntry] = []  # distinct host/disk entries in row order
            lower_rows: list[int] = []
            for row, entry in enumerate(entries):
                first = first_row.setdefault(id(entry), row)
                if first != row:
                    duplicates.append((row, first))
                elif entry.tier is Tier.DEVICE:
                    device_rows.append(row)
                    device_slots.append(entry.slot)
                else:
                    lower.append(entry)
                    lower_rows.append(row)
            # Stage every host/disk hit in one CPU tensor (row order). Disk files are decoded first, so a
            # corrupt one is removed and raised before anything moves.
            lower_kv = None
            if lower:
                lower_kv = torch.empty((len(lower), *shape), dtype=self._spec.dtype, pin_memory=device.type == "cuda")
                lower_flat = lower_kv.view(len(lower), -1)
                self._load_disk_payloads(lower, lower_kv)
                host_pos = [pos for pos, entry in enumerate(lower) if entry.tier is Tier.HOST]
                if len(host_pos) == len(lower):
                    gather_slots(self._flat_slots[Tier.HOST], [entry.slot for entry in lower], lower_flat)
                elif host_pos:
                    gathered = torch.empty((len(host_pos), lower_flat.shape[1]), dtype=self._spec.dtype)
                    gather_slots(self._flat_slots[Tier.HOST], [lower[pos].slot for pos in host_pos], gathered)
                    lower_flat.index_copy_(0, torch.tensor(host_pos, dtype=torch.long), gathered)
            if lower_kv is not None and lower_kv.device != device:
                lower_kv = lower_kv.to(device, non_blocking=True)  # pinned staging: an async copy, ordered before its readers
            if promote and lower:
                self._promote_batch(lower, lower_kv.view(len(lower), -1))
            if lower_kv is not None and len(lower) == num:
                out = lower_kv  # fresh staging memory in row order: no further copy
            else:
                out = torch.empty((num, *shape), dtype=self._spec.dtype, device=device)
                if lower_kv is not None:
                    out.index_copy_(0, torch.tensor(lower_rows, dtype=torch.long, device=device), lower_kv)
                if device_rows and len(device_rows) == num:
                    gather_slots(self._flat_slots[Tier.DEVICE], device_slots, out.view(num, -1))
                elif device_rows:
                    gathered = torch.empty((len(device_rows), out[0].numel()), dtype=self._spec.dtype, device=device)
                    gather_slots(self._flat_slots[Tier.DEVICE], device_slots, gathered)
                    out.view(num, -1).index_copy_(0, torch.tensor(device_rows, dtype=torch.long, device=device), gathered)
                for row, first in duplicates:
                    out[row].copy_(out[first])
            for entry in entries:
                entry.last_access = now
                self._lru[entry.tier].touch(entry)
            return out

    def _load_disk_payloads(self, lower: Sequence[CacheEntry], staging: torch.Tensor) -> None:
        """Decode the disk entries of ``lower`` into their rows of ``staging``; a bad file is dropped and raised."""
        staging_bytes = None
        aeads: dict[str, tuple[bytes, AESGCM]] = {}
        for pos, entry in enumerate(lower):
            if entry.tier is not Tier.DISK:
                continue
            if staging_bytes is None:
                staging_bytes = staging.view(torch.uint8).reshape(len(lower), self._spec.block_bytes).numpy()
            staging_bytes[pos] = np.frombuffer(self._disk_payload(entry, aeads), dtype=np.uint8)

    def _disk_payload(self, entry: CacheEntry, aeads: dict[str, tuple[bytes, AESGCM]]) -> bytes | memoryview:
        """The authenticated KV bytes of a disk entry's file; a missing or bad file is dropped and raised."""
        try:
            return self._disk.payload(entry.key, aeads)
        except BlockRestoreError as error:
            self._drop(entry, RemovalReason.RESTORE_FAILED)
            raise BlockRestoreError(entry.block_hash, error.reason) from None

    def _promote_batch(self, lower: Sequence[CacheEntry], staged: torch.Tensor) -> None:
        """Move the leading host/disk entries of ``lower`` to device slots; ``staged[i]`` is ``lower[i]``'s KV.

        As many move as there are free device slots plus unreferenced READY
        device entries to demote (every entry read is referenced, so none of
        them can be a victim, and once one finds no room none after it does).
        Bookkeeping and events go per entry, in order; the tensor work is
        batched: the staged KV is written into the new device slots in one
        go, and the host slots left behind are zeroed in one go — earlier
        whenever a device victim must be demoted, since its demotion may reuse
        a slot just left (a swap) and must find it zeroed and not be zeroed
        after. Both also run if the loop raises, so no device slot an entry
        was placed in is left without its bytes and no left slot unzeroed.
        Nothing reads the new device slots before the write: their entries
        are referenced.

        The disk files they leave are unlinked without the zero overwrite
        that removal uses: a promotion keeps the block cached, so it deletes
        no data. A sealed (tenant/user) file stays covered by crypto-erase —
        its ciphertext is useless once the scope key is destroyed — and a
        public block holds no personal data. Every path that deletes a
        block's data (eviction, expiry, invalidation, restore failure: all go
        through ``_drop``) still overwrites and unlinks with evidence. No
        fsync on this read path. Residual: the freed filesystem blocks of a
        sealed file may keep its ciphertext after a later *document*
        invalidation while the tenant key stays alive — readable only with
        raw-device access and that key, and gone with the key's destruction
        (the overwrite itself is best effort on SSDs and copy-on-write
        filesystems).
        """
        budget = len(self._free_slots[Tier.DEVICE])
        if budget < len(lower):
            for candidate in self._lru[Tier.DEVICE].candidates():
                if candidate.ref_count == 0:
                    budget += 1
                    if budget >= len(lower):
                        break
        moved = lower[: min(budget, len(lower))]
        free_host, free_device = self._free_slots[Tier.HOST], self._free_slots[Tier.DEVICE]
        host_table = self._flat_slots.get(Tier.HOST)
        left_host_slots: list[int] = []  # left by moved entries, not yet zeroed
        placed: list[int] = []
        try:
            for entry in moved:
                from_tier = entry.tier
                if from_tier is Tier.HOST:
                    left_host_slots.append(entry.slot)
                else:
                    self._disk.unlink_promoted(entry.block_hash)
                self._unplace(entry)
                if not free_device:
                    if left_host_slots:
                        zero_slots(host_table, left_host_slots)
                        for slot in left_host_slots:
                            heapq.heappush(free_host, slot)
                        left_host_slots.clear()
                    made_room = self._make_room(Tier.DEVICE)
                    assert made_room, "an unreferenced device victim always yields a slot"
                slot = heapq.heappop(free_device)
                self._place(entry, Tier.DEVICE, slot)
                placed.append(slot)
                self._events.append(BlockMoved(entry.key.block_hash, from_tier, Tier.DEVICE))
        finally:
            if left_host_slots:
                zero_slots(host_table, left_host_slots)
                for slot in left_host_slots:
                    heapq.heappush(free_host, slot)
            if placed:
                scatter_slots(self._flat_slots[Tier.DEVICE], placed, staged[: len(placed)])
            self._num_promotions += len(placed)

    def export_record(self, entry: CacheEntry) -> bytes | None:
        """A referenced entry as an at-rest record (snapshots); None if its scope has no data key."""
        with self._lock:
            if entry.ref_count <= 0:
                raise ValueError("export_record needs an entry referenced with inc_lock_ref")
            if entry.tombstoned or entry.tier is None:
                raise BlockRestoreError(entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED))
            kv = self._read_payload(entry)
            return encode_block_record(self._record(entry, kv), self._key_provider)

    def import_record(self, data: bytes, tier: Tier) -> bool:
        """Warm one READY block into a free slot of ``tier`` (never evicting).

        False when the block is present, expired or the tier has no free room;
        :class:`BlockRestoreError` when the record is corrupt, undecryptable or
        of another namespace or KV format.
        """
        record = decode_block_record(data, self._key_provider)
        check_record(record, record.key.block_hash, self._config.namespace, self._spec)
        with self._lock:
            now = self._clock()
            expires_at = self._expiry_from_wall(record.expires_at_wall)
            if record.key.block_hash in self._entries or (expires_at is not None and expires_at <= now):
                return False
            if not self._has_room(tier):
                return False
            entry = CacheEntry(key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at)
            kv = payload_tensor(record.payload, self._spec)
            if tier is Tier.DISK:
                if not self._write_disk(entry, kv):
                    return False
                slot = None
            else:
                slot = heapq.heappop(self._free_slots[tier])
                self._slots[tier][slot].copy_(kv)
            self._admit(entry)
            self._place(entry, tier, slot)
            self._events.append(BlockStored(entry.key, tier))
            return True

    # --- tier management ---------------------------------------------------------------

    def demote(self, block_hash: bytes, to_tier: Tier) -> bool:
        """Move an unreferenced READY block down to ``to_tier``; False when not possible now."""
        if to_tier is Tier.DEVICE:
            raise ValueError("nothing can be demoted to the device tier")
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY or entry.ref_count > 0:
                return False
            if _TIER_DEPTH[entry.tier] >= _TIER_DEPTH[to_tier] or not self._make_room(to_tier):
                return False
            return self._demote(entry, to_tier, self._read_payload(entry))

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

    def remove_where(
        self, predicate: Callable[[BlockProvenance], bool], reason: RemovalReason, candidates: IndexKey | None = None
    ) -> RemovalReport:
        """Delete every block whose provenance matches, in every tier, with per-block evidence.

        All matches are tombstoned before any byte is touched, so no match is
        served once this starts. Unreferenced READY matches are deleted now;
        referenced ones on their last release; BUILDING ones at commit.

        ``candidates`` (an :data:`IndexKey`) narrows the scan to the entries
        filed under that key — the caller guarantees every match is among
        them — and ``predicate`` is still applied to each. The report and the
        events are then exactly those of the full scan (same entries, same order).
        """
        return self.remove_many([(predicate, candidates)], reason)[0]

    def remove_many(
        self, requests: Sequence[tuple[Callable[[BlockProvenance], bool], IndexKey | None]], reason: RemovalReason
    ) -> list[RemovalReport]:
        """:meth:`remove_where` for each ``(predicate, candidates)`` in order, with one bulk deletion of bytes.

        The reports and events are those of calling :meth:`remove_where` for
        each request in turn: a block deleted for one request is not reported
        again by a later one, while a referenced or BUILDING match is reported
        by every request matching it. All matches of all requests are
        tombstoned before any byte is touched.
        """
        for _, candidates in requests:
            if candidates is not None and (not candidates or candidates[0] not in INDEX_KINDS):
                raise ValueError(f"unknown index key {candidates!r}")
        with self._lock:
            dropping: set[CacheEntry] = set()
            matches_per_request: list[list[CacheEntry]] = []
            for predicate, candidates in requests:
                scanned = self._entries.values() if candidates is None else self._candidates(candidates)
                matches = [entry for entry in scanned if entry not in dropping and predicate(entry.provenance)]
                for entry in matches:
                    if not entry.tombstoned:
                        self._tombstone(entry, reason)
                    if entry.state is not BlockState.BUILDING and entry.ref_count == 0:
                        dropping.add(entry)
                matches_per_request.append(matches)
            fault_point("node.between_tombstone_and_delete")
            cleared = self._clear_bytes(list(dropping))
            return [self._report_removal(matches, reason, cleared) for matches in matches_per_request]

    def _report_removal(self, matches: list[CacheEntry], reason: RemovalReason, cleared: dict[CacheEntry, bool]) -> RemovalReport:
        """Drop the unreferenced ``matches`` whose bytes :meth:`_clear_bytes` deleted; report all of them."""
        num_removed = dict.fromkeys(Tier, 0)
        removed: list[bytes] = []
        deferred: list[bytes] = []
        building: list[bytes] = []
        evidence: list[RemovalEvidence] = []
        for entry in matches:
            if entry.state is BlockState.BUILDING:
                building.append(entry.block_hash)
            elif entry.ref_count > 0:
                deferred.append(entry.block_hash)
            else:
                tier = entry.tier
                evidence.append(self._drop(entry, reason, cleared[entry]))
                num_removed[tier] += 1
                removed.append(entry.block_hash)
        return RemovalReport(reason, num_removed, tuple(removed), tuple(deferred), tuple(building), tuple(evidence))

    def _clear_bytes(self, entries: Sequence[CacheEntry]) -> dict[CacheEntry, bool]:
        """Delete the bytes of placed ``entries`` in bulk; per entry, whether the deletion verified.

        Memory slots are zeroed and read back with one operation per tier, files
        overwritten and unlinked in parallel: removing thousands of blocks costs a
        few tensor operations, not two per block. The entries stay indexed; the
        caller drops each with its outcome (:meth:`_drop`).
        """
        cleared: dict[CacheEntry, bool] = {}
        for tier in (Tier.DEVICE, Tier.HOST):
            in_tier = sorted((entry for entry in entries if entry.tier is tier), key=lambda entry: entry.slot)
            if in_tier:
                verified = zero_slots_verified(self._flat_slots[tier], [entry.slot for entry in in_tier])
                cleared.update(zip(in_tier, verified, strict=True))
        files = [entry for entry in entries if entry.tier is Tier.DISK]
        if files:
            cleared.update(zip(files, self._disk.delete_many([entry.block_hash for entry in files]), strict=True))
        return cleared

    def load_disk_tier(self) -> int:
        """Re-index block files left by an earlier run; returns how many became READY.

        Corrupt, undecryptable, foreign-namespace and expired files are deleted
        (and reported as removed), as are files beyond ``max_disk_blocks``.
        Re-indexed blocks changed no bytes, so they produce no event; the node
        reports them in its inventory.
        """
        if self._disk is None:
            return 0
        with self._lock:
            num_loaded = 0
            now = self._clock()
            for path, block_hash in self._disk.stored_files():
                if block_hash in self._entries:
                    continue
                data, record, meta = self._disk.open_stored(path, block_hash)
                encrypted = is_sealed(data)
                if record is None:
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.RESTORE_FAILED)
                    continue
                expires_at = self._expiry_from_wall(record.expires_at_wall)
                if expires_at is not None and expires_at <= now:
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EXPIRED)
                    continue
                if not self._has_room(Tier.DISK):
                    self._delete_stray_file(path, block_hash, encrypted, RemovalReason.EVICTED)
                    continue
                entry = CacheEntry(key=record.key, state=BlockState.READY, last_access=now, expires_at=expires_at)
                self._admit(entry)
                self._disk.adopt(block_hash, data, meta)
                self._place(entry, Tier.DISK, None)
                num_loaded += 1
            return num_loaded

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

    def _lower_tier(self, tier: Tier) -> Tier | None:
        for lower in Tier:
            if _TIER_DEPTH[lower] > _TIER_DEPTH[tier] and self._capacity[lower] > 0:
                return lower
        return None

    def _make_room(self, tier: Tier) -> bool:
        """Free one unit of ``tier`` by demoting its LRU unreferenced READY entry (device → host → disk → drop)."""
        if self._has_room(tier):
            return True
        victim = self._victim(tier)
        if victim is None:
            return False
        lower = self._lower_tier(tier)
        if lower is not None and self._make_room(lower) and self._demote(victim, lower, self._read_payload(victim)):
            return True
        self._drop(victim, RemovalReason.EVICTED)
        return True

    def _victim(self, tier: Tier) -> CacheEntry | None:
        return next((entry for entry in self._lru[tier].candidates() if entry.ref_count == 0), None)

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

    def _demote(self, entry: CacheEntry, to_tier: Tier, kv: torch.Tensor) -> bool:
        """Copy ``kv`` into lower ``to_tier`` (room already made), then zero the old slot; False if unsealable."""
        from_tier = entry.tier
        assert from_tier is not None and _TIER_DEPTH[to_tier] > _TIER_DEPTH[from_tier], "a demotion moves a placed entry down"
        if to_tier is Tier.DISK:
            if not self._write_disk(entry, kv):
                return False
            slot = None
        else:
            slot = heapq.heappop(self._free_slots[to_tier])
            self._slots[to_tier][slot].copy_(kv)
        self._delete_bytes(entry)
        self._unplace(entry)
        self._place(entry, to_tier, slot)
        self._num_demotions += 1
        self._events.append(BlockMoved(entry.block_hash, from_tier, to_tier))
        return True

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
        self._events.append(BlockRemoved(entry.block_hash, tier, reason, evidence))
        return evidence

    def _delete_bytes(self, entry: CacheEntry, cleared: bool | None = None) -> RemovalEvidence:
        """Zero the entry's slot (read back as zero) or zero+unlink its file (checked absent).

        ``cleared`` is the outcome of that deletion when the caller already did
        it (:meth:`_clear_bytes`, for a batch removal); None: delete now.
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

    def _delete_stray_file(self, path: Path, block_hash: bytes, encrypted: bool, reason: RemovalReason) -> None:
        """Delete an unindexed block file found at start and report it, so the ledger drops its placement."""
        verified = overwrite_and_unlink(path)
        evidence = RemovalEvidence(block_hash, Tier.DISK, METHOD_OVERWRITE_UNLINK, encrypted, verified)
        if reason is RemovalReason.EXPIRED:
            self._num_expired += 1
        elif reason is RemovalReason.RESTORE_FAILED:
            self._num_restore_failures += 1
        else:
            self._num_evictions += 1
        self._events.append(BlockRemoved(block_hash, Tier.DISK, reason, evidence))

    def _record(self, entry: CacheEntry, kv: torch.Tensor) -> BlockRecord:
        return BlockRecord(entry.key, self._spec.kv_format, self._wall_expiry(entry), tensor_bytes(kv))

    def _write_disk(self, entry: CacheEntry, kv: torch.Tensor) -> bool:
        """Write the block file (sealed unless public); False when its scope has no data key."""
        return self._disk.write(self._record(entry, kv))

    def _wall_expiry(self, entry: CacheEntry) -> float | None:
        """Expiry in wall-clock time, so a TTL survives a restart (the pool clock is monotonic)."""
        return None if entry.expires_at is None else self._wall_clock() + (entry.expires_at - self._clock())

    def _expiry_from_wall(self, expires_at_wall: float | None) -> float | None:
        return None if expires_at_wall is None else self._clock() + (expires_at_wall - self._wall_clock())
