"""The node's usage meter: per-tenant counts of finished completions, drained into contiguous
windows."""

from __future__ import annotations

import pytest

from gpu_node.engine.async_engine import GenerationDone, TokenDelta
from gpu_node.governance.usage import TenantUsage, UsageMeter, usage_meter


def Done(num_completion_tokens: int) -> GenerationDone:
    return GenerationDone("stop", num_completion_tokens)


async def _stream(items):
    for item in items:
        yield item


async def test_metered_streams_record_once_when_generation_is_done_and_pass_items_unchanged():
    meter = UsageMeter()
    # Every token carries its running count; only the end of the generation is a completed request.
    items = ["stats", TokenDelta(5, "a", 1), TokenDelta(6, "b", 2), Done(7)]
    assert [item async for item in meter.metered(_stream(items), "acme", 40, 32)] == items
    unfinished = [TokenDelta(5, "a", 1)]
    assert [
        item async for item in meter.metered(_stream(unfinished), "acme", 99, 0)
    ] == unfinished  # never finished: not counted
    async for _ in meter.metered(_stream([Done(1)]), "globex", 10, 0):
        pass
    first = meter.drain()
    assert [(u.tenant_id, u.num_requests, u.num_prompt_tokens, u.num_cached_tokens, u.num_output_tokens) for u in first] == [
        ("acme", 1, 40, 32, 7), ("globex", 1, 10, 0, 1)
    ]  # fmt: skip
    assert first[0].window_start <= first[0].window_end


def test_windows_are_contiguous_and_empty_ones_report_nothing():
    meter = UsageMeter()
    meter.record("acme", 5, 0, 1)
    meter.record("acme", 5, 5, 2)
    (first,) = meter.drain()
    assert isinstance(first, TenantUsage)
    assert (
        first.num_requests,
        first.num_prompt_tokens,
        first.num_cached_tokens,
        first.num_output_tokens,
    ) == (2, 10, 5, 3)
    assert meter.drain() == []
    meter.record("acme", 1, 0, 0)
    (third,) = meter.drain()
    assert (
        third.window_start >= first.window_end
    )  # the empty second window lies between them, nothing is lost
    with pytest.raises(AssertionError, match="cached 6 of 5"):
        meter.record("acme", 5, 6, 0)


def test_each_engine_has_its_own_meter():
    class Engine:
        pass

    one, two = Engine(), Engine()
    assert usage_meter(one) is usage_meter(one)
    assert usage_meter(one) is not usage_meter(two)
