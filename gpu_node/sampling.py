"""Batched sampling: one call per engine step picks the next token of every sampling sequence.

Greedy rows (temperature 0) take the argmax, the comparison bar for cached vs
uncached outputs. Other rows are scaled by their temperature, cut to their
top-p nucleus and drawn with their request's own ``torch.Generator``, so a
seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingState:
    """Per-request sampling configuration; ``generator`` is None for greedy."""

    temperature: float
    top_p: float
    generator: torch.Generator | None


def make_sampling_state(temperature: float, top_p: float, seed: int | None) -> SamplingState:
    """Validate and build a request's sampling state (a seeded generator unless greedy); ValueError on bad values."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
    if temperature == 0:
        return SamplingState(0.0, 1.0, None)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else torch.seed())
    return SamplingState(temperature, top_p, generator)


def sample_batch(logits: torch.Tensor, states: Sequence[SamplingState]) -> list[int]:
    """Next token per row of ``logits`` ``[rows, vocab]``, row ``i`` sampled under ``states[i]``."""
    assert logits.shape[0] == len(states), "one sampling state per logits row"
    tokens = torch.argmax(logits, dim=-1).tolist()
    rows = [row for row, state in enumerate(states) if state.generator is not None]
    if not rows:
        return tokens
    temperatures = torch.tensor([states[row].temperature for row in rows], dtype=torch.float32)
    probs = torch.softmax(logits[rows].float().cpu() / temperatures[:, None], dim=-1)
    top_p = torch.tensor([states[row].top_p for row in rows], dtype=torch.float32)
    nucleus_rows = top_p < 1.0
    if bool(nucleus_rows.any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token while the probability mass strictly before it is under top_p (the top token always stays)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p[:, None]) | ~nucleus_rows[:, None]
        filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
        probs = filtered / filtered.sum(dim=-1, keepdim=True)
    for position, row in enumerate(rows):
        tokens[row] = int(torch.multinomial(probs[position], 1, generator=states[row].generator).item())
    return tokens
