"""``kvledger bench ledger``'s report: the COPY ratio is the headline, taken per run, with the lag
percentiles."""

from __future__ import annotations

import argparse

from bench.ledger import LedgerRun, render_markdown


def _run(end_to_end: float, copy: float, apply: float, lag_p99_ms: float) -> LedgerRun:
    return LedgerRun(
        num_events=50000,
        end_to_end_events_per_s=end_to_end,
        lag_p50_ms=100.0,
        lag_p99_ms=lag_p99_ms,
        raw_insert_rows_per_s=10000.0,
        raw_copy_rows_per_s=copy,
        apply_events_per_s=apply,
        decode_ms_per_record=1.0,
        verify_ms_per_record=0.5,
        sign_ms_per_record=0.25,
        parse_ms_per_record=2.0,
    )


def test_headline_is_the_median_of_per_run_copy_ratios() -> None:
    args = argparse.Namespace(runs=3, events=50000, blocks_per_record=50)
    # Ratios 50 %, 80 %, 60 %: the median of the ratios (60 %), not the ratio of the medians (30,000
    # / 40,000 = 75 %).
    runs = [
        _run(20000, 40000, 30000, 900),
        _run(40000, 50000, 45000, 1200),
        _run(30000, 50000, 25000, 1000),
    ]
    report = render_markdown(args, runs)
    assert (
        "| **end to end / raw COPY of the same rows** (per run: 50 %, 80 %, 60 %) | **60 %** | ≥ 70 % |"
        in report
    )
    assert "| consumer lag p50 / p99 (per record, publish → visible) | 100 / 1,000 ms | |" in report
    assert (
        "| ledger apply alone (the batch handler on decoded records, no broker) / raw COPY | 75 % (30,000 block events/s) | |"
        in report
    )
    assert (
        "| CPU per 50-block record: consumer decode / signature check, node signing | 1.00 / 0.50 ms, 0.25 ms | |"
        in report
    )
    assert (
        "| consumer decode: compiled (`events.kv_decoder`) / pydantic (`schema.parse_event`) | 1,000 / 500 records/s | |"
        in report
    )
    assert "load average at the end" in report and "git " in report
