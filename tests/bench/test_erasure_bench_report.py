"""``kvledger bench erasure --sweep``'s report: one row per size, its time growth over the size before, peak memory."""

from __future__ import annotations

import argparse

from bench.erasure import ErasureRun, render_markdown

MIB = 2**20


def test_the_sweep_reports_each_size_with_its_growth_and_peak_memory() -> None:
    args = argparse.Namespace(runs=1, blocks=10_000, sweep=[1_000, 10_000, 100_000])
    runs = [
        ErasureRun(1_000, 2_000, 2.0, 120 * MIB, 500 * MIB),
        ErasureRun(10_000, 20_000, 5.0, 150 * MIB, 700 * MIB),
        ErasureRun(100_000, 200_000, 40.0, 400 * MIB, 2_000 * MIB),
    ]
    report = render_markdown(args, runs)
    assert "`kvledger bench erasure --sweep 1000,10000,100000 --runs 1`" in report
    assert "| 1000 | 2000 | 2.00 s | 2.00 / 2.00 s |  | 120 MiB | 500 MiB |" in report
    assert (
        "| 10000 | 20000 | 5.00 s | 5.00 / 5.00 s | 2.5x for 10x the blocks | 150 MiB | 700 MiB |"
        in report
    )
    assert (
        "| 100000 | 200000 | 40.00 s | 40.00 / 40.00 s | 8.0x for 10x the blocks | 400 MiB | 2000 MiB |"
        in report
    )


def test_without_a_sweep_the_single_size_table_is_kept() -> None:
    args = argparse.Namespace(runs=2, blocks=10_000, sweep=None)
    report = render_markdown(
        args, [ErasureRun(10_000, 20_000, 4.0), ErasureRun(10_000, 20_000, 6.0)]
    )
    assert "| request → verified receipt, p50 of 2 runs | 5.00 s | ≤ 5 s |" in report
