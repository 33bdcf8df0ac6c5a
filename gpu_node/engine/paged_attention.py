"""Attention over the block pool's device tier, registered with transformers' attention interface.

One model forward per engine step carries every scheduled token of every
sequence as one flattened row (``[1, num_tokens]`` with explicit positions).
Each attention layer then, through :func:`paged_attention_forward`:

1. writes the step's new keys and values straight into the pool's device tensor
   ``[num_device_blocks, layers, 2, kv_heads, block_size, head_dim]`` at the
   step's slot mapping (block slot, offset) — a sequence's KV lives in pool
   blocks from the moment it is computed, so committing a full prefix block
   for reuse is bookkeeping, and a device-tier hit is read in place;
2. reads each sequence's keys and values back through its block table and runs
   SDPA: all single-token decodes together as one padded batch (a key mask
   hides the padding), each prefill chunk on its own with a causal mask offset
   by the tokens already in its blocks — or, for a chunk with nothing before
   it (a miss), plain causal SDPA over its own new keys, with no gather. A lone
   decode reads its own blocks cut to its context (no mask); decodes whose
   tables start with the same blocks read those once for the whole batch
   (:func:`_decodes_over_shared_prefix`).

Everything that depends only on the step (indices, masks) is built once per
step in :class:`PagedStep` and shared by all layers. Without a ``paged_step``
keyword the function is plain SDPA, so the same loaded model still runs
``generate`` and ``DynamicCache`` forwards (benchmarks' floors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

PAGED_ATTENTION = "kvledger_paged_sdpa"


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Query rows ``[first_row, first_row + num_tokens)`` of one sequence whose context is
    ``num_context_tokens`` long."""

    first_row: int
    num_tokens: int
    num_context_tokens: int
    context_rows: (
        torch.Tensor | None
    )  # [layers, 2, kv_heads, num_context_tokens]; None when the chunk is its whole context
    causal_mask: (
        torch.Tensor | None
    )  # [num_tokens, num_context_tokens], True = may attend; None likewise


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What one step's attention layers need: where new KV goes and how to read each sequence's KV.

    Rows ``[0, num_decodes)`` of the flattened batch are single-token decodes,
    the rest are :class:`PrefillChunk` s. Every ``*_rows`` tensor indexes
    ``kv_rows`` (:func:`kv_rows`), one index tensor per layer.
    """

    kv_rows: torch.Tensor  # the pool's device tier viewed as [num_rows, head_dim]: one row per (slot, layer, k/v, head, offset)
    write_rows: (
        torch.Tensor
    )  # [layers, 2, kv_heads, num_tokens]: where each new token's keys and values go
    num_decodes: int
    decode_rows: torch.Tensor  # [layers, num_decodes, 2, kv_heads, T] after the shared tokens, padded; [layers, 2, kv_heads, T] for one
    decode_shared_rows: (
        torch.Tensor | None
    )  # [layers, 2, kv_heads, P]: the leading tokens of every decode (2+ decodes), read once
    decode_mask: (
        torch.Tensor | None
    )  # [num_decodes, 1, 1, T], True = real context token; None for one decode (its rows are exact)
    prefills: tuple[PrefillChunk, ...]


def row_view(kv_table: torch.Tensor) -> torch.Tensor:
    """``kv_table`` ``[slots, layers, 2, kv_heads, block_size, head_dim]`` as rows of ``head_dim``
    values, without a copy."""
    return kv_table.view(-1, kv_table.shape[-1])


class RowIndex:
    """Builds the ``*_rows`` index tensors of a :class:`PagedStep` for one device tier's shape.

    The row of the key (``kv`` 0) or value (1) of head ``h`` at offset ``o`` of
    slot ``s`` in layer ``l`` of :func:`row_view` is
    ``s * rows_per_slot + l * rows_per_layer + (kv * kv_heads + h) * block_size + o``.
    The constant part per (layer, kv, head) and the positions ``0, 1, ..`` (with
    their block index and offset) are built once and sliced, so a step's indices
    cost a few tensor operations whatever its number of sequences.
    """

    def __init__(self, kv_table: torch.Tensor) -> None:
        _, num_layers, _, num_kv_heads, block_size, _ = kv_table.shape
        device = kv_table.device
        self._block_shape = (kv_table.shape[1:], device)
        self.block_size = block_size
        rows_per_layer = 2 * num_kv_heads * block_size
        self.rows_per_slot = num_layers * rows_per_layer
        kv_head = (
            torch.arange(2 * num_kv_heads, device=device).view(2, num_kv_heads, 1) * block_size
        )
        self.within_slot = (
            torch.arange(num_layers, device=device).view(num_layers, 1, 1, 1) * rows_per_layer
            + kv_head
        )  # [L, 2, H, 1]
        self.positions = torch.arange(0, device=device)
        self._grow(4096)

    def fits(self, kv_table: torch.Tensor) -> bool:
        """Whether these indices are valid for ``kv_table`` (same block shape, same device; any number of slots)."""
        return (kv_table.shape[1:], kv_table.device) == self._block_shape

    def _grow(self, num_positions: int) -> None:
        self.positions = torch.arange(num_positions, device=self.positions.device)
        self.block_of = torch.div(self.positions, self.block_size, rounding_mode="floor")
        self.offset_of = self.positions % self.block_size

    def arange(self, num_positions: int) -> torch.Tensor:
        """Positions ``0 .. num_positions - 1`` (a view of a cached tensor)."""
        if num_positions > len(self.positions):
            self._grow(max(num_positions, 2 * len(self.positions)))
        return self.positions[:num_positions]

    def slot_rows(self, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows ``[layers, ..., 2, kv_heads, T]`` of the keys and values at ``offsets`` of device
        ``slots`` (both ``[..., T]``).

        One ``index_select`` of a layer's rows lays the tokens' keys and values
        out as ``[..., kv_heads, T, head_dim]``, ready for attention: a single
        copy, where selecting whole blocks and then flattening them copies twice.
        """
        token_rows = torch.add(offsets, slots, alpha=self.rows_per_slot)  # [..., T]
        within_slot = self.within_slot.view(
            self.within_slot.shape[0], *([1] * (token_rows.dim() - 1)), *self.within_slot.shape[1:]
        )
        return token_rows[..., None, None, :] + within_slot

    def context_rows(self, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """:meth:`slot_rows` of the first ``num_tokens`` tokens (at most ``n * block_size``) of block table(s) ``blocks`` ``[..., n]``."""
        self.arange(num_tokens)
        block_index = self.block_of[:num_tokens].expand(*blocks.shape[:-1], -1)
        return self.slot_rows(torch.gather(blocks, -1, block_index), self.offset_of[:num_tokens])


def _gather(step: PagedStep, rows: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[..., kv_heads, T, head_dim]`` at ``rows`` ``[layers, ..., 2, kv_heads, T]`` of ``layer``."""
    layer_rows = rows[layer]
    gathered = step.kv_rows.index_select(0, layer_rows.reshape(-1)).view(*layer_rows.shape, -1)
    return gathered.select(-4, 0), gathered.select(-4, 1)


def _decodes_over_shared_prefix(
    query: torch.Tensor, step: PagedStep, layer: int, scaling: float | None
) -> torch.Tensor:
    """Attention ``[S, H, D]`` of ``S`` decode queries whose contexts all start with the tokens at
    ``step.decode_shared_rows``.

    The shared tokens (a common system prompt, say) are gathered once and
    scored by every query in one matmul, instead of being copied once per
    sequence into a padded batch; each sequence's own tokens are gathered and
    masked as usual. One softmax over both score parts keeps it exact attention.
    """
    num_seqs, num_heads, head_dim = query.shape
    shared_k, shared_v = _gather(step, step.decode_shared_rows, layer)  # [Hkv, P, D]
    own_k, own_v = _gather(step, step.decode_rows, layer)  # [S, Hkv, T, D]
    num_kv_heads = shared_k.shape[0]
    group = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = (
        query.reshape(num_seqs, num_kv_heads, group, head_dim).float() * scale
    )  # query head h reads kv head h // group
    by_kv_head = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * group, head_dim)
    shared_scores = torch.matmul(by_kv_head, shared_k.float().transpose(-1, -2))  # [Hkv, S * g, P]
    shared_scores = shared_scores.view(num_kv_heads, num_seqs, group, -1).permute(
        1, 0, 2, 3
    )  # [S, Hkv, g, P]
    own_scores = torch.matmul(q, own_k.float().transpose(-1, -2))  # [S, Hkv, g, T]
    own_scores = own_scores.masked_fill(~step.decode_mask, float("-inf"))  # mask [S, 1, 1, T]
    num_shared = shared_scores.shape[-1]
    probs = torch.softmax(torch.cat((shared_scores, own_scores), dim=-1), dim=-1)
    shared_probs = (
        probs[..., :num_shared]
        .permute(1, 0, 2, 3)
        .reshape(num_kv_heads, num_seqs * group, num_shared)
    )
    attended = (
        torch.matmul(shared_probs, shared_v.float())
        .view(num_kv_heads, num_seqs, group, head_dim)
        .permute(1, 0, 2, 3)
    )
    attended = attended + torch.matmul(probs[..., num_shared:], own_v.float())  # [S, Hkv, g, D]
    return attended.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    paged_step: PagedStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    step = paged_step
    layer = module.layer_idx
    # [1, H, T, D] x2 -> rows in write_rows' [2, H, T] order; the new tokens' KV goes into their
    # blocks before anything reads them
    new_kv = torch.stack((key[0], value[0])).to(step.kv_rows.dtype)
    step.kv_rows.index_copy_(
        0, step.write_rows[layer].reshape(-1), new_kv.view(-1, new_kv.shape[-1])
    )
    num_heads = query.shape[1]
    out = query.new_empty((query.shape[2], num_heads, query.shape[3]))
    if step.num_decodes == 1:
        # One decode: its rows are exactly its context, so it needs no mask (the fused kernel, no
        # padding).
        k, v = _gather(step, step.decode_rows, layer)
        attended = functional.scaled_dot_product_attention(
            query[:, :, :1], k[None], v[None], scale=scaling, enable_gqa=True
        )
        out[:1] = attended[:, :, 0]
    elif step.decode_shared_rows is not None:
        out[: step.num_decodes] = _decodes_over_shared_prefix(
            query[0, :, : step.num_decodes].transpose(0, 1), step, layer, scaling
        )
    elif step.num_decodes:
        q = query[0, :, : step.num_decodes].transpose(0, 1).unsqueeze(2)  # [S, H, 1, D]
        k, v = _gather(step, step.decode_rows, layer)
        attended = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=step.decode_mask, scale=scaling, enable_gqa=True
        )
        out[: step.num_decodes] = attended[:, :, 0]
    # Batched (4D) inputs throughout: for 3D ones SDPA on CPU falls back to its unfused math path.
    for chunk in step.prefills:
        rows = slice(chunk.first_row, chunk.first_row + chunk.num_tokens)
        q = query[:, :, rows]  # [1, H, n, D]
        if chunk.num_context_tokens == chunk.num_tokens:
            # Nothing before this chunk: its own keys are the whole context, and plain causal SDPA
            # (the fused kernel, no mask tensor, no gather) is what a miss costs without paging.
            attended = functional.scaled_dot_product_attention(
                q,
                key[:, :, rows],
                value[:, :, rows],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
        else:
            k, v = _gather(step, chunk.context_rows, layer)
            attended = functional.scaled_dot_product_attention(
                q, k[None], v[None], attn_mask=chunk.causal_mask, scale=scaling, enable_gqa=True
            )
        out[rows] = attended[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register() -> None:
    """Make :data:`PAGED_ATTENTION` a valid ``attn_implementation`` (idempotent)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


def no_mask(device: torch.device) -> torch.Tensor:
    """A 4D placeholder mask: transformers passes a prepared 4D mask through untouched, and the paged path ignores it."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
