"""``kvledger erasure request|status|receipt`` as a privacy officer runs them, against the real coordinator.

The coordinator (consumers and HTTP API) and two nodes come from ``test_erasure_e2e``'s
``stack`` fixture; the CLI runs as a subprocess with a stack file that names the
coordinator and the operator key, exactly as ``kvledger up`` writes it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

from ledger_helpers import OPERATOR_PRIVATE_KEY_PEM
from test_erasure_e2e import stack, wait_status  # noqa: F401 - the module-scoped stack fixture

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def _stack_dir(tmp_path: Path, coordinator_url: str) -> str:
    (tmp_path / "operator_key.pem").write_bytes(OPERATOR_PRIVATE_KEY_PEM)
    stack_file = {"coordinator_url": coordinator_url, "operator_private_key_file": str(tmp_path / "operator_key.pem")}
    (tmp_path / "stack.json").write_text(json.dumps(stack_file))
    return str(tmp_path)


async def test_request_follow_and_verify_an_erasure_from_the_cli(stack, tmp_path):  # noqa: F811 - the fixture
    state = _stack_dir(tmp_path, stack["url"])
    tenant, subject = f"acme-{uuid.uuid4().hex[:6]}", f"alice-{uuid.uuid4().hex[:8]}"

    requested = _cli("erasure", "request", "--stack", state, "--tenant", tenant, "--subject", subject, "--reason", "gdpr-art17", "--request-id", "t-1")
    assert requested.returncode == 0, requested.stderr
    erasure_id = requested.stdout.split()[1]
    assert uuid.UUID(erasure_id)
    assert requested.stdout.splitlines()[1] == f"follow it: kvledger erasure status {erasure_id} --tenant {tenant}"
    assert subject not in requested.stdout + requested.stderr
    retried = _cli("erasure", "request", "--stack", state, "--tenant", tenant, "--subject", subject, "--reason", "gdpr-art17", "--request-id", "t-1", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["id"] == erasure_id, "the same request id starts nothing new"

    await wait_status(stack["url"], erasure_id, "verified")
    status = _cli("erasure", "status", erasure_id, "--stack", state, "--tenant", tenant)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"erasure {erasure_id} ({tenant}, reason gdpr-art17): verified"
    node_lines = lines[2:]
    assert sorted(line.split()[0] for line in node_lines) == sorted(node.node_id for node in stack["nodes"])
    assert all(line.split()[1] == "acked" for line in node_lines)
    as_json = _cli("erasure", "status", erasure_id, "--stack", state, "--tenant", tenant, "--json")
    assert json.loads(as_json.stdout)["status"] == "verified" and json.loads(as_json.stdout)["live_copies"] == 0

    receipt = _cli("erasure", "receipt", erasure_id, "--stack", state, "--tenant", tenant, "--output", str(tmp_path / "evidence"))
    assert receipt.returncode == 0, receipt.stderr
    command = receipt.stdout.splitlines()[-1].removeprefix("check offline: ")
    argv = shlex.split(command)
    assert argv[0] == "kvledger"
    verified = subprocess.run([sys.executable, "-m", "kvledger.cli", *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.strip().endswith("receipt verified")
    assert json.loads((tmp_path / "evidence" / "receipt.json").read_text())["receipt"]["erasure_id"] == erasure_id


async def test_refusals_are_one_line_errors(stack, tmp_path):  # noqa: F811 - the fixture
    state = _stack_dir(tmp_path, stack["url"])
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    # An auditor of another tenant sees neither the erasure nor whether it exists.
    unknown = _cli("erasure", "status", str(uuid.uuid4()), "--stack", state, "--tenant", tenant)
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert len(unknown.stderr.splitlines()) == 1
    assert unknown.stderr.startswith("kvledger: error: HTTP 403 from GET /v1/erasures/")
    # The coordinator's own input checks come back as its message.
    bad = _cli("erasure", "request", "--stack", state, "--tenant", tenant, "--subject", "x" * 10_000, "--reason", "r")
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1 and "HTTP 4" in bad.stderr
    assert "x" * 100 not in bad.stderr, "the subject is never echoed"
