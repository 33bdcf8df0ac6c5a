"""How a ``kvledger`` command becomes a child process: the one place every node, coordinator, router
and ``kvledger up`` child is started from (``kvledger up``, ``kvledger demo``, the benchmarks'
clusters, the tests).

:func:`spawn_cli` runs ``python -m kvledger.cli ARGS`` with stdin closed and stdout and stderr
appended to a log, asking Linux to end the child when its parent goes away. It returns a
:class:`Process` — what callers use of ``subprocess.Popen`` — made by a :class:`Launcher`:
:func:`popen_cli` (a new interpreter) unless the caller passes another. The test suite passes its
fork server (``tests/helpers/fork_server.py``), which has the ML stack imported once and forks each
node from it; what runs in the child is the same command.

A caller that passes no launcher (``kvledger up``, ``kvledger demo``) gets :func:`popen_cli`, unless
its own environment has :data:`TEST_LAUNCHER_ENV`: the tests set it on the stacks they start, so the
stack's coordinator, nodes and router are forked from the tests' fork server too. Nothing else sets
it; a user's ``kvledger up`` starts new interpreters."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Protocol

_PR_SET_PDEATHSIG = 1
TEST_LAUNCHER_ENV = "KVLEDGER_TEST_LAUNCHER"
"""Tests only: a Python file whose ``launcher()`` returns the :class:`Launcher` that
:func:`spawn_cli` uses when its caller passes none (the tests' ``helpers/fork_server.py``)."""


def die_with_parent() -> None:
    """``preexec_fn``: ask Linux to SIGTERM the child when the parent goes away.

    The signal follows the *thread* that forked, so services are spawned from the
    event-loop thread, which lives as long as anything could stop them.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Process(Protocol):
    """The part of ``subprocess.Popen``'s interface the callers of :func:`spawn_cli` use."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts ``python -m kvledger.cli CLI_ARGS`` with ``env``, stdin closed, stdout to ``stdout``,
    stderr to ``stderr`` (None: with stdout); ``new_session``: in a session of its own;
    ``dies_with_parent``: SIGTERM when the parent goes away."""

    def __call__(
        self,
        cli_args: list[str],
        env: Mapping[str, str],
        stdout: IO[bytes],
        stderr: IO[bytes] | None,
        *,
        new_session: bool,
        dies_with_parent: bool,
    ) -> Process: ...


def popen_cli(
    cli_args: list[str],
    env: Mapping[str, str],
    stdout: IO[bytes],
    stderr: IO[bytes] | None,
    *,
    new_session: bool,
    dies_with_parent: bool,
) -> subprocess.Popen:
    """The default :class:`Launcher`: a new interpreter."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", *cli_args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT if stderr is None else stderr,
        start_new_session=new_session,
        preexec_fn=die_with_parent if dies_with_parent else None,
    )


@functools.cache
def _test_launcher(path: str) -> Launcher:
    spec = importlib.util.spec_from_file_location("kvledger_test_launcher", path)
    assert spec is not None and spec.loader is not None, f"{TEST_LAUNCHER_ENV}={path}: not a file"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.launcher()


def default_launcher() -> Launcher:
    """:func:`popen_cli`, or in a process the tests started with :data:`TEST_LAUNCHER_ENV` the
    launcher that file provides."""
    path = os.environ.get(TEST_LAUNCHER_ENV)
    return popen_cli if not path else _test_launcher(path)


def spawn_cli(
    cli_args: list[str],
    env: Mapping[str, str],
    log_path: Path | None,
    *,
    errors_path: Path | None = None,
    new_session: bool = False,
    dies_with_parent: bool = True,
    launcher: Launcher | None = None,
) -> Process:
    """Start ``kvledger CLI_ARGS`` as a child process, its output appended to ``log_path`` (None:
    discarded) and its stderr to ``errors_path`` when given. ``new_session``: its own session (a
    terminal's Ctrl-C does not reach it; ``os.killpg`` ends it and its children);
    ``dies_with_parent=False`` for a child meant to be stopped by its caller alone; ``launcher``:
    how (None: :func:`default_launcher`)."""
    launcher = launcher or default_launcher()
    with open(log_path or os.devnull, "ab") as log, open(errors_path or os.devnull, "ab") as errors:
        return launcher(
            cli_args,
            env,
            log,
            errors if errors_path is not None else None,
            new_session=new_session,
            dies_with_parent=dies_with_parent,
        )
