"""``kvledger bench routing`` (the index section) runs and reports every measure, on a small index."""

from __future__ import annotations

import argparse

from bench.routing import _render, _run


async def test_the_routing_bench_reports_lookups_decisions_and_events():
    args = argparse.Namespace(runs=1, lookups=400, nodes=4, blocks=12, output=None)
    runs = await _run(args)
    assert runs[0]["lookups_per_s"] > 0 and runs[0]["events_per_s"] > 0
    assert runs[0]["nodes_matched"] == 4.0  # every group's first block is on every node
    report = _render(args, runs)
    for measure in (
        "index lookups",
        "routing decisions",
        "bare `dict.get`",
        "block events applied",
    ):
        assert measure in report
