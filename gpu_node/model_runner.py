"""The model runner: the only module that calls the transformers model.

It turns block KV tensors into a transformers ``DynamicCache`` and back, runs
prefill over the uncached suffix and single-token decode steps, and samples.
It knows nothing about keys, tiers or requests; the engine calls it from its one
worker thread, so nothing here is thread-safe on purpose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from gpu_node.kv_spec import KVBlockSpec

log = logging.getLogger(__name__)

# Decoder-only, full-attention causal LMs whose KV is a plain per-layer
# [batch, kv_heads, T, head_dim] tensor pair. Anything else (sliding windows,
# SSM state, encoder-decoder, MLA latents) cannot be restored block-wise.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "granite", "olmo", "olmo2", "phi3"})

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        raise UnsupportedModelError(f"{model_type}: sliding-window attention is not supported (sliding_window={config.sliding_window})")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(f"{model_type}: only full-attention layers are supported, got {sorted(set(layer_types))}")


@dataclass(frozen=True, slots=True)
class SamplingState:
    """Per-request sampling configuration; ``generator`` is None for greedy."""

    temperature: float
    top_p: float
    generator: torch.Generator | None


class ModelRunner:
    """Loads a local HF causal LM and runs prefill/decode against explicit caches."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32", block_size: int = 16) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a model directory (no config.json); run `kvledger model init {model_dir}`")
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        check_supported(config)
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.config = self.model.config
        self.attn_implementation = getattr(self.config, "_attn_implementation", None) or "eager"
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
        eos = self.config.eos_token_id if self.config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def restore(self, block_kv: torch.Tensor) -> DynamicCache:
        """Build a cache from ``[n, layers, 2, kv_heads, block_size, head_dim]`` block KV.

        Blocks are concatenated along the sequence axis per layer; the cache
        then behaves exactly as if the model had just prefilled those tokens.
        """
        spec = self.kv_spec
        if block_kv.dim() != 6 or tuple(block_kv.shape[1:]) != spec.block_shape:
            raise ValueError(f"block KV shape {tuple(block_kv.shape)} does not match [n, *{spec.block_shape}]")
        if block_kv.dtype != spec.dtype:
            raise ValueError(f"block KV dtype {block_kv.dtype} does not match {spec.dtype}")
        num_blocks = block_kv.shape[0]
        num_tokens = num_blocks * spec.block_size
        # [n, L, 2, H, bs, D] -> [L, 2, H, n, bs, D] -> [L, 2, 1, H, n*bs, D]
        per_layer = block_kv.to(self.device, non_blocking=True).permute(1, 2, 3, 0, 4, 5)
        per_layer = per_layer.reshape(spec.num_layers, 2, 1, spec.num_kv_heads, num_tokens, spec.head_dim)
        cache = self.new_cache()
        for layer in range(spec.num_layers):
            # update() concatenates into fresh storage, which is the one copy a restore needs;
            # making the strided views contiguous first would copy every byte twice.
            cache.update(per_layer[layer, 0], per_layer[layer, 1], layer)
        assert cache.get_seq_length() == num_tokens, f"restored cache holds {cache.get_seq_length()} tokens, expected {num_tokens}"
        return cache

    def extract_blocks(self, cache: DynamicCache, first_block: int, num_blocks: int) -> torch.Tensor:
        """Copy ``num_blocks`` full blocks starting at ``first_block`` out of a cache.

        Returns ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``; a
        fresh tensor, so later decode steps cannot change stored blocks.
        """
        spec = self.kv_spec
        start = first_block * spec.block_size
        end = start + num_blocks * spec.block_size
        assert cache.get_seq_length() >= end, f"cache holds {cache.get_seq_length()} tokens, need {end}"
        blocks = torch.empty((num_blocks, *spec.block_shape), dtype=spec.dtype, device=self.device)
        for index, layer in enumerate(cache.layers[: spec.num_layers]):
            for kind, tensor in enumerate((layer.keys, layer.values)):
                # [H, T, D] -> [H, n, bs, D] -> [n, H, bs, D], copied straight into the output
                span = tensor[0, :, start:end, :].reshape(spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
                blocks[:, index, kind].copy_(span.permute(1, 0, 2, 3))
        return blocks

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Run the tokens not yet in ``cache``; returns the last position's logits."""
        assert token_ids, "prefill needs at least one token"
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, token_id: int, cache: DynamicCache) -> torch.Tensor:
        input_ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1].float()

    def sampling_state(self, temperature: float, top_p: float, seed: int | None) -> SamplingState:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if temperature == 0:
            return SamplingState(0.0, 1.0, None)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed if seed is not None else torch.seed())
        return SamplingState(temperature, top_p, generator)

    @staticmethod
    def sample(logits: torch.Tensor, state: SamplingState) -> int:
        """Greedy when temperature is 0 (the correctness bar compares these), else top-p sampling."""
        if state.generator is None:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.cpu() / state.temperature, dim=-1)
        if state.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < state.top_p
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        return int(torch.multinomial(probs, 1, generator=state.generator).item())
