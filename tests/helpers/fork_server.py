"""A fork server for the tests' node and coordinator processes: the ML stack imported once, each
process forked.

A ``kvledger node`` process spends most of its start importing torch and transformers (about 6
CPU-seconds on the CI machine); the suite starts dozens. :class:`ForkServer` runs this file as a
long-lived process that imports the third-party libraries the node and the coordinator use — and
nothing of this project — then forks one child per start, which runs ``python -m kvledger.cli ARGS``
as a new interpreter would, with the caller's environment, stdio and working directory.
:meth:`ForkServer.launch` is a ``kvledger.processes.Launcher``; the handle it returns behaves as
``subprocess.Popen`` (pid, poll/wait and returncode, signals), so ``SIGKILL``, ``SIGSTOP`` and
restarts of the fault suite see a plain child.

Why it is the same process as a fresh start:

* the project's own modules are imported in the child, after its environment is in place, so whatever
  they read at import (``KVLEDGER_FAULT_POINT``) is the child's. The server checks it imported none.
* the libraries imported early read their environment then: a start whose environment differs from the
  server's in anything but ``KVLEDGER_*`` variables (and pytest's ``PYTEST_CURRENT_TEST``) is not forked
  but started as a new interpreter.
* nothing runs in the server that starts a thread (no torch op, no event loop, no CUDA): it asserts before
  every fork that no Python thread runs and that no import but numpy's (OpenBLAS, fork-aware) started one. Python reseeds ``random`` in a forked child; numpy's global generator is
  reseeded here.
* the child exits as the interpreter would, short of tearing down the preloaded libraries (which would
  write to nearly every page it shares with the server: 1.6 CPU-seconds a process): non-daemon threads
  joined, ``atexit`` handlers run, stdio flushed, then ``os._exit`` with the same status.
* the exit status comes from the server, which reaps its children, over the connection that asked for the
  start; signals go through a pidfd the server opened at the fork, so they never reach a recycled pid.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

PRELOADED = (
    "numpy",
    "torch",
    "safetensors",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.cache_utils",
    "sqlalchemy",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.orm",
    "alembic",
    "asyncpg",
    "fastapi",
    "uvicorn",
    "pydantic",
    "pydantic_settings",
    "aiokafka",
    "httpx",
    "cryptography",
    "jinja2",
)
"""What the server imports before it forks: the expensive imports of ``kvledger node`` and ``kvledger coordinator``."""
PROJECT_PACKAGES = (
    "bench",
    "coordinator",
    "events",
    "gpu_node",
    "identity",
    "kvledger",
    "migrations",
    "prefix_keys",
    "router",
)
"""Never imported by the server (their import-time reads of the environment must see the child's)."""
OWN_PREFIX = "KVLEDGER_"
"""Variables only the project reads (at import in the child, or later): a child may differ from the
server in these."""
UNREAD = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
"""Variables no preloaded library reads at import, which the tests' process sets while it runs: pytest the running
test's name, torch its compile cache's default directory the first time it compiles (read when compiling)."""
SOCKET_ENV = "KVLEDGER_TEST_FORK_SERVER"
"""The server's socket, in the environment of a process that starts its children through it
(:meth:`ForkServer.hook_env`)."""
START_TIMEOUT_S = 300.0
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 16
_READY = b"ready\n"
_FORKED_LINE = "forked "
_FRESH_LINE = "new interpreter for "


def _libraries_differences(env: Mapping[str, str], server_env: Mapping[str, str]) -> set[str]:
    """The variables a preloaded library may read whose value in ``env`` is not the server's."""
    names = (env.keys() | server_env.keys()) - UNREAD
    return {
        name
        for name in names
        if not name.startswith(OWN_PREFIX) and env.get(name) != server_env.get(name)
    }


class ForkedProcess:
    """A child of the fork server, driven as ``subprocess.Popen``: its exit status arrives on
    ``connection``."""

    def __init__(self, args: list[str], pid: int, pidfd: int, connection: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._connection = connection
        self._lock = threading.Lock()

    def _receive(self, timeout_s: float | None) -> None:
        """Read the exit status if it arrives within ``timeout_s``; the caller holds the lock."""
        if self.returncode is not None:
            return
        self._connection.settimeout(timeout_s)
        try:
            message = self._connection.recv(256)
        except (TimeoutError, BlockingIOError):
            return
        assert message, (
            f"the fork server closed the connection of pid {self.pid} without its exit status"
        )
        self.returncode = json.loads(message)["returncode"]
        self._connection.close()
        os.close(self._pidfd)

    def poll(self) -> int | None:
        if self._lock.acquire(blocking=False):  # another thread in wait(): it will set returncode
            try:
                self._receive(0.0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            self._receive(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            self._lock.release()
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServerClient:
    """Starts processes through a running fork server's socket: :meth:`launch` is a
    ``kvledger.processes.Launcher``. The tests' process has one (:class:`ForkServer`); a ``kvledger up``
    or ``kvledger demo`` the tests start gets one from :func:`launcher` (:data:`HOOK_ENV`)."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.num_forked = 0
        self.num_fresh = 0
        """Starts handed to a new interpreter (an environment the server's imports did not see)."""
        self.fresh_because: set[str] = set()
        """The variables that made the last such start differ."""

    def launch(
        self,
        cli_args: list[str],
        env: Mapping[str, str],
        stdout: IO[bytes],
        stderr: IO[bytes] | None,
        *,
        new_session: bool,
        dies_with_parent: bool,
    ):
        """A ``kvledger.processes.Launcher``: forked from the server, or a new interpreter where
        forking would differ (the server answers which variables differ instead of forking)."""
        from kvledger.processes import popen_cli

        request = {
            "args": cli_args,
            "env": dict(env),
            "cwd": os.getcwd(),
            "new_session": new_session,
            "dies_with_parent": dies_with_parent,
        }
        fds = [stdout.fileno(), (stderr or stdout).fileno()]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.settimeout(START_TIMEOUT_S)
        try:
            connection.connect(str(self.socket_path))
            socket.send_fds(connection, [json.dumps(request).encode()], fds)
            message, pidfds, _, _ = socket.recv_fds(connection, MAX_REPLY_BYTES, 1)
        except BaseException:
            connection.close()
            raise
        assert message, f"the fork server did not start {cli_args[0]} (see its log)"
        reply = json.loads(message)
        if "fresh" in reply:
            connection.close()
            self.num_fresh += 1
            self.fresh_because = set(reply["fresh"])
            return popen_cli(
                cli_args,
                env,
                stdout,
                stderr,
                new_session=new_session,
                dies_with_parent=dies_with_parent,
            )
        assert len(pidfds) == 1, f"the fork server sent no pidfd for {cli_args[0]}"
        self.num_forked += 1
        return ForkedProcess(
            [sys.executable, "-m", "kvledger.cli", *cli_args], reply["pid"], pidfds[0], connection
        )

    def run(
        self, cli_args: list[str], env: Mapping[str, str], work_dir: Path, timeout_s: float
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(["python", "-m", "kvledger.cli", *cli_args], capture_output=True,
        text=True)`` through :meth:`launch`: its output captured in files under ``work_dir``."""
        work_dir.mkdir(parents=True, exist_ok=True)
        out_path, err_path = work_dir / "cli.out", work_dir / "cli.err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = self.launch(cli_args, env, out, err, new_session=False, dies_with_parent=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(
            process.args, returncode, out_path.read_text(), err_path.read_text()
        )


class ForkServer(ForkServerClient):
    """The server process (started by :meth:`start`, stopped by :meth:`stop`) and the client side of
    its socket."""

    def __init__(self, work_dir: Path) -> None:
        super().__init__(work_dir / "fork-server.sock")
        self.log_path = work_dir / "fork-server.log"
        self.env = dict(os.environ)
        self.process: subprocess.Popen | None = None

    def start(self) -> ForkServer:
        from kvledger.processes import die_with_parent

        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(self.socket_path)],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, preexec_fn=die_with_parent,
            )  # fmt: skip
        ready = self.process.stdout.readline()
        assert ready == _READY, (
            f"the fork server did not start ({ready!r}):\n{self.log_path.read_text()[-4000:]}"
        )
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def hook_env(self) -> dict[str, str]:
        """The variables that make a ``kvledger up`` (or ``kvledger demo``) start its own children
        through this server (``kvledger.processes.TEST_LAUNCHER_ENV``)."""
        from kvledger.processes import TEST_LAUNCHER_ENV

        return {TEST_LAUNCHER_ENV: str(Path(__file__).resolve()), SOCKET_ENV: str(self.socket_path)}

    def starts(self) -> tuple[int, int]:
        """(forked, new interpreters) of every start the server was asked for, its hooked ``kvledger
        up`` stacks' included: the server logs one line per start."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return (
            sum(line.startswith(_FORKED_LINE) for line in lines),
            sum(line.startswith(_FRESH_LINE) for line in lines),
        )


def launcher():
    """The ``kvledger.processes.Launcher`` of a process the tests started with
    :meth:`ForkServer.hook_env`: the session's fork server, named by :data:`SOCKET_ENV`."""
    return ForkServerClient(Path(os.environ[SOCKET_ENV])).launch


# -- the server process
# ---------------------------------------------------------------------------------


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload() -> int:
    """Import :data:`PRELOADED`; the number of OS threads the server may have when it forks.

    numpy's OpenBLAS starts its worker threads at import (as in every node process); OpenBLAS stops
    them before a fork (``pthread_atfork``) and starts them again on demand. Nothing imported after
    numpy may start a thread of its own."""
    import importlib

    importlib.import_module(PRELOADED[0])
    num_threads = _num_threads()
    for name in PRELOADED[1:]:
        importlib.import_module(name)
        assert _num_threads() == num_threads, (
            f"importing {name} started a thread: the fork server cannot fork safely"
        )
    project = sorted(name for name in sys.modules if name.partition(".")[0] in PROJECT_PACKAGES)
    assert not project, (
        f"the fork server imported project modules, which read the environment at import: {project}"
    )
    return num_threads


class _Child:
    """A forked child the server has not reaped: the connection its exit status goes to, and
    whether it ends when that connection's other side goes away."""

    def __init__(self, connection: socket.socket, dies_with_requester: bool) -> None:
        self.connection: socket.socket | None = connection
        self.dies_with_requester = dies_with_requester


def _serve(socket_path: str, num_threads: int, server_env: Mapping[str, str]) -> dict:
    """Fork a child per request until killed; returns only in a child, with its request.

    A child started with ``dies_with_parent`` is sent SIGTERM when the process that asked for it
    closes its end of the connection (exits, or is killed), as a child of that process would be by
    ``PR_SET_PDEATHSIG``: a ``kvledger up`` whose children the server forks takes them down with
    it, even when killed."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: dict[int, _Child] = {}
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                request = _fork(
                    connection,
                    listener,
                    children,
                    (wake_read, wake_write),
                    selector,
                    num_threads,
                    server_env,
                )
                if request is not None:
                    return request
            elif key.fileobj is wake_read:
                while True:
                    try:
                        if not os.read(wake_read, 4096):
                            break
                    except BlockingIOError:
                        break
                _reap(children, selector)
            else:
                _requester_gone(key.data, children, selector)


def _fork(
    connection: socket.socket,
    listener: socket.socket,
    children: dict[int, _Child],
    wake: tuple[int, int],
    selector: selectors.BaseSelector,
    num_threads: int,
    server_env: Mapping[str, str],
) -> dict | None:
    message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST_BYTES, 2)
    if not message or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        connection.close()
        return None
    request = json.loads(message)
    differences = _libraries_differences(request["env"], server_env)
    if differences:
        for fd in fds:
            os.close(fd)
        _log(f"{_FRESH_LINE}{request['args'][:1]}: {sorted(differences)}")
        try:
            connection.send(json.dumps({"fresh": sorted(differences)}).encode())
        finally:
            connection.close()
        return None
    assert threading.active_count() == 1 and _num_threads() <= num_threads, (
        f"a thread was started in the fork server ({threading.active_count()} Python, {_num_threads()} in all): it cannot fork safely"
    )
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        for child in children.values():
            if child.connection is not None:
                child.connection.close()
        listener.close()
        connection.close()
        for fd in wake:
            os.close(fd)
        request["fds"] = fds
        return request
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(connection, [json.dumps({"pid": pid}).encode()], [pidfd])
    finally:
        os.close(pidfd)
    _log(f"{_FORKED_LINE}pid {pid}: {request['args'][:1]}")
    children[pid] = _Child(connection, request["dies_with_parent"])
    selector.register(connection, selectors.EVENT_READ, pid)
    return None


def _log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _requester_gone(
    pid: int, children: dict[int, _Child], selector: selectors.BaseSelector
) -> None:
    """The connection of child ``pid`` is readable: the requester never sends after its request,
    so its side closed. The child, not reaped yet, cannot be a recycled pid."""
    child = children[pid]
    assert child.connection is not None
    selector.unregister(child.connection)
    child.connection.close()
    child.connection = None
    if child.dies_with_requester:
        os.kill(pid, signal.SIGTERM)


def _reap(children: dict[int, _Child], selector: selectors.BaseSelector) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        child = children.pop(pid, None)
        if child is None or child.connection is None:
            continue
        selector.unregister(child.connection)
        try:
            child.connection.send(
                json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode()
            )
        except OSError:  # the caller is gone: nobody to tell
            pass
        child.connection.close()


def _become_child(request: dict) -> None:
    """In the forked child: the caller's session, parent-death signal, stdio, directory and
    environment."""
    if request["new_session"]:
        os.setsid()
    stdout_fd, stderr_fd = request["fds"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {devnull, stdout_fd, stderr_fd} - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.path[0] = request["cwd"]
    sys.argv = [sys.argv[0], *request["args"]]
    if request["dies_with_parent"]:
        # the parent is this server, which dies with the tests' process; the requester's exit is
        # the server's to act on (_requester_gone)
        from kvledger.processes import die_with_parent

        die_with_parent()


def _exit_status(exit_: SystemExit) -> int:
    """The status the interpreter exits with for ``exit_``, printing a non-integer code as it does."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)
    return 1


def _run_child() -> None:
    """Run ``kvledger.cli`` as ``python -m`` would, then exit as the interpreter does up to its
    teardown: non-daemon threads joined, ``atexit`` handlers run (logging's flush among them), stdio
    flushed — and no more. Tearing down the preloaded torch and transformers (module dicts, objects'
    reference counts) writes to nearly every page the child shares with the server, about 1.6
    CPU-seconds a process on the CI machine, more than a short command runs; a new interpreter
    exiting frees its memory without touching it either. An exception other than ``SystemExit``
    takes the interpreter's own path (its traceback, status 1)."""
    import atexit
    import runpy

    try:
        runpy.run_module("kvledger.cli", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_)
    threading._shutdown()  # type: ignore[attr-defined] # what the interpreter calls first at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the interpreter ignores it too
            pass
    os._exit(status)


if __name__ == "__main__":
    environment_at_start = dict(os.environ)  # what the preloaded libraries read at import
    child_request = _serve(sys.argv[1], _preload(), environment_at_start)
    _become_child(child_request)
    _run_child()
