"""``kvledger bench engine``: TTFT on hit/miss against plain transformers and the
hand-held-cache floor, hashing cost, and restore bandwidth from host and disk.

Every ratio compares measurements taken in the same run, interleaved, on the same
prompt; each number is the median of ``--runs`` repetitions. Wall-clock numbers
live here and in docs/benchmarks.md, never in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_node.block_pool import BlockPool, PoolConfig, Tier
from gpu_node.crypto import LocalKeyStore
from gpu_node.engine import AsyncEngine, GenerationRequest, PromptStats, SamplingParams
from gpu_node.kv_cache_utils import BlockKey, CacheScope, Principal, Segment, compute_block_keys
from gpu_node.kv_spec import KVBlockSpec
from gpu_node.prompt import ChatMessage, render_prompt
from gpu_node.settings import CacheSettings, NodeSettings
from kvledger.model_init import build_tiny_model

PRINCIPAL = Principal("bench-tenant", "bench-user", frozenset(), {}, 0)
_WORDS = "tenant cache block prefix document version policy ledger erasure receipt node tier snapshot".split()


def _text(num_words: int, seed: int) -> str:
    return " ".join(f"{_WORDS[(seed * 7 + i) % len(_WORDS)]}{(seed + i) % 89}" for i in range(num_words))


def _messages_for(tokenizer, prefix_tokens: int, suffix_tokens: int, seed: int) -> tuple[list[ChatMessage], int]:
    """A public system prompt of about ``prefix_tokens`` then a user suffix of about ``suffix_tokens``."""
    words = max(prefix_tokens // 3, 1)
    for _ in range(8):
        system = ChatMessage("system", _text(words, seed), CacheScope.PUBLIC, None)
        num_tokens = render_prompt(tokenizer, [system]).segments[0].end
        if abs(num_tokens - prefix_tokens) <= 8:
            break
        words = max(int(words * prefix_tokens / num_tokens), 1)
    user = ChatMessage("user", _text(max(suffix_tokens // 3, 1), seed + 1000), CacheScope.USER, None)
    return [system, user], num_tokens


def _median(values: list[float]) -> float:
    return statistics.median(values)


@dataclass
class TTFTRow:
    prefix_tokens: int
    num_prompt_tokens: int
    plain_ms: float
    floor_ms: float
    miss_ms: float
    hit_ms: float

    @property
    def hit_vs_floor(self) -> float:
        return self.hit_ms / self.floor_ms

    @property
    def miss_overhead(self) -> float:
        return self.miss_ms / self.plain_ms - 1.0


async def _engine_ttft_ms(engine: AsyncEngine, messages: list[ChatMessage]) -> tuple[float, int]:
    request = GenerationRequest("bench", tuple(messages), SamplingParams(max_tokens=1), PRINCIPAL)
    started = time.perf_counter()
    num_cached = -1
    async for item in engine.generate(request):
        if isinstance(item, PromptStats):
            elapsed_ms = (time.perf_counter() - started) * 1000
            num_cached = item.num_cached_tokens
    return elapsed_ms, num_cached


def _plain_ttft_ms(runner, messages) -> float:
    """Plain transformers: tokenize, full prefill, greedy first token."""
    started = time.perf_counter()
    token_ids = render_prompt(runner.tokenizer, messages).token_ids
    logits = runner.prefill(token_ids, runner.new_cache())
    int(torch.argmax(logits))
    return (time.perf_counter() - started) * 1000


def _floor_ttft_ms(runner, messages, held_cache, num_cached_tokens: int) -> float:
    """The floor: a prefix DynamicCache held by hand, copied and reused directly."""
    started = time.perf_counter()
    token_ids = render_prompt(runner.tokenizer, messages).token_ids
    cache = copy.deepcopy(held_cache)
    logits = runner.prefill(token_ids[num_cached_tokens:], cache)
    int(torch.argmax(logits))
    return (time.perf_counter() - started) * 1000


async def bench_ttft(engine: AsyncEngine, prefix_tokens: int, suffix_tokens: int, runs: int, seed_base: int = 0) -> TTFTRow:
    runner = engine.runner
    plain, floor, miss, hit = [], [], [], []
    num_prompt_tokens = 0
    for run in range(runs):
        # A fresh prefix per run so the miss is a real miss; everything else interleaved.
        messages, _ = _messages_for(runner.tokenizer, prefix_tokens, suffix_tokens, seed=seed_base + prefix_tokens * 100 + run)
        token_ids = render_prompt(runner.tokenizer, messages).token_ids
        num_prompt_tokens = len(token_ids)
        plain.append(await asyncio.to_thread(_plain_ttft_ms, runner, messages))
        miss_ms, num_cached = await _engine_ttft_ms(engine, messages)
        assert num_cached == 0, "miss run hit the cache"
        miss.append(miss_ms)
        hit_ms, num_cached = await _engine_ttft_ms(engine, messages)
        assert num_cached > 0, "hit run missed the cache"
        hit.append(hit_ms)
        held = runner.new_cache()
        await asyncio.to_thread(runner.prefill, token_ids[:num_cached], held)
        floor.append(await asyncio.to_thread(_floor_ttft_ms, runner, messages, held, num_cached))
    return TTFTRow(prefix_tokens, num_prompt_tokens, _median(plain), _median(floor), _median(miss), _median(hit))


def bench_hashing(engine: AsyncEngine, num_tokens: int, runs: int) -> float:
    runner = engine.runner
    messages, _ = _messages_for(runner.tokenizer, num_tokens, 16, seed=7)
    prompt = render_prompt(runner.tokenizer, messages)
    samples = []
    for _ in range(max(runs, 5)):
        started = time.perf_counter_ns()
        for _ in range(20):
            compute_block_keys(engine.namespace.namespace, prompt.token_ids, prompt.segments, PRINCIPAL, engine.block_size)
        samples.append((time.perf_counter_ns() - started) / 20 / len(prompt.token_ids))
    return _median(samples)


@dataclass
class RestoreRow:
    shape: str
    tier: str
    num_bytes: int
    restore_gbps: float
    baseline_gbps: float
    baseline: str

    @property
    def ratio(self) -> float:
        return self.restore_gbps / self.baseline_gbps


def _synthetic_keys(num_blocks: int, block_size: int) -> list[BlockKey]:
    """User-scope keys (the encrypted case on disk), chained like a real prompt's."""
    token_ids = list(range(num_blocks * block_size + 1))
    segments = [Segment(0, len(token_ids), CacheScope.USER)]
    return compute_block_keys("bench-restore", token_ids, segments, PRINCIPAL, block_size)


def bench_restore(spec: KVBlockSpec, num_blocks: int, runs: int) -> list[RestoreRow]:
    """Gather the same blocks from host and from disk (with promotion, as a hit does), vs memcpy and file reads.

    Baselines: a plain tensor copy of the same bytes for host; for disk both one
    sequential read of the same bytes from one file and the same bytes read as one
    file per block (the disk tier's layout), with the page cache warm in all cases.
    For host, memcpy is measured both into warm memory and into a fresh allocation,
    since a restore must hand back new memory (page faults included).
    """
    shape = f"{spec.block_bytes // 1024} KiB blocks ({spec.num_layers} layers, {spec.num_kv_heads} kv heads, {spec.head_dim} dim, {spec.dtype_name})"
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        config = PoolConfig(
            namespace="bench-restore",
            num_device_blocks=num_blocks,
            num_host_blocks=num_blocks,
            max_disk_blocks=num_blocks,
            disk_dir=Path(directory) / "blocks",
            ttl_s={scope: None for scope in CacheScope},
        )
        pool = BlockPool(spec, config, LocalKeyStore(Path(directory) / "keys.json"))
        keys = _synthetic_keys(num_blocks, spec.block_size)
        generator = torch.Generator().manual_seed(0)
        for key in keys:
            entry = pool.begin_build(key)
            assert pool.commit_build(entry, torch.randn(spec.block_shape, generator=generator).to(spec.dtype))
        num_bytes = num_blocks * spec.block_bytes
        for tier in (Tier.HOST, Tier.DISK):
            restore, baseline, per_file = [], [], []
            for _ in range(runs):
                for key in keys:
                    assert pool.demote(key.block_hash, tier), f"could not place block on {tier}"
                entries = [pool.get_ready(key.block_hash) for key in keys]
                pool.inc_lock_ref(entries)
                started = time.perf_counter()
                block_kv = pool.read_blocks(entries)
                restore.append(num_bytes / (time.perf_counter() - started) / 1e9)
                pool.dec_lock_ref(entries)
                pool.take_events()
                if tier == Tier.HOST:
                    source = block_kv.clone()
                    target = torch.empty_like(source)
                    target.copy_(source)  # touch the pages once so the timed copy measures bandwidth
                    started = time.perf_counter()
                    target.copy_(source)
                    baseline.append(num_bytes / (time.perf_counter() - started) / 1e9)
                    # a restore hands back new memory, so also: the same copy into a fresh allocation
                    started = time.perf_counter()
                    torch.empty_like(source).copy_(source)
                    per_file.append(num_bytes / (time.perf_counter() - started) / 1e9)
                else:
                    raw = block_kv.view(torch.uint8).numpy().tobytes()
                    single = Path(directory) / "single.bin"
                    single.write_bytes(raw)
                    started = time.perf_counter()
                    torch.frombuffer(bytearray(single.read_bytes()), dtype=torch.uint8)
                    baseline.append(num_bytes / (time.perf_counter() - started) / 1e9)
                    files = [Path(directory) / f"b{i}.bin" for i in range(num_blocks)]
                    for i, path in enumerate(files):
                        path.write_bytes(raw[i * spec.block_bytes : (i + 1) * spec.block_bytes])
                    started = time.perf_counter()
                    chunks = [path.read_bytes() for path in files]
                    torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
                    per_file.append(num_bytes / (time.perf_counter() - started) / 1e9)
            if tier == Tier.HOST:
                rows.append(RestoreRow(shape, "host", num_bytes, _median(restore), _median(baseline), "memcpy (warm destination)"))
                rows.append(RestoreRow(shape, "host", num_bytes, _median(restore), _median(per_file), "memcpy into fresh memory"))
            else:
                rows.append(RestoreRow(shape, "disk", num_bytes, _median(restore), _median(baseline), "one-file read"))
                rows.append(RestoreRow(shape, "disk", num_bytes, _median(restore), _median(per_file), "file-per-block read"))
    return rows


def render_markdown(args, ttft_rows: list[TTFTRow], ns_per_token: float, restore_rows: list[RestoreRow]) -> str:
    lines = [
        "## Engine (`kvledger bench engine`)",
        "",
        f"Command: `kvledger bench engine --runs {args.runs} --prefixes {args.prefixes} --suffix {args.suffix}` "
        f"on {platform.machine()} / {torch.get_num_threads()} torch threads / device `{args.device}`, tiny model, fp32. "
        f"Median of {args.runs} runs; every ratio is within one run.",
        "",
        "| prefix P | prompt tokens | plain transformers ms | floor (held DynamicCache) ms | kvledger miss ms | kvledger hit ms | hit / floor (≤ 1.3) | miss overhead vs plain (≤ 5 %) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in ttft_rows:
        lines.append(
            f"| {row.prefix_tokens} | {row.num_prompt_tokens} | {row.plain_ms:.1f} | {row.floor_ms:.1f} | {row.miss_ms:.1f} | "
            f"{row.hit_ms:.1f} | {row.hit_vs_floor:.2f} | {row.miss_overhead * 100:+.1f} % |"
        )
    lines += [
        "",
        f"Block hashing (`compute_block_keys`, 2048-token prompt): **{ns_per_token:.0f} ns/token** (target ≤ 100).",
        "",
        "Restore = `BlockPool.read_blocks` of user-scope blocks (AES-256-GCM on disk) with promotion to the device tier, as a hit does.",
        "",
        "| blocks | restore from | bytes | restore GB/s | baseline | baseline GB/s | ratio (≥ 50 %) |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for row in restore_rows:
        lines.append(
            f"| {row.shape} | {row.tier} | {row.num_bytes} | {row.restore_gbps:.2f} | {row.baseline} | {row.baseline_gbps:.2f} | {row.ratio * 100:.0f} % |"
        )
    return "\n".join(lines) + "\n"


async def run(args) -> str:
    model_dir = Path(args.model_dir)
    build_tiny_model(model_dir)
    with tempfile.TemporaryDirectory() as data_dir:
        cache = CacheSettings(num_device_blocks=2048, num_host_blocks=2048, max_disk_blocks=4096)
        settings = NodeSettings(model_dir=model_dir, data_dir=Path(data_dir), device=args.device, cache=cache)
        engine = AsyncEngine.from_settings(settings)
        await engine.start()
        try:
            prefixes = [int(p) for p in args.prefixes.split(",")]
            await bench_ttft(engine, prefixes[0], args.suffix, 1, seed_base=10_000_000)  # warm-up: allocator, kernels
            ttft_rows = [await bench_ttft(engine, p, args.suffix, args.runs) for p in prefixes]
            ns_per_token = bench_hashing(engine, 2048, args.runs)
            tiny = engine.runner.kv_spec
            restore_rows = bench_restore(tiny, 128, args.runs)
            # a Llama-3-8B-shaped block (32 layers, 8 kv heads, 128 dim, bf16): 2 MiB per block
            restore_rows += bench_restore(KVBlockSpec(32, 8, 128, tiny.block_size, torch.bfloat16), 32, args.runs)
        finally:
            await engine.stop()
    return render_markdown(args, ttft_rows, ns_per_token, restore_rows)


def cli(args: argparse.Namespace) -> int:
    report = asyncio.run(run(args))
    print(report)
    if args.output:
        Path(args.output).write_text(report)
    return 0
