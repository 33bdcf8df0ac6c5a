"""`kvledger up` as a user runs it: real processes, real HTTP, the official openai client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.stack import Up, cli_token, port_is_free
from openai import OpenAI

from identity.tokens import issue_token

pytestmark = pytest.mark.e2e


def _environment_of(argv_items: list[str]) -> dict[str, str]:
    """The environment of the one running process whose command line holds all of ``argv_items``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if all(item.encode() in argv for item in argv_items):
                found.append(
                    dict(
                        line.split("=", 1)
                        for line in (proc / "environ").read_text().split("\0")
                        if "=" in line
                    )
                )
        except OSError:
            continue  # exited meanwhile
    assert len(found) == 1, f"expected one process running {argv_items}, found {len(found)}"
    return found[0]


def test_kvledger_up_serves_the_openai_client_and_stops_cleanly(
    tiny_model_dir, tmp_path, fork_server
):
    # its children as new interpreters: the test reads their command lines and environments in /proc
    up = Up.start(tmp_path, tiny_model_dir, fork_server=fork_server, fork_children=False)
    state_dir, port = up.state_dir, up.port
    try:
        stack = up.wait_ready()
        assert set(stack) >= {
            "coordinator_url",
            "node_urls",
            "kafka_bootstrap",
            "database_url",
            "jwt_secret",
            "operator_private_key_file",
            "metrics_token",
        }
        assert stack["node_urls"] == [f"http://127.0.0.1:{port}"]
        assert stack["router_url"] == f"http://127.0.0.1:{port + 100}"
        assert os.stat(stack["operator_private_key_file"]).st_mode & 0o777 == 0o600

        token = cli_token(
            state_dir, "--tenant", "acme", "--sub", "alice", "--scopes", "hr", "--pv", "1"
        )
        client = OpenAI(base_url=stack["router_url"] + "/v1", api_key=token, max_retries=0)
        messages = [
            {
                "role": "system",
                "content": "You are the ACME assistant. " * 20,
                "cache_scope": "public",
            },
            {
                "role": "user",
                "content": "Vacation policy: " + "twenty days per year. " * 20,
                "document": {"id": "handbook", "version": 1, "auth_scope": "hr"},
            },
            {"role": "user", "content": "How many days?"},
        ]
        first = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, max_tokens=4
        )
        second = client.chat.completions.create(model=first.model, messages=messages, max_tokens=4)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert (
            second.usage.prompt_tokens_details.cached_tokens
            == (first.usage.prompt_tokens - 1) // 16 * 16
        )
        assert second.choices[0].message.content == first.choices[0].message.content

        admin = cli_token(
            state_dir, "--tenant", "platform", "--sub", "operator", "--role", "platform-admin"
        )
        headers = {"Authorization": f"Bearer {admin}"}
        # The end users' secret mints no operator: the coordinator refuses it whatever it claims.
        forged = issue_token(
            tenant="acme",
            sub="mallory",
            roles=["platform-admin"],
            ttl_s=600,
            secret=stack["jwt_secret"],
        )
        refused = httpx.get(
            f"{stack['coordinator_url']}/v1/nodes", headers={"Authorization": f"Bearer {forged}"}
        )
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_token")
        node_role = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvledger.cli",
                "token",
                "--stack",
                str(state_dir),
                "--tenant",
                "acme",
                "--sub",
                "n",
                "--role",
                "node",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (
            node_role.returncode == 2
            and node_role.stdout == ""
            and len(node_role.stderr.splitlines()) == 1
        )
        assert "no command mints node credentials" in node_role.stderr

        def ledger_has_the_blocks():
            response = httpx.get(
                f"{stack['coordinator_url']}/v1/ledger/blocks",
                params={"tenant": "acme", "doc_id": "handbook"},
                headers=headers,
            )
            return response.status_code == 200 and response.json()["blocks"]

        up.wait_for(ledger_has_the_blocks, "the node's blocks in the ledger", 60)
        nodes = httpx.get(f"{stack['coordinator_url']}/v1/nodes", headers=headers).json()
        assert [node["node_id"] for node in nodes["nodes"]] == ["node-0"]
        auditor = cli_token(
            state_dir, "--tenant", "acme", "--sub", "auditor-1", "--role", "auditor"
        )
        own = httpx.get(
            f"{stack['coordinator_url']}/v1/ledger/blocks",
            params={"doc_id": "handbook"},
            headers={"Authorization": f"Bearer {auditor}"},
        )
        assert (
            own.status_code == 200
            and own.json()["blocks"]
            and {b["tenant_id"] for b in own.json()["blocks"]} == {"acme"}
        )
        other = httpx.get(
            f"{stack['coordinator_url']}/v1/ledger/blocks",
            params={"tenant": "globex"},
            headers={"Authorization": f"Bearer {auditor}"},
        )
        assert (other.status_code, other.json()["error"]["code"]) == (403, "tenant_forbidden")
        # The node verifies operators with the stack's operator key too.
        snapshot = httpx.post(
            f"{stack['node_urls'][0]}/v1/cache/snapshots", headers=headers, timeout=60
        )
        assert snapshot.status_code == 201, snapshot.text

        # Every process got the stack's metrics token: scrapes need it, and nothing else opens
        # /metrics.
        scraper = {"Authorization": f"Bearer {stack['metrics_token']}"}
        for url in (stack["coordinator_url"], stack["node_urls"][0], stack["router_url"]):
            assert httpx.get(f"{url}/metrics").status_code == 401
            assert httpx.get(f"{url}/metrics", headers=headers).status_code == 401
            assert httpx.get(f"{url}/metrics", headers=scraper).status_code == 200

        # The node proves who it is with its own key (its kv-events reached the ledger above, so it
        # is enrolled), pins the command key, and holds none of the coordinator's secrets.
        for key_file in (state_dir / "node-0" / "node_key.pem", state_dir / "command_key.pem"):
            assert key_file.stat().st_mode & 0o777 == 0o600
        assert (state_dir / "command_key.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
        node_env = _environment_of(
            ["kvledger.cli", "node", "--node-id", "node-0", "--data-dir", str(state_dir / "node-0")]
        )
        assert node_env["KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE"] == str(
            state_dir / "command_key.pub"
        )
        # Its peer list (where a pull hint may send it) is the stack's own nodes, nothing a request
        # names.
        assert json.loads(node_env["KVLEDGER_NODE_PEERS__URLS"]) == {
            "node-0": stack["node_urls"][0]
        }
        router_env = _environment_of(["kvledger.cli", "router", "--port", str(port + 100)])
        for secret in (
            "KVLEDGER_MASTER_KEY",
            "KVLEDGER_DATABASE_URL",
            "KVLEDGER_COMMAND_SIGNING_KEY",
        ):
            assert secret not in node_env
            assert secret not in router_env
        assert (state_dir / "router_token").stat().st_mode & 0o777 == 0o600
    finally:
        status = up.terminate()
    assert status == 0, up.log.read_text()[-4000:]
    assert port_is_free(port) and port_is_free(port - 100) and port_is_free(port + 100)


def test_kvledger_up_reports_progress_and_exits_non_zero_when_a_child_dies(tmp_path, fork_server):
    errors = tmp_path / "up.err"
    up = Up.start(tmp_path, errors=errors, fork_server=fork_server)
    state_dir, port, process = up.state_dir, up.port, up.process
    try:
        stack = up.wait_ready()
        steps = [
            line.split("] ", 1)[1]
            for line in up.log.read_text().splitlines()
            if line.startswith("[")
        ]
        assert steps == [
            f"building the tiny model in {tmp_path / 'model'}",
            "model built",
            "postgres ready",
            "broker ready",
            "migrations applied",
            "node keys enrolled (node-0)",
            f"producer key enrolled for all tenants ({state_dir / 'producer_key.pem'})",
            f"coordinator ready at {stack['coordinator_url']}",
            f"node-0 ready at http://127.0.0.1:{port}",
            f"router ready at http://127.0.0.1:{port + 100}",
        ]
        assert set(stack["pids"]) == {"coordinator", "node-0", "router"}

        node_pid = stack["pids"]["node-0"]
        os.kill(node_pid, signal.SIGKILL)
        status = process.wait(timeout=90)
    except BaseException:
        up.kill()
        raise
    assert status == 1, up.log.read_text()[-4000:]
    lines = errors.read_text().splitlines()
    assert (
        lines[-1]
        == f"kvledger up: error: node-0 (pid {node_pid}) exited with status -9; stopped the stack (log: {state_dir / 'logs' / 'node-0.log'})"
    )
    assert "Traceback" not in errors.read_text()
    assert port_is_free(port) and port_is_free(port - 100)
