"""A memory tier of the block pool (device or host): one preallocated slot table, its free slots,
batched slot I/O.

The device and host tiers differ only in where their table lives (the model's
device; CPU memory, pinned under CUDA), so both are this one type. It knows
slots, not blocks: which block sits in a slot, and whether a slot may be
written, is the pool state's (:class:`gpu_node.pool.state.PoolState`). The
lowest free slot is always taken first, which keeps layouts deterministic.

A CPU table that is not page-locked is zero pages of an anonymous mapping
(:func:`lazy_zeros`): the kernel backs a page only when it is first written, so a
fresh node does not cost its tiers' full size in resident memory.
"""

from __future__ import annotations

import heapq
import math
import mmap
from collections.abc import Sequence

import torch

from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.slot_io import gather_slots, scatter_slots, zero_slots, zero_slots_verified


class MemoryTier:
    """``table[slot]`` is one block's KV; ``free`` the slots holding no block (a heap, lowest
    first)."""

    __slots__ = ("capacity", "flat", "free", "table")

    def __init__(self, table: torch.Tensor, spec: KVBlockSpec) -> None:
        assert tuple(table.shape[1:]) == spec.block_shape, (
            "a slot table is [num_slots, *block_shape]"
        )
        self.table = table
        self.capacity = table.shape[0]
        # A two-dimensional view ``[slots, block_elements]`` of the same storage, for batched slot
        # I/O.
        self.flat = table.view(self.capacity, spec.num_elements)
        # A sorted list is a valid heap.
        self.free = list(range(self.capacity))

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free)

    def has_room(self) -> bool:
        return bool(self.free)

    def take(self) -> int:
        """The lowest free slot, now taken; the caller checked :meth:`has_room`."""
        return heapq.heappop(self.free)

    def release(self, slots: Sequence[int]) -> None:
        """Return slots whose bytes the caller already zeroed."""
        free = self.free
        for slot in slots:
            heapq.heappush(free, slot)

    def write(self, slot: int, kv: torch.Tensor) -> None:
        self.table[slot].copy_(kv)

    def gather(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """``out[i] = slot slots[i]`` (``out`` is ``[len(slots), block_elements]``)."""
        gather_slots(self.flat, slots, out)

    def scatter(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """``slot slots[i] = rows[i]``."""
        scatter_slots(self.flat, slots, rows)

    def zero(self, slots: Sequence[int]) -> None:
        zero_slots(self.flat, slots)

    def zero_verified(self, slots: Sequence[int]) -> list[bool]:
        """Zero the slots and read them back: per slot, whether it now holds only zeros."""
        return zero_slots_verified(self.flat, slots)

    def clear(self, slot: int) -> bool:
        """Zero one slot, read it back and free it; whether it read back as zero."""
        slot_tensor = self.table[slot]
        slot_tensor.zero_()
        cleared = not bool(slot_tensor.any())
        heapq.heappush(self.free, slot)
        return cleared


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are backed only once written (an anonymous private
    mapping).

    Zero on every read of a page never written, guaranteed by the kernel (unlike
    ``torch.empty``, which may hand back reused memory).
    """
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
