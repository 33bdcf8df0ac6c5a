"""Apply the Alembic migrations: the only way the ledger schema is created.

``upgrade``/``downgrade`` block until done and run their own event loop (the engine
is async, Alembic is synchronous and runs inside ``AsyncConnection.run_sync``), so
async callers run them in a thread: ``await asyncio.to_thread(upgrade, url)``.
Concurrent upgrades (several coordinators starting at once) serialize on a
Postgres advisory lock held for the migration transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
_LOCK_KEY = 0x6B766C6564676572  # "kvledger"; arbitrary, constant across releases


def alembic_config() -> Config:
    """Alembic config pointing at the packaged migrations (works from a wheel, any cwd)."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions has no revisions"
    return head


async def current_revision(connection: AsyncConnection) -> str | None:
    """The revision the database is at; None for an empty (never migrated) database.

    Read directly rather than through Alembic's MigrationContext, which logs at INFO on
    every call — too loud for a readiness probe polled every few seconds.
    """
    if await connection.scalar(text("SELECT to_regclass('alembic_version')")) is None:
        return None
    return await connection.scalar(text("SELECT version_num FROM alembic_version"))


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` (SQLAlchemy asyncpg URL) up to ``revision``. Blocking."""
    asyncio.run(_run(url, lambda config: command.upgrade(config, revision)))


def downgrade(url: str, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"`` drops the whole ledger schema). Blocking."""
    asyncio.run(_run(url, lambda config: command.downgrade(config, revision)))


async def _run(url: str, action: Callable[[Config], None]) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
            await connection.run_sync(_with_connection, action)
    finally:
        await engine.dispose()


def _with_connection(connection: Connection, action: Callable[[Config], None]) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    action(config)


def cli(args: argparse.Namespace) -> int:
    """``kvledger migrate [--database-url URL] [--revision REV] [--downgrade]``."""
    from coordinator.settings import CoordinatorSettings

    overrides = {"database": {"url": args.database_url}} if args.database_url else {}
    try:
        url = CoordinatorSettings(**overrides).database.url.get_secret_value()
        if args.downgrade and args.revision == "head":
            raise ValueError("--downgrade needs an explicit --revision (e.g. base)")
    except ValueError as exc:
        print(f"kvledger migrate: error: {exc}", file=sys.stderr)
        return 2
    if args.downgrade:
        downgrade(url, args.revision)
    else:
        upgrade(url, args.revision)
    return 0
