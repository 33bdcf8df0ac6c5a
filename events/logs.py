"""Logging of every kvledger process: one format switch, request ids, one access line per request.

Shared by the node, the coordinator and the CLI (it imports none of them), so every
process logs the same way (docs/operations.md "Logs"):

* ``KVLEDGER_LOG_FORMAT=text`` (default) or ``json`` (one JSON object per line);
* uvicorn logs through the same root handler (:func:`uvicorn_log_config`), its own
  access log stays off: it prints query strings, and a query may carry a subject id;
* :class:`RequestIdMiddleware` accepts a caller's ``X-Request-Id`` when it is short and
  plain (else makes a fresh one), echoes it on every response, puts it in every log
  line written while the request runs, and writes one access line per request:
  method, path, status, duration — never a body, a query string, a tenant or a subject;
* one log record is one line: :class:`SafeTextFormatter` escapes every character that
  could end a line, forge one or hide text (C0/C1 controls, ANSI escapes, Unicode line
  separators and bidi controls, :func:`escape_control`) in the message and all its
  arguments, and indents a traceback's lines; the JSON format escapes the same characters.
  Field names and values an outsider sent (a Kafka record's keys, a header) can therefore
  never write a line of their own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

LOG_FORMAT_ENV = "KVLEDGER_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_PATTERN = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_REQUEST_ID_CHARS}}}")
NO_REQUEST_ID = "-"
METRIC_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods kept as a metric label; any other (caller-chosen) method is counted as ``other``."""

_UNSAFE_CHARS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]"
)
"""What may not reach a log line or a terminal raw: C0 and C1 controls (newline, carriage
return, ESC of every ANSI sequence, DEL, CSI), the Unicode line and paragraph separators
(line breaks to many readers) and the bidirectional controls and marks that reorder what a
reader sees (Trojan Source)."""
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match[0]
    code = ord(char)
    return _SHORT_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_control(text: str) -> str:
    """``text`` with every character of :data:`_UNSAFE_CHARS` written as a visible escape (``\\n``,
    ``\\x1b``, ``\\u2028``).

    The one escaping of text an outsider may have chosen before it is logged or printed on a
    terminal: log lines (:class:`SafeTextFormatter`), validation errors (``events.schema``) and the
    CLI's tables all use it.
    """
    return _UNSAFE_CHARS.sub(_escaped, text)


_JSON_UNSAFE = re.compile(
    "[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]"
)
"""What ``json.dumps(ensure_ascii=False)`` leaves raw of :data:`_UNSAFE_CHARS` (it escapes C0
itself)."""


request_id_var: ContextVar[str] = ContextVar("kvledger_request_id", default=NO_REQUEST_ID)
"""The id of the request being served by this task, ``-`` outside of one."""


def request_id_from(header: str | None) -> str:
    """The caller's id when it is at most 128 chars of ``[A-Za-z0-9._-]``, else a fresh one.

    The bound keeps log lines and headers small, the alphabet keeps a caller from
    forging log structure (newlines, quotes) through an id it chose.
    """
    if header is not None and _REQUEST_ID_PATTERN.fullmatch(header):
        return header
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request id (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request id, message (and the exception, when
    any)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", NO_REQUEST_ID),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # These characters only ever occur inside JSON strings here, where \uXXXX means the same.
        return _JSON_UNSAFE.sub(
            lambda match: f"\\u{ord(match[0]):04x}", json.dumps(line, ensure_ascii=False)
        )


class SafeTextFormatter(logging.Formatter):
    """The text format, one line per record whatever the message and its arguments hold
    (:func:`escape_control`).

    A traceback keeps its lines, each indented and escaped, so none of them can pass for a
    record of its own (an exception message may quote what an outsider sent).
    """

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging.Formatter's name
        return escape_control(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:  # noqa: N802
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("    " + escape_control(line) for line in text.splitlines())


def log_format() -> str:
    """``KVLEDGER_LOG_FORMAT`` (``text`` when unset); anything else is a configuration error."""
    value = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV} must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return value


def make_handler(fmt: str, stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) writing ``fmt`` lines that carry the request id."""
    assert fmt in LOG_FORMATS, f"unknown log format {fmt!r}"
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else SafeTextFormatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    return handler


def configure_logging(level: int = logging.INFO) -> None:
    """The process's one logging setup: the root logger writes :func:`log_format` lines to stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(make_handler(log_format()))
    root.setLevel(level)


def uvicorn_log_config() -> dict[str, Any]:
    """``log_config`` for every uvicorn server: its loggers propagate to the root handler, no own
    handlers."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"level": "INFO", "handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


MAX_LOGGED_PATH_CHARS = 512


def loggable_path(path: str) -> str:
    """The request path percent-encoded again and bounded: a caller's ``%0A`` cannot start a fake log line."""
    quoted = quote(path, safe="/:@!$&'()*+,;=-._~")
    return quoted if len(quoted) <= MAX_LOGGED_PATH_CHARS else quoted[:MAX_LOGGED_PATH_CHARS] + "…"


Observe = Callable[[str, str, int, float], None]
"""``observe(method, route, status, seconds)``: a server's request-latency histogram."""


class RequestIdMiddleware:
    """ASGI middleware: request id in, request id out, one access line per HTTP request.

    Added last (outermost) so the id is set before any other code of the request logs.
    ``route`` in the latency metric is the matched path template (bounded), never the raw path.
    """

    def __init__(
        self,
        app: Any,
        access_logger: str,
        error_body: bytes,
        observe: Observe | None = None,
        quiet_paths: frozenset[str] = frozenset(),
    ) -> None:
        """``error_body``: the app's own JSON error for an unhandled exception (sent with the id);
        answered requests to ``quiet_paths`` (polled by machines several times a second) are logged
        at DEBUG, refusals at INFO as any."""
        self.app = app
        self.quiet_paths = quiet_paths
        self.access_log = logging.getLogger(access_logger)
        self.error_body = error_body
        self.observe = observe

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next(
            (value for name, value in scope["headers"] if name == REQUEST_ID_HEADER.encode()), None
        )
        request_id = request_id_from(header.decode("latin-1") if header is not None else None)
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: dict) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if not response_started:  # the server's own 500 would go out without the id
                body = self.error_body
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
            raise
        finally:
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            level = (
                logging.DEBUG
                if status < 400 and scope["path"] in self.quiet_paths
                else logging.INFO
            )
            self.access_log.log(
                level,
                "%s %s %d %.1fms",
                scope["method"],
                loggable_path(scope["path"]),
                status,
                seconds * 1000,
            )
            if self.observe is not None:
                method = scope["method"] if scope["method"] in METRIC_METHODS else "other"
                self.observe(method, route, status, seconds)
            request_id_var.reset(token)
