"""Per-block KV tensor geometry.

The pool, the snapshot writer and the model runner must agree byte-for-byte on
what one block is; this module is that single definition. ``kv_format`` is part
of the cache namespace (docs/design.md §2), so two nodes whose blocks differ in dtype,
layout version or block size can never share a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_LAYOUT_VERSION = 1
"""Version of the block layout in memory and at rest: part of every namespace's KV format."""


@dataclass(frozen=True, slots=True)
class KVBlockSpec:
    """Shape and dtype of one cached block: every layer's keys and values for ``block_size`` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2 [k|v], kv_heads, block_size, head_dim)``: the layout of pool slots and block
        files."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def num_elements(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_format(self) -> str:
        """Canonical KV format string for the namespace, e.g. ``float32/L1/bs16``."""
        return f"{self.dtype_name}/L{KV_LAYOUT_VERSION}/bs{self.block_size}"
