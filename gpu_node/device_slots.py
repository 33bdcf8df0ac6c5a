"""Device slots owned by running sequences (paged KV, :mod:`gpu_node.paged_kv`): allocate, free, commit in place.

Split from :class:`gpu_node.block_pool.BlockPool` because these slots are not
cache entries until committed: a sequence writes its KV straight into them and
the pool neither reads, moves nor zeroes them meanwhile. Making room (demoting
cached blocks) and committing (placing a READY entry) use the pool's own
bookkeeping under its lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpu_node.pool_types import BlockState, CacheEntry, Tier
from gpu_node.slot_io import zero_slots

if TYPE_CHECKING:
    from gpu_node.block_pool import BlockPool


class DeviceSlots:
    """Serves the pool's device-slot methods (:meth:`BlockPool.allocate_device_slots` and kin) under the pool's lock."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def usage(self) -> tuple[int, int]:
        """``(slots in use, slots in total)`` of the device tier: cached entries plus sequences' own slots."""
        pool = self._pool
        with pool._lock:
            return pool._capacity[Tier.DEVICE] - len(pool._free_slots[Tier.DEVICE]), pool._capacity[Tier.DEVICE]

    def allocate(self, num_slots: int) -> list[int] | None:
        """Take ``num_slots`` device slots for a sequence's own KV; None (nothing taken) when there is no room.

        Room is made like for any new block: unreferenced READY device entries
        are demoted (or dropped) in LRU order. The slots belong to the caller
        until :meth:`BlockPool.free_device_slots` or :meth:`BlockPool.commit_slot`; the pool never
        reads, moves or zeroes them meanwhile.
        """
        pool = self._pool
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        with pool._lock:
            available = len(pool._free_slots[Tier.DEVICE])
            if available < num_slots:
                for candidate in pool._lru[Tier.DEVICE].candidates():
                    if candidate.ref_count == 0:
                        available += 1
                        if available >= num_slots:
                            break
            if available < num_slots:
                return None
            slots = []
            for _ in range(num_slots):
                made_room = pool._demoter.make_room(Tier.DEVICE)
                assert made_room, "counted victims always yield slots"
                slots.append(heapq.heappop(pool._free_slots[Tier.DEVICE]))
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """Zero and return slots taken with :meth:`BlockPool.allocate_device_slots`: a request's KV never outlives it in a free slot."""
        pool = self._pool
        if not slots:
            return
        with pool._lock:
            ordered = sorted(slots)
            zero_slots(pool._flat_slots[Tier.DEVICE], ordered)
            for slot in ordered:
                heapq.heappush(pool._free_slots[Tier.DEVICE], slot)

    def commit(self, entry: CacheEntry, slot: int) -> bool:
        """Make a BUILDING entry READY in the caller's own device ``slot`` (its KV is already there): no copy.

        The entry starts with one reference, the committing sequence's, since
        its attention keeps reading the block; release it with
        :meth:`BlockPool.dec_lock_ref`. False when the entry was tombstoned while
        building: it is discarded and the slot stays the caller's.
        """
        pool = self._pool
        with pool._lock:
            assert pool._entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING, (
                "commit_slot takes the BUILDING entry begin_build returned"
            )
            # Range only: a membership scan of the free-slot heap cost ~20 µs per committed block, on every miss.
            assert 0 <= slot < pool._capacity[Tier.DEVICE], "the slot must be a device slot the caller allocated"
            if entry.tombstoned:
                pool._discard_building(entry)
                return False
            entry.ref_count = 1
            pool._make_ready(entry, slot)
            return True
