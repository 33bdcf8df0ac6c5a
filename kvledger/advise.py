"""``kvledger advise``: which prompt segments break an otherwise stable prefix, and what moving them
gains.

Reads each node's layout sample (``GET /v1/cache/layout`` with the metrics token;
nodes sample only with ``cache.layout_sample_size`` > 0, see :mod:`gpu_node.cache.layout_sampler`)
and, per node (segment hashes are keyed per node, so samples are never mixed):

* the distribution of where requests first missed the cache: segment index, role, scope;
* the *breaking* segments: positions whose hash differs on most requests (its most common
  hash is on fewer than ``min_share`` of them) while the cache could have reused what follows;
* the expected hit ratio before and after moving them to the end of the prompt, from a replay
  of the sample: each request hits the longest run of whole segments, from the start, that an
  earlier sampled request had in the same order (segments are tokenized one by one, so moving
  one leaves the others' tokens unchanged), rounded down to whole blocks and capped at the
  cacheable part of its prompt (the last token is always computed). The replay assumes an
  unbounded cache, so it shows what the layout allows, not what eviction leaves.

Pure functions carry the analysis (unit tests pin exact numbers); :func:`cli` only fetches and
prints."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

from kvledger.api import REQUEST_TIMEOUT_S
from kvledger.errors import EXIT_FAILURE, CliError
from kvledger.tokens import load_stack


@dataclass(frozen=True)
class DivergencePoint:
    """Where sampled requests first missed the cache (``segment_index`` None: they hit every cacheable block)."""

    segment_index: int | None
    role: str | None
    scope: str | None
    num_requests: int
    share: float


@dataclass(frozen=True)
class BreakingSegment:
    segment_index: int
    role: str
    scope: str
    num_requests: int
    num_distinct_hashes: int
    top_hash_share: float
    """Share of requests carrying this position's most common hash."""
    mean_tokens: float
    hit_ratio_after_move: float
    """Replayed hit ratio with only this segment moved to the end."""
    hit_ratio_gain: float


@dataclass(frozen=True)
class LayoutAdvice:
    num_samples: int
    num_prompt_tokens: int
    observed_hit_ratio: float
    """Hit tokens at lookup / prompt tokens, as the node saw them."""
    replayed_hit_ratio: float
    """The replay of the sample in its current layout (comparable with the ``after`` figures)."""
    divergence: list[DivergencePoint]
    breaking: list[BreakingSegment]
    hit_ratio_after_moving_all: float
    hit_ratio_gain: float


def replay_hit_tokens(
    samples: Sequence[dict], block_size: int, moved: frozenset[int] = frozenset()
) -> int:
    """Prompt tokens the sampled requests would hit, in order, with the segments at ``moved`` positions put last."""
    seen: set[tuple[str, ...]] = set()
    num_hit_tokens = 0
    for sample in samples:
        segments = sample["segments"]
        chain = [s for s in segments if s["index"] not in moved] + [
            s for s in segments if s["index"] in moved
        ]
        prefix: tuple[str, ...] = ()
        num_matched = 0
        matching = True
        for segment in chain:
            prefix += (segment["hash"],)
            if matching and prefix in seen:
                num_matched += segment["num_tokens"]
            else:
                matching = False
            seen.add(prefix)
        num_cacheable = (sample["num_prompt_tokens"] - 1) // block_size * block_size
        num_hit_tokens += min(num_matched // block_size * block_size, num_cacheable)
    return num_hit_tokens


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def analyze(samples: Sequence[dict], block_size: int, min_share: float = 0.5) -> LayoutAdvice:
    """The advice for one node's sample (``samples`` as ``GET /v1/cache/layout`` serves them)."""
    if not 0 < min_share <= 1:
        raise ValueError(f"min_share must be in (0, 1] (got {min_share})")
    if block_size < 1:
        raise ValueError(f"block_size must be positive (got {block_size})")
    num_prompt_tokens = sum(sample["num_prompt_tokens"] for sample in samples)
    num_samples = len(samples)

    divergences = Counter(
        (d["segment_index"], d["role"], d["scope"])
        if (d := sample["divergence"]) is not None
        else (None, None, None)
        for sample in samples
    )
    divergence = [
        DivergencePoint(index, role, scope, count, _ratio(count, num_samples))
        for (index, role, scope), count in sorted(
            divergences.items(), key=lambda item: (-item[1], item[0][0] is None, item[0][0] or 0)
        )
    ]

    by_position: dict[int, list[dict]] = {}
    for sample in samples:
        for segment in sample["segments"]:
            by_position.setdefault(segment["index"], []).append(segment)
    current = replay_hit_tokens(samples, block_size)
    unstable = []
    for index, segments in sorted(by_position.items()):
        hashes = Counter(segment["hash"] for segment in segments)
        top_count = hashes.most_common(1)[0][1]
        if len(segments) >= 2 and top_count / len(segments) < min_share:
            unstable.append((index, segments, hashes, top_count))
    breaking = []
    for index, segments, hashes, top_count in unstable:
        after = replay_hit_tokens(samples, block_size, frozenset({index}))
        if after <= current:
            continue  # nothing after it repeats: moving it gains nothing
        (role, scope), _ = Counter(
            (segment["role"], segment["scope"]) for segment in segments
        ).most_common(1)[0]
        breaking.append(
            BreakingSegment(
                segment_index=index,
                role=role,
                scope=scope,
                num_requests=len(segments),
                num_distinct_hashes=len(hashes),
                top_hash_share=top_count / len(segments),
                mean_tokens=sum(segment["num_tokens"] for segment in segments) / len(segments),
                hit_ratio_after_move=_ratio(after, num_prompt_tokens),
                hit_ratio_gain=_ratio(after - current, num_prompt_tokens),
            )
        )
    after_all = (
        replay_hit_tokens(samples, block_size, frozenset(b.segment_index for b in breaking))
        if breaking
        else current
    )
    return LayoutAdvice(
        num_samples=num_samples,
        num_prompt_tokens=num_prompt_tokens,
        observed_hit_ratio=_ratio(
            sum(sample["num_hit_tokens"] for sample in samples), num_prompt_tokens
        ),
        replayed_hit_ratio=_ratio(current, num_prompt_tokens),
        divergence=divergence,
        breaking=breaking,
        hit_ratio_after_moving_all=_ratio(after_all, num_prompt_tokens),
        hit_ratio_gain=_ratio(after_all - current, num_prompt_tokens),
    )


def fetch_layout(url: str, metrics_token: str | None) -> dict:
    """A node's layout sample; CliError with the node's message when it refuses."""
    headers = {"Authorization": f"Bearer {metrics_token}"} if metrics_token else {}
    response = httpx.get(
        f"{url.rstrip('/')}/v1/cache/layout", headers=headers, timeout=REQUEST_TIMEOUT_S
    )
    if not response.is_success:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise CliError(
            f"HTTP {response.status_code} from {url}/v1/cache/layout: {message}", EXIT_FAILURE
        )
    return response.json()


def _where(index: int | None, role: str | None, scope: str | None) -> str:
    return "every cacheable block hit" if index is None else f"segment {index} ({role}, {scope})"


def _print(url: str, layout: dict, advice: LayoutAdvice | None) -> None:
    if advice is None:
        print(
            f"{url}: layout sampling is off (set KVLEDGER_NODE_CACHE__LAYOUT_SAMPLE_SIZE, e.g. 1000)"
        )
        return
    print(
        f"{url}: {advice.num_samples} requests sampled (of {layout['num_observed']} observed), block size {layout['block_size']}"
    )
    print(
        f"  hit ratio: {advice.observed_hit_ratio:.1%} observed, {advice.replayed_hit_ratio:.1%} replayed from the sample"
    )
    print("  first miss:")
    for point in advice.divergence:
        print(
            f"    {_where(point.segment_index, point.role, point.scope):<36} {point.num_requests:>6} requests  {point.share:.1%}"
        )
    if not advice.breaking:
        print("  no segment breaks a stable prefix")
        return
    print("  segments that break an otherwise stable prefix (move them after the stable ones):")
    for segment in advice.breaking:
        print(
            f"    {_where(segment.segment_index, segment.role, segment.scope)}: {segment.num_distinct_hashes} different contents in "
            f"{segment.num_requests} requests (most common on {segment.top_hash_share:.1%}), ~{segment.mean_tokens:.0f} tokens; "
            f"moved to the end: hit ratio {advice.replayed_hit_ratio:.1%} -> {segment.hit_ratio_after_move:.1%} (+{segment.hit_ratio_gain:.1%})"
        )
    print(
        f"  all of them moved to the end: hit ratio {advice.replayed_hit_ratio:.1%} -> {advice.hit_ratio_after_moving_all:.1%} "
        f"(+{advice.hit_ratio_gain:.1%})"
    )


def cli(args: argparse.Namespace) -> int:
    stack = load_stack(args.stack)
    urls = args.nodes or stack.get("node_urls")
    if not urls:
        raise CliError(
            "pass --node URL (repeatable) or run `kvledger up` in this directory (or pass --stack)"
        )
    metrics_token = args.metrics_token or stack.get("metrics_token")
    report = []
    for url in urls:
        layout = fetch_layout(url, metrics_token)
        advice = (
            analyze(layout["samples"], layout["block_size"], args.min_share)
            if layout["enabled"]
            else None
        )
        report.append((url, layout, advice))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "node": url,
                        "enabled": layout["enabled"],
                        "num_observed": layout["num_observed"],
                        "advice": None if advice is None else asdict(advice),
                    }
                    for url, layout, advice in report
                ],
                indent=2,
            )
        )
        return 0
    for url, layout, advice in report:
        _print(url, layout, advice)
    return 0
