"""``kvledger erasure request|status|receipt`` and ``kvledger status`` as operators run them, against the real coordinator.

The coordinator (consumers and HTTP API) and two nodes come from ``test_erasure_e2e``'s
``stack`` fixture; the CLI runs as a subprocess with a stack file that names the
coordinator and the operator key, exactly as ``kvledger up`` writes it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import uvicorn
from helpers.ledger import (
    OPERATOR_PRIVATE_KEY_PEM,
    coordinator_settings,
    eventually,
    operator_headers,
    operator_token,
)
from test_erasure_e2e import stack, wait_status  # noqa: F401 - the module-scoped stack fixture

from coordinator.api.app import create_app
from kvledger.net import loopback_listener

REPO = Path(__file__).resolve().parents[2]


async def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a subprocess, off the event loop (the nodes under test run on it)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _stack_dir(tmp_path: Path, coordinator_url: str, **extra: str) -> str:
    (tmp_path / "operator_key.pem").write_bytes(OPERATOR_PRIVATE_KEY_PEM)
    stack_file = {
        "coordinator_url": coordinator_url,
        "operator_private_key_file": str(tmp_path / "operator_key.pem"),
        **extra,
    }
    (tmp_path / "stack.json").write_text(json.dumps(stack_file))
    return str(tmp_path)


async def test_request_follow_and_verify_an_erasure_from_the_cli(stack, tmp_path):  # noqa: F811 - the fixture
    state = _stack_dir(tmp_path, stack["url"])
    tenant, subject = f"acme-{uuid.uuid4().hex[:6]}", f"alice-{uuid.uuid4().hex[:8]}"

    requested = await _cli(
        "erasure",
        "request",
        "--stack",
        state,
        "--tenant",
        tenant,
        "--subject",
        subject,
        "--reason",
        "gdpr-art17",
        "--request-id",
        "t-1",
    )
    assert requested.returncode == 0, requested.stderr
    erasure_id = requested.stdout.split()[1]
    assert uuid.UUID(erasure_id)
    assert (
        requested.stdout.splitlines()[1]
        == f"follow it: kvledger erasure status {erasure_id} --tenant {tenant}"
    )
    assert subject not in requested.stdout + requested.stderr
    retried = await _cli(
        "erasure",
        "request",
        "--stack",
        state,
        "--tenant",
        tenant,
        "--subject",
        subject,
        "--reason",
        "gdpr-art17",
        "--request-id",
        "t-1",
        "--json",
    )
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["id"] == erasure_id, "the same request id starts nothing new"

    await wait_status(stack["url"], erasure_id, "verified")
    status = await _cli("erasure", "status", erasure_id, "--stack", state, "--tenant", tenant)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"erasure {erasure_id} ({tenant}, reason gdpr-art17): verified"
    node_lines = lines[2:]
    assert sorted(line.split()[0] for line in node_lines) == sorted(
        node.node_id for node in stack["nodes"]
    )
    assert all(line.split()[1] == "acked" for line in node_lines)
    as_json = await _cli(
        "erasure", "status", erasure_id, "--stack", state, "--tenant", tenant, "--json"
    )
    assert (
        json.loads(as_json.stdout)["status"] == "verified"
        and json.loads(as_json.stdout)["live_copies"] == 0
    )

    receipt = await _cli(
        "erasure",
        "receipt",
        erasure_id,
        "--stack",
        state,
        "--tenant",
        tenant,
        "--output",
        str(tmp_path / "evidence"),
    )
    assert receipt.returncode == 0, receipt.stderr
    command = receipt.stdout.splitlines()[-1].removeprefix("check offline: ")
    argv = shlex.split(command)
    assert argv[0] == "kvledger"
    verified = await _cli(*argv[1:])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.strip().endswith("receipt verified")
    assert (
        json.loads((tmp_path / "evidence" / "receipt.json").read_text())["receipt"]["erasure_id"]
        == erasure_id
    )


async def test_refusals_are_one_line_errors(stack, tmp_path):  # noqa: F811 - the fixture
    state = _stack_dir(tmp_path, stack["url"])
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    # An auditor of another tenant sees neither the erasure nor whether it exists.
    unknown = await _cli(
        "erasure", "status", str(uuid.uuid4()), "--stack", state, "--tenant", tenant
    )
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert len(unknown.stderr.splitlines()) == 1
    assert unknown.stderr.startswith("kvledger: error: HTTP 403 from GET /v1/erasures/")
    # The coordinator's own input checks come back as its message.
    bad = await _cli(
        "erasure",
        "request",
        "--stack",
        state,
        "--tenant",
        tenant,
        "--subject",
        "x" * 10_000,
        "--reason",
        "r",
    )
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1 and "HTTP 4" in bad.stderr
    assert "x" * 100 not in bad.stderr, "the subject is never echoed"


async def test_status_shows_live_nodes_and_says_why_figures_are_missing(stack, tmp_path):  # noqa: F811 - the fixture
    """The stack's coordinator serves no metrics (no token configured): the node table still comes, the figures say why not."""
    state = _stack_dir(tmp_path, stack["url"])
    status = await _cli("status", "--stack", state)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"coordinator  {stack['url']}"
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    for node in stack["nodes"]:
        assert rows[node.node_id][1:3] == ["yes", "active"], status.stdout
    assert (
        lines[-1]
        == "backlog      unknown: no metrics token (pass --metrics-token or run `kvledger up` here)"
    )
    with_token = await _cli("status", "--stack", state, "--metrics-token", "wrong")
    assert with_token.stdout.splitlines()[-1] == "backlog      unknown: /metrics answered HTTP 404"


async def test_status_reads_backlog_from_metrics(stack, tmp_path):  # noqa: F811 - the fixture
    """A second API process on the same ledger, with a metrics token: outbox, dead letters and lag come from its /metrics."""
    settings = coordinator_settings(
        stack["database_url"],
        keys={"master_key": base64.b64encode(os.urandom(32)).decode()},
        metrics={"token": "scrape-me"},
    )
    sock = loopback_listener()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), log_level="warning", access_log=False)
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:

        async def started() -> bool:
            return server.started

        await eventually(started, what="the API server to start")
        state = _stack_dir(tmp_path, url, metrics_token="scrape-me")
        status = await _cli("status", "--stack", state, "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert {node["node_id"] for node in report["nodes"]} >= {
            node.node_id for node in stack["nodes"]
        }
        assert report["metrics_missing"] is None
        figures = report["metrics"]
        assert isinstance(figures["outbox_pending"], int) and figures["outbox_pending"] >= 0
        assert isinstance(figures["dead_letters"], dict) and all(
            isinstance(n, int) for n in figures["dead_letters"].values()
        )
        text = await _cli("status", "--stack", state)
        assert text.stdout.splitlines()[-4].startswith("outbox       ")
        assert text.stdout.splitlines()[-3].startswith("dead letters ")
        assert text.stdout.splitlines()[-1].startswith(
            "consumers    "
        )  # stalled groups: none in this process
    finally:
        server.should_exit = True
        await serving
        sock.close()


async def test_a_producer_key_made_enrolled_and_revoked_from_the_cli_signs_what_kvledger_publish_sends(
    stack,  # noqa: F811 - the fixture
    tmp_path,
    kafka_bootstrap,
):
    state = _stack_dir(tmp_path, stack["url"])
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    key_file, public_file = tmp_path / "hr-system.pem", tmp_path / "hr-system.pub"

    made = await _cli("producers", "key", "--key-file", str(key_file))
    assert made.returncode == 0, made.stderr
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    public_file.write_text(made.stdout)
    key_id = made.stderr.split()[2]

    enrolled = await _cli(
        "producers",
        "enroll",
        "--stack",
        state,
        "--public-key",
        str(public_file),
        "--name",
        "hr-system",
        "--tenant",
        tenant,
    )
    assert (enrolled.returncode, enrolled.stdout.strip()) == (
        0,
        f"enrolled producer key {key_id} (hr-system) for {tenant}",
    ), enrolled.stderr
    # A tenant-admin token (one --tenant) cannot bind a key to all tenants.
    token = operator_token("tenant-admin", tenant)
    refused = await _cli(
        "producers",
        "enroll",
        "--stack",
        state,
        "--public-key",
        str(public_file),
        "--name",
        "x",
        "--all-tenants",
        "--token",
        token,
    )
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr

    published = await _cli(
        "publish", "--kafka-bootstrap", kafka_bootstrap, "--producer-key", str(key_file),
        "document-updated", "--tenant", tenant, "--doc", "handbook", "--version", "2",
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    event_id = published.stdout.strip()

    async def decided() -> bool:
        listed = await asyncio.to_thread(
            httpx.get,
            f"{stack['url']}/v1/invalidations",
            params={"tenant": tenant},
            headers=operator_headers("auditor", tenant),
            timeout=30,
        )
        return any(row["source_event_id"] == event_id for row in listed.json()["invalidations"])

    await eventually(decided, timeout_s=60, what="the decision for the CLI's signed event")

    listed = await _cli("producers", "list", "--stack", state, "--tenant", tenant, "--json")
    (mine,) = [key for key in json.loads(listed.stdout) if key["key_id"] == key_id]
    assert (mine["tenants"], mine["revoked_at"]) == ([tenant], None)
    revoked = await _cli("producers", "revoke", key_id, "--stack", state, "--tenant", tenant)
    assert (revoked.returncode, revoked.stdout.strip()) == (0, f"revoked producer key {key_id}"), (
        revoked.stderr
    )
    listed = await _cli("producers", "list", "--stack", state, "--tenant", tenant, "--json")
    (mine,) = [key for key in json.loads(listed.stdout) if key["key_id"] == key_id]
    assert mine["revoked_at"] is not None
