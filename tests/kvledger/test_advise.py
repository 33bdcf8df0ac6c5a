"""Prompt-layout advice: the node's content-free sample and ``kvledger advise``'s analysis, with exact numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from gpu_node.cache.layout_sampler import MAX_SEGMENTS, LayoutSampler
from kvledger.advise import analyze, replay_hit_tokens
from prefix_keys.blocks import CacheScope, DocumentRef, Principal, Segment, compute_block_keys
from prefix_keys.prompt import ChatMessage, RenderedPrompt

BLOCK_SIZE = 4
ALICE = Principal("acme", "alice", frozenset({"hr"}), {"hr": 1})


def segment(
    index: int,
    digest: str,
    num_tokens: int,
    role: str = "system",
    scope: str = "public",
    start: int = 0,
) -> dict:
    return {
        "index": index,
        "role": role,
        "scope": scope,
        "start": start,
        "num_tokens": num_tokens,
        "hash": digest,
    }


def sample(segments: list[dict], num_hit_tokens: int = 0, divergence: dict | None = None) -> dict:
    return {
        "num_prompt_tokens": sum(s["num_tokens"] for s in segments),
        "num_hit_tokens": num_hit_tokens,
        "num_segments": len(segments),
        "segments": segments,
        "divergence": divergence,
    }


def timestamp_first(request: int) -> dict:
    """8 tokens of timestamp (new every request), a 32-token document, an 8-token question, 4 of
    generation prompt: 52."""
    return sample(
        [
            segment(0, f"ts{request}", 8),
            segment(1, "doc", 32, "system", "tenant", 8),
            segment(2, "question", 8, "user", "user", 40),
            segment(3, "gen", 4, "generation", "public", 48),
        ],
        divergence={"segment_index": 0, "token_offset": 0, "role": "system", "scope": "public"},
    )


def test_a_varying_segment_before_a_stable_document_is_named_with_its_exact_gain() -> None:
    samples = [timestamp_first(request) for request in range(4)]
    advice = analyze(samples, BLOCK_SIZE)
    # Current layout: the timestamp differs on every request, so nothing after it is ever hit.
    assert replay_hit_tokens(samples, BLOCK_SIZE) == 0
    # Moved to the end: requests 2..4 hit doc + question + generation prompt = 44 tokens
    # (whole blocks: 44; cacheable part of 52 tokens: 48), the first request writes them.
    assert replay_hit_tokens(samples, BLOCK_SIZE, frozenset({0})) == 3 * 44
    assert advice.num_samples == 4
    assert advice.num_prompt_tokens == 4 * 52
    assert advice.observed_hit_ratio == 0.0
    assert advice.replayed_hit_ratio == 0.0
    assert [
        (b.segment_index, b.role, b.scope, b.num_requests, b.num_distinct_hashes)
        for b in advice.breaking
    ] == [(0, "system", "public", 4, 4)]
    (breaking,) = advice.breaking
    assert breaking.top_hash_share == 0.25
    assert breaking.mean_tokens == 8.0
    assert breaking.hit_ratio_after_move == 132 / 208
    assert breaking.hit_ratio_gain == 132 / 208
    assert advice.hit_ratio_after_moving_all == 132 / 208
    assert advice.hit_ratio_gain == 132 / 208
    assert [
        (p.segment_index, p.role, p.scope, p.num_requests, p.share) for p in advice.divergence
    ] == [(0, "system", "public", 4, 1.0)]


def test_a_stable_layout_has_nothing_to_move() -> None:
    stable = [
        sample(
            [
                segment(0, "sys", 8),
                segment(1, "doc", 32, scope="tenant", start=8),
                segment(2, f"q{r}", 8, "user", "user", 40),
            ],
            num_hit_tokens=0 if r == 0 else 40,
            divergence={"segment_index": 2, "token_offset": 40, "role": "user", "scope": "user"},
        )
        for r in range(3)
    ]
    advice = analyze(stable, BLOCK_SIZE)
    # the last segment varies, but nothing follows it: moving it gains nothing, so it is not named
    assert advice.breaking == []
    assert replay_hit_tokens(stable, BLOCK_SIZE) == 2 * 40
    assert advice.replayed_hit_ratio == 80 / 144
    assert advice.observed_hit_ratio == 80 / 144
    assert advice.hit_ratio_gain == 0.0


def test_hits_round_down_to_whole_blocks_and_stop_before_the_last_token() -> None:
    # 6 + 3 tokens repeat: 9 matched → 8 in whole blocks; a 9-token prompt caches at most 8 (the
    # last is computed)
    samples = [sample([segment(0, "a", 6), segment(1, "b", 3, start=6)]) for _ in range(2)]
    assert replay_hit_tokens(samples, BLOCK_SIZE) == 8
    short = [sample([segment(0, "a", 4)]) for _ in range(2)]
    assert (
        replay_hit_tokens(short, BLOCK_SIZE) == 0
    )  # 4 tokens: the only block holds the last token


def test_a_segment_stable_on_most_requests_is_not_breaking_and_min_share_is_checked() -> None:
    samples = [
        sample([segment(0, "ts" if r < 3 else "other", 8), segment(1, "doc", 32, start=8)])
        for r in range(4)
    ]
    assert analyze(samples, BLOCK_SIZE).breaking == []  # its most common hash is on 75% of requests
    with pytest.raises(ValueError, match="min_share"):
        analyze(samples, BLOCK_SIZE, min_share=0)


def test_an_empty_sample_advises_nothing() -> None:
    advice = analyze([], BLOCK_SIZE)
    assert (advice.num_samples, advice.breaking, advice.divergence, advice.hit_ratio_gain) == (
        0,
        [],
        [],
        0.0,
    )


# --------------------------------------------------------------------------- the node's sampler


@dataclass
class Request:
    messages: tuple[ChatMessage, ...]
    principal: Principal


SECRET_WORDS = ("zebracorn", "quartzmoon")


def _prompt(timestamp: int) -> tuple[Request, RenderedPrompt]:
    messages = (
        ChatMessage("system", f"time {timestamp} zebracorn", CacheScope.PUBLIC),
        ChatMessage("system", "handbook quartzmoon", CacheScope.TENANT, DocumentRef("hb", 1, "hr")),
        ChatMessage("user", "question", CacheScope.USER),
    )
    token_ids = [timestamp] * 5 + list(range(100, 120)) + list(range(200, 206)) + [7, 7]
    segments = [
        Segment(0, 5, CacheScope.PUBLIC),
        Segment(5, 25, CacheScope.TENANT, DocumentRef("hb", 1, "hr")),
        Segment(25, 31, CacheScope.USER),
        Segment(31, 33, CacheScope.PUBLIC),
    ]
    return Request(messages, ALICE), RenderedPrompt(token_ids, segments)


def test_the_sampler_records_layout_and_divergence_without_content() -> None:
    sampler = LayoutSampler(capacity=2, block_size=BLOCK_SIZE)
    for timestamp, num_hit_blocks in ((1, 0), (2, 3), (3, 8)):
        request, prompt = _prompt(timestamp)
        keys = compute_block_keys("ns", prompt.token_ids, prompt.segments, ALICE, BLOCK_SIZE)
        assert len(keys) == 8
        sampler.observe(request, prompt, keys, num_hit_blocks)
    snapshot = sampler.snapshot()
    assert (
        snapshot["enabled"],
        snapshot["capacity"],
        snapshot["block_size"],
        snapshot["num_observed"],
    ) == (True, 2, BLOCK_SIZE, 3)
    first, second = snapshot["samples"]  # a ring: the oldest request fell out
    assert [
        (s["index"], s["role"], s["scope"], s["start"], s["num_tokens"]) for s in first["segments"]
    ] == [
        (0, "system", "public", 0, 5),
        (1, "system", "tenant", 5, 20),
        (2, "user", "user", 25, 6),
        (3, "generation", "public", 31, 2),
    ]
    # 3 hit blocks: the first miss is token 12, inside the document segment
    assert first["divergence"] == {
        "segment_index": 1,
        "token_offset": 12,
        "role": "system",
        "scope": "tenant",
    }
    assert (first["num_prompt_tokens"], first["num_hit_tokens"], first["num_segments"]) == (
        33,
        12,
        4,
    )
    assert second["divergence"] is None  # every cacheable block hit
    # the timestamp segment's hash changes, the document's does not
    assert first["segments"][0]["hash"] != second["segments"][0]["hash"]
    assert first["segments"][1]["hash"] == second["segments"][1]["hash"]
    assert all(len(s["hash"]) == 32 for s in first["segments"])
    text = json.dumps(snapshot)
    assert not any(word in text for word in (*SECRET_WORDS, "alice", "acme", "hb@1", "question"))


def test_hashes_are_keyed_per_sampler_and_include_who_shares_the_segment() -> None:
    request, prompt = _prompt(1)
    keys = compute_block_keys("ns", prompt.token_ids, prompt.segments, ALICE, BLOCK_SIZE)
    one, two = LayoutSampler(4, BLOCK_SIZE), LayoutSampler(4, BLOCK_SIZE)
    one.observe(request, prompt, keys, 0)
    two.observe(request, prompt, keys, 0)
    bob = Principal("acme", "bob", frozenset({"hr"}), {"hr": 1})
    one.observe(Request(request.messages, bob), prompt, keys, 0)
    (a,), (b,) = one.snapshot()["samples"][:1], two.snapshot()["samples"]
    assert [s["hash"] for s in a["segments"]] != [
        s["hash"] for s in b["segments"]
    ]  # another node's key
    alice_hashes, bob_hashes = (
        [s["hash"] for s in x["segments"]] for x in one.snapshot()["samples"]
    )
    # public and tenant segments are shared with bob (same tenant); his user segment is his own
    assert alice_hashes[:2] == bob_hashes[:2] and alice_hashes[3] == bob_hashes[3]
    assert alice_hashes[2] != bob_hashes[2]


def test_the_sampler_is_off_by_default_bounded_per_request_and_skips_uncacheable_prompts() -> None:
    request, prompt = _prompt(1)
    keys = compute_block_keys("ns", prompt.token_ids, prompt.segments, ALICE, BLOCK_SIZE)
    off = LayoutSampler(0, BLOCK_SIZE)
    off.observe(request, prompt, keys, 0)
    assert off.snapshot() == {
        "enabled": False,
        "capacity": 0,
        "block_size": BLOCK_SIZE,
        "num_observed": 0,
        "samples": [],
    }
    on = LayoutSampler(1, BLOCK_SIZE)
    on.observe(request, prompt, [], 0)
    assert on.snapshot()["num_observed"] == 0
    num_messages = MAX_SEGMENTS + 10
    many = Request(tuple(ChatMessage("user", "x") for _ in range(num_messages)), ALICE)
    long_prompt = RenderedPrompt(
        list(range(num_messages * 2)),
        [Segment(2 * i, 2 * i + 2, CacheScope.USER) for i in range(num_messages)],
    )
    on.observe(
        many,
        long_prompt,
        compute_block_keys("ns", long_prompt.token_ids, long_prompt.segments, ALICE, BLOCK_SIZE),
        0,
    )
    (recorded,) = on.snapshot()["samples"]
    assert (recorded["num_segments"], len(recorded["segments"])) == (num_messages, MAX_SEGMENTS)
    with pytest.raises(ValueError):
        LayoutSampler(-1, BLOCK_SIZE)
