"""The model runner: the only module that calls the transformers model.

:meth:`ModelRunner.execute` runs one engine step: one forward over the tokens
of every scheduled sequence, its KV read and written in place in the pool's
device tier through block tables (:mod:`gpu_node.engine.paged_attention`).
:meth:`ModelRunner.prefill` over a ``DynamicCache`` remains for benchmark floors.
It knows nothing about keys, tiers or requests; the engine calls it from its one
worker thread, so nothing here is thread-safe on purpose.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedTokenizerBase,
)

from gpu_node.engine import paged_attention
from gpu_node.engine.paged_attention import PagedStep, PrefillChunk, RowIndex, no_mask, row_view
from gpu_node.pool.kv_spec import KVBlockSpec

log = logging.getLogger(__name__)

# Decoder-only, full-attention causal LMs whose KV is a plain per-layer
# [batch, kv_heads, T, head_dim] tensor pair. Anything else (sliding windows,
# SSM state, encoder-decoder, MLA latents) cannot be restored block-wise.
SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "granite", "olmo", "olmo2", "phi3"}
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def intra_op_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op thread count for the calling thread's operations inside the block (restored
    after).

    The engine runs a step's bookkeeping (scheduling, step tensors, sampling) at one
    thread and only the model forward at the configured count: an operation on a few
    tens of thousands of elements is split across the OpenMP team, and its fork and join
    cost more than the work, far more when another process holds the helper thread's
    core (docs/benchmarks.md, session 13). Cheap (well under a microsecond a change).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be served with block-wise prefix reuse."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def check_supported(config) -> None:
    """Refuse at load time what we cannot serve correctly, with a clear reason."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models are not supported")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported decoder-only full-attention types: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"{model_type}: sliding-window attention is not supported (sliding_window={config.sliding_window})"
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(
            f"{model_type}: only full-attention layers are supported, got {sorted(set(layer_types))}"
        )


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """A step's model inputs, built by :meth:`ModelRunner.prepare` and run by
    :meth:`ModelRunner.forward`."""

    input_ids: torch.Tensor  # [1, num_tokens]
    position_ids: torch.Tensor  # [1, num_tokens]
    logits_to_keep: (
        torch.Tensor
    )  # flattened rows whose logits are returned, sampling chunks in order
    paged_step: PagedStep


@dataclass(frozen=True, slots=True)
class StepChunk:
    """Tokens of one sequence computed in a step: ``token_ids`` at positions ``start ..``, KV in
    ``block_table``'s slots."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    samples: bool


class ModelRunner:
    """Loads a local HF causal LM and runs prefill/decode against explicit caches."""

    def __init__(
        self, model_dir: Path, device: str = "cpu", dtype: str = "float32", block_size: int = 16
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"{model_dir} is not a model directory (no config.json); run `kvledger model init {model_dir}`"
            )
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        check_supported(config)
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True
        )
        # Prompts are encoded on the tokenizers backend itself (prefix_keys.prompt), as a router
        # encodes them: without the truncation or padding a tokenizer.json may configure, which
        # transformers would only switch off inside its own calls.
        self.tokenizer.backend_tokenizer.no_truncation()
        self.tokenizer.backend_tokenizer.no_padding()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=self.dtype
        ).to(self.device)
        self.model.eval()
        # Attention reads and writes the pool's device tier (gpu_node.engine.paged_attention); it is
        # SDPA underneath, and plain SDPA for forwards without a paged step (HF generate,
        # DynamicCache).
        paged_attention.register()
        self.model.set_attn_implementation(paged_attention.PAGED_ATTENTION)
        self.config = self.model.config
        self.attn_implementation = paged_attention.PAGED_ATTENTION
        num_heads = self.config.num_attention_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // num_heads
        self.kv_spec = KVBlockSpec(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=getattr(self.config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )
        self.max_context_tokens = int(getattr(self.config, "max_position_embeddings", 2048))
        eos = (
            self.config.eos_token_id
            if self.config.eos_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.eos_token_ids = frozenset(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        self._rows: RowIndex | None = None
        self.num_threads = torch.get_num_threads()
        """The intra-op threads :meth:`forward` runs on: torch's count when the runner was built."""

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Run the tokens not yet in ``cache``; returns the last position's logits."""
        assert token_ids, "prefill needs at least one token"
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1].float()

    def execute(self, chunks: Sequence[StepChunk], kv_table: torch.Tensor) -> torch.Tensor:
        """One forward over every chunk of a step; logits ``[num sampling chunks, vocab]`` in
        ``chunks`` order.

        Keys and values are written into ``kv_table`` (the pool's device tier) at
        each chunk's block table, and attention reads them back from there
        (:mod:`gpu_node.engine.paged_attention`).
        """
        return self.forward(self.prepare(chunks, kv_table))

    @torch.inference_mode()
    def prepare(self, chunks: Sequence[StepChunk], kv_table: torch.Tensor) -> PreparedStep:
        """A step's input tensors, slot mapping and attention metadata (:class:`PagedStep`); no model call.

        Single-token chunks are laid out first so their attention runs as one batch.
        Separate from :meth:`forward` so the engine can time the model alone.
        """
        assert chunks, "a step computes at least one token"
        block_size = self.kv_spec.block_size
        decode_order = [index for index, chunk in enumerate(chunks) if len(chunk.token_ids) == 1]
        order = decode_order + [
            index for index, chunk in enumerate(chunks) if len(chunk.token_ids) != 1
        ]
        decodes = [chunks[index] for index in decode_order]
        # Decodes, one row each, in comprehensions: at 64 running they are most of a step's rows.
        token_ids = [chunk.token_ids[0] for chunk in decodes]
        positions = [chunk.start for chunk in decodes]
        slot_blocks = [
            chunk.block_table[chunk.start // block_size] for chunk in decodes
        ]  # IndexError: blocks do not cover it
        first_rows = [0] * len(chunks)
        for row, index in enumerate(decode_order):
            first_rows[index] = row
        for index in order[len(decodes) :]:
            chunk = chunks[index]
            first_rows[index] = len(token_ids)
            token_ids.extend(chunk.token_ids)
            end = chunk.start + len(chunk.token_ids)
            assert len(chunk.block_table) * block_size >= end, (
                "a chunk's blocks must cover its tokens"
            )
            positions.extend(range(chunk.start, end))
            slot_blocks.extend(
                chunk.block_table[position // block_size] for position in range(chunk.start, end)
            )
        device = self.device
        rows = self._row_index(kv_table)
        decode_mask = decode_shared_rows = None
        if len(decodes) == 1:
            # a lone decode reads exactly its own context and needs no mask
            blocks = torch.tensor(decodes[0].block_table, dtype=torch.long, device=device)
            decode_rows = rows.context_rows(blocks, decodes[0].start + 1)
        elif decodes:
            tables = [chunk.block_table[: -(-(chunk.start + 1) // block_size)] for chunk in decodes]
            num_shared = _num_common_leading(
                tables, max_blocks=min(len(table) for table in tables) - 1
            )
            if num_shared:
                shared_blocks = torch.tensor(
                    tables[0][:num_shared], dtype=torch.long, device=device
                )
                decode_shared_rows = rows.context_rows(shared_blocks, num_shared * block_size)
                tables = [table[num_shared:] for table in tables]
            max_blocks = max(len(table) for table in tables)
            padded = [list(table) + [0] * (max_blocks - len(table)) for table in tables]
            context = torch.tensor(
                [chunk.start + 1 - num_shared * block_size for chunk in decodes], device=device
            )
            num_context_tokens = max(chunk.start + 1 for chunk in decodes) - num_shared * block_size
            decode_mask = (rows.arange(num_context_tokens)[None, :] < context[:, None])[
                :, None, None, :
            ]
            decode_rows = rows.context_rows(
                torch.tensor(padded, dtype=torch.long, device=device), num_context_tokens
            )
        else:
            decode_rows = torch.zeros((0,), dtype=torch.long, device=device)
        prefills = []
        for index in order[len(decodes) :]:
            chunk = chunks[index]
            num_tokens = len(chunk.token_ids)
            num_context_tokens = chunk.start + num_tokens
            if chunk.start:
                context_positions = rows.arange(num_context_tokens)
                causal = context_positions[None, :] <= context_positions[chunk.start :, None]
                blocks = torch.tensor(
                    chunk.block_table[: -(-num_context_tokens // block_size)],
                    dtype=torch.long,
                    device=device,
                )
                context_rows = rows.context_rows(blocks, num_context_tokens)
            else:
                causal = context_rows = (
                    None  # the chunk's own keys are its whole context (plain causal attention)
                )
            prefills.append(
                PrefillChunk(
                    first_rows[index], num_tokens, num_context_tokens, context_rows, causal
                )
            )
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        step = PagedStep(
            kv_rows=row_view(kv_table),
            write_rows=rows.slot_rows(
                torch.tensor(slot_blocks, dtype=torch.long, device=device),
                position_tensor % block_size,
            ),
            num_decodes=len(decodes),
            decode_rows=decode_rows,
            decode_shared_rows=decode_shared_rows,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
        )
        keep = [
            first_rows[index] + len(chunk.token_ids) - 1
            for index, chunk in enumerate(chunks)
            if chunk.samples
        ]
        return PreparedStep(
            torch.tensor([token_ids], dtype=torch.long, device=device),
            position_tensor[None, :],
            torch.tensor(keep, dtype=torch.long, device=device),
            step,
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> torch.Tensor:
        """The model over a prepared step, on :attr:`num_threads` intra-op threads; logits ``[num
        sampling chunks, vocab]``."""
        with intra_op_threads(self.num_threads):
            output = self.model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                attention_mask=no_mask(self.device),
                use_cache=False,
                logits_to_keep=step.logits_to_keep,
                paged_step=step.paged_step,
            )
        return output.logits[0].float()

    def _row_index(self, kv_table: torch.Tensor) -> RowIndex:
        """The :class:`RowIndex` of ``kv_table``'s shape (the pool's device tier: one per runner in
        practice)."""
        if self._rows is None or not self._rows.fits(kv_table):
            self._rows = RowIndex(kv_table)
        return self._rows


def _num_common_leading(tables: list[Sequence[int]], max_blocks: int) -> int:
    """How many leading blocks (at most ``max_blocks``) every table has in common: a prefix all
    sequences read in place."""
    first = list(tables[0])
    num_common = max(max_blocks, 0)
    for table in tables[1:]:
        if (
            list(table[:num_common]) != first[:num_common]
        ):  # one C-level comparison in the common case
            num_common = next(
                index
                for index, (mine, theirs) in enumerate(zip(table, first, strict=False))
                if mine != theirs
            )
    return num_common
