"""`kvledger demo` as a user runs it: it starts the embedded stack, tells the story, checks the
receipt, stops the stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fork_server import ForkServer
from helpers.ledger import GROUP_TIMING_ENV
from helpers.stack import free_port_pair, port_is_free, user_env

from coordinator.audit.verifier import verify_served_receipt

pytestmark = pytest.mark.e2e

DEMO_TIMEOUT_S = 420


def _kvledger(
    *args: str, timeout_s: float, fork_server: ForkServer | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvledger ARGS`` from a user's shell; the stack it starts joins its consumer groups with the
    tests' timing, and with ``fork_server`` is forked from it (``kvledger up`` and its children)."""
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=user_env() | GROUP_TIMING_ENV | ({} if fork_server is None else fork_server.hook_env()),
    )


def test_demo_tells_the_whole_story_and_stops_its_stack(
    tmp_path: Path, tiny_model_dir: Path, fork_server: ForkServer
) -> None:
    port = free_port_pair()
    state_dir, output = tmp_path / "state", tmp_path / "receipt"
    demo = _kvledger(
        "demo",
        "--state-dir",
        str(state_dir),
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--output",
        str(output),
        timeout_s=DEMO_TIMEOUT_S,
        fork_server=fork_server,
    )
    print(demo.stdout)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.splitlines()
    assert [line for line in lines if re.match(r"^\[\d/5\]", line)] == [
        "[1/5] the stack",
        "[2/5] a cached hit",
        "[3/5] a document update: the old version refused, the cache rebuilt",
        "[4/5] a permission revocation: the old token refused",
        "[5/5] an erasure: a signed receipt, verified offline",
    ]
    assert sum(1 for line in lines if re.fullmatch(r"      ok \(\d+\.\d s\)", line)) == 5
    text = demo.stdout
    assert re.search(r"first request: 200, (\d+) prompt tokens, 0 cached", text)
    hit = re.search(r"same prompt again: 200, \d+ prompt tokens, ([1-9]\d*) cached", text)
    assert hit, text
    assert re.search(r"request with handbook v1: 409 stale_document_version after", text)
    assert re.search(
        r"request with a token of policy version 1: 401 stale_authorization after", text
    )
    assert "receipt checked offline: 10 checks passed" in text
    assert re.search(r"node-0: acked, removed .*device [1-9]", text)
    assert lines[-1].startswith("demo passed: 5/5 steps in ")
    # The receipt it wrote verifies here too, and the stack it started is gone.
    documents = {
        name: json.loads((output / f"{name}.json").read_text())
        for name in ("receipt", "keys", "checkpoint")
    }
    assert verify_served_receipt(
        documents["receipt"], documents["keys"], documents["checkpoint"]
    ).ok
    assert port_is_free(port) and port_is_free(port - 100)


def test_demo_without_a_stack_file_is_one_line(tmp_path: Path) -> None:
    missing = _kvledger("demo", "--stack", str(tmp_path / "nowhere"), timeout_s=60)
    assert (missing.returncode, missing.stdout) == (2, "[1/5] the stack\n")
    assert missing.stderr == f"kvledger: error: no stack file at {tmp_path / 'nowhere'}\n"
