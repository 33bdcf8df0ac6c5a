"""``kvledger bench soak``'s pieces that need no services: durations, the report, refusing a bad duration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import SoakReport, parse_duration, render_markdown

KVLEDGER = str(Path(sys.executable).with_name("kvledger"))


def test_durations_take_seconds_minutes_and_hours() -> None:
    assert [parse_duration(text) for text in ("90", "90s", "2m", "1.5m", "1h")] == [90, 90, 120, 90, 3600]
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
    )
    text = render_markdown(report, "kvledger bench soak --duration 2m")
    assert "| requests_ok | 10 |" in text and "| faults: node_sigkill | 1 |" in text
    assert "| **violations** | **1** |" in text and "- erasure e verified" in text
    assert "| coordinator | rss_bytes | 100 | 150 | +50 |" in text
    assert "| tables (bytes) | inbox | 8192 | 16384 | +8192 |" in text
    assert report.to_json()["num_violations"] == 1


def test_a_bad_duration_is_refused_before_anything_starts() -> None:
    result = subprocess.run([KVLEDGER, "bench", "soak", "--duration", "soon"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "duration 'soon'" in result.stderr
