"""``kvledger up`` as a user runs it, for the e2e tests: a child process in its own session, with none of the
caller's ``KVLEDGER_*`` variables, only the tests' consumer-group timing (``helpers.ledger.GROUP_TIMING_ENV``).

Given the session's fork server, ``kvledger up`` is forked from it, and so are its coordinator, nodes and
router (``ForkServer.hook_env``): the same commands with the same environments, without each paying
its torch and transformers imports. A test that reads the children's ``/proc`` (command line,
environment: a forked child shows the server's) starts them as new interpreters
(``fork_children=False``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from helpers.fork_server import ForkServer
from helpers.ledger import GROUP_TIMING_ENV
from kvledger.processes import Process, popen_cli, spawn_cli

STARTUP_TIMEOUT_S = 240
T = TypeVar("T")


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def free_port_pair() -> int:
    """A node port P with P, the coordinator's P - 100 and the router's P + 100 free."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if 1200 < port < 65_000 and port_is_free(port - 100) and port_is_free(port + 100):
            return port
    raise AssertionError("no free port pair")


def user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the caller's ``KVLEDGER_*`` settings."""
    return {key: value for key, value in os.environ.items() if not key.startswith("KVLEDGER_")}


def cli_token(state_dir: Path, *args: str) -> str:
    """``kvledger token --stack STATE_DIR ARGS`` as a user runs it."""
    minted = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "token", "--stack", str(state_dir), *args],
        capture_output=True, text=True, timeout=60, check=True, env=user_env(),
    )  # fmt: skip
    return minted.stdout.strip()


@dataclass
class Up:
    """A running ``kvledger up``: its process, state dir, node port and log (stdout, and stderr unless separated)."""

    process: Process
    state_dir: Path
    port: int
    log: Path

    @classmethod
    def start(
        cls,
        tmp_path: Path,
        model_dir: Path | None = None,
        errors: Path | None = None,
        *,
        fork_server: ForkServer | None = None,
        fork_children: bool = True,
    ) -> Up:
        """Start one node's stack in ``tmp_path`` (state and log there); ``errors`` separates stderr.

        ``model_dir``: a model already built (the session's ``tiny_model_dir``, found, not built again: about
        4 s of CPU saved); by default ``kvledger up`` builds one in ``tmp_path / "model"``, as on a first start.
        ``fork_server``: ``kvledger up`` forked from it, and its children too unless ``fork_children`` is
        False."""
        state_dir, port, log = tmp_path / "state", free_port_pair(), tmp_path / "up.log"
        model = model_dir or tmp_path / "model"
        args = ["up", "--state-dir", str(state_dir), "--model", str(model), "--port", str(port)]
        args.append(
            "--tiny"
        )  # what it builds when the directory is empty: tests run on the tiny model
        env = user_env() | GROUP_TIMING_ENV
        if fork_server is not None and fork_children:
            env |= fork_server.hook_env()
        process = spawn_cli(
            args,
            env,
            log,
            errors_path=errors,
            new_session=True,
            dies_with_parent=False,
            launcher=popen_cli if fork_server is None else fork_server.launch,
        )
        return cls(process, state_dir, port, log)

    def wait_for(self, condition: Callable[[], T], what: str, timeout_s: float) -> T:
        """Poll ``condition`` until it returns something true; fail with the log's tail if ``kvledger up`` exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value:
                return value
            if self.process.poll() is not None:
                raise AssertionError(
                    f"kvledger up exited ({self.process.returncode}) while waiting for {what}:\n{self.log.read_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(0.1)

    def stack_file(self) -> dict | None:
        path = self.state_dir / "stack.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_ready(self) -> dict:
        """The stack file, once ``kvledger up`` wrote it (it does when every part answered ready)."""
        return self.wait_for(self.stack_file, "stack.json", STARTUP_TIMEOUT_S)

    def terminate(self) -> int:
        """SIGTERM, as Ctrl-C in a user's terminal; the exit status (SIGKILL to the whole session if it hangs)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
