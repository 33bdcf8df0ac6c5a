"""Alembic environment for the ledger: async engine (asyncpg), schema only through migrations.

Two ways in:

* programmatic (``coordinator.ledger.migrate``): the caller opens the async connection,
  takes the migration lock and hands the sync-facing connection in
  ``config.attributes["connection"]``;
* the ``alembic`` command line: this module creates an async engine from
  ``sqlalchemy.url`` (or the coordinator settings) and runs the migrations itself.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

import coordinator.keys.data_keys  # noqa: F401 - declares data_keys on Base.metadata
from coordinator.ledger.models import Base

config = context.config
target_metadata = Base.metadata

if config.cmd_opts is not None and config.config_file_name is not None:
    # Only when run as the alembic CLI: fileConfig would otherwise reconfigure the host app's
    # logging.
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from coordinator.settings import CoordinatorSettings

    return CoordinatorSettings().database.url.get_secret_value()


def run_migrations_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade head --sql``) for DBAs who apply scripts by hand."""
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_with(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_with)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_with(connection)
    else:
        asyncio.run(_run_async())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
