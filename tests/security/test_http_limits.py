"""Unauthenticated HTTP exhaustion: what one client may hold of a server before any token is checked.

The node and the coordinator run as their own processes (``kvledger node``, ``kvledger
coordinator``) with small bounds set through their settings, and are attacked with raw
bytes on loopback: an endless request line, an endless header, a trickled head, a silent
connection, more connections than the bound. Each must be answered or closed within its
bound, ``/healthz`` must keep answering, and the log must not grow per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.fork_server import ForkServer
from helpers.http_servers import RawConnection, ServerProcess, get
from helpers.ledger import coordinator_env, eventually

from events.http_server import HttpServerLimits
from identity.tokens import issue_token

SECRET = "http-limits-test-secret-0123456789abcdef"
HEADER_READ_TIMEOUT_S = 1.0
KEEP_ALIVE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 8
NUM_PROBE_CONNECTIONS = 2
CLOSE_DEADLINE_S = 20.0
"""How long a test waits for a connection the server should close after about a second (a loaded
machine)."""
DEFAULTS = HttpServerLimits()


def limits_env(
    prefix: str,
    max_connections: int = MAX_CONNECTIONS,
    num_probe_connections: int = NUM_PROBE_CONNECTIONS,
) -> dict[str, str]:
    return {
        f"{prefix}HTTP_LIMITS__HEADER_READ_TIMEOUT_S": str(HEADER_READ_TIMEOUT_S),
        f"{prefix}HTTP_LIMITS__KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_TIMEOUT_S),
        f"{prefix}HTTP_LIMITS__MAX_CONNECTIONS": str(max_connections),
        f"{prefix}HTTP_LIMITS__NUM_PROBE_CONNECTIONS": str(num_probe_connections),
    }


@pytest.fixture(scope="module")
async def node(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> AsyncIterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("http-limits-node")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KVLEDGER_KAFKA_BOOTSTRAP", "KVLEDGER_NODE_KAFKA_BOOTSTRAP")
    }
    env |= {"KVLEDGER_NODE_AUTH__JWT_SECRET": SECRET, **limits_env("KVLEDGER_NODE_")}
    args = [
        "node",
        "--model",
        str(tiny_model_dir),
        "--node-id",
        "limits-node",
        "--data-dir",
        str(data_dir),
    ]
    server = ServerProcess(args, env, data_dir / "node.log", fork_server.launch)
    try:
        yield await server.start()
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def connections(port: int, count: int) -> AsyncIterator[list[RawConnection]]:
    opened = [await RawConnection.open(port) for _ in range(count)]
    try:
        yield opened
    finally:
        for connection in opened:
            await connection.close()


async def answer(port: int, request: bytes) -> int:
    """The status a fresh connection gets for ``request``."""
    async with connections(port, 1) as (connection,):
        await connection.send(request)
        return await connection.status()


async def test_request_line_past_the_bound_is_414_before_it_ends(node: ServerProcess):
    async with connections(node.port, 1) as (connection,):
        await connection.send(
            b"GET /" + b"a" * (DEFAULTS.max_url_bytes + 1024)
        )  # no end of line: the server must not wait for it
        assert await connection.status() == 414
        assert await connection.closed_by_server(CLOSE_DEADLINE_S)


async def test_head_past_the_bound_is_431_before_it_ends(node: ServerProcess):
    async with connections(node.port, 1) as (connection,):
        await connection.send(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Fill: "
            + b"a" * (DEFAULTS.max_header_bytes + 1024)
        )
        assert await connection.status() == 431
        assert await connection.closed_by_server(CLOSE_DEADLINE_S)


async def test_too_many_header_fields_is_431(node: ServerProcess):
    assert (
        await answer(
            node.port,
            get("/healthz", *(f"X-Field-{index}: v" for index in range(DEFAULTS.max_headers + 1))),
        )
        == 431
    )
    assert (
        await answer(
            node.port,
            get("/healthz", *(f"X-Field-{index}: v" for index in range(DEFAULTS.max_headers - 2))),
        )
        == 200
    )


async def test_silent_connection_is_closed_after_the_header_read_timeout(node: ServerProcess):
    async with connections(node.port, 1) as (connection,):
        assert await connection.closed_by_server(CLOSE_DEADLINE_S), (
            "a connection that never sent a byte was kept open"
        )


async def test_trickled_head_is_closed_after_the_header_read_timeout(node: ServerProcess):
    """Slowloris: a header line every 100 ms keeps the connection busy but never completes the head."""
    async with connections(node.port, 1) as (connection,):
        await connection.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for index in range(int(CLOSE_DEADLINE_S * 10)):
                    await connection.send(f"X-{index}: v\r\n".encode())
                    await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        try:
            assert await connection.closed_by_server(CLOSE_DEADLINE_S), (
                "a trickled request head kept its connection open"
            )
        finally:
            trickling.cancel()


async def test_idle_keep_alive_connection_is_closed(node: ServerProcess):
    async with connections(node.port, 1) as (connection,):
        await connection.send(get("/healthz"))
        status, _ = await connection.response()
        assert status == 200
        assert await connection.closed_by_server(CLOSE_DEADLINE_S)


async def test_pipelined_requests_are_answered_and_bounded_alike(node: ServerProcess):
    """Requests sent back to back are each answered; an endless head behind them is still cut off (a
    pipelined head is counted from the slice after the previous request's end, so it may pass the
    bound by one slice)."""
    async with connections(node.port, 1) as (connection,):
        endless = b"GET /healthz HTTP/1.1\r\nX-Fill: " + b"a" * (3 * DEFAULTS.max_header_bytes)
        await connection.send(get("/healthz") + get("/readyz") + endless)
        assert [(await connection.response())[0] for _ in range(2)] == [200, 200]
        assert await connection.status() == 431
    async with connections(node.port, 1) as (connection,):
        await connection.send(get("/healthz"))
        assert (await connection.response())[0] == 200
        await connection.send(get("/healthz", f"X-Fill: {'a' * DEFAULTS.max_header_bytes}"))
        assert await connection.status() == 431, (
            "the second request on a connection has the same bound"
        )


async def test_connection_bound_answers_503_while_probes_answer(node: ServerProcess):
    """Requests held open (bodies never finished) fill what other requests may use; the next one is
    503, ``/healthz`` still 200, also once idle connections fill the rest of the bound."""
    token = issue_token(
        tenant="acme", sub="mallory", scopes=(), pv=1, roles=(), ttl_s=600, secret=SECRET
    )
    authorization = f"Authorization: Bearer {token}"
    stuck_post = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{authorization}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    ).encode()
    async with connections(node.port, MAX_CONNECTIONS - NUM_PROBE_CONNECTIONS) as held:
        for connection in held:
            await connection.send(stuck_post)

        async def past_the_bound_refused() -> bool:
            return await answer(node.port, get("/v1/models", authorization)) == 503

        await eventually(
            past_the_bound_refused,
            timeout_s=CLOSE_DEADLINE_S,
            what="a request past the bound answered 503",
        )
        assert await answer(node.port, get("/healthz")) == 200
        assert await answer(node.port, get("/readyz")) == 200
        async with connections(node.port, 2 * NUM_PROBE_CONNECTIONS) as idle:
            assert await answer(node.port, get("/healthz")) == 200
            assert await idle[0].closed_by_server(CLOSE_DEADLINE_S), (
                "the longest idle connection was kept open"
            )


async def test_log_stays_bounded_under_a_flood_of_bad_connections(node: ServerProcess):
    num_lines_before = len(node.log().splitlines())
    num_bad = 40
    for index in range(num_bad):
        request = (
            b"NOT HTTP AT ALL\r\n\r\n"
            if index % 2
            else b"GET /" + b"a" * (DEFAULTS.max_url_bytes + 1)
        )
        assert await answer(node.port, request) in (400, 414)
    async with connections(node.port, 3 * MAX_CONNECTIONS):
        assert await answer(node.port, get("/healthz")) == 200
    added = node.log().splitlines()[num_lines_before:]
    assert len(added) < num_bad // 4, "\n".join(added[-20:])
    assert not any("Traceback" in line for line in added), "\n".join(added[-20:])


async def test_coordinator_has_the_same_bounds(
    ledger_url: str, kafka_bootstrap: str, tmp_path: Path, fork_server: ForkServer
):
    env = coordinator_env(
        ledger_url,
        kafka_bootstrap,
        f"http-limits-{uuid.uuid4().hex[:8]}",
        **limits_env("KVLEDGER_COORDINATOR_", 4, 1),
    )
    coordinator = ServerProcess(
        ["coordinator", "--role", "all"], env, tmp_path / "coordinator.log", fork_server.launch
    )
    try:
        await coordinator.start()
        async with connections(coordinator.port, 1) as (connection,):
            await connection.send(b"GET /" + b"a" * (DEFAULTS.max_url_bytes + 1024))
            assert await connection.status() == 414
        assert (
            await answer(
                coordinator.port, get("/healthz", f"X-Fill: {'a' * DEFAULTS.max_header_bytes}")
            )
            == 431
        )
        async with connections(coordinator.port, 6) as idle:
            assert await answer(coordinator.port, get("/healthz")) == 200
            assert await idle[-1].closed_by_server(CLOSE_DEADLINE_S), (
                "a silent connection was kept open"
            )
    finally:
        coordinator.stop()
