"""Demotion: making room in a tier by moving its least recently used block down (device → host → disk → drop).

Split from :class:`gpu_node.block_pool.BlockPool` because it is the one policy
that chains tiers: room in one tier is made by making room in the next one down,
recursively, and a block that finds no room below (or cannot be sealed for disk)
is dropped instead. Writing the bytes into the lower tier is the pool's
:meth:`BlockPool._store_bytes`, the same call that stores a built or imported
block; placement, events and counters stay the pool's. This runs under the
pool's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_node.pool_types import BlockState, CacheEntry, MovedInPool, RemovalReason, Tier

if TYPE_CHECKING:
    from gpu_node.block_pool import BlockPool

TIER_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
"""How far down each tier lies: blocks only ever move down by demotion (and up to the device by promotion)."""


class PoolDemoter:
    """Serves :meth:`BlockPool.demote` and makes room for every path that needs a slot (builds, promotions, sequences)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def demote(self, block_hash: bytes, to_tier: Tier) -> bool:
        """Move an unreferenced READY block down to ``to_tier``; False when not possible now."""
        pool = self._pool
        if to_tier is Tier.DEVICE:
            raise ValueError("nothing can be demoted to the device tier")
        with pool._lock:
            entry = pool._entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY or entry.ref_count > 0:
                return False
            if TIER_DEPTH[entry.tier] >= TIER_DEPTH[to_tier] or not self.make_room(to_tier):
                return False
            return self._move_down(entry, to_tier, pool._read_payload(entry))

    def make_room(self, tier: Tier) -> bool:
        """Free one unit of ``tier`` by demoting its LRU unreferenced READY entry (device → host → disk → drop).

        False only when every entry of the full tier is referenced.
        """
        pool = self._pool
        if pool._has_room(tier):
            return True
        victim = next((entry for entry in pool._lru[tier].candidates() if entry.ref_count == 0), None)
        if victim is None:
            return False
        lower = self._lower_tier(tier)
        if lower is not None and self.make_room(lower) and self._move_down(victim, lower, pool._read_payload(victim)):
            return True
        pool._drop(victim, RemovalReason.EVICTED)
        return True

    def _lower_tier(self, tier: Tier) -> Tier | None:
        """The nearest tier below ``tier`` that has any capacity."""
        for lower in Tier:
            if TIER_DEPTH[lower] > TIER_DEPTH[tier] and self._pool._capacity[lower] > 0:
                return lower
        return None

    def _move_down(self, entry: CacheEntry, to_tier: Tier, kv: torch.Tensor) -> bool:
        """Store ``kv`` in lower ``to_tier`` (room already made), then delete the old bytes; False if unsealable."""
        pool = self._pool
        from_tier = entry.tier
        assert from_tier is not None and TIER_DEPTH[to_tier] > TIER_DEPTH[from_tier], "a demotion moves a placed entry down"
        stored, slot = pool._store_bytes(entry, to_tier, kv)
        if not stored:
            return False
        pool._delete_bytes(entry)
        pool._unplace(entry)
        pool._place(entry, to_tier, slot)
        pool._num_demotions += 1
        pool._events.append(MovedInPool(entry.block_hash, from_tier, to_tier))
        return True
