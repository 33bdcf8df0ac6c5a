"""``kvledger dead-letters list --since``: an age or a zoned ISO time, anything else a usage error."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kvledger.cli import main
from kvledger.dead_letters import since_time

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("90s", "2026-12-01T11:58:30+00:00"),
        ("30m", "2026-12-01T11:30:00+00:00"),
        ("6h", "2026-12-01T06:00:00+00:00"),
        ("2d", "2026-11-29T12:00:00+00:00"),
        ("2026-12-01T10:00:00Z", "2026-12-01T10:00:00+00:00"),
        ("2026-12-01T10:00:00+02:00", "2026-12-01T10:00:00+02:00"),
    ],
)
def test_since_accepts_ages_and_zoned_times(value: str, expected: str) -> None:
    assert since_time(value, now=NOW) == expected


@pytest.mark.parametrize("value", ["yesterday", "0h", "-1d", "2026-12-01T10:00:00", "6 h"])
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="--since"):
        since_time(value, now=NOW)


def test_a_bad_since_is_a_usage_error_before_any_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            [
                "dead-letters",
                "list",
                "--since",
                "yesterday",
                "--coordinator-url",
                "http://127.0.0.1:9",
                "--token",
                "t",
            ]
        )
        == 2
    )
    assert "--since 'yesterday'" in capsys.readouterr().err
