"""Builders shared by the block pool's unit tests: a tiny KV spec, deterministic hashes, keys, KV and a clock.

Each test module keeps its own ``make_key`` (the provenance it needs); they all build
keys through :func:`block_key`, so block ``i`` has the same hash and parent everywhere.

The tests of the pool's parts (state, demotion, reads, removal, warm start, device
slots) build a :class:`PoolState` alone with :func:`make_state` and set up blocks
with :func:`put` and :func:`building`, which go through the state's own
primitives, so each part is exercised without the pool around it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from events.tiers import Tier
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import BlockState, CacheEntry, PoolConfig
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

NS = "ns-test"
SPEC = KVBlockSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
NO_TTL = {CacheScope.PUBLIC: None, CacheScope.TENANT: None, CacheScope.USER: None}


class FakeClock:
    """A settable time source (plain callable) for TTL tests."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def block_key(i: int, provenance: CacheProvenance) -> BlockKey:
    """Block ``i`` of a chain: parent ``i - 1``, token offset ``i``."""
    return BlockKey(block_hash(i), block_hash(i - 1), i, SPEC.block_size, provenance)


def make_kv(i: int) -> torch.Tensor:
    """KV of block ``i``: distinct per block and never all zeros (freed slots are)."""
    return torch.arange(SPEC.num_elements, dtype=SPEC.dtype).reshape(SPEC.block_shape) + 1000.0 * (
        i + 1
    )


def scoped_key(
    i: int,
    scope: CacheScope = CacheScope.PUBLIC,
    tenant: str = "acme",
    documents: tuple[str, ...] = (),
) -> BlockKey:
    """Block ``i`` of namespace :data:`NS` in ``scope`` (tenant scope: auth scope ``*``; user scope:
    subject alice)."""
    provenance = CacheProvenance(
        namespace=NS,
        tenant_id=None if scope == CacheScope.PUBLIC else tenant,
        scope=scope,
        auth_scopes=(("*", 1),) if scope == CacheScope.TENANT else (),
        subject_id="alice" if scope == CacheScope.USER else None,
        documents=documents,
        created_at=0.0,
    )
    return block_key(i, provenance)


def make_state(
    tmp_path: Path,
    *,
    device: int = 4,
    host: int = 0,
    disk: int = 0,
    ttl=None,
    clock=None,
    wall_clock=None,
    keys=None,
) -> PoolState:
    """A pool state alone; unless given, the wall clock runs 1,000,000 s ahead of the pool clock
    (1000.0)."""
    clock = clock or FakeClock(1000.0)
    config = PoolConfig(NS, device, host, disk, tmp_path / "disk", NO_TTL if ttl is None else ttl)
    wall_clock = wall_clock or (lambda: clock() + 1_000_000.0)
    return PoolState(SPEC, config, keys or LocalKeyStore(tmp_path / "keys.json"), clock, wall_clock)


def put(
    state: PoolState,
    i: int,
    tier: Tier = Tier.DEVICE,
    *,
    key: BlockKey | None = None,
    ref_count: int = 0,
) -> CacheEntry:
    """Block ``i`` (KV :func:`make_kv`) READY in ``tier``, which has room, as an import places it; no event."""
    entry = CacheEntry(key=key or scoped_key(i), state=BlockState.READY, last_access=state.clock())
    stored, slot = state.store_bytes(entry, tier, make_kv(i))
    assert stored, "put stores only blocks the tier can hold"
    state.admit(entry)
    state.place(entry, tier, slot)
    entry.ref_count = ref_count
    return entry


def building(state: PoolState, i: int, *, key: BlockKey | None = None) -> CacheEntry:
    """Block ``i`` claimed for building, as :meth:`gpu_node.pool.block_pool.BlockPool.begin_build`
    claims it."""
    entry = CacheEntry(
        key=key or scoped_key(i), state=BlockState.BUILDING, last_access=state.clock()
    )
    state.admit(entry)
    state.num_building += 1
    return entry


def lru_order(state: PoolState, tier: Tier) -> list[int]:
    """The block numbers of ``tier``'s READY entries, least recently used first."""
    numbers = {block_hash(i): i for i in range(-1, 64)}
    return [numbers[entry.block_hash] for entry in state.lru[tier].candidates()]


def placed(state: PoolState) -> dict[int, tuple[Tier, int | None]]:
    """Block number → (tier, slot) of every placed entry."""
    numbers = {block_hash(i): i for i in range(-1, 64)}
    return {
        numbers[entry.block_hash]: (entry.tier, entry.slot)
        for entry in state.entries.values()
        if entry.tier is not None
    }
