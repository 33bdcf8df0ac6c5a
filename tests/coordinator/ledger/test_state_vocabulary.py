"""One vocabulary: the enums code uses are exactly what the ledger's CHECK constraints allow.

``coordinator.ledger.states`` and ``events.tiers`` name every value a state, status or tier column
may hold, and ``coordinator.ledger.models`` builds its CHECK constraints from them. The schema
itself exists only through the migrations, so an enum whose spelling drifted from a migrated
constraint would pass every test on the models and fail on a real ledger: here the constraints of a
migrated database are held against those ``create_all`` makes from the models, one by one, as
Postgres itself prints them."""

from __future__ import annotations

import asyncio
import typing

from helpers.ledger import fresh_database
from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import create_async_engine

import coordinator.keys.data_keys  # noqa: F401 - declares data_keys on Base.metadata
from coordinator.ledger import migrate
from coordinator.ledger.models import Base
from coordinator.ledger.states import (
    ErasureStatus,
    InvalidationStatus,
    NamespaceStatus,
    NodeStatus,
    PlacementState,
    TargetStatus,
)
from events import schema
from events.tiers import STORAGE_TIERS, VOLATILE_TIERS, Tier
from gpu_node.pool import vocabulary

CHECKS = text(
    "SELECT rel.relname || '.' || con.conname, pg_get_constraintdef(con.oid) FROM pg_constraint con"
    " JOIN pg_class rel ON rel.oid = con.conrelid JOIN pg_namespace nsp ON nsp.oid = rel.relnamespace"
    " WHERE con.contype = 'c' AND nsp.nspname = 'public'"
)


async def _checks(url: str) -> dict[str, str]:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            return dict((await connection.execute(CHECKS)).all())
    finally:
        await engine.dispose()


async def test_the_models_check_constraints_are_the_migrated_ones(database_url: str) -> None:
    async with fresh_database(database_url) as migrated, fresh_database(database_url) as declared:
        await asyncio.to_thread(migrate.upgrade, migrated)
        engine = create_async_engine(declared, poolclass=pool.NullPool)
        try:
            async with engine.begin() as connection:
                await connection.run_sync(Base.metadata.create_all)
        finally:
            await engine.dispose()
        from_migrations, from_models = await _checks(migrated), await _checks(declared)
    assert from_models == from_migrations
    for name, enum in (
        ("namespaces.ck_namespaces_status", NamespaceStatus),
        ("nodes.ck_nodes_status", NodeStatus),
        ("placements.ck_placements_tier", Tier),
        ("placements.ck_placements_state", PlacementState),
        ("invalidations.ck_invalidations_status", InvalidationStatus),
        ("invalidation_targets.ck_invalidation_targets_status", TargetStatus),
        ("erasures.ck_erasures_status", ErasureStatus),
    ):
        allowed = from_migrations[name]
        assert all(f"'{member}'::text" in allowed for member in enum), (name, allowed)
        assert allowed.count("::text") == len(enum), (name, allowed)


def test_the_tiers_of_the_contract_and_the_node_are_the_ledgers() -> None:
    assert schema.Placement.model_fields["tier"].annotation is Tier
    assert typing.get_args(schema.StoredBlock.model_fields["tier"].annotation) == STORAGE_TIERS
    assert all(
        typing.get_type_hints(event)["tier"] is Tier
        for event in (vocabulary.StoredInPool, vocabulary.RemovedFromPool)
    )
    assert set(VOLATILE_TIERS) < set(STORAGE_TIERS)
