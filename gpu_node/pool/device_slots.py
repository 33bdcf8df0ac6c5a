"""Device slots owned by running sequences (paged KV, :mod:`gpu_node.engine.paged_kv`): allocate, free, commit in place.

Its own part of the pool because these slots are not cache entries until
committed: a sequence writes its KV straight into them and the pool neither
reads, moves nor zeroes them meanwhile. Making room goes through the demoter
(:class:`gpu_node.pool.demotion.PoolDemoter`), committing (placing a READY
entry) through the pool state's primitives
(:class:`gpu_node.pool.state.PoolState`), under the state's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.tiers import Tier
from gpu_node.pool.demotion import PoolDemoter
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import BlockState, CacheEntry


class DeviceSlots:
    """Serves the pool's device-slot methods (``allocate_device_slots`` and kin) on one pool state."""

    def __init__(self, state: PoolState, demoter: PoolDemoter) -> None:
        self._state = state
        self._demoter = demoter

    def usage(self) -> tuple[int, int]:
        """``(slots in use, slots in total)`` of the device tier: cached entries plus sequences' own
        slots."""
        state = self._state
        with state.lock:
            device = state.memory[Tier.DEVICE]
            return device.num_used, device.capacity

    def allocate(self, num_slots: int) -> list[int] | None:
        """Take ``num_slots`` device slots for a sequence's own KV; None (nothing taken) when there is no room.

        Room is made like for any new block: unreferenced READY device entries
        are demoted (or dropped) in LRU order. The slots belong to the caller
        until :meth:`BlockPool.free_device_slots` or :meth:`BlockPool.commit_slot`; the pool never
        reads, moves or zeroes them meanwhile.
        """
        state = self._state
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        with state.lock:
            device = state.memory[Tier.DEVICE]
            available = len(device.free)
            if available < num_slots:
                for candidate in state.lru[Tier.DEVICE].candidates():
                    if candidate.ref_count == 0:
                        available += 1
                        if available >= num_slots:
                            break
            if available < num_slots:
                return None
            slots = []
            for _ in range(num_slots):
                made_room = self._demoter.make_room(Tier.DEVICE)
                assert made_room, "counted victims always yield slots"
                slots.append(device.take())
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """Zero and return slots taken with :meth:`BlockPool.allocate_device_slots`: a request's KV
        never outlives it in a free slot."""
        state = self._state
        if not slots:
            return
        with state.lock:
            ordered = sorted(slots)
            device = state.memory[Tier.DEVICE]
            device.zero(ordered)
            device.release(ordered)

    def commit(self, entry: CacheEntry, slot: int) -> bool:
        """Make a BUILDING entry READY in the caller's own device ``slot`` (its KV is already there): no copy.

        The entry starts with one reference, the committing sequence's, since
        its attention keeps reading the block; release it with
        :meth:`BlockPool.dec_lock_ref`. False when the entry was tombstoned while
        building: it is discarded and the slot stays the caller's.
        """
        state = self._state
        with state.lock:
            assert (
                state.entries.get(entry.block_hash) is entry and entry.state is BlockState.BUILDING
            ), "commit_slot takes the BUILDING entry begin_build returned"
            # Range only: a membership scan of the free-slot heap cost ~20 µs per committed block,
            # on every miss.
            assert 0 <= slot < state.memory[Tier.DEVICE].capacity, (
                "the slot must be a device slot the caller allocated"
            )
            if entry.tombstoned:
                state.discard_building(entry)
                return False
            entry.ref_count = 1
            state.make_ready(entry, slot)
            return True
