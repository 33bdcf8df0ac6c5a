"""``kvledger.processes.spawn_cli`` through the tests' fork server (``helpers.fork_server``): a forked node is
driven exactly as a ``subprocess.Popen`` (the fault suite's kills, pauses and restarts rely on it), reads its
environment after the fork, a start the server's imports would not match runs in a new interpreter, and a
process the tests hook (a ``kvledger up``) forks its own children, which end with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.fork_server import ForkServer
from helpers.http_servers import ServerProcess, free_loopback_port
from helpers.ledger import eventually

from events.fault_points import ENV_VAR as FAULT_POINT_ENV
from kvledger.processes import spawn_cli

SECRET = "fork-server-test-secret-0123456789abcdef"


def _state(pid: int) -> str:
    """The process state letter of ``/proc/PID/stat`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _node_env() -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KVLEDGER_KAFKA_BOOTSTRAP", "KVLEDGER_NODE_KAFKA_BOOTSTRAP")
    }
    return env | {"KVLEDGER_NODE_AUTH__JWT_SECRET": SECRET}


async def test_a_forked_node_is_driven_as_a_popen(
    fork_server: ForkServer, tiny_model_dir: Path, tmp_path: Path
):
    args = [
        "node",
        "--model",
        str(tiny_model_dir),
        "--node-id",
        "forked-node",
        "--data-dir",
        str(tmp_path / "data"),
    ]
    forked_before = fork_server.num_forked
    node = await ServerProcess(args, _node_env(), tmp_path / "node.log", fork_server.launch).start()
    process = node.process
    try:
        assert fork_server.num_forked == forked_before + 1, (
            f"not forked: {fork_server.fresh_because}"
        )
        assert _parent(process.pid) == fork_server.process.pid
        assert process.poll() is None and process.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)

        process.send_signal(signal.SIGSTOP)
        await eventually(lambda: _state(process.pid) == "T", timeout_s=10, what="the node stopped")
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.TimeoutException):
                await client.get(f"{node.url}/healthz", timeout=0.5)
            process.send_signal(signal.SIGCONT)
            assert (await client.get(f"{node.url}/healthz", timeout=10)).status_code == 200

        waiting = asyncio.create_task(
            asyncio.to_thread(process.wait)
        )  # as bench.cluster.Child waits: in a thread
        await asyncio.sleep(0.1)
        assert process.poll() is None, "poll must not block while another thread waits"
        process.kill()
        assert await asyncio.wait_for(waiting, 30) == -signal.SIGKILL
        assert process.poll() == -signal.SIGKILL and process.returncode == -signal.SIGKILL
        assert process.wait(timeout=1) == -signal.SIGKILL
        process.terminate()  # after the exit: nothing to signal, as with Popen
        assert (
            not Path(f"/proc/{process.pid}").exists()
            or _parent(process.pid) != fork_server.process.pid
        ), "the child was not reaped"
    finally:
        node.stop()


def test_the_environment_read_at_import_is_the_childs(fork_server: ForkServer, tmp_path: Path):
    """``KVLEDGER_FAULT_POINT`` is parsed when ``events.fault_points`` is imported: a value given to
    the child alone must reach that import, so a bad one fails the forked node at its start, as it
    fails a new interpreter."""
    log = tmp_path / "node.log"
    env = _node_env() | {FAULT_POINT_ENV: "no.such.fault.point"}
    forked_before = fork_server.num_forked
    process = spawn_cli(
        ["node", "--model", str(tmp_path / "no-model")], env, log, launcher=fork_server.launch
    )
    assert (
        process.wait(timeout=120) == 2
    )  # as a new interpreter: the setting's ValueError is a usage error
    assert fork_server.num_forked == forked_before + 1, f"not forked: {fork_server.fresh_because}"
    assert "no.such.fault.point" in log.read_text() and "unknown fault point" in log.read_text()


def test_a_different_library_environment_gets_a_new_interpreter(
    fork_server: ForkServer, tmp_path: Path
):
    """The libraries the server imported read their variables then: a start that sets one differently is not forked."""
    log = tmp_path / "version.log"
    env = dict(os.environ) | {
        "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"
    }
    fresh_before, forked_before = fork_server.num_fresh, fork_server.num_forked
    process = spawn_cli(["--version"], env, log, launcher=fork_server.launch)
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=120) == 0
    assert (fork_server.num_fresh, fork_server.num_forked) == (fresh_before + 1, forked_before)
    assert fork_server.fresh_because == {"OMP_NUM_THREADS"}
    assert log.read_text().startswith("kvledger ")


_REQUESTER = """
import os, sys, time
from pathlib import Path
from kvledger.processes import spawn_cli
node = spawn_cli(sys.argv[2:], os.environ, Path(sys.argv[1]))
print(node.pid, flush=True)
time.sleep(600)
"""
"""A process that starts a node as ``kvledger up`` does (no launcher passed) and outlives it."""


async def test_a_hooked_process_forks_its_children_and_they_end_with_it(
    fork_server: ForkServer, tiny_model_dir: Path, tmp_path: Path
):
    """``kvledger up`` in the tests (``ForkServer.hook_env``): ``spawn_cli`` without a launcher forks
    from the session's server, and a child started ``dies_with_parent`` is ended when the process that
    asked for it dies, SIGKILL included, as its own child would be by ``PR_SET_PDEATHSIG``."""
    args = ["node", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data")]
    args += ["--port", str(free_loopback_port())]
    env = _node_env() | fork_server.hook_env()
    forked_before = fork_server.starts()[0]
    requester = subprocess.Popen(
        [sys.executable, "-c", _REQUESTER, str(tmp_path / "node.log"), *args],
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        node_pid = int(await asyncio.wait_for(asyncio.to_thread(requester.stdout.readline), 120))
        assert _parent(node_pid) == fork_server.process.pid
        assert fork_server.starts()[0] == forked_before + 1
        assert requester.poll() is None
        requester.kill()
        requester.wait(timeout=30)
        await eventually(
            lambda: not Path(f"/proc/{node_pid}").exists(),
            timeout_s=30,
            what="the node ended and reaped after its requester was killed",
        )
    finally:
        if requester.poll() is None:
            requester.kill()
            requester.wait()
