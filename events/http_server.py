"""Bounded HTTP serving for every kvledger server (the node and the coordinator alike).

Anyone who can reach a server's port can talk HTTP to it before any token is checked, so
what one unauthenticated client may hold is bounded here, below the application
(docs/security.md "HTTP server limits"):

* **Request head size.** The request target may be at most ``max_url_bytes`` (else ``414``),
  the whole head (request line and headers) at most ``max_header_bytes`` and
  ``max_headers`` fields (else ``431``). The head is fed to the parser in slices that never
  pass the bound, so neither the parser nor uvicorn buffers more (a pipelined request: at
  most one slice more, see :meth:`BoundedHttpProtocol.data_received`).
* **Time.** A connection must deliver a complete request head within
  ``header_read_timeout_s`` of connecting or of its first byte after a response (slowloris);
  an idle keep-alive connection is closed after ``keep_alive_timeout_s``.
* **Connections.** At most ``max_connections`` sockets stay open. One more evicts the
  connection idle longest (between requests, or still sending its head); when none is idle
  it is answered ``503`` and closed. Requests other than the probes (:data:`PROBE_PATHS`)
  may occupy at most ``max_connections - num_probe_connections`` connections at once (``503``
  past it), so there is always an idle connection to evict for a probe: ``/healthz`` keeps
  answering while the bound is full.
* **File descriptors.** :func:`raise_file_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard
  one and the connection bound stays well below it: client connections alone cannot exhaust it.
* **Logs.** Refusals are counted, not logged one by one: :class:`RefusalLog` writes the
  first of a kind and then one summary line per kind per interval, never a traceback.

:func:`server_config` builds the ``uvicorn.Config`` both servers run with. It pins
uvicorn's httptools implementation (:class:`BoundedHttpProtocol` is a subclass of it) and
turns WebSockets off: no kvledger endpoint uses them, and an upgraded connection would
leave these bounds behind.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar

import httptools
import uvicorn
from pydantic import BaseModel, Field, model_validator
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from events.logs import uvicorn_log_config

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""What a supervisor and a scraper ask; answered even when the connection bound is full."""

LISTEN_BACKLOG = 511
"""Connections the kernel holds before they are accepted; a burst may accept this many at once."""
NUM_SPARE_FILES = 256
"""File descriptors kept for everything that is not a client connection (model and disk-tier
files, Kafka and Postgres connections, snapshots)."""
SUMMARY_INTERVAL_S = 10.0
"""How often refusals of one kind are summarized in the log, at most."""

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class HttpServerLimits(BaseModel):
    """What one client may hold of an HTTP server before it is authenticated (module docstring)."""

    max_url_bytes: int = Field(8 * 1024, ge=256)
    """Longest request target (path and query string); longer: ``414``."""
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    """Largest request head (request line and every header line); larger: ``431``."""
    max_headers: int = Field(100, ge=8)
    """Most header fields in one request; more: ``431``."""
    header_read_timeout_s: float = Field(10.0, gt=0)
    """Longest a request head may take to arrive; then the connection is closed without an answer."""
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    """Longest an idle connection is kept open between requests."""
    max_connections: int = Field(1024, ge=2)
    """Most open client connections (lowered at start when the file descriptor limit is too low)."""
    num_probe_connections: int = Field(16, ge=1)
    """Connections requests other than the probes can never occupy: the probes' reserve."""

    @model_validator(mode="after")
    def _consistent(self) -> HttpServerLimits:
        if self.max_url_bytes > self.max_header_bytes:
            raise ValueError(
                "max_url_bytes must not exceed max_header_bytes: the request line is part of the head"
            )
        if self.num_probe_connections >= self.max_connections:
            raise ValueError("num_probe_connections must be less than max_connections")
        return self


def error_json(message: str, error_type: str, code: str) -> bytes:
    """The body of a refusal: the ``{"error": {...}}`` shape of both servers' APIs (``param`` as
    OpenAI's has it)."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":")).encode()


REFUSALS: dict[int, tuple[str, bytes]] = {
    414: (
        "414 URI Too Long",
        error_json("request target too long", "invalid_request_error", "url_too_long"),
    ),
    431: (
        "431 Request Header Fields Too Large",
        error_json("request headers too large", "invalid_request_error", "headers_too_large"),
    ),
    400: (
        "400 Bad Request",
        error_json("malformed HTTP request", "invalid_request_error", "bad_request"),
    ),
    503: (
        "503 Service Unavailable",
        error_json("server at its connection bound, retry later", "server_error", "over_capacity"),
    ),
}
"""Status line and body of each answer the server gives without the application."""


def refusal_bytes(status: int) -> bytes:
    """A complete ``Connection: close`` response with a refusal's status and body."""
    reason, body = REFUSALS[status]
    retry = "retry-after: 1\r\n" if status == 503 else ""
    head = f"HTTP/1.1 {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{retry}connection: close\r\n\r\n"
    return head.encode() + body


class RefusalLog:
    """Refusals by kind: the first of a kind is logged at once, then one count per kind per interval.

    A flood of bad connections writes a few lines per interval, not one (or a traceback) per
    connection. Called on the event loop only (it schedules the summaries there).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.num_held_back: dict[str, int] = {}
        """Kinds with an open window, and how many of each arrived in it after the first."""

    def record(self, kind: str) -> None:
        if kind in self.num_held_back:
            self.num_held_back[kind] += 1
            return
        self.logger.warning(
            "http: %s (more are counted, summarized every %.0f s)", kind, self.interval_s
        )
        self.open_window(kind)

    def open_window(self, kind: str) -> None:
        self.num_held_back[kind] = 0
        asyncio.get_running_loop().call_later(self.interval_s, self.close_window, kind)

    def close_window(self, kind: str) -> None:
        """Log what the window held back; while they keep coming, the next window opens right away."""
        num_events = self.num_held_back.pop(kind)
        if num_events:
            self.logger.warning("http: %d more in %.0f s: %s", num_events, self.interval_s, kind)
            self.open_window(kind)


class InFlightBound:
    """ASGI middleware: at most ``max_in_flight`` requests other than the probes run at once; past it, ``503``.

    Keeping other requests below the connection bound is what leaves idle connections to
    evict, and so room, for a probe when the bound is full. A client that disconnects while
    its body is read is counted, not logged with a traceback per request.
    """

    def __init__(self, app: ASGIApp, max_in_flight: int, refusals: RefusalLog) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.refusals = refusals
        self.num_in_flight = 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in PROBE_PATHS:
            await self.serve(scope, receive, send)
            return
        if self.num_in_flight >= self.max_in_flight:
            self.refusals.record("request refused: requests in flight at their bound (503)")
            _, body = REFUSALS[503]
            headers = [
                (b"content-type", b"application/json"),
                (b"retry-after", b"1"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        self.num_in_flight += 1
        try:
            await self.serve(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    async def serve(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            self.refusals.record(
                "request abandoned: the client disconnected while its body was read"
            )


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; ``status`` is the answer."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head, time and connection bounds (module docstring).

    :func:`bounded_protocol` makes the subclass a server runs with: its ``limits``, its
    connection bound and its own table of idle connections.
    """

    limits: ClassVar[HttpServerLimits]
    max_connections: ClassVar[int]
    idle: ClassVar[dict[BoundedHttpProtocol, None]]
    """This server's connections not serving a request, longest idle first (insertion order)."""
    refusals: ClassVar[RefusalLog]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self.head_timer: asyncio.TimerHandle | None = None
        self.in_head = True
        """From the connection's start or a message's end to the next message's complete head."""
        self.num_head_bytes = 0
        self.busy = False
        """A request is being served (head complete, response not yet)."""
        self.deferred_refusal: int | None = None
        """The status to answer once the requests being served are answered (:meth:`refuse`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            longest_idle = next(iter(self.idle), None)
            if longest_idle is None:
                self.refusals.record(
                    "connection refused: connection bound reached, none idle (503)"
                )
                self.refuse(503)
                return
            self.idle.pop(longest_idle)
            longest_idle.transport.close()
            self.refusals.record("idle connection closed to make room: connection bound reached")
        self.idle[self] = None
        self.start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self.cancel_head_timer()
        super().connection_lost(exc)

    def start_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(
                self.limits.header_read_timeout_s, self.on_head_timeout
            )

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def on_head_timeout(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self.refusals.record(
                "connection closed: request head not complete within header_read_timeout_s"
            )
            self.transport.close()

    def refuse(self, status: int) -> None:
        """Answer ``status`` without the application and close the connection.

        A refused head behind complete requests still being answered (pipelined) waits for their
        responses, which go first, as HTTP/1.1 orders them; what the client sends meanwhile is
        dropped. A request whose own body cannot be parsed is answered at once, as uvicorn does.
        """
        self.cancel_head_timer()
        if self.busy and self.in_head:
            self.deferred_refusal = status
            return
        if not self.transport.is_closing():
            self.transport.write(refusal_bytes(status))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Feed the parser, a head never more than ``max_header_bytes`` at once.

        Counting restarts at each message's end, so a pipelined head that arrived in the same
        slice as that end is counted only from the next slice on (docs/security.md).
        """
        self._unset_keepalive_if_required()
        if not self.busy:
            self.start_head_timer()
        while data and not self.transport.is_closing() and self.deferred_refusal is None:
            if self.in_head:
                room = self.limits.max_header_bytes - self.num_head_bytes
                if room <= 0:
                    self.refusals.record("request refused: head larger than max_header_bytes (431)")
                    self.refuse(431)
                    return
                chunk, data = data[:room], data[room:]
                self.num_head_bytes += len(chunk)
            else:
                chunk, data = data, b""
            self.feed(chunk)

    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserUpgrade:
            pass  # WebSockets are off (``ws="none"``): the request is served as plain HTTP
        except httptools.HttpParserError as error:
            status = error.__context__.status if isinstance(error.__context__, _Refused) else 400
            self.refusals.record(f"request refused: {REFUSALS[status][0]}")
            self.refuse(status)

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.max_url_bytes:
            raise _Refused(414)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            raise _Refused(431)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.busy = True
        self.idle.pop(self, None)
        self.cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.in_head = True
        self.num_head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """Idle again once the newest request is answered too (``self.cycle`` is the last one parsed; a
        pipelined request behind this response has just been started)."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle.response_complete:
            self.busy = False
            if self.deferred_refusal is not None:
                self.refuse(self.deferred_refusal)
                return
            self.idle[self] = None


def bounded_protocol(limits: HttpServerLimits, max_connections: int) -> type[BoundedHttpProtocol]:
    """The protocol class of one server: ``limits``, its connection bound, its own idle table and
    refusal log."""
    server_limits, bound = limits, max_connections

    class ServerProtocol(BoundedHttpProtocol):
        limits = server_limits
        max_connections = bound
        idle = {}
        refusals = RefusalLog(log)

    return ServerProtocol


def raise_file_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the file descriptor limit from %d to %d", soft, target)
    return soft


def connection_bound(limits: HttpServerLimits, num_files: int) -> int:
    """``max_connections``, lowered so that every connection, a full accept backlog and the process's
    other files fit in ``num_files`` descriptors; ValueError when not even the probes' reserve fits."""
    fitting = num_files - LISTEN_BACKLOG - NUM_SPARE_FILES
    if fitting <= limits.num_probe_connections:
        raise ValueError(
            f"the file descriptor limit ({num_files}) leaves no room for client connections:"
            f" raise it (ulimit -n) to at least {LISTEN_BACKLOG + NUM_SPARE_FILES + limits.max_connections}"
        )
    if limits.max_connections > fitting:
        log.warning(
            "max_connections lowered from %d to %d to fit the file descriptor limit (%d)",
            limits.max_connections,
            fitting,
            num_files,
        )
        return fitting
    return limits.max_connections


RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def summarize_resource_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Out-of-resource errors the loop reports (``accept`` failing with EMFILE …) are counted, not each
    logged with a traceback; everything else goes to the loop's default handler."""
    refusals = RefusalLog(log)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in RESOURCE_ERRNOS:
            refusals.record(
                f"{context.get('message', 'event loop error')}: {errno.errorcode[error.errno]}"
            )
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def server_config(app: ASGIApp, host: str, port: int, limits: HttpServerLimits) -> uvicorn.Config:
    """The uvicorn configuration of a kvledger server: ``app`` behind every bound of ``limits``.

    Call it from the event loop the server will run on (it installs that loop's resource-error
    summary)."""
    max_connections = connection_bound(limits, raise_file_limit())
    summarize_resource_errors(asyncio.get_running_loop())
    protocol = bounded_protocol(limits, max_connections)
    bounded_app = InFlightBound(
        app, max_connections - limits.num_probe_connections, protocol.refusals
    )
    return uvicorn.Config(
        bounded_app,
        host=host,
        port=port,
        http=protocol,
        ws="none",
        backlog=LISTEN_BACKLOG,
        access_log=False,
        log_config=uvicorn_log_config(),
    )
