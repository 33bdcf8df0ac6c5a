"""The pool's batched read path: KV of referenced entries, promoting host/disk hits to the device tier.

Its own part of the pool because it is the pool's one bulk tensor path
(staging, gathers, scatters, disk decoding) and its longest piece of code. It
changes the pool state (:class:`gpu_node.pool.state.PoolState`) through the
state's placement primitives, makes room on the device tier through the
demoter (:class:`gpu_node.pool.demotion.PoolDemoter`), and runs entirely under
the state's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from events.tiers import Tier
from gpu_node.pool.block_records import BlockRestoreError
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import CacheEntry, MovedInPool, RemovalReason


class PoolReader:
    """Serves :meth:`gpu_node.pool.block_pool.BlockPool.read_blocks` from one pool state."""

    def __init__(self, state: PoolState, demoter: PoolDemoter) -> None:
        self._state = state
        self._demoter = demoter

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
        state = self._state
        with state.lock:
            for entry in entries:
                if entry.ref_count <= 0:
                    raise ValueError("read_blocks needs entries referenced with inc_lock_ref")
            for entry in entries:
                if entry.tombstoned or entry.tier is None:
                    raise BlockRestoreError(
                        entry.block_hash, str(entry.removal_reason or RemovalReason.INVALIDATED)
                    )
            num = len(entries)
            device = torch.device(state.config.device)
            shape = state.spec.block_shape
            now = state.clock()
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
            # Stage every host/disk hit in one CPU tensor (row order). Disk files are decoded first,
            # so a corrupt one is removed and raised before anything moves.
            lower_kv = None
            if lower:
                lower_kv = torch.empty(
                    (len(lower), *shape), dtype=state.spec.dtype, pin_memory=device.type == "cuda"
                )
                lower_flat = lower_kv.view(len(lower), -1)
                self._load_disk_payloads(lower, lower_kv)
                host_pos = [pos for pos, entry in enumerate(lower) if entry.tier is Tier.HOST]
                if len(host_pos) == len(lower):
                    state.memory[Tier.HOST].gather([entry.slot for entry in lower], lower_flat)
                elif host_pos:
                    gathered = torch.empty(
                        (len(host_pos), lower_flat.shape[1]), dtype=state.spec.dtype
                    )
                    state.memory[Tier.HOST].gather([lower[pos].slot for pos in host_pos], gathered)
                    lower_flat.index_copy_(0, torch.tensor(host_pos, dtype=torch.long), gathered)
            if lower_kv is not None and lower_kv.device != device:
                lower_kv = lower_kv.to(
                    device, non_blocking=True
                )  # pinned staging: an async copy, ordered before its readers
            if promote and lower:
                self._promote_batch(lower, lower_kv.view(len(lower), -1))
            if lower_kv is not None and len(lower) == num:
                out = lower_kv  # fresh staging memory in row order: no further copy
            else:
                out = torch.empty((num, *shape), dtype=state.spec.dtype, device=device)
                if lower_kv is not None:
                    out.index_copy_(
                        0, torch.tensor(lower_rows, dtype=torch.long, device=device), lower_kv
                    )
                if device_rows and len(device_rows) == num:
                    state.memory[Tier.DEVICE].gather(device_slots, out.view(num, -1))
                elif device_rows:
                    gathered = torch.empty(
                        (len(device_rows), out[0].numel()), dtype=state.spec.dtype, device=device
                    )
                    state.memory[Tier.DEVICE].gather(device_slots, gathered)
                    out.view(num, -1).index_copy_(
                        0, torch.tensor(device_rows, dtype=torch.long, device=device), gathered
                    )
                for row, first in duplicates:
                    out[row].copy_(out[first])
            for entry in entries:
                entry.last_access = now
                state.lru[entry.tier].touch(entry)
            return out

    def _load_disk_payloads(self, lower: Sequence[CacheEntry], staging: torch.Tensor) -> None:
        """Decode the disk entries of ``lower`` into their rows of ``staging``; a bad file is dropped and raised."""
        state = self._state
        staging_bytes = None
        aeads: dict[str, tuple[bytes, AESGCM]] = {}
        for pos, entry in enumerate(lower):
            if entry.tier is not Tier.DISK:
                continue
            if staging_bytes is None:
                staging_bytes = (
                    staging.view(torch.uint8).reshape(len(lower), state.spec.block_bytes).numpy()
                )
            staging_bytes[pos] = np.frombuffer(self._disk_payload(entry, aeads), dtype=np.uint8)

    def _disk_payload(
        self, entry: CacheEntry, aeads: dict[str, tuple[bytes, AESGCM]]
    ) -> bytes | memoryview:
        """The authenticated KV bytes of a disk entry's file; a missing or bad file is dropped and
        raised."""
        state = self._state
        try:
            return state.disk.payload(entry.key, aeads)
        except BlockRestoreError as error:
            state.drop(entry, RemovalReason.RESTORE_FAILED)
            raise BlockRestoreError(entry.block_hash, error.reason) from None

    def _promote_batch(self, lower: Sequence[CacheEntry], staged: torch.Tensor) -> None:
        """Move the leading host/disk entries of ``lower`` to device slots; ``staged[i]`` is
        ``lower[i]``'s KV.

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
        through :meth:`PoolState.drop`) still overwrites and unlinks with evidence. No
        fsync on this read path. Residual: the freed filesystem blocks of a
        sealed file may keep its ciphertext after a later *document*
        invalidation while the tenant key stays alive — readable only with
        raw-device access and that key, and gone with the key's destruction
        (the overwrite itself is best effort on SSDs and copy-on-write
        filesystems).
        """
        state = self._state
        host, device = state.memory[Tier.HOST], state.memory[Tier.DEVICE]
        budget = len(device.free)
        if budget < len(lower):
            for candidate in state.lru[Tier.DEVICE].candidates():
                if candidate.ref_count == 0:
                    budget += 1
                    if budget >= len(lower):
                        break
        moved = lower[: min(budget, len(lower))]
        left_host_slots: list[int] = []  # left by moved entries, not yet zeroed
        placed: list[int] = []
        try:
            for entry in moved:
                from_tier = entry.tier
                if from_tier is Tier.HOST:
                    left_host_slots.append(entry.slot)
                else:
                    state.disk.unlink_promoted(entry.block_hash)
                state.unplace(entry)
                if not device.free:
                    if left_host_slots:
                        host.zero(left_host_slots)
                        host.release(left_host_slots)
                        left_host_slots.clear()
                    made_room = self._demoter.make_room(Tier.DEVICE)
                    assert made_room, "an unreferenced device victim always yields a slot"
                slot = device.take()
                state.place(entry, Tier.DEVICE, slot)
                placed.append(slot)
                state.events.append(MovedInPool(entry.key.block_hash, from_tier, Tier.DEVICE))
        finally:
            if left_host_slots:
                host.zero(left_host_slots)
                host.release(left_host_slots)
            if placed:
                device.scatter(placed, staged[: len(placed)])
            state.num_promotions += len(placed)
