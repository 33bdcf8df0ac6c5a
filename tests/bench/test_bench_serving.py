"""`kvledger bench engine`'s serving section: it drives a real engine in process and over HTTP, and its
ratios are taken within each run (wall-clock numbers themselves are never asserted)."""

from __future__ import annotations

import argparse
import secrets

import pytest

from bench.engine import (
    ModeSample,
    ServingRow,
    _FloorProcess,
    _render_serving,
    _sections,
    bench_serving,
)
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.settings import CacheSettings, NodeSettings
from identity.settings import IssuerSettings


def _args(**overrides) -> argparse.Namespace:
    values = {
        "runs": 1,
        "concurrency": "1,2",
        "serving_prefix": 32,
        "serving_prompt": 12,
        "serving_tokens": 3,
    } | overrides
    return argparse.Namespace(**values)


def test_sections_are_a_subset_of_the_known_ones():
    assert _sections("serving") == {"serving"}
    assert _sections("ttft, serving") == {"ttft", "serving"}
    for bad in ("", "serving,latency", ","):
        with pytest.raises(ValueError, match="--sections takes"):
            _sections(bad)


def test_ratios_are_taken_within_each_run_then_the_median():
    def sample(tokens_per_s: float) -> ModeSample:
        return ModeSample(tokens_per_s, [10.0], [1.0])

    one = ServingRow(
        0,
        1,
        [100.0, 200.0, 400.0],
        [sample(50), sample(100), sample(100)],
        [sample(10), sample(20), sample(40)],
    )
    # Ratio of medians would say 100/200 = 0.50 in process; the runs say 0.9, 0.5 and 1.0.
    sixteen = ServingRow(
        0,
        16,
        [100.0, 200.0, 400.0],
        [sample(90), sample(100), sample(400)],
        [sample(60), sample(60), sample(60)],
    )
    lines = _render_serving(_args(runs=3), [one, sixteen])
    assert "| 0 | 16 | 200 | 100 | 0.90 | 60 | 0.30 | 10/10 | 1.0/1.0 | 10/10 | 1.0/1.0 |" in lines
    # 16 ÷ 1 per run: in process 90/50, 100/100, 400/100 → 1.8, 1.0, 4.0; HTTP 6, 3, 1.5.
    assert (
        "* shared prefix 0: tokens/s at 16 concurrent ÷ at 1: in process 1.80×, HTTP 3.00×."
        in lines
    )


async def test_the_serving_section_measures_every_cell_in_process_and_over_http(
    tiny_model_dir, tmp_path
):
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path,
        auth=IssuerSettings(jwt_secret=secrets.token_hex(32)),
        cache=CacheSettings(
            block_size=16, num_device_blocks=256, num_host_blocks=0, max_disk_blocks=0
        ),
    )
    floor = _FloorProcess(tiny_model_dir, "cpu", settings.cache.block_size)
    try:
        await floor.start()
        engine = AsyncEngine.from_settings(settings)
        await engine.start()
        try:
            rows = await bench_serving(engine, floor, _args())
        finally:
            await engine.stop()
    finally:
        floor.close()
    assert [(row.shared_prefix_tokens, row.concurrency) for row in rows] == [
        (0, 1),
        (0, 2),
        (32, 1),
        (32, 2),
    ]
    for row in rows:
        assert len(row.floor_tokens_per_s) == 1 and row.floor_tokens_per_s[0] > 0
        for samples in (row.in_process, row.http):
            (sample,) = samples
            assert len(sample.ttft_ms) == row.concurrency, "one TTFT per request"
            assert sample.tokens_per_s > 0 and len(sample.itl_ms) <= row.concurrency * 2
