"""Data keys for tenant/user data at rest, held by the coordinator (docs/design.md §3, §6).

Nodes seal tenant and user blocks that leave memory (disk tier, snapshots)
under a per-scope data key: one per tenant for tenant scope, one per
(tenant, subject) for user scope. The keys live here rather than on the nodes
so that an erasure is one database transaction on the coordinator instead of a
best-effort deletion on every node: once ``destroy_subject`` commits, no node
can fetch the key again, so every copy of the subject's sealed data — on any
node, in any snapshot, or copied away — is cryptographically erased (NIST
800-88 Purge). Nodes keep fetched keys in memory only and forget them when the
erasure's command reaches them.

Storage: each key is wrapped with AES-256-GCM under the deployment master key
(``KVLEDGER_MASTER_KEY``) with the key id as AAD, so a row cannot be moved to
another id, and a database dump without the master key reveals no key. Key ids
are random (not derived from tenant or subject) because they appear in clear in
block file headers. Subjects are stored only as their keyed digest
(:func:`events.schema.subject_digest`), like everywhere else in the ledger.

Destruction sets ``destroyed_at`` and zero-fills ``wrapped_key`` in one
transaction; the row stays so receipts can name the destroyed key ids, and the
next ``resolve`` for the scope creates a new key under a new id. Caveat (for
receipts): PostgreSQL keeps the superseded row version — still wrapped under the
master key — until VACUUM reclaims it, and WAL archives keep it as long as they
are retained.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import CheckConstraint, ColumnElement, Index, and_, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from coordinator.ledger.db import Database
from coordinator.ledger.models import Base
from events.schema import subject_digest
from identity.sealing import KEY_BYTES, KEY_ID_HEX_CHARS, NONCE_BYTES

log = logging.getLogger(__name__)

KEY_SCOPES = ("tenant", "user")
MASTER_KEY_BYTES = 32
_KEY_ID = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_CHARS}}}")
_SUBJECT_HASH = re.compile(r"[0-9a-f]{64}")
_RESOLVE_ATTEMPTS = 3


class DataKey(Base):
    """One data key, wrapped under the master key; ``destroyed_at`` set (and the wrapped bytes zeroed) once erased."""

    __tablename__ = "data_keys"
    __table_args__ = (
        CheckConstraint("scope IN ('tenant', 'user')", name="scope"),
        CheckConstraint("(scope = 'user') = (subject_hash IS NOT NULL)", name="scope_subject"),
        CheckConstraint(f"key_id ~ '^[0-9a-f]{{{KEY_ID_HEX_CHARS}}}$'", name="key_id_hex"),
        Index(
            "uq_data_keys_live_scope",
            "scope",
            "tenant_id",
            "subject_hash",
            unique=True,
            postgresql_where=text("destroyed_at IS NULL"),
            postgresql_nulls_not_distinct=True,
        ),
        Index(None, "tenant_id", "subject_hash"),
    )

    key_id: Mapped[str] = mapped_column(primary_key=True)
    scope: Mapped[str]
    tenant_id: Mapped[str]
    subject_hash: Mapped[bytes | None]
    wrapped_key: Mapped[bytes]
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    destroyed_at: Mapped[datetime | None]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A known key id and its key; ``key`` is None once the key is destroyed."""

    key_id: str
    key: bytes | None


class MasterKeyError(RuntimeError):
    """A live key does not unwrap: the configured master key is not the one that wrapped it."""


def _check_tenant(tenant_id: str) -> None:
    if not isinstance(tenant_id, str) or not tenant_id:
        raise ValueError("tenant_id must be a non-empty string")


def _subject_bytes(subject_hash: str) -> bytes:
    if not isinstance(subject_hash, str) or not _SUBJECT_HASH.fullmatch(subject_hash):
        raise ValueError(
            "subject_hash must be the 64 lowercase hex digits of events.schema.subject_digest"
        )
    return bytes.fromhex(subject_hash)


def _check_key_id(key_id: str) -> None:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ValueError(f"key ids are {KEY_ID_HEX_CHARS} lowercase hex digits")


class KeyService:
    """Get-or-create, fetch and destroy data keys in the ledger database.

    ``subject_key`` is the deployment's subject digest key (shared with the
    nodes): the erasure flow knows a raw subject id and turns it into the
    digest the keys are filed under with :meth:`subject_hash`.
    """

    def __init__(self, database: Database, master_key: bytes, subject_key: bytes) -> None:
        if len(master_key) != MASTER_KEY_BYTES:
            raise ValueError(
                f"the master key must be {MASTER_KEY_BYTES} bytes, got {len(master_key)}"
            )
        if len(subject_key) < 16:
            raise ValueError("the subject digest key must be at least 16 bytes")
        self._database = database
        self._master = AESGCM(master_key)
        self._subject_key = subject_key

    def subject_hash(self, tenant_id: str, subject_id: str) -> str:
        """The digest a subject's keys are filed under (the same one the nodes compute)."""
        return subject_digest(self._subject_key, tenant_id, subject_id)

    def _wrap(self, key_id: str, key: bytes) -> bytes:
        return wrap_secret(self._master, key_id.encode("ascii"), key)

    def _unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        key = unwrap_secret(self._master, key_id.encode("ascii"), wrapped, f"data key {key_id}")
        assert len(key) == KEY_BYTES, "wrapped keys are always data keys of KEY_BYTES"
        return key

    async def resolve(self, tenant_id: str, subject_hash: str | None) -> tuple[str, bytes]:
        """``(key_id, key)`` of the live key for a tenant (``subject_hash`` None) or one subject in it.

        Created on first use. Concurrent callers — several nodes, several
        coordinator replicas — all get the same key: the insert does nothing
        when the partial unique index already holds a live key for the scope,
        and the loser reads the winner's row. Retried when the live key is
        destroyed between the conflict and the read (an erasure racing a
        resolve); the retry then creates the scope's next key.
        """
        _check_tenant(tenant_id)
        subject = None if subject_hash is None else _subject_bytes(subject_hash)
        scope = "tenant" if subject is None else "user"
        live = and_(
            DataKey.scope == scope,
            DataKey.tenant_id == tenant_id,
            DataKey.subject_hash.is_(None) if subject is None else DataKey.subject_hash == subject,
            DataKey.destroyed_at.is_(None),
        )
        async with self._database.session() as session:
            for _ in range(_RESOLVE_ATTEMPTS):
                async with session.begin():
                    row = (
                        await session.execute(
                            select(DataKey.key_id, DataKey.wrapped_key).where(live)
                        )
                    ).first()
                    if row is not None:
                        return row.key_id, self._unwrap(row.key_id, row.wrapped_key)
                    key_id, key = os.urandom(KEY_ID_HEX_CHARS // 2).hex(), os.urandom(KEY_BYTES)
                    inserted = await session.scalar(
                        insert(DataKey)
                        .values(
                            key_id=key_id,
                            scope=scope,
                            tenant_id=tenant_id,
                            subject_hash=subject,
                            wrapped_key=self._wrap(key_id, key),
                        )
                        .on_conflict_do_nothing(
                            index_elements=["scope", "tenant_id", "subject_hash"],
                            index_where=DataKey.destroyed_at.is_(None),
                        )
                        .returning(DataKey.key_id)
                    )
                    if inserted is not None:
                        log.info(
                            "created %s-scope data key %s for tenant %s", scope, key_id, tenant_id
                        )
                        return key_id, key
        raise RuntimeError(
            f"no live {scope}-scope data key after {_RESOLVE_ATTEMPTS} attempts: erasures keep racing"
        )

    async def find(self, key_id: str) -> KeyRecord | None:
        """The key under ``key_id`` (``key`` None once destroyed); None when no such key was ever
        issued."""
        _check_key_id(key_id)
        async with self._database.session() as session:
            row = (
                await session.execute(
                    select(DataKey.wrapped_key, DataKey.destroyed_at).where(
                        DataKey.key_id == key_id
                    )
                )
            ).first()
        if row is None:
            return None
        if row.destroyed_at is not None:
            return KeyRecord(key_id, None)
        return KeyRecord(key_id, self._unwrap(key_id, row.wrapped_key))

    async def get(self, key_id: str) -> bytes | None:
        """The key to unseal with; None once destroyed (or never issued)."""
        record = await self.find(key_id)
        return None if record is None else record.key

    async def destroy_subject(self, tenant_id: str, subject_hash: str) -> list[str]:
        """Destroy every key of one subject in a tenant; the ids of all of them, sorted.

        All of the subject's keys are returned, including ones an earlier call
        destroyed, so a retried erasure records the same ids (the call is
        idempotent). Returns [] when the subject never had a key.
        """
        return await self._destroy(subject_keys(tenant_id, subject_hash))

    async def destroy_tenant(self, tenant_id: str) -> list[str]:
        """Destroy every key of a tenant: its tenant-scope keys and all of its subjects' keys. Ids,
        sorted."""
        _check_tenant(tenant_id)
        return await self._destroy(DataKey.tenant_id == tenant_id)

    async def _destroy(self, condition: ColumnElement[bool]) -> list[str]:
        async with self._database.session() as session, session.begin():
            return await destroy_keys(session, condition)


def wrap_secret(master: AESGCM, label: bytes, secret: bytes) -> bytes:
    """``nonce ‖ AES-256-GCM(master, secret, aad=label)``: the label binds the ciphertext to its
    row."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + master.encrypt(nonce, secret, label)


def unwrap_secret(master: AESGCM, label: bytes, wrapped: bytes, what: str) -> bytes:
    """Inverse of :func:`wrap_secret`; :class:`MasterKeyError` naming ``what`` when the master key is not the one."""
    try:
        return master.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], label)
    except InvalidTag:
        raise MasterKeyError(
            f"{what} does not unwrap: KVLEDGER_MASTER_KEY differs from the key that wrapped it"
        ) from None


def subject_keys(tenant_id: str, subject_hash: str) -> ColumnElement[bool]:
    """Every data key of one subject in a tenant (the condition :func:`destroy_keys` takes for an
    erasure)."""
    _check_tenant(tenant_id)
    return and_(
        DataKey.tenant_id == tenant_id, DataKey.subject_hash == _subject_bytes(subject_hash)
    )


async def destroy_keys(session: AsyncSession, condition: ColumnElement[bool]) -> list[str]:
    """Mark the matching keys destroyed and zero their wrapped bytes in the caller's transaction; ids, sorted.

    In the caller's transaction so that an erasure destroys the keys together with
    its decision, or not at all. Zero-filling (rather than deleting the row) keeps
    the id for receipts and makes the destruction visible in the table itself: a row
    whose ``destroyed_at`` is set holds no key material. ``coalesce`` keeps the first
    destruction time on a retry.
    """
    key_ids = (
        await session.scalars(
            update(DataKey)
            .where(condition)
            .values(
                destroyed_at=func.coalesce(DataKey.destroyed_at, func.now()),
                wrapped_key=func.decode(func.repeat("00", func.length(DataKey.wrapped_key)), "hex"),
            )
            .returning(DataKey.key_id)
            .execution_options(synchronize_session=False)
        )
    ).all()
    key_ids = sorted(key_ids)
    if key_ids:
        log.info("destroyed data keys %s", ", ".join(key_ids))
    return key_ids
