"""The ledger schema exists only through Alembic: upgrade from empty, downgrade to base, upgrade
again."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from helpers.ledger import fresh_database
from sqlalchemy import inspect, pool
from sqlalchemy.ext.asyncio import create_async_engine

import coordinator.keys.data_keys  # noqa: F401 - declares data_keys on Base.metadata
from coordinator.ledger import migrate
from coordinator.ledger.models import Base

LEDGER_TABLES = {table.name for table in Base.metadata.sorted_tables}


async def _state(url: str) -> tuple[str | None, set[str], list]:
    """(revision, tables, differences between the migrated schema and the models)."""
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            revision = await migrate.current_revision(connection)
            tables = set(await connection.run_sync(lambda sync: inspect(sync).get_table_names()))
            diff = await connection.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(
                        sync, opts={"compare_type": True, "compare_server_default": True}
                    ),
                    Base.metadata,
                )
            )
        return revision, tables - {"alembic_version"}, diff
    finally:
        await engine.dispose()


@pytest.fixture
async def empty_url(database_url: str):
    async with fresh_database(database_url) as url:
        yield url


async def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    revision, tables, _ = await _state(empty_url)
    assert (revision, tables) == (None, set())

    await asyncio.to_thread(migrate.upgrade, empty_url)
    revision, tables, diff = await _state(empty_url)
    assert revision == migrate.head_revision()
    assert tables == LEDGER_TABLES
    assert diff == [], f"migrations and coordinator.ledger.models disagree: {diff}"

    await asyncio.to_thread(migrate.downgrade, empty_url, "base")
    revision, tables, _ = await _state(empty_url)
    assert (revision, tables) == (None, set())

    await asyncio.to_thread(migrate.upgrade, empty_url)
    revision, tables, diff = await _state(empty_url)
    assert (revision, tables, diff) == (migrate.head_revision(), LEDGER_TABLES, [])


async def test_concurrent_upgrades_serialize(empty_url: str) -> None:
    """Several coordinators may run `kvledger migrate` at once; the advisory lock makes that safe."""
    await asyncio.gather(*(asyncio.to_thread(migrate.upgrade, empty_url) for _ in range(3)))
    revision, tables, diff = await _state(empty_url)
    assert (revision, tables, diff) == (migrate.head_revision(), LEDGER_TABLES, [])


async def test_cli(empty_url: str) -> None:
    """`kvledger migrate` blocks (it runs its own event loop), so it is driven from a worker thread
    here."""

    def run(**overrides) -> int:
        args = {"database_url": empty_url, "revision": "head", "downgrade": False, **overrides}
        return migrate.cli(argparse.Namespace(**args))

    assert await asyncio.to_thread(run) == 0
    assert (await _state(empty_url))[0] == migrate.head_revision()
    assert await asyncio.to_thread(run, downgrade=True) == 2  # a downgrade must name its target
    assert (await _state(empty_url))[0] == migrate.head_revision()
    assert await asyncio.to_thread(run, downgrade=True, revision="base") == 0
    assert (await _state(empty_url))[:2] == (None, set())
