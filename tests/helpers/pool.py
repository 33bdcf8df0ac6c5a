"""Builders shared by the block pool's unit tests: a tiny KV spec, deterministic hashes, keys, KV and a clock.

Each test module keeps its own ``make_key`` (the provenance it needs); they all build
keys through :func:`block_key`, so block ``i`` has the same hash and parent everywhere.
"""

from __future__ import annotations

import hashlib

import torch

from gpu_node.kv_spec import KVBlockSpec
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
    return torch.arange(SPEC.num_elements, dtype=SPEC.dtype).reshape(SPEC.block_shape) + 1000.0 * (i + 1)
