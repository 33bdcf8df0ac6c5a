"""Batched sampling: one call per engine step picks the next token of every sampling sequence.

Greedy rows (temperature 0) take the argmax, the comparison bar for cached vs
uncached outputs. Other rows are scaled by their temperature, cut to their
top-p nucleus and drawn with their request's own ``torch.Generator``, so a
seeded request draws the same tokens whatever else shares its batch.

vLLM's ``min_tokens`` works here as it does there: until a request has generated
that many tokens, the tokens that would end it (end of sequence unless
``ignore_eos``, and its ``stop_token_ids``) are masked out of its logits, so
they can be neither picked nor drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """A sampling parameter the caller got wrong; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingState:
    """Per-request sampling configuration; ``generator`` is None for greedy.

    ``stop_token_ids`` are the tokens that end the request (its own, plus the model's
    end-of-sequence tokens unless it ignores them); they are masked while fewer than
    ``min_tokens`` tokens have been generated.
    """

    temperature: float
    top_p: float
    generator: torch.Generator | None
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0


def make_sampling_state(
    temperature: float,
    top_p: float,
    seed: int | None,
    *,
    vocab_size: int,
    stop_token_ids: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> SamplingState:
    """Validate and build a request's sampling state (a seeded generator unless greedy); SamplingError on bad values."""
    if temperature < 0:
        raise SamplingError("temperature must be >= 0", "temperature")
    if not 0 < top_p <= 1:
        raise SamplingError("top_p must be in (0, 1]", "top_p")
    if min_tokens < 0:
        raise SamplingError("min_tokens must be >= 0", "min_tokens")
    out_of_vocabulary = sorted(token for token in stop_token_ids if not 0 <= token < vocab_size)
    if out_of_vocabulary:
        raise SamplingError(
            f"stop_token_ids must be token ids of this model (0 to {vocab_size - 1}); {out_of_vocabulary[0]} is not",
            "stop_token_ids",
        )
    if temperature == 0:
        return SamplingState(0.0, 1.0, None, stop_token_ids, min_tokens)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else torch.seed())
    return SamplingState(temperature, top_p, generator, stop_token_ids, min_tokens)


def _mask_early_stops(
    logits: torch.Tensor, states: Sequence[SamplingState], num_output_tokens: Sequence[int]
) -> torch.Tensor:
    """``logits`` with the stop tokens at -inf in every row still short of its ``min_tokens``.

    A copy when any row is masked: the model's logits are an inference-mode tensor, not to be
    written."""
    rows = [
        row
        for row, state in enumerate(states)
        if num_output_tokens[row] < state.min_tokens and state.stop_token_ids
    ]
    if not rows:
        return logits
    masked = logits.clone()
    for row in rows:
        ids = torch.tensor(
            sorted(states[row].stop_token_ids), dtype=torch.long, device=logits.device
        )
        masked[row].index_fill_(0, ids, float("-inf"))
    return masked


def sample_batch(
    logits: torch.Tensor,
    states: Sequence[SamplingState],
    num_output_tokens: Sequence[int] | None = None,
) -> list[int]:
    """Next token per row of ``logits`` ``[rows, vocab]``, row ``i`` sampled under ``states[i]``.

    ``num_output_tokens[i]``: tokens row ``i``'s request has generated so far (for
    ``min_tokens``; omitted, every request is past its minimum).
    """
    assert logits.shape[0] == len(states), "one sampling state per logits row"
    if num_output_tokens is not None:
        assert len(num_output_tokens) == len(states), "one output count per logits row"
        logits = _mask_early_stops(logits, states, num_output_tokens)
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
        # keep a token while the probability mass strictly before it is under top_p (the top token
        # always stays)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p[:, None]) | ~nucleus_rows[
            :, None
        ]
        filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
        probs = filtered / filtered.sum(dim=-1, keepdim=True)
    for position, row in enumerate(rows):
        tokens[row] = int(
            torch.multinomial(probs[position], 1, generator=states[row].generator).item()
        )
    return tokens
