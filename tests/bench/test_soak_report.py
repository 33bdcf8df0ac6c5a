"""``kvledger bench soak``'s pieces that need no services: durations, the report, refusing a bad
duration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import RssSample, SoakReport, parse_duration, render_markdown

KVLEDGER = str(Path(sys.executable).with_name("kvledger"))
MIB = 2**20


def test_durations_take_seconds_minutes_and_hours() -> None:
    assert [parse_duration(text) for text in ("90", "90s", "2m", "1.5m", "1h")] == [
        90,
        90,
        120,
        90,
        3600,
    ]
    for bad in ("", "0", "-1m", "2d", "m", "two minutes"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


def test_the_report_shows_counts_faults_violations_and_growth() -> None:
    report = SoakReport(
        duration_s=120,
        counts={"requests_ok": 10, "erasures_verified": 2},
        faults={"node_sigkill": 1},
        violations=["erasure e verified but the ledger holds 1 live disk copies on n"],
        resources_start={"coordinator": {"rss_bytes": 100}, "tables (bytes)": {"inbox": 8192}},
        resources_end={"coordinator": {"rss_bytes": 150}, "tables (bytes)": {"inbox": 16384}},
        rss_samples=[
            RssSample(0.0, "node-0", 11, 400 * MIB),
            RssSample(30.0, "node-0", 11, 401 * MIB),
            RssSample(60.0, "node-0", 12, 380 * MIB),  # restarted: a new life
            RssSample(360.0, "node-0", 12, 392 * MIB),
        ],
    )
    text = render_markdown(report, "kvledger bench soak --duration 2m")
    assert "| requests_ok | 10 |" in text and "| faults: node_sigkill | 1 |" in text
    assert "| **violations** | **1** |" in text and "- erasure e verified" in text
    assert "| coordinator | rss_bytes | 100 | 150 | +50 |" in text
    assert "| tables (bytes) | inbox | 8192 | 16384 | +8192 |" in text
    assert "| node-0 | 11 | 0 – 30 | 2 | 400.0 → 401.0 |  |" in text  # under a minute: no rate
    assert "| node-0 | 12 | 60 – 360 | 2 | 380.0 → 392.0 | +24.0 |" in text  # 12 MiB in 5 minutes
    assert report.to_json()["num_violations"] == 1
    assert report.to_json()["rss_samples"][0] == {
        "at_s": 0.0,
        "name": "node-0",
        "pid": 11,
        "rss_bytes": 400 * MIB,
    }


def test_a_bad_duration_is_refused_before_anything_starts() -> None:
    result = subprocess.run(
        [KVLEDGER, "bench", "soak", "--duration", "soon"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "duration 'soon'" in result.stderr
