"""``kvledger bench engine``: TTFT on hit/miss against plain transformers and the
hand-held-cache floor, hashing cost, restore bandwidth from host and disk, and
serving throughput under concurrency against a Hugging Face ``generate`` floor.

Every ratio compares measurements taken in the same run, interleaved, on the same
prompt; each number is the median of ``--runs`` repetitions. ``--sections`` picks
which sections run. Wall-clock numbers live here and in docs/benchmarks.md, never
in tests.

The floors (plain transformers, the held ``DynamicCache``, the padded ``generate``
batch) run in an idle process of their own, :class:`_FloorProcess`, and every other
torch operation of this process runs on the engine's model worker
(``run_exclusive``). torch's OpenMP keeps a team of threads for each thread that ever
ran a parallel operation; once the teams of a process hold more threads than the
machine has cores, their threads stop spinning between operations and sleep, and a
small model's forward then runs at about one core. Measured from a second thread of
the engine's process, the padded batch made about half the tokens/s of an idle
process of its own, and the engine beside it was slowed the same way
(docs/benchmarks.md, "Why the floor was slow").

The serving section drives the engine only through its public interface (``AsyncEngine.generate`` in
process, the official ``openai`` client over HTTP from its own process), so it measures whatever
engine the node runs."""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import multiprocessing
import platform
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import uvicorn

from bench.common import percentile
from events.tiers import Tier
from gpu_node.engine.async_engine import (
    AsyncEngine,
    GenerationDone,
    GenerationRequest,
    PromptStats,
    SamplingParams,
    StepTiming,
    TokenDelta,
)
from gpu_node.entrypoints.routes import create_app
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.vocabulary import PoolConfig
from gpu_node.settings import CacheSettings, NodeSettings, SchedulerSettings
from identity.settings import IssuerSettings
from identity.tokens import TokenVerifier, issue_token
from kvledger.model_init import build_tiny_model
from kvledger.net import loopback_listener
from prefix_keys.blocks import BlockKey, CacheScope, Principal, Segment, compute_block_keys
from prefix_keys.prompt import ChatMessage, render_prompt

if TYPE_CHECKING:
    import openai

PRINCIPAL = Principal("bench-tenant", "bench-user", frozenset(), {}, 0)
_WORDS = "tenant cache block prefix document version policy ledger erasure receipt node tier snapshot".split()


def _text(num_words: int, seed: int) -> str:
    return " ".join(
        f"{_WORDS[(seed * 7 + i) % len(_WORDS)]}{(seed + i) % 89}" for i in range(num_words)
    )


def _messages_for(
    tokenizer, prefix_tokens: int, suffix_tokens: int, seed: int
) -> tuple[list[ChatMessage], int]:
    """A public system prompt of about ``prefix_tokens`` then a user suffix of about
    ``suffix_tokens``."""
    words = max(prefix_tokens // 3, 1)
    for _ in range(8):
        system = ChatMessage("system", _text(words, seed), CacheScope.PUBLIC, None)
        num_tokens = render_prompt(tokenizer, [system]).segments[0].end
        if abs(num_tokens - prefix_tokens) <= 8:
            break
        words = max(int(words * prefix_tokens / num_tokens), 1)
    user = ChatMessage(
        "user", _text(max(suffix_tokens // 3, 1), seed + 1000), CacheScope.USER, None
    )
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


_FLOOR: dict = {}
"""In the floor process: its own ModelRunner over the benchmark's model directory."""


def _floor_init(model_dir: str, device: str, block_size: int, num_threads: int) -> None:
    """Build the model directory if empty, load it, and warm ``generate`` up (the first call pays
    one-off costs)."""
    from gpu_node.engine.model_runner import ModelRunner

    torch.set_num_threads(num_threads)
    build_tiny_model(Path(model_dir))
    runner = ModelRunner(Path(model_dir), device, block_size=block_size)
    _FLOOR["runner"] = runner
    _generate_floor(runner, _serving_prompts(runner.tokenizer, 2, 16, None), 4)


def _floor_ttft(messages: list[ChatMessage], num_cached_tokens: int) -> tuple[float, float]:
    """In the floor process: plain transformers' TTFT, then the held-cache floor's over the first
    ``num_cached_tokens``."""
    runner = _FLOOR["runner"]
    plain_ms = _plain_ttft_ms(runner, messages)
    held = runner.new_cache()
    runner.prefill(render_prompt(runner.tokenizer, messages).token_ids[:num_cached_tokens], held)
    return plain_ms, _floor_ttft_ms(runner, messages, held, num_cached_tokens)


def _floor_generate(prompts: list[list[ChatMessage]], max_tokens: int) -> float:
    return _generate_floor(_FLOOR["runner"], prompts, max_tokens)


def _floor_ready() -> int:
    return torch.get_num_threads()


class _FloorProcess:
    """The floors' own process (spawned, idle while the engine runs): the same model directory, device and torch threads.

    ``await floor(function, *args)`` runs one of this module's ``_floor_*``
    functions there; each times itself, so the process hop is not in the numbers.
    """

    def __init__(self, model_dir: Path, device: str, block_size: int) -> None:
        self._executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_floor_init,
            initargs=(str(model_dir), device, block_size, torch.get_num_threads()),
        )

    async def start(self) -> None:
        """Start the process: it builds the model directory when empty, so before the engine loads
        it."""
        num_threads = await self(_floor_ready)
        assert num_threads == torch.get_num_threads(), (
            "the floor process runs on as many torch threads as the engine"
        )

    async def __call__(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


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


async def bench_ttft(
    engine: AsyncEngine,
    floor: _FloorProcess,
    prefix_tokens: int,
    suffix_tokens: int,
    runs: int,
    seed_base: int = 0,
) -> TTFTRow:
    runner = engine.runner
    plain, held, miss, hit = [], [], [], []
    num_prompt_tokens = 0
    for run in range(runs):
        # A fresh prefix per run so the miss is a real miss; everything else interleaved.
        messages, _ = _messages_for(
            runner.tokenizer,
            prefix_tokens,
            suffix_tokens,
            seed=seed_base + prefix_tokens * 100 + run,
        )
        token_ids = render_prompt(runner.tokenizer, messages).token_ids
        num_prompt_tokens = len(token_ids)
        miss_ms, num_cached = await _engine_ttft_ms(engine, messages)
        assert num_cached == 0, "miss run hit the cache"
        miss.append(miss_ms)
        hit_ms, num_cached = await _engine_ttft_ms(engine, messages)
        assert num_cached > 0, "hit run missed the cache"
        hit.append(hit_ms)
        plain_ms, floor_ms = await floor(_floor_ttft, messages, num_cached)
        plain.append(plain_ms)
        held.append(floor_ms)
    return TTFTRow(
        prefix_tokens, num_prompt_tokens, _median(plain), _median(held), _median(miss), _median(hit)
    )


def bench_hashing(engine: AsyncEngine, num_tokens: int, runs: int) -> float:
    runner = engine.runner
    messages, _ = _messages_for(runner.tokenizer, num_tokens, 16, seed=7)
    prompt = render_prompt(runner.tokenizer, messages)
    samples = []
    for _ in range(max(runs, 5)):
        started = time.perf_counter_ns()
        for _ in range(20):
            compute_block_keys(
                engine.namespace.namespace,
                prompt.token_ids,
                prompt.segments,
                PRINCIPAL,
                engine.block_size,
            )
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
    """Gather the same blocks from host and from disk (with promotion, as a hit does), vs memcpy and
    file reads.

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
            assert pool.commit_build(
                entry, torch.randn(spec.block_shape, generator=generator).to(spec.dtype)
            )
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
                    target.copy_(
                        source
                    )  # touch the pages once so the timed copy measures bandwidth
                    started = time.perf_counter()
                    target.copy_(source)
                    baseline.append(num_bytes / (time.perf_counter() - started) / 1e9)
                    # a restore hands back new memory, so also: the same copy into a fresh
                    # allocation
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
                rows.append(
                    RestoreRow(
                        shape,
                        "host",
                        num_bytes,
                        _median(restore),
                        _median(baseline),
                        "memcpy (warm destination)",
                    )
                )
                rows.append(
                    RestoreRow(
                        shape,
                        "host",
                        num_bytes,
                        _median(restore),
                        _median(per_file),
                        "memcpy into fresh memory",
                    )
                )
            else:
                rows.append(
                    RestoreRow(
                        shape,
                        "disk",
                        num_bytes,
                        _median(restore),
                        _median(baseline),
                        "one-file read",
                    )
                )
                rows.append(
                    RestoreRow(
                        shape,
                        "disk",
                        num_bytes,
                        _median(restore),
                        _median(per_file),
                        "file-per-block read",
                    )
                )
    return rows


# --- serving: throughput and latency under concurrency ------------------------------------------

SECTIONS = ("ttft", "hashing", "restore", "steps", "serving")


@dataclass
class _Timed:
    """One request as its client saw it: time to first token, gaps between tokens, tokens generated."""

    ttft_ms: float
    itl_ms: list[float]
    num_tokens: int


def _timed(started: float, stamps: list[float], num_tokens: int) -> _Timed:
    assert stamps, "the request produced no token"
    gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(stamps)]
    return _Timed((stamps[0] - started) * 1000, gaps, num_tokens)


@dataclass
class ModeSample:
    """One run of one concurrency level in one mode (in-process or HTTP)."""

    tokens_per_s: float
    ttft_ms: list[float]
    itl_ms: list[float]


@dataclass
class ServingRow:
    """Per-run samples of one (shared prefix, concurrency) cell; the report takes medians over runs."""

    shared_prefix_tokens: int
    concurrency: int
    floor_tokens_per_s: list[float] = field(default_factory=list)
    in_process: list[ModeSample] = field(default_factory=list)
    http: list[ModeSample] = field(default_factory=list)


def _serving_prompts(
    tokenizer, num_prompts: int, prompt_tokens: int, system: ChatMessage | None
) -> list[list[ChatMessage]]:
    """Distinct user prompts of about ``prompt_tokens``, after the shared public ``system`` message
    when given.

    A random tag leads each user message, so no two prompts (in any run or mode) share
    a user-scope block: what one request caches, no later one hits.
    """
    prompts = []
    for index in range(num_prompts):
        text = f"[{uuid.uuid4().hex[:12]}] " + _text(max(prompt_tokens // 3, 1), index)
        user = ChatMessage("user", text, CacheScope.USER, None)
        prompts.append([system, user] if system is not None else [user])
    return prompts


async def _in_process_request(
    engine: AsyncEngine, messages: list[ChatMessage], max_tokens: int, ignore_eos: bool = False
) -> _Timed:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    request = GenerationRequest(f"bench-{uuid.uuid4().hex}", tuple(messages), sampling, PRINCIPAL)
    started = time.perf_counter()
    stamps: list[float] = []
    num_tokens = 0
    async for item in engine.generate(request):
        if isinstance(item, TokenDelta):
            stamps.append(time.perf_counter())
        elif isinstance(item, GenerationDone):
            num_tokens = item.num_completion_tokens
    return _timed(started, stamps, num_tokens)


def _http_messages(messages: list[ChatMessage]) -> list[dict]:
    return [
        {"role": message.role, "content": message.content, "cache_scope": message.scope.label}
        for message in messages
    ]


async def _http_request(
    client: openai.AsyncOpenAI, model: str, body: list[dict], max_tokens: int
) -> _Timed:
    """A streamed chat completion; a token is a content chunk (the node sends one per token with
    text)."""
    started = time.perf_counter()
    stamps: list[float] = []
    num_tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=body,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return _timed(started, stamps, num_tokens)


async def _concurrently(send: Callable[[Any], Awaitable[_Timed]], prompts: list) -> ModeSample:
    """Start every prompt at once; aggregate tokens/s is all tokens over the time until the last one
    finished."""
    started = time.perf_counter()
    results = await asyncio.gather(*(send(prompt) for prompt in prompts))
    elapsed_s = time.perf_counter() - started
    return ModeSample(
        sum(result.num_tokens for result in results) / elapsed_s,
        [result.ttft_ms for result in results],
        [gap for result in results for gap in result.itl_ms],
    )


def _generate_floor(runner, prompts: list[list[ChatMessage]], max_tokens: int) -> float:
    """Hugging Face ``generate`` on the same prompts as one left-padded batch, greedy, exactly
    ``max_tokens`` each.

    Timed from rendering the prompts (the engine renders them too) to the last token. Run in the
    floor process (:class:`_FloorProcess`): same model, device and torch thread count as the engine;
    no prefix reuse."""
    tokenizer = runner.tokenizer
    started = time.perf_counter()
    token_ids = [render_prompt(tokenizer, prompt).token_ids for prompt in prompts]
    width = max(len(ids) for ids in token_ids)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    with torch.inference_mode():
        output = runner.model.generate(
            input_ids=input_ids.to(runner.device),
            attention_mask=attention_mask.to(runner.device),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed_s = time.perf_counter() - started
    num_generated = output.shape[1] - width
    assert num_generated == max_tokens, (
        f"generate produced {num_generated} tokens per row, expected {max_tokens}"
    )
    return len(prompts) * num_generated / elapsed_s


_CLIENT: dict = {}
"""The client process's event loop and ``openai`` client, kept between levels (warm connections, as in a real client)."""


def _client_level(
    url: str, token: str, model: str, bodies: list[list[dict]], max_tokens: int
) -> ModeSample:
    """In the client process: start every request at once over HTTP and measure them as
    :func:`_concurrently` does."""
    # Imported here: the other sections run on the [node] extra alone; the client comes with [test].
    import openai

    if _CLIENT.get("url") != url:
        _CLIENT.update(url=url, loop=asyncio.new_event_loop())
        _CLIENT["client"] = openai.AsyncOpenAI(
            base_url=url, api_key=token, max_retries=0, timeout=600
        )
    client = _CLIENT["client"]

    async def send(body: list[dict]) -> _Timed:
        return await _http_request(client, model, body, max_tokens)

    loop = _CLIENT["loop"]
    sample = loop.run_until_complete(_concurrently(send, bodies))
    # The client's finished streams leave async generators to close: let their finalizers run now,
    # not never.
    loop.run_until_complete(asyncio.sleep(0))
    return sample


class _HttpNode:
    """The node's OpenAI-compatible app around ``engine`` on a real uvicorn socket, in this event loop.

    The ``openai`` client runs in a process of its own, as every real client
    does: in this process it would share the interpreter lock with the node,
    and its per-chunk parsing would be charged to the server.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.sock = loopback_listener()
        app = create_app(engine, TokenVerifier(engine.settings.auth))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.task: asyncio.Task | None = None
        self.client_process = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )

    async def __aenter__(self) -> Callable[[list[list[ChatMessage]], int], Awaitable[ModeSample]]:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + 60
        while not self.server.started:
            if self.task.done():
                self.task.result()
            if time.monotonic() > deadline:
                raise TimeoutError("the benchmark's node did not start serving within 60 s")
            await asyncio.sleep(0.01)
        secret = self.engine.settings.auth.jwt_secret.get_secret_value()
        token = issue_token(
            tenant=PRINCIPAL.tenant_id, sub=PRINCIPAL.subject_id, ttl_s=24 * 3600, secret=secret
        )
        url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        loop = asyncio.get_running_loop()

        async def level(prompts: list[list[ChatMessage]], max_tokens: int) -> ModeSample:
            bodies = [_http_messages(prompt) for prompt in prompts]
            return await loop.run_in_executor(
                self.client_process,
                _client_level,
                url,
                token,
                self.engine.model_name,
                bodies,
                max_tokens,
            )

        return level

    async def __aexit__(self, *exc_info) -> None:
        self.client_process.shutdown(wait=True)
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 60)
        self.sock.close()


async def bench_serving(engine: AsyncEngine, floor: _FloorProcess, args) -> list[ServingRow]:
    """Aggregate tokens/s, TTFT and inter-token latency at each concurrency, with and without a shared prefix.

    Per run, per cell: the ``generate`` floor, then the engine in process, then over
    HTTP, each on fresh prompts of the same shape (so user-scope blocks never hit).
    The shared prefix is one public system prompt, built once before the cells that
    use it: the steady state of a deployment whose system prompt is cached.
    """
    levels = _levels(args.concurrency)
    prefixes = sorted({0, args.serving_prefix})
    rows = {(prefix, level): ServingRow(prefix, level) for prefix in prefixes for level in levels}
    runner = engine.runner
    async with _HttpNode(engine) as over_http:

        async def in_process(prompt: list[ChatMessage]) -> _Timed:
            return await _in_process_request(engine, prompt, args.serving_tokens)

        # warm-up at every level, both sides: allocator, kernels, the HTTP stack, generate's batch
        # shapes
        for level in levels:
            warm = _serving_prompts(runner.tokenizer, level, args.serving_prompt, None)
            await floor(_floor_generate, warm, 4)
            await _concurrently(lambda prompt: _in_process_request(engine, prompt, 4), warm)
            await over_http(warm, 4)
        for run in range(args.runs):
            for prefix in prefixes:
                system = None
                if prefix:
                    (system, _), _ = _messages_for(
                        runner.tokenizer, prefix, 1, seed=20_000_000 + run
                    )
                    await _in_process_request(
                        engine, _serving_prompts(runner.tokenizer, 1, 8, system)[0], 1
                    )
                for level in levels:
                    row = rows[(prefix, level)]
                    floor_prompts = _serving_prompts(
                        runner.tokenizer, level, args.serving_prompt, system
                    )
                    row.floor_tokens_per_s.append(
                        await floor(_floor_generate, floor_prompts, args.serving_tokens)
                    )
                    row.in_process.append(
                        await _concurrently(
                            in_process,
                            _serving_prompts(runner.tokenizer, level, args.serving_prompt, system),
                        )
                    )
                    row.http.append(
                        await over_http(
                            _serving_prompts(runner.tokenizer, level, args.serving_prompt, system),
                            args.serving_tokens,
                        )
                    )
                    print(
                        f"serving run {run + 1}/{args.runs} prefix {prefix} x{level}: floor {row.floor_tokens_per_s[-1]:.0f}, "
                        f"in-process {row.in_process[-1].tokens_per_s:.0f}, http {row.http[-1].tokens_per_s:.0f} tokens/s",
                        flush=True,
                    )
    return list(rows.values())


def _levels(value: str) -> list[int]:
    return [int(level) for level in value.split(",")]


@dataclass
class StepRow:
    """Steady decode steps with ``num_running`` requests, over ``--runs`` runs: each step's
    :class:`StepTiming`."""

    num_running: int
    steps: list[StepTiming] = field(default_factory=list)

    def quantiles_ms(self, value: Callable[[StepTiming], float]) -> str:
        values = [value(step) * 1000 for step in self.steps]
        return "/".join(f"{percentile(values, q):.3f}" for q in (0.5, 0.99))


async def bench_steps(engine: AsyncEngine, args) -> list[StepRow]:
    """The engine's time per step outside the model forward, with exactly ``n`` requests decoding.

    ``n`` requests start at once and each generates ``--serving-tokens`` tokens
    (``ignore_eos``, so none ends early); the steps that decode all ``n`` and
    nothing else are kept (prefill and ramp-down steps are not the steady state).
    """
    rows = []
    for level in _levels(args.step_levels):
        row = StepRow(level)
        for run in range(args.runs + 1):  # the first run warms up
            timings: list[StepTiming] = []
            engine.step_sink = timings.append
            try:
                prompts = _serving_prompts(
                    engine.runner.tokenizer, level, args.serving_prompt, None
                )
                await _concurrently(
                    lambda prompt: _in_process_request(
                        engine, prompt, args.serving_tokens, ignore_eos=True
                    ),
                    prompts,
                )
            finally:
                engine.step_sink = None
            if run:
                row.steps += [
                    timing
                    for timing in timings
                    if timing.num_seqs == level and timing.num_tokens == level
                ]
        assert row.steps, f"no step decoded {level} requests together"
        rows.append(row)
        print(
            f"steps x{level}: overhead p50/p99 {row.quantiles_ms(lambda step: step.overhead_s)} ms",
            flush=True,
        )
    return rows


def _render_steps(args, rows: list[StepRow]) -> list[str]:
    lines = [
        "",
        f"Engine step outside the model forward (`kvledger_engine_step_overhead_seconds`): n requests of "
        f"{args.serving_prompt}-token prompts decoding {args.serving_tokens} tokens each (`ignore_eos`), in process; "
        f"the steps that decode all n and nothing else, over {args.runs} runs. Overhead = the step's wall time on the "
        f"model worker less the forward (scheduling, step tensors, sampling, detokenizing, hand-off to the streams); "
        f"CPU = the worker thread's CPU time in it (the rest is waiting: for the interpreter lock, for a core). ms, p50/p99.",
        "",
        "| running | steps | overhead p50/p99 (≤ 1 ms at 16) | overhead CPU p50/p99 | forward p50/p99 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.num_running} | {len(row.steps)} | {row.quantiles_ms(lambda step: step.overhead_s)} | "
            f"{row.quantiles_ms(lambda step: step.overhead_cpu_s)} | {row.quantiles_ms(lambda step: step.forward_s)} |"
        )
    return lines


def _mode_cells(samples: list[ModeSample]) -> tuple[float, str, str]:
    """Median over runs of tokens/s, and of each run's TTFT and ITL p50 / p99."""
    tokens_per_s = _median([sample.tokens_per_s for sample in samples])
    ttft = "/".join(
        f"{_median([percentile(sample.ttft_ms, q) for sample in samples]):.0f}" for q in (0.5, 0.99)
    )
    if all(sample.itl_ms for sample in samples):
        itl = "/".join(
            f"{_median([percentile(sample.itl_ms, q) for sample in samples]):.1f}"
            for q in (0.5, 0.99)
        )
    else:
        itl = "–"
    return tokens_per_s, ttft, itl


def _run_ratio(samples: list[ModeSample], baselines: list[float]) -> float:
    """Median over runs of each run's tokens/s ÷ the same run's baseline tokens/s."""
    return _median(
        [
            sample.tokens_per_s / baseline
            for sample, baseline in zip(samples, baselines, strict=True)
        ]
    )


def _render_serving(args, rows: list[ServingRow]) -> list[str]:
    lines = [
        "",
        f"Serving: {args.serving_prompt}-token distinct user prompts, {args.serving_tokens} generated tokens each (greedy), "
        f"all requests of a level started at once; tokens/s = all generated tokens / time until the last finished. "
        f"Floor = Hugging Face `generate` of the same number of prompts of the same shape as one left-padded batch "
        f"in an idle process of its own (same model, same torch threads, rendering included, no prefix reuse). In process = `AsyncEngine.generate`; "
        f"HTTP = the official `openai` client in a process of its own, streaming, against the node's app on uvicorn in the benchmark's process. "
        f"TTFT and inter-token latency (ITL) in ms, p50/p99 over the requests of a run (ITL over HTTP: between content chunks).",
        "",
        "| shared prefix | concurrent | floor tok/s | in-process tok/s | ÷ floor (≥ 0.9 at 16) | HTTP tok/s | ÷ floor (≥ 0.6 at 16) | in-process TTFT p50/p99 | in-process ITL p50/p99 | HTTP TTFT p50/p99 | HTTP ITL p50/p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_cell = {(row.shared_prefix_tokens, row.concurrency): row for row in rows}
    for row in rows:
        floor = _median(row.floor_tokens_per_s)
        local, local_ttft, local_itl = _mode_cells(row.in_process)
        http, http_ttft, http_itl = _mode_cells(row.http)
        local_ratio = _run_ratio(row.in_process, row.floor_tokens_per_s)
        http_ratio = _run_ratio(row.http, row.floor_tokens_per_s)
        lines.append(
            f"| {row.shared_prefix_tokens} | {row.concurrency} | {floor:.0f} | {local:.0f} | {local_ratio:.2f} | {http:.0f} | "
            f"{http_ratio:.2f} | {local_ttft} | {local_itl} | {http_ttft} | {http_itl} |"
        )
    lines += [
        "",
        "Ratios are taken within each run, then the median over runs. Target: 16 concurrent ≥ 4× the tokens/s of 1 at a time.",
    ]
    for prefix in sorted({row.shared_prefix_tokens for row in rows}):
        one, sixteen = by_cell.get((prefix, 1)), by_cell.get((prefix, 16))
        if one is None or sixteen is None:
            continue
        local = _run_ratio(sixteen.in_process, [sample.tokens_per_s for sample in one.in_process])
        http = _run_ratio(sixteen.http, [sample.tokens_per_s for sample in one.http])
        lines.append(
            f"* shared prefix {prefix}: tokens/s at 16 concurrent ÷ at 1: in process {local:.2f}×, HTTP {http:.2f}×."
        )
    return lines


def render_markdown(
    args,
    ttft_rows: list[TTFTRow] | None,
    ns_per_token: float | None,
    restore_rows: list[RestoreRow] | None,
    serving_rows: list[ServingRow] | None = None,
    step_rows: list[StepRow] | None = None,
) -> str:
    command = (
        f"kvledger bench engine --model {Path(args.model_dir).name} --runs {args.runs} --sections {args.sections} "
        f"--prefixes {args.prefixes} --suffix {args.suffix} "
        f"--concurrency {args.concurrency} --serving-prefix {args.serving_prefix} --serving-prompt {args.serving_prompt} "
        f"--serving-tokens {args.serving_tokens} --step-levels {args.step_levels}"
    )
    lines = [
        "## Engine (`kvledger bench engine`)",
        "",
        f"Command: `{command}` "
        f"on {platform.machine()} / {torch.get_num_threads()} torch threads / device `{args.device}`, model `{Path(args.model_dir).name}`, fp32. "
        f"Median of {args.runs} runs; every ratio is within one run.",
    ]
    if ttft_rows is not None:
        lines += [
            "",
            "| prefix P | prompt tokens | plain transformers ms | floor (held DynamicCache) ms | kvledger miss ms | kvledger hit ms | hit / floor (≤ 1.1) | miss overhead vs plain (≤ 5 %) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in ttft_rows:
            lines.append(
                f"| {row.prefix_tokens} | {row.num_prompt_tokens} | {row.plain_ms:.1f} | {row.floor_ms:.1f} | {row.miss_ms:.1f} | "
                f"{row.hit_ms:.1f} | {row.hit_vs_floor:.2f} | {row.miss_overhead * 100:+.1f} % |"
            )
    if ns_per_token is not None:
        lines += [
            "",
            f"Block hashing (`compute_block_keys`, 2048-token prompt): **{ns_per_token:.0f} ns/token** (target ≤ 100).",
        ]
    if restore_rows is not None:
        lines += [
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
    if step_rows is not None:
        lines += _render_steps(args, step_rows)
    if serving_rows is not None:
        lines += _render_serving(args, serving_rows)
    return "\n".join(lines) + "\n"


def _sections(value: str) -> set[str]:
    sections = {name.strip() for name in value.split(",") if name.strip()}
    unknown = sections - set(SECTIONS)
    if unknown or not sections:
        raise ValueError(
            f"--sections takes a comma-separated subset of {', '.join(SECTIONS)}; got {value!r}"
        )
    return sections


async def run(args) -> str:
    sections = _sections(args.sections)
    model_dir = Path(args.model_dir)
    block_size = CacheSettings().block_size
    ttft_rows = ns_per_token = restore_rows = serving_rows = step_rows = None
    floor = _FloorProcess(model_dir, args.device, block_size)
    with tempfile.TemporaryDirectory() as data_dir:
        await floor.start()
        cache = CacheSettings(
            num_device_blocks=2048,
            num_host_blocks=2048,
            max_disk_blocks=4096,
            block_size=block_size,
        )
        # The serving section's node takes end users' tokens from this run's own issuer.
        auth = IssuerSettings(jwt_secret=secrets.token_hex(32))
        scheduler = SchedulerSettings(
            max_num_seqs=max(64, *_levels(args.step_levels), *_levels(args.concurrency))
        )
        settings = NodeSettings(
            model_dir=model_dir,
            data_dir=Path(data_dir),
            device=args.device,
            cache=cache,
            auth=auth,
            scheduler=scheduler,
        )
        engine = AsyncEngine.from_settings(settings)
        await engine.start()
        try:
            if "ttft" in sections:
                prefixes = [int(p) for p in args.prefixes.split(",")]
                await bench_ttft(
                    engine, floor, prefixes[0], args.suffix, 1, seed_base=10_000_000
                )  # warm-up: allocator, kernels
                ttft_rows = [
                    await bench_ttft(engine, floor, p, args.suffix, args.runs) for p in prefixes
                ]
            if "hashing" in sections:
                ns_per_token = bench_hashing(engine, 2048, args.runs)
            if "restore" in sections:
                tiny = engine.runner.kv_spec
                # On the model worker, as every torch operation of this process (see the module
                # docstring).
                restore_rows = await engine.run_exclusive(bench_restore, tiny, 128, args.runs)
                # a Llama-3-8B-shaped block (32 layers, 8 kv heads, 128 dim, bf16): 2 MiB per block
                restore_rows += await engine.run_exclusive(
                    bench_restore,
                    KVBlockSpec(32, 8, 128, tiny.block_size, torch.bfloat16),
                    32,
                    args.runs,
                )
            if "steps" in sections:
                step_rows = await bench_steps(engine, args)
            if "serving" in sections:
                serving_rows = await bench_serving(engine, floor, args)
        finally:
            await engine.stop()
            floor.close()
    return render_markdown(args, ttft_rows, ns_per_token, restore_rows, serving_rows, step_rows)


def cli(args: argparse.Namespace) -> int:
    try:
        _sections(args.sections)
    except ValueError as exc:
        print(f"kvledger bench engine: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    print(report)
    if args.output:
        Path(args.output).write_text(report)
    return 0
