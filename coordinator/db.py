"""The ledger database: the one place that creates the engine and hands out sessions.

Sessions use ``expire_on_commit=False`` so ORM objects stay readable after the
transaction commits (no implicit lazy I/O from an async context). HTTP handlers
get a session per request from :func:`request_session`; consumers and background
tasks open one per unit of work with :meth:`Database.session`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from coordinator.settings import DatabaseSettings


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
        )
        self.sessionmaker: async_sessionmaker[AsyncSession] = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session for one unit of work; the caller commits (``async with session.begin()``)."""
        async with self.sessionmaker() as session:
            yield session

    async def dispose(self) -> None:
        await self.engine.dispose()


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
