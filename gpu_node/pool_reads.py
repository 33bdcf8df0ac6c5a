"""The pool's batched read path: KV of referenced entries, promoting host/disk hits to the device tier.

Split from :class:`gpu_node.block_pool.BlockPool` because it is the pool's one
bulk tensor path (staging, gathers, scatters, disk decoding) and its longest
piece of code; the state machine it changes (placement, LRU, events, counters)
stays the pool's, and it runs entirely under the pool's lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.block_records import BlockRestoreError
from gpu_node.pool_types import CacheEntry, MovedInPool, RemovalReason, Tier
from gpu_node.slot_io import gather_slots, scatter_slots, zero_slots

if TYPE_CHECKING:
    from gpu_node.block_pool import BlockPool


class PoolReader:
    """Serves :meth:`BlockPool.read_blocks`; operates on its pool's state under the pool's lock."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def read(self, entries: Sequence[CacheEntry], promote: bool = True) -> torch.Tensor:
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
        pool = self._pool
        with pool._lock:
            for entry in entries:
                if entry.ref_count <= 0:
                    raise ValueError("read_blocks needs entries referenced with inc_lock_ref")
            for entry in entries:
                if entry.tombstoned or entry.tier is None:
                    raise BlockRestoreError(entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED))
            num = len(entries)
            device = torch.device(pool._config.device)
            shape = pool._spec.block_shape
            now = pool._clock()
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
                lower_kv = torch.empty((len(lower), *shape), dtype=pool._spec.dtype, pin_memory=device.type == "cuda")
                lower_flat = lower_kv.view(len(lower), -1)
                self._load_disk_payloads(lower, lower_kv)
                host_pos = [pos for pos, entry in enumerate(lower) if entry.tier is Tier.HOST]
                if len(host_pos) == len(lower):
                    gather_slots(pool._flat_slots[Tier.HOST], [entry.slot for entry in lower], lower_flat)
                elif host_pos:
                    gathered = torch.empty((len(host_pos), lower_flat.shape[1]), dtype=pool._spec.dtype)
                    gather_slots(pool._flat_slots[Tier.HOST], [lower[pos].slot for pos in host_pos], gathered)
                    lower_flat.index_copy_(0, torch.tensor(host_pos, dtype=torch.long), gathered)
            if lower_kv is not None and lower_kv.device != device:
                lower_kv = lower_kv.to(device, non_blocking=True)  # pinned staging: an async copy, ordered before its readers
            if promote and lower:
                self._promote_batch(lower, lower_kv.view(len(lower), -1))
            if lower_kv is not None and len(lower) == num:
                out = lower_kv  # fresh staging memory in row order: no further copy
            else:
                out = torch.empty((num, *shape), dtype=pool._spec.dtype, device=device)
                if lower_kv is not None:
                    out.index_copy_(0, torch.tensor(lower_rows, dtype=torch.long, device=device), lower_kv)
                if device_rows and len(device_rows) == num:
                    gather_slots(pool._flat_slots[Tier.DEVICE], device_slots, out.view(num, -1))
                elif device_rows:
                    gathered = torch.empty((len(device_rows), out[0].numel()), dtype=pool._spec.dtype, device=device)
                    gather_slots(pool._flat_slots[Tier.DEVICE], device_slots, gathered)
                    out.view(num, -1).index_copy_(0, torch.tensor(device_rows, dtype=torch.long, device=device), gathered)
                for row, first in duplicates:
                    out[row].copy_(out[first])
            for entry in entries:
                entry.last_access = now
                pool._lru[entry.tier].touch(entry)
            return out

    def _load_disk_payloads(self, lower: Sequence[CacheEntry], staging: torch.Tensor) -> None:
        """Decode the disk entries of ``lower`` into their rows of ``staging``; a bad file is dropped and raised."""
        pool = self._pool
        staging_bytes = None
        aeads: dict[str, tuple[bytes, AESGCM]] = {}
        for pos, entry in enumerate(lower):
            if entry.tier is not Tier.DISK:
                continue
            if staging_bytes is None:
                staging_bytes = staging.view(torch.uint8).reshape(len(lower), pool._spec.block_bytes).numpy()
            staging_bytes[pos] = np.frombuffer(self._disk_payload(entry, aeads), dtype=np.uint8)

    def _disk_payload(self, entry: CacheEntry, aeads: dict[str, tuple[bytes, AESGCM]]) -> bytes | memoryview:
        """The authenticated KV bytes of a disk entry's file; a missing or bad file is dropped and raised."""
        pool = self._pool
        try:
            return pool._disk.payload(entry.key, aeads)
        except BlockRestoreError as error:
            pool._drop(entry, RemovalReason.RESTORE_FAILED)
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
        pool = self._pool
        budget = len(pool._free_slots[Tier.DEVICE])
        if budget < len(lower):
            for candidate in pool._lru[Tier.DEVICE].candidates():
                if candidate.ref_count == 0:
                    budget += 1
                    if budget >= len(lower):
                        break
        moved = lower[: min(budget, len(lower))]
        free_host, free_device = pool._free_slots[Tier.HOST], pool._free_slots[Tier.DEVICE]
        host_table = pool._flat_slots.get(Tier.HOST)
        left_host_slots: list[int] = []  # left by moved entries, not yet zeroed
        placed: list[int] = []
        try:
            for entry in moved:
                from_tier = entry.tier
                if from_tier is Tier.HOST:
                    left_host_slots.append(entry.slot)
                else:
                    pool._disk.unlink_promoted(entry.block_hash)
                pool._unplace(entry)
                if not free_device:
                    if left_host_slots:
                        zero_slots(host_table, left_host_slots)
                        for slot in left_host_slots:
                            heapq.heappush(free_host, slot)
                        left_host_slots.clear()
                    made_room = pool._demoter.make_room(Tier.DEVICE)
                    assert made_room, "an unreferenced device victim always yields a slot"
                slot = heapq.heappop(free_device)
                pool._place(entry, Tier.DEVICE, slot)
                placed.append(slot)
                pool._events.append(MovedInPool(entry.key.block_hash, from_tier, Tier.DEVICE))
        finally:
            if left_host_slots:
                zero_slots(host_table, left_host_slots)
                for slot in left_host_slots:
                    heapq.heappush(free_host, slot)
            if placed:
                scatter_slots(pool._flat_slots[Tier.DEVICE], placed, staged[: len(placed)])
            pool._num_promotions += len(placed)
