"""A kvledger server as its own process (``kvledger node`` / ``kvledger coordinator``) and raw HTTP/1.1 connections to it.

The HTTP server limits (``events.http_server``) live below any HTTP client library: a test has
to send exactly the bytes an attacker would (a half request, a trickled header, nothing at all),
so :class:`RawConnection` is a plain loopback socket with deadlines on every wait.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx

from helpers.ledger import eventually
from kvledger.net import loopback_listener
from kvledger.processes import Launcher, Process, popen_cli, spawn_cli

STARTUP_TIMEOUT_S = 120.0
WAIT_S = 30.0


def free_loopback_port() -> int:
    with loopback_listener() as probe:
        return probe.getsockname()[1]


class ServerProcess:
    """``python -m kvledger.cli ARGS --port PORT`` with ``env``, its output in ``log_path``; ready once ``/readyz`` is 200.
    ``launcher``: how it is started (the session's ``fork_server`` fixture forks it from a preloaded process)."""

    def __init__(
        self, args: list[str], env: dict[str, str], log_path: Path, launcher: Launcher = popen_cli
    ) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.env, self.log_path, self.launcher = args, env, log_path, launcher
        self.process: Process | None = None

    async def start(self) -> ServerProcess:
        self.process = spawn_cli(
            [*self.args, "--port", str(self.port)], self.env, self.log_path, launcher=self.launcher
        )

        async def ready() -> bool:
            assert self.process.poll() is None, (
                f"the server exited ({self.process.returncode}):\n{self.log()[-4000:]}"
            )
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{self.url}/readyz", timeout=2)).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(
            ready,
            timeout_s=STARTUP_TIMEOUT_S,
            what=f"{self.args[0]} on {self.url} to be ready",
            poll_s=0.2,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RawConnection:
    """One TCP connection to a server: send bytes, read what comes back, wait for the server to close it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> RawConnection:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def status(self) -> int:
        """The status code of the next response (its head is read, its body left)."""
        line = await asyncio.wait_for(self.reader.readline(), WAIT_S)
        assert line.startswith(b"HTTP/1.1 "), f"not a response: {line[:80]!r}"
        return int(line.split()[1])

    async def response(self) -> tuple[int, bytes]:
        """The next response with a ``Content-Length`` body: its status and body."""
        status = await self.status()
        length = 0
        while (line := await asyncio.wait_for(self.reader.readline(), WAIT_S)) not in (
            b"\r\n",
            b"",
        ):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await asyncio.wait_for(self.reader.readexactly(length), WAIT_S)

    async def closed_by_server(self, timeout_s: float) -> bool:
        """Whether the server closes the connection within ``timeout_s`` (whatever it still sends is
        read and dropped)."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), WAIT_S)
        except (ConnectionError, TimeoutError):
            pass


def get(path: str, *headers: str) -> bytes:
    """A complete ``GET`` request head."""
    return "".join(
        [
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n",
            *(f"{header}\r\n" for header in headers),
            "\r\n",
        ]
    ).encode()
