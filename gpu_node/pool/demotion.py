"""Demotion: making room in a tier by moving its least recently used block down (device → host → disk → drop).

Its own part of the pool because it is the one policy that chains tiers: room
in one tier is made by making room in the next one down, recursively, and a
block that finds no room below (or cannot be sealed for disk) is dropped
instead. Writing the bytes into the lower tier is
:meth:`gpu_node.pool.state.PoolState.store_bytes`, the same call that stores a
built or imported block. Every path that needs a slot (builds, promotions,
sequences' own slots) makes room through :meth:`PoolDemoter.make_room`. Callers
hold the state's lock.
"""

from __future__ import annotations

import torch

from events.tiers import STORAGE_TIERS, Tier
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import BlockState, CacheEntry, MovedInPool, RemovalReason

TIER_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
"""How far down each tier lies: blocks only ever move down by demotion (and up to the device by
promotion)."""


class PoolDemoter:
    """Demotes blocks of one pool state and makes room in its tiers."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def demote(self, block_hash: bytes, to_tier: Tier) -> bool:
        """Move an unreferenced READY block down to ``to_tier``; False when not possible now."""
        state = self._state
        if to_tier is Tier.DEVICE:
            raise ValueError("nothing can be demoted to the device tier")
        if to_tier not in TIER_DEPTH:
            raise ValueError(f"blocks are demoted to the host or disk tier, not {to_tier}")
        with state.lock:
            entry = state.entries.get(block_hash)
            if entry is None or entry.state is not BlockState.READY or entry.ref_count > 0:
                return False
            if TIER_DEPTH[entry.tier] >= TIER_DEPTH[to_tier] or not self.make_room(to_tier):
                return False
            return self._move_down(entry, to_tier, state.read_payload(entry))

    def make_room(self, tier: Tier) -> bool:
        """Free one unit of ``tier`` by demoting its LRU unreferenced READY entry (device → host → disk → drop).

        False only when every entry of the full tier is referenced.
        """
        state = self._state
        if state.has_room(tier):
            return True
        victim = next(
            (entry for entry in state.lru[tier].candidates() if entry.ref_count == 0), None
        )
        if victim is None:
            return False
        lower = self._lower_tier(tier)
        if (
            lower is not None
            and self.make_room(lower)
            and self._move_down(victim, lower, state.read_payload(victim))
        ):
            return True
        state.drop(victim, RemovalReason.EVICTED)
        return True

    def _lower_tier(self, tier: Tier) -> Tier | None:
        """The nearest tier below ``tier`` that has any capacity."""
        for lower in STORAGE_TIERS:
            if TIER_DEPTH[lower] > TIER_DEPTH[tier] and self._state.capacity[lower] > 0:
                return lower
        return None

    def _move_down(self, entry: CacheEntry, to_tier: Tier, kv: torch.Tensor) -> bool:
        """Store ``kv`` in lower ``to_tier`` (room already made), then delete the old bytes; False if unsealable."""
        state = self._state
        from_tier = entry.tier
        assert from_tier is not None and TIER_DEPTH[to_tier] > TIER_DEPTH[from_tier], (
            "a demotion moves a placed entry down"
        )
        stored, slot = state.store_bytes(entry, to_tier, kv)
        if not stored:
            return False
        state.delete_bytes(entry)
        state.unplace(entry)
        state.place(entry, to_tier, slot)
        state.num_demotions += 1
        state.events.append(MovedInPool(entry.block_hash, from_tier, to_tier))
        return True
