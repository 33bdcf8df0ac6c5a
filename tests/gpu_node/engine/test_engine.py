"""Engine behaviour on the tiny model: exactness of hits, isolation, singleflight, faults,
snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.tiers import Tier
from gpu_node.engine.async_engine import (
    AsyncEngine,
    GenerationDone,
    GenerationRequest,
    PromptStats,
    PromptTooLongError,
    SamplingParams,
    StepTiming,
    TokenDelta,
)
from gpu_node.metrics import MissReason
from gpu_node.settings import CacheSettings, NodeSettings
from prefix_keys.blocks import (
    CacheScope,
    DocumentRef,
    Principal,
    compute_block_keys,
    num_cacheable_blocks,
)
from prefix_keys.prompt import ChatMessage, render_prompt

BLOCK = 16
ALICE = Principal("acme", "alice", frozenset({"hr", "finance"}), {"hr": 1, "finance": 1})
CAROL = dataclasses.replace(ALICE, subject_id="carol")
BOB_AT_GLOBEX = Principal("globex", "bob", frozenset({"hr"}), {"hr": 1})

WORDS = "the handbook says each tenant keeps its own cache blocks while public prompts are shared by all".split()


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str


def system(text: str = "You are a careful assistant for the kvledger test suite.") -> ChatMessage:
    return ChatMessage("system", text, CacheScope.PUBLIC, None)


def document(doc_id: str, version: int, text: str, auth_scope: str = "hr") -> ChatMessage:
    return ChatMessage("user", text, CacheScope.TENANT, DocumentRef(doc_id, version, auth_scope))


def user(text: str) -> ChatMessage:
    return ChatMessage("user", text, CacheScope.USER, None)


def long_text(num_words: int, offset: int = 0) -> str:
    return " ".join(
        WORDS[(offset + i) % len(WORDS)] + str((offset + i) % 97) for i in range(num_words)
    )


async def complete(
    engine: AsyncEngine, messages, principal=ALICE, use_cache=True, max_tokens=6, **sampling
) -> Completion:
    request = GenerationRequest(
        "test",
        tuple(messages),
        SamplingParams(max_tokens=max_tokens, **sampling),
        principal,
        use_cache,
    )
    token_ids: list[int] = []
    text = ""
    stats = done = None
    async for item in engine.generate(request):
        if isinstance(item, PromptStats):
            stats = item
        elif isinstance(item, TokenDelta):
            token_ids.append(item.token_id)
            text += item.text
        else:
            assert isinstance(item, GenerationDone)
            done = item
    assert stats is not None and done is not None
    return Completion(
        token_ids, text, stats.num_prompt_tokens, stats.num_cached_tokens, done.finish_reason
    )


def node_settings(model_dir: Path, data_dir: Path, **cache) -> NodeSettings:
    cache_settings = CacheSettings(
        block_size=BLOCK,
        **({"num_device_blocks": 256, "num_host_blocks": 256, "max_disk_blocks": 1024} | cache),
    )
    return NodeSettings(model_dir=model_dir, data_dir=data_dir, cache=cache_settings)


@pytest.fixture
async def engine(tiny_model_dir, tmp_path):
    engine = AsyncEngine.from_settings(node_settings(tiny_model_dir, tmp_path / "node"))
    await engine.start()
    yield engine
    await engine.stop()


def metric(engine: AsyncEngine, name: str, labels: dict | None = None) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def expected_cached(num_prompt_tokens: int) -> int:
    return num_cacheable_blocks(num_prompt_tokens, BLOCK) * BLOCK


def ready_hashes(engine: AsyncEngine) -> list[bytes]:
    return [entry.block_hash for entry in engine.pool.ready_entries()]


async def test_every_step_is_timed_outside_its_forward(engine):
    timings: list[StepTiming] = []
    engine.step_sink = timings.append
    done = await complete(engine, [system(), user("Time my steps.")], max_tokens=5, ignore_eos=True)
    # The last step hands its token over before it is timed: a job on the worker runs after that
    # step has finished.
    await engine.run_exclusive(lambda: None)
    engine.step_sink = None
    assert len(done.token_ids) == 5
    # one step per token: the prefill yields the first, each decode one more
    assert [(timing.num_seqs, timing.num_tokens > 1) for timing in timings] == [(1, True)] + [
        (1, False)
    ] * 4
    assert all(
        timing.forward_s > 0 and timing.overhead_s > 0 and timing.overhead_cpu_s >= 0
        for timing in timings
    )
    assert metric(engine, "kvledger_engine_step_overhead_seconds_count") == len(timings)
    assert metric(engine, "kvledger_engine_step_overhead_seconds_sum") == pytest.approx(
        sum(timing.overhead_s for timing in timings)
    )


async def test_only_the_forward_runs_on_the_configured_intra_op_threads(engine, monkeypatch):
    """Scheduling, step tensors and sampling run at one torch thread; the model forward at the runner's count."""
    engine.runner.num_threads = 2
    seen = {"forward": [], "schedule": []}
    hook = engine.runner.model.register_forward_pre_hook(
        lambda *_: seen["forward"].append(torch.get_num_threads())
    )
    schedule = engine.scheduler.schedule

    def observed_schedule():
        seen["schedule"].append(torch.get_num_threads())
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", observed_schedule)
    threads_before = torch.get_num_threads()
    try:
        done = await complete(
            engine, [system(), user("Count my threads.")], max_tokens=3, ignore_eos=True
        )
    finally:
        hook.remove()
    assert len(done.token_ids) == 3
    assert seen["forward"] == [2, 2, 2]
    assert seen["schedule"] and set(seen["schedule"]) == {1}
    # the worker's other jobs (restores, snapshots) run at the count it had before the step
    assert await engine.run_exclusive(torch.get_num_threads) == threads_before


async def test_second_request_hits_every_full_block_and_matches_uncached(engine):
    messages = [
        system(),
        document("handbook", 3, long_text(60)),
        user("What does the handbook say?"),
    ]
    uncached = await complete(engine, messages, use_cache=False)
    first = await complete(engine, messages)
    second = await complete(engine, messages)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_cached(second.num_prompt_tokens)
    assert uncached.token_ids == first.token_ids == second.token_ids
    assert metric(engine, "kvledger_cache_misses_total", {"reason": "NO_ENTRY"}) == 1
    assert metric(engine, "kvledger_prefix_hits_total") == 1
    # the uncached request and the first cached one both served no token from cache
    assert metric(engine, "kvledger_full_misses_total") == 2


message_strategy = st.one_of(
    st.builds(lambda n, o: system(long_text(n, o)), st.integers(1, 30), st.integers(0, 50)),
    st.builds(
        lambda d, v, n, o: document(f"doc-{d}", v, long_text(n, o)),
        st.integers(0, 2),
        st.integers(1, 3),
        st.integers(1, 40),
        st.integers(0, 50),
    ),
    st.builds(lambda n, o: user(long_text(n, o)), st.integers(1, 30), st.integers(0, 50)),
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    messages=st.lists(message_strategy, min_size=1, max_size=4),
    principal=st.sampled_from([ALICE, CAROL, BOB_AT_GLOBEX]),
    tier=st.sampled_from([None, Tier.HOST, Tier.DISK, "evict-middle"]),
)
async def test_greedy_tokens_with_hits_equal_uncached(engine, messages, principal, tier):
    if principal is BOB_AT_GLOBEX:
        messages = [
            m
            if m.document is None
            else dataclasses.replace(m, document=dataclasses.replace(m.document, auth_scope="hr"))
            for m in messages
        ]
    uncached = await complete(engine, messages, principal, use_cache=False)
    first = await complete(engine, messages, principal)
    num_blocks = num_cacheable_blocks(first.num_prompt_tokens, BLOCK)
    prompt = render_prompt(engine.runner.tokenizer, messages)
    keys = compute_block_keys(
        engine.namespace.namespace, prompt.token_ids, prompt.segments, principal, BLOCK
    )
    expected_blocks = num_blocks
    if tier in (Tier.HOST, Tier.DISK):
        for key in keys:
            assert engine.pool.demote(key.block_hash, tier)
    elif tier == "evict-middle" and num_blocks >= 2:
        middle = keys[num_blocks // 2]
        assert engine.pool.evict(middle.block_hash)
        expected_blocks = num_blocks // 2
    again = await complete(engine, messages, principal)
    assert again.token_ids == first.token_ids == uncached.token_ids
    assert again.num_cached_tokens == expected_blocks * BLOCK


async def test_isolation_public_prefix_shared_tenant_and_user_parts_not(engine):
    handbook = long_text(50)
    public = system(long_text(40, 3))
    alice = await complete(engine, [public, document("handbook", 1, handbook), user("hi")], ALICE)
    assert alice.num_cached_tokens == 0
    rendered = render_prompt(
        engine.runner.tokenizer, [public, document("handbook", 1, handbook), user("hi")]
    )
    public_tokens = rendered.segments[0].end
    misses_before = {
        reason: metric(engine, "kvledger_cache_misses_total", {"reason": reason})
        for reason in MissReason
    }
    bob = await complete(
        engine, [public, document("handbook", 1, handbook), user("hi")], BOB_AT_GLOBEX
    )
    assert bob.num_cached_tokens == (public_tokens // BLOCK) * BLOCK
    # Acme's copy of the document is none of globex's business: the miss reads as if nobody had
    # cached it.
    misses_after = {
        reason: metric(engine, "kvledger_cache_misses_total", {"reason": reason})
        for reason in MissReason
    }
    assert {
        reason: misses_after[reason] - misses_before[reason]
        for reason in MissReason
        if misses_after[reason] != misses_before[reason]
    } == {MissReason.NO_ENTRY: 1}

    # Two subjects of one tenant share the document blocks but never each other's user blocks.
    history = user(long_text(40, 9))
    await complete(engine, [public, document("handbook", 1, handbook), history], ALICE)
    carol = await complete(engine, [public, document("handbook", 1, handbook), history], CAROL)
    user_start = (
        render_prompt(engine.runner.tokenizer, [public, document("handbook", 1, handbook), history])
        .segments[2]
        .start
    )
    assert carol.num_cached_tokens == (user_start // BLOCK) * BLOCK


async def test_same_tokens_under_the_callers_own_other_scope_is_an_auth_scope_mismatch(engine):
    """A reason may compare with entries the caller could have been served: here its own user-scope
    copy."""
    text = long_text(40, 21)
    await complete(engine, [user(text)], ALICE)
    before = metric(engine, "kvledger_cache_misses_total", {"reason": "AUTH_SCOPE_MISMATCH"})
    shared = await complete(engine, [ChatMessage("user", text, CacheScope.TENANT)], ALICE)
    assert shared.num_cached_tokens == 0
    assert (
        metric(engine, "kvledger_cache_misses_total", {"reason": "AUTH_SCOPE_MISMATCH"})
        == before + 1
    )


async def test_short_prompt_counts_prefix_too_short(engine):
    await complete(engine, [system("hi")], max_tokens=2)
    assert metric(engine, "kvledger_cache_misses_total", {"reason": "PREFIX_TOO_SHORT"}) == 1


async def test_concurrent_identical_new_prefix_is_built_once(engine):
    prefix = [system(long_text(400, 11))]
    prompt_messages = prefix + [user("Summarise.")]
    builds_before = metric(engine, "kvledger_prefix_builds_total")
    blocks_before = metric(engine, "kvledger_blocks_built_total")
    results = await asyncio.gather(
        *(complete(engine, prompt_messages, max_tokens=4) for _ in range(32))
    )
    assert results[0].num_prompt_tokens >= 1000
    assert metric(engine, "kvledger_prefix_builds_total") - builds_before == 1
    assert metric(engine, "kvledger_blocks_built_total") - blocks_before == num_cacheable_blocks(
        results[0].num_prompt_tokens, BLOCK
    )
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert (
        sorted(r.num_cached_tokens for r in results)[1:]
        == [expected_cached(results[0].num_prompt_tokens)] * 31
    )
    assert metric(engine, "kvledger_singleflight_waiters") == 0


async def test_corrupt_disk_block_falls_back_and_is_never_served_again(engine):
    messages = [system(), document("payroll", 2, long_text(60, 5), "finance"), user("Total?")]
    baseline = await complete(engine, messages, use_cache=False)
    await complete(engine, messages)
    for block_hash in ready_hashes(engine):
        assert engine.pool.demote(block_hash, Tier.DISK)
    victim = engine.pool.get_ready(ready_hashes(engine)[0])
    path = engine.pool.disk_path(victim.block_hash)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    failed = await complete(engine, messages)
    assert failed.token_ids == baseline.token_ids
    assert metric(engine, "kvledger_cache_misses_total", {"reason": "KV_RESTORE_FAILED"}) >= 1
    assert engine.pool.get_ready(victim.block_hash) is None
    assert not path.exists()


async def test_destroyed_key_makes_disk_blocks_undecryptable(engine):
    messages = [system(), user(long_text(60, 21))]
    baseline = await complete(engine, messages, use_cache=False)
    await complete(engine, messages)
    for block_hash in ready_hashes(engine):
        engine.pool.demote(block_hash, Tier.DISK)
    user_entries = [e for e in engine.pool.ready_entries() if e.provenance.scope == CacheScope.USER]
    assert user_entries
    key_id, _ = engine.pool.key_provider.key_for(user_entries[0].provenance)
    assert engine.pool.key_provider.destroy(key_id)

    after = await complete(engine, messages)
    assert after.token_ids == baseline.token_ids
    assert after.num_cached_tokens < expected_cached(after.num_prompt_tokens)
    assert metric(engine, "kvledger_cache_misses_total", {"reason": "KV_RESTORE_FAILED"}) >= 1


async def test_snapshot_warm_start_serves_hits(engine, tiny_model_dir, tmp_path):
    messages = [system(long_text(50, 2)), document("handbook", 4, long_text(40, 7)), user("And?")]
    first = await complete(engine, messages)
    summary = await engine.write_snapshot()
    assert summary["num_blocks"] == num_cacheable_blocks(first.num_prompt_tokens, BLOCK)

    # A replica warm-starting from another node's snapshot needs that node's data keys
    # for the tenant/user shards; here it is handed the key file.
    (tmp_path / "warm").mkdir()
    shutil.copy(tmp_path / "node" / "keys.json", tmp_path / "warm" / "keys.json")
    warm_settings = node_settings(tiny_model_dir, tmp_path / "warm").model_copy(
        update={"warm_from": Path(summary["path"])}
    )
    warm = AsyncEngine.from_settings(warm_settings)
    await warm.start()
    try:
        hit = await complete(warm, messages)
        assert hit.num_cached_tokens == expected_cached(hit.num_prompt_tokens)
        assert hit.token_ids == first.token_ids
    finally:
        await warm.stop()


async def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(PromptTooLongError) as error:
        await complete(engine, [user(long_text(3000))])
    assert error.value.max_context_tokens == engine.max_context_tokens


# --------------------------------------------------------------------------- vLLM's stop extensions


def reference_greedy(
    model_dir: Path, prompt_ids: list[int], max_new_tokens: int, min_new_tokens: int, stop_ids
) -> list[int]:
    """transformers' own greedy ``generate`` with the same stop rule: what the node must produce."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32
    )
    output = model.generate(
        torch.tensor([prompt_ids]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=0,
    )
    generated = output[0, len(prompt_ids) :].tolist()
    return generated[:-1] if generated and generated[-1] in stop_ids else generated


def model_with_eos(tiny_model_dir: Path, directory: Path, eos_token_id: int) -> Path:
    """A copy of the tiny model whose end-of-sequence token is ``eos_token_id`` (the tiny model's
    greedy output never reaches its own), so that stopping at it, and not stopping, can be
    observed."""
    import json

    shutil.copytree(tiny_model_dir, directory)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config["eos_token_id"] = [eos_token_id]
        (directory / name).write_text(json.dumps(config))
    return directory


HELLO = [user("hello there, what does the handbook say")]


async def test_stop_token_ids_end_generation_before_the_token(engine):
    baseline = await complete(engine, HELLO, max_tokens=12)
    assert baseline.finish_reason == "length"
    stop_at = next(
        index
        for index, token in enumerate(baseline.token_ids)
        if index > 0 and token != baseline.token_ids[0]
    )
    stopped = await complete(
        engine, HELLO, max_tokens=12, stop_token_ids=(baseline.token_ids[stop_at],)
    )
    assert (stopped.token_ids, stopped.finish_reason) == (baseline.token_ids[:stop_at], "stop")


async def test_min_tokens_masks_stop_tokens_like_transformers(engine, tiny_model_dir):
    baseline = await complete(engine, HELLO, max_tokens=12)
    stop_ids = {baseline.token_ids[0], baseline.token_ids[1]}
    prompt_ids = render_prompt(engine.runner.tokenizer, tuple(HELLO)).token_ids
    expected = reference_greedy(
        tiny_model_dir, prompt_ids, 12, 5, stop_ids | engine.runner.eos_token_ids
    )
    assert not stop_ids & set(
        expected[:5]
    )  # the minimum changed the output: it is not the baseline's
    got = await complete(engine, HELLO, max_tokens=12, min_tokens=5, stop_token_ids=tuple(stop_ids))
    assert got.token_ids == expected
    assert got.finish_reason == ("stop" if len(expected) < 12 else "length")


async def test_eos_stops_unless_ignored_and_min_tokens_defers_it(tiny_model_dir, tmp_path, engine):
    baseline = await complete(engine, HELLO, max_tokens=10)
    eos = baseline.token_ids[1]
    model_dir = model_with_eos(tiny_model_dir, tmp_path / "eos-model", eos)
    eos_engine = AsyncEngine.from_settings(node_settings(model_dir, tmp_path / "eos-node"))
    await eos_engine.start()
    try:
        stopped = await complete(eos_engine, HELLO, max_tokens=10)
        assert (stopped.token_ids, stopped.finish_reason) == (baseline.token_ids[:1], "stop")
        # ignore_eos: the end-of-sequence token is generated, streamed and counted like any other.
        ignored = await complete(eos_engine, HELLO, max_tokens=10, ignore_eos=True)
        assert (ignored.token_ids, ignored.finish_reason) == (baseline.token_ids, "length")
        prompt_ids = render_prompt(eos_engine.runner.tokenizer, tuple(HELLO)).token_ids
        deferred = await complete(eos_engine, HELLO, max_tokens=10, min_tokens=4)
        assert deferred.token_ids == reference_greedy(model_dir, prompt_ids, 10, 4, {eos})
        assert eos not in deferred.token_ids[:4]
    finally:
        await eos_engine.stop()


async def test_stop_strings_wait_for_min_tokens(engine):
    baseline = await complete(engine, HELLO, max_tokens=8)
    first_text = engine.runner.tokenizer.decode(baseline.token_ids[:1])
    assert first_text.strip(), "the first token has text to stop at"
    assert (await complete(engine, HELLO, max_tokens=8, stop=(first_text,))).token_ids == []
    late = await complete(engine, HELLO, max_tokens=8, stop=(first_text,), min_tokens=3)
    assert late.token_ids[:3] == baseline.token_ids[:3]
    assert late.finish_reason == (
        "stop" if first_text in engine.runner.tokenizer.decode(baseline.token_ids[3:]) else "length"
    )


async def test_out_of_vocabulary_stop_token_is_refused(engine):
    with pytest.raises(ValueError, match="stop_token_ids"):
        await complete(engine, HELLO, stop_token_ids=(engine.runner.config.vocab_size,))
