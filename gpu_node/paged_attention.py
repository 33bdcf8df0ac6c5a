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
    """Query rows ``[first_row, first_row + num_tokens)`` of one sequence whose context is ``num_context_tokens`` long."""

    first_row: int
    num_tokens: int
    num_context_tokens: int
    blocks: torch.Tensor | None  # device slots holding the context, in order; None when the chunk is its whole context
    causal_mask: torch.Tensor | None  # [num_tokens, num_blocks * block_size], True = may attend; None likewise


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What one step's attention layers need: where new KV goes and how to read each sequence's KV.

    Rows ``[0, num_decodes)`` of the flattened batch are single-token decodes,
    the rest are :class:`PrefillChunk` s.
    """

    kv_table: torch.Tensor
    slot_blocks: torch.Tensor  # [num_tokens]: device slot of each new token
    slot_offsets: torch.Tensor  # [num_tokens]: offset of each new token inside its block
    num_decodes: int
    decode_blocks: torch.Tensor  # [num_decodes, max_blocks], padded with slot 0; after the shared blocks when those are set
    decode_shared_blocks: torch.Tensor | None  # [num_shared]: leading blocks of every decode's table (2+ decodes), read once
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size], True = real context token; None for one decode
    num_decode_context_tokens: int  # the context length of a lone decode (its keys are cut to it instead of masked); else 0
    prefills: tuple[PrefillChunk, ...]


def _gather(kv_table: torch.Tensor, blocks: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[..., kv_heads, len(blocks) * block_size, head_dim]`` for index tensor ``blocks`` ``[..., n]``."""
    layer_view = kv_table[:, layer]  # [N, 2, H, bs, D], strided
    if blocks.dim() == 1:
        # One copy: selecting blocks along the permuted view lays them out as [2, H, n, bs, D] directly.
        gathered = layer_view.permute(1, 2, 0, 3, 4).index_select(2, blocks).flatten(2, 3)  # [2, H, n * bs, D]
        return gathered[0], gathered[1]
    # index_select on the layer's strided view: advanced indexing of the 6D table costs ~100x more on CPU
    gathered = layer_view.index_select(0, blocks.reshape(-1))  # [prod(...) * n, 2, H, bs, D]
    gathered = gathered.view(*blocks.shape, *gathered.shape[1:])  # [..., n, 2, H, bs, D]
    gathered = gathered.movedim(-5, -3)  # [..., 2, H, n, bs, D]
    gathered = gathered.flatten(-3, -2)  # [..., 2, H, n * bs, D]
    return gathered.select(-4, 0), gathered.select(-4, 1)


def _decodes_over_shared_prefix(
    query: torch.Tensor, table: torch.Tensor, step: PagedStep, layer: int, scaling: float | None
) -> torch.Tensor:
    """Attention ``[S, H, D]`` of ``S`` decode queries whose block tables all start with ``step.decode_shared_blocks``.

    The shared blocks (a common system prompt, say) are gathered once and
    scored by every query in one matmul, instead of being copied once per
    sequence into a padded batch; each sequence's own blocks are gathered and
    masked as usual. One softmax over both score parts keeps it exact attention.
    """
    num_seqs, num_heads, head_dim = query.shape
    shared_k, shared_v = _gather(table, step.decode_shared_blocks, layer)  # [Hkv, P, D]
    own_k, own_v = _gather(table, step.decode_blocks, layer)  # [S, Hkv, T, D]
    num_kv_heads = shared_k.shape[0]
    group = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim).float() * scale  # query head h reads kv head h // group
    by_kv_head = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * group, head_dim)
    shared_scores = torch.matmul(by_kv_head, shared_k.float().transpose(-1, -2))  # [Hkv, S * g, P]
    shared_scores = shared_scores.view(num_kv_heads, num_seqs, group, -1).permute(1, 0, 2, 3)  # [S, Hkv, g, P]
    own_scores = torch.matmul(q, own_k.float().transpose(-1, -2))  # [S, Hkv, g, T]
    own_scores = own_scores.masked_fill(~step.decode_mask, float("-inf"))  # mask [S, 1, 1, T]
    num_shared = shared_scores.shape[-1]
    probs = torch.softmax(torch.cat((shared_scores, own_scores), dim=-1), dim=-1)
    shared_probs = probs[..., :num_shared].permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * group, num_shared)
    attended = torch.matmul(shared_probs, shared_v.float()).view(num_kv_heads, num_seqs, group, head_dim).permute(1, 0, 2, 3)
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
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    step = paged_step
    layer = module.layer_idx
    table = step.kv_table
    # [1, H, T, D] x2 -> [T, 2, H, D]; the new tokens' KV goes into their blocks before anything reads them
    table[step.slot_blocks, layer, :, :, step.slot_offsets] = torch.stack((key[0], value[0]), dim=1).transpose(0, 2).to(table.dtype)
    num_heads = query.shape[1]
    out = query.new_empty((query.shape[2], num_heads, query.shape[3]))
    if step.num_decodes == 1:
        # One decode: its keys cut to its context length need no mask (the fused kernel, no padding).
        k, v = _gather(table, step.decode_blocks[0], layer)
        context = slice(0, step.num_decode_context_tokens)
        q = query[:, :, :1]  # [1, H, 1, D]
        attended = functional.scaled_dot_product_attention(q, k[None, :, context], v[None, :, context], scale=scaling, enable_gqa=True)
        out[:1] = attended[:, :, 0]
    elif step.decode_shared_blocks is not None:
        out[: step.num_decodes] = _decodes_over_shared_prefix(query[0, :, : step.num_decodes].transpose(0, 1), table, step, layer, scaling)
    elif step.num_decodes:
        q = query[0, :, : step.num_decodes].transpose(0, 1).unsqueeze(2)  # [S, H, 1, D]
        k, v = _gather(table, step.decode_blocks, layer)
        attended = functional.scaled_dot_product_attention(q, k, v, attn_mask=step.decode_mask, scale=scaling, enable_gqa=True)
        out[: step.num_decodes] = attended[:, :, 0]
    # Batched (4D) inputs throughout: for 3D ones SDPA on CPU falls back to its unfused math path.
    for chunk in step.prefills:
        rows = slice(chunk.first_row, chunk.first_row + chunk.num_tokens)
        q = query[:, :, rows]  # [1, H, n, D]
        if chunk.num_context_tokens == chunk.num_tokens:
            # Nothing before this chunk: its own keys are the whole context, and plain causal SDPA
            # (the fused kernel, no mask tensor, no gather) is what a miss costs without paging.
            attended = functional.scaled_dot_product_attention(
                q, key[:, :, rows], value[:, :, rows], is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k, v = _gather(table, chunk.blocks, layer)
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
