"""The ledger database: the one place that creates the engine and hands out sessions.

Sessions use ``expire_on_commit=False`` so ORM objects stay readable after the
transaction commits (no implicit lazy I/O from an async context). HTTP handlers
get a session per request from :func:`request_session`; consumers and background
tasks open one per unit of work with :meth:`Database.session`.

An unreachable database never hangs anyone: connects and statements are bounded
(``database.connect_timeout_s``, ``command_timeout_s``), a failed connect raises
:class:`DatabaseUnavailable`, and :class:`DatabaseUnavailableMiddleware` answers any HTTP
request that met such a failure with 503 and ``Retry-After`` (docs/operations.md,
"Degraded modes"). The pool replaces dropped connections by itself once the server is back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from coordinator.http import error_content
from coordinator.settings import DatabaseSettings

log = logging.getLogger(__name__)


class DatabaseUnavailable(Exception):
    """A connection to the ledger database could not be made (refused, no socket, timed out, starting up)."""


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) means the database is out of reach, not that a query is
    wrong.

    Connect failures arrive as :class:`DatabaseUnavailable`; a server that went away under
    an open connection or stopped answering arrives as a driver error SQLAlchemy marks as a
    disconnect, an operational/interface error, a statement timeout or a pool timeout.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(
            current, DatabaseUnavailable | sa_exc.TimeoutError | asyncpg.PostgresConnectionError
        ):
            return True
        if isinstance(current, asyncpg.exceptions.OperatorInterventionError):
            return True  # admin shutdown, cannot connect now, statement cancelled
        if isinstance(current, sa_exc.DBAPIError) and (
            current.connection_invalidated
            or isinstance(current, sa_exc.OperationalError | sa_exc.InterfaceError)
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


class Database:
    def __init__(self, settings: DatabaseSettings, *, pre_ping: bool = True) -> None:
        """``pre_ping``: test every connection with a round trip when it is checked out, so a
        connection the server dropped (a restart) fails no request. The consumers turn it off:
        every ledger transaction of theirs paid that round trip, and a batch that meets a dropped
        connection is retried anyway (SQLAlchemy then replaces the whole pool's connections)."""
        self.engine: AsyncEngine = create_async_engine(
            settings.url.get_secret_value(),
            pool_size=settings.pool_size,
            max_overflow=settings.max_overflow,
            pool_timeout=settings.pool_timeout_s,
            pool_pre_ping=pre_ping,
            connect_args={
                "timeout": settings.connect_timeout_s,
                "command_timeout": settings.command_timeout_s,
            },
        )
        event.listen(self.engine.sync_engine, "do_connect", _connect_or_unavailable)
        self.sessionmaker: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False
        )

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session for one unit of work; the caller commits (``async with session.begin()``)."""
        async with self.sessionmaker() as session:
            yield session

    async def dispose(self) -> None:
        await self.engine.dispose()


def _connect_or_unavailable(dialect: Any, _record: Any, cargs: tuple, cparams: dict) -> Any:
    """The dialect's own connect, with "cannot reach the server" raised as
    :class:`DatabaseUnavailable`.

    asyncpg reports a refused connection, a missing unix socket or a connect timeout as a
    bare ``OSError``/``TimeoutError``, which SQLAlchemy passes through unwrapped; naming it
    here keeps :func:`is_unavailable` from having to treat every ``OSError`` as the database's.
    """
    try:
        return dialect.connect(*cargs, **cparams)
    except (
        OSError,
        TimeoutError,
        asyncpg.PostgresConnectionError,
        asyncpg.exceptions.OperatorInterventionError,
    ) as error:
        raise DatabaseUnavailable(
            f"cannot connect to the ledger database ({type(error).__name__})"
        ) from error


class DatabaseUnavailableMiddleware:
    """ASGI middleware: a request that failed because the database is out of reach gets 503 with
    ``Retry-After``.

    The API's error shape, code ``database_unavailable``; the failure's text is not echoed.
    Sits inside :class:`events.logs.RequestIdMiddleware` (which adds the request id) and
    covers every route, whichever router added it.
    """

    def __init__(self, app: Callable, retry_after_s: int) -> None:
        self.app = app
        self._headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_UNAVAILABLE_BODY)).encode()),
            (b"retry-after", str(retry_after_s).encode()),
        ]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            if started or not is_unavailable(error):
                raise
            log.warning("database unavailable (%s): answered 503", type(error).__name__)
            await send({"type": "http.response.start", "status": 503, "headers": self._headers})
            await send({"type": "http.response.body", "body": _UNAVAILABLE_BODY})


_UNAVAILABLE_BODY = json.dumps(
    error_content(
        "server_error", "database_unavailable", "the ledger database is unavailable; retry later"
    ),
    separators=(",", ":"),
).encode()


async def request_session(request: Request) -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: a session bound to the app's :class:`Database` for one request."""
    database: Database = request.app.state.database
    async with database.session() as session:
        yield session


def database_lifespan(settings: DatabaseSettings):
    """A FastAPI lifespan that owns one :class:`Database` on ``app.state.database``: created at
    startup, disposed at shutdown (the API and the consumers-only ops app both use it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        database = Database(settings)
        app.state.database = database
        try:
            yield
        finally:
            await database.dispose()

    return lifespan
