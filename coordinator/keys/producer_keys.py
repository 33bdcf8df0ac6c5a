"""The enrollment registry of customer-event producer keys, and the check the decisions consumer rests on.

Customer events (``DocumentUpdated``/``DocumentDeleted``, ``PermissionRevoked``,
``ErasureRequested``) decide what the cache must forget, so whoever may publish one for a
tenant holds power over that tenant's cache. Kafka records carry no authenticated principal
the coordinator could map to a tenant (and the embedded broker has no SASL at all), so a
producer proves which tenants it speaks for with a signature instead: its Ed25519 key
(``identity.signing``, as nodes sign their records) is enrolled here bound to a list of
tenants, or to all of them. The decisions consumer passes on only events signed by a live
key bound to the event's tenant (:func:`producer_record_problem`, through
``coordinator.keys.node_keys.VerifiedRecords``); every other one is dead-lettered and counted
(``docs/security.md``, "Signed customer events").

Lookups are cached like node keys (``coordinator.keys.node_keys.KeyCache``) for
``ledger.node_key_cache_s``: a revocation takes effect at every replica within that bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.keys.node_keys import MAX_CACHED_KEYS, KeyCache
from coordinator.ledger.db import Database
from coordinator.ledger.models import ProducerKey
from events.schema import MAX_LIST_ITEMS, Envelope, check_identifier
from identity.signing import (
    UNKNOWN_KEY,
    UNSIGNED,
    key_id,
    public_key_from_raw,
    raw_public_key,
    signature_problem,
)

REVOKED_KEY = "revoked_key"
"""Signed by a producer key that was enrolled and has been revoked."""
TENANT_NOT_BOUND = "tenant_not_bound"
"""Signed by a live producer key whose binding does not include the event's tenant."""


@dataclass(frozen=True, slots=True)
class ProducerBinding:
    """One enrolled producer key: whom it belongs to (``name``, a label), and which tenants it speaks for."""

    key_id: str
    name: str
    public_key: Ed25519PublicKey
    all_tenants: bool
    tenants: frozenset[str]
    revoked: bool

    def binds(self, tenant_id: str | None) -> bool:
        return tenant_id is not None and (self.all_tenants or tenant_id in self.tenants)


def _binding(row: ProducerKey) -> ProducerBinding:
    return ProducerBinding(
        key_id=row.key_id,
        name=row.name,
        public_key=public_key_from_raw(row.public_key),
        all_tenants=row.all_tenants,
        tenants=frozenset(row.tenants),
        revoked=row.revoked_at is not None,
    )


def _check_tenants(tenants: list[str] | None) -> list[str]:
    """The sorted, distinct tenants of a binding (None: all tenants → []). ValueError for an empty or bad list."""
    if tenants is None:
        return []
    if not tenants or len(tenants) > MAX_LIST_ITEMS:
        raise ValueError(
            f"a producer key is bound to 1..{MAX_LIST_ITEMS} tenants, or to all of them"
        )
    for tenant in tenants:
        if not isinstance(tenant, str) or not 1 <= len(tenant) <= 256:
            raise ValueError("a tenant id is 1..256 characters")
        check_identifier(tenant)
    return sorted(set(tenants))


async def enroll(
    session: AsyncSession,
    public_key: Ed25519PublicKey,
    tenants: list[str] | None,
    *,
    name: str,
    enrolled_by: str,
) -> ProducerBinding:
    """Enroll ``public_key`` for ``tenants`` (None: every tenant); idempotent for the same binding.

    ValueError when the key was revoked (a revoked key is never enrolled again) or is already
    enrolled with another binding (revoke it and enroll a new key: a binding never widens in place).
    """
    if not 1 <= len(name) <= 256:
        raise ValueError("a producer key's name is 1..256 characters")
    check_identifier(name)
    bound = _check_tenants(tenants)
    kid = key_id(public_key)
    await session.execute(
        pg_insert(ProducerKey)
        .values(
            key_id=kid,
            name=name,
            public_key=raw_public_key(public_key),
            all_tenants=tenants is None,
            tenants=bound,
            enrolled_by=enrolled_by,
        )
        .on_conflict_do_nothing(index_elements=[ProducerKey.key_id])
    )
    row = (await session.execute(select(ProducerKey).where(ProducerKey.key_id == kid))).scalar_one()
    if row.revoked_at is not None:
        raise ValueError(
            f"key {kid} was revoked; a revoked key is never enrolled again (make a new one)"
        )
    if (row.all_tenants, sorted(row.tenants)) != (tenants is None, bound):
        raise ValueError(
            f"key {kid} is already enrolled with another binding; revoke it and enroll a new key"
        )
    return _binding(row)


async def get(session: AsyncSession, kid: str) -> ProducerBinding | None:
    row = await session.get(ProducerKey, kid)
    return None if row is None else _binding(row)


async def revoke(session: AsyncSession, kid: str) -> bool:
    """Revoke key ``kid``; False when there is no such live key."""
    result = await session.execute(
        update(ProducerKey)
        .where(ProducerKey.key_id == kid, ProducerKey.revoked_at.is_(None))
        .values(revoked_at=func.now())
    )
    return bool(result.rowcount)


def _described(row: ProducerKey) -> dict[str, Any]:
    return {
        "key_id": row.key_id,
        "name": row.name,
        "all_tenants": row.all_tenants,
        "tenants": list(row.tenants),
        "enrolled_at": row.enrolled_at.isoformat(),
        "enrolled_by": row.enrolled_by,
        "revoked_at": None if row.revoked_at is None else row.revoked_at.isoformat(),
    }


async def described(session: AsyncSession, kid: str) -> dict[str, Any] | None:
    """Key ``kid`` as the API shows it (None: no such key)."""
    row = await session.get(ProducerKey, kid, populate_existing=True)
    return None if row is None else _described(row)


async def listed(session: AsyncSession, tenant_id: str | None) -> list[dict[str, Any]]:
    """Every enrolled key (``tenant_id`` given: those that may publish for it, all-tenant keys
    included), oldest first."""
    query = select(ProducerKey).order_by(ProducerKey.enrolled_at, ProducerKey.key_id)
    if tenant_id is not None:
        query = query.where(ProducerKey.all_tenants | ProducerKey.tenants.contains([tenant_id]))
    return [_described(row) for row in await session.scalars(query)]


async def _producer_keys(session: AsyncSession, key_ids: set[str]) -> dict[str, ProducerBinding]:
    """Enrolled keys among ``key_ids``, revoked ones included: a revoked key's records get their own
    reason."""
    rows = await session.scalars(select(ProducerKey).where(ProducerKey.key_id.in_(key_ids)))
    return {row.key_id: _binding(row) for row in rows}


class ProducerKeyRegistry(KeyCache[ProducerBinding]):
    """Enrolled producer keys by id, cached for ``ledger.node_key_cache_s``
    (``coordinator.keys.node_keys.KeyCache``)."""

    def __init__(
        self, database: Database, cache_s: float, max_cached: int = MAX_CACHED_KEYS
    ) -> None:
        super().__init__(database, cache_s, _producer_keys, max_cached)


def producer_record_problem(envelope: Envelope, enrolled: dict[str, ProducerBinding]) -> str | None:
    """Why ``envelope`` may not be trusted as a customer event of its tenant (a reason label), or None when it may.

    Reasons: ``unsigned``, ``unknown_key`` (never enrolled), ``revoked_key``, ``bad_signature``
    (tampered, or forged under an enrolled key id) and ``tenant_not_bound`` (a valid signature by a
    key that may not publish for the envelope's tenant). The signature is checked before the binding,
    so a forged record learns nothing about which tenants a key speaks for.
    """
    if envelope.signature is None:
        return UNSIGNED
    binding = enrolled.get(envelope.signature.kid)
    if binding is None:
        return UNKNOWN_KEY
    if binding.revoked:
        return REVOKED_KEY
    problem = signature_problem(envelope, binding.public_key)
    if problem is not None:
        return problem
    return None if binding.binds(envelope.tenant_id) else TENANT_NOT_BOUND
