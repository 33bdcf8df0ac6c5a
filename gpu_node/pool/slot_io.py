"""Batched slot I/O on a memory tier's ``[slots, block_elements]`` view.

Contiguous runs of slots become plain slice copies (memcpy/memset speed), anything
more fragmented one indexed op: moving or zeroing thousands of blocks costs a few
tensor operations, not one per block. Every function writes every listed row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_SLICE_RUNS = 16
"""Up to this many runs of consecutive slots are copied as slices; more take one indexed op."""


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first slot, first position, length)`` of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for pos, slot in enumerate(slots):
        if runs and slot == runs[-1][0] + runs[-1][2]:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((slot, pos, 1))
    return runs


def gather_slots(table: torch.Tensor, slots: Sequence[int], out: torch.Tensor) -> None:
    """``out[i] = table[slots[i]]``."""
    runs = slot_runs(slots)
    if len(runs) <= MAX_SLICE_RUNS:
        for start, first, length in runs:
            out[first : first + length].copy_(table[start : start + length])
    else:
        torch.index_select(
            table, 0, torch.tensor(slots, dtype=torch.long, device=table.device), out=out
        )


def scatter_slots(table: torch.Tensor, slots: Sequence[int], rows: torch.Tensor) -> None:
    """``table[slots[i]] = rows[i]``."""
    runs = slot_runs(slots)
    if len(runs) <= MAX_SLICE_RUNS:
        for start, first, length in runs:
            table[start : start + length].copy_(rows[first : first + length])
    else:
        table.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=table.device), rows)


def zero_slots(table: torch.Tensor, slots: Sequence[int]) -> None:
    """``table[slot] = 0`` for every listed slot."""
    runs = slot_runs(slots)
    if len(runs) <= MAX_SLICE_RUNS:
        for start, _, length in runs:
            table[start : start + length].zero_()
    else:
        table.index_fill_(0, torch.tensor(slots, dtype=torch.long, device=table.device), 0)


def zero_slots_verified(table: torch.Tensor, slots: Sequence[int]) -> list[bool]:
    """Zero every listed slot, then read them back: per slot, whether it now holds only zeros."""
    zero_slots(table, slots)
    runs = slot_runs(slots)
    if len(runs) <= MAX_SLICE_RUNS:
        nonzero = torch.cat([table[start : start + length].any(dim=1) for start, _, length in runs])
    else:
        nonzero = table.index_select(
            0, torch.tensor(slots, dtype=torch.long, device=table.device)
        ).any(dim=1)
    return [not value for value in nonzero.tolist()]
