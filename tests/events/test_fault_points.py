"""``events.fault_points``: inert unless named in the environment; then SIGKILL at exactly the chosen hit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from events.fault_points import ENV_VAR, parse

_SCRIPT = """
import sys
from events.fault_points import fault_point
for hit in range(1, 4):
    print(hit, flush=True)
    fault_point("node.between_delete_and_ack")
    fault_point("coordinator.mid_ack_batch")
print("survived", flush=True)
"""


def _run(setting: str | None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != ENV_VAR}
    if setting is not None:
        env[ENV_VAR] = setting
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )


def test_parse_names_the_point_and_the_hit() -> None:
    assert parse(None) is None and parse("") is None
    assert parse("coordinator.after_publish") == ("coordinator.after_publish", 1)
    assert parse("node.during_snapshot_write:3") == ("node.during_snapshot_write", 3)
    assert parse("node.kv_events_send_timed_out") == ("node.kv_events_send_timed_out", 1)
    for bad in (
        "coordinator.nowhere",
        "node.during_snapshot_write:0",
        "node.during_snapshot_write:x",
        "node.during_snapshot_write:-1",
    ):
        with pytest.raises(ValueError, match=ENV_VAR):
            parse(bad)


def test_unset_or_another_point_does_nothing() -> None:
    for setting in (None, "coordinator.after_publish"):
        result = _run(setting)
        assert (result.returncode, result.stdout.split()) == (0, ["1", "2", "3", "survived"])


def test_the_process_is_sigkilled_at_the_chosen_hit() -> None:
    first = _run("node.between_delete_and_ack")
    assert (first.returncode, first.stdout.split()) == (-signal.SIGKILL, ["1"])
    second = _run("coordinator.mid_ack_batch:2")
    assert (second.returncode, second.stdout.split()) == (-signal.SIGKILL, ["1", "2"])


def test_a_simulated_fault_is_triggered_once_at_the_chosen_hit() -> None:
    script = "from events.fault_points import fault_triggered\nprint([fault_triggered('node.kv_events_send_timed_out') for _ in range(4)])"
    env = {name: value for name, value in os.environ.items() if name != ENV_VAR}
    unset = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    armed = subprocess.run(
        [sys.executable, "-c", script],
        env=env | {ENV_VAR: "node.kv_events_send_timed_out:2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unset.stdout.strip() == "[False, False, False, False]"
    assert armed.stdout.strip() == "[False, True, False, False]"
