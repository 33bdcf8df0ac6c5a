"""The enrollment registry of node keys, and the checks that rest on it.

Every node has its own Ed25519 key (``identity.signing``). An operator enrolls its
public key for the node's id (``kvledger nodes enroll``; ``kvledger up`` does it for
its own nodes) and may revoke it (``kvledger nodes revoke``). The registry answers two
questions for the rest of the coordinator:

* the key service (``coordinator.api.routes.keys``): is this bearer credential a live EdDSA
  JWT signed by a key enrolled, and not revoked, for the node it names?
* the kv-events and ack consumers (:class:`VerifiedRecords`): was this record signed by
  a key enrolled for the ``node_id`` its payload names? A record that was not — unsigned,
  tampered, signed by an unknown or revoked key, or a copy of one node's record
  relabelled with another node's id — is dead-lettered, counted, and never applied or
  counted as evidence.

Lookups are cached in memory for ``ledger.node_key_cache_s`` (5 s by default); a revocation
(or an enrollment replacing a key) therefore takes effect at every coordinator replica
within that bound. Unknown key ids are never cached, so a newly enrolled key works at once.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from aiokafka.structs import ConsumerRecord
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import Request
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.ledger.db import Database
from coordinator.ledger.models import NodeKey
from events.codec import encode_event, encode_key
from events.kafka.consumer import ConsumedEvent, Handler
from events.kafka.dead_letters import Seal, send_to_dead_letter
from events.kafka.producer import EventProducer
from events.metrics import DEAD_LETTER_TOTAL, UNVERIFIED_RECORDS_TOTAL
from events.schema import Envelope
from identity.node_credentials import CredentialError, credential_key_id, verify_node_credential
from identity.signing import (
    SIGNATURE_ERROR,
    EnrolledKey,
    key_id,
    public_key_from_raw,
    raw_public_key,
    record_problem,
)
from identity.tokens import AuthError

log = logging.getLogger(__name__)

K = TypeVar("K")

MAX_CACHED_KEYS = 4096
"""At most this many keys are held in memory, least recently used dropped first: far more than
the nodes of a deployment, so a full cache only means one more query per lookup."""


async def enroll(session: AsyncSession, node_id: str, public_key: Ed25519PublicKey) -> EnrolledKey:
    """Enroll ``public_key`` for ``node_id`` (idempotent). ValueError when the key is revoked or
    another node's."""
    if not node_id or len(node_id) > 256 or not node_id.isprintable():
        raise ValueError("a node id is 1..256 printable characters")
    kid = key_id(public_key)
    await session.execute(
        pg_insert(NodeKey)
        .values(key_id=kid, node_id=node_id, public_key=raw_public_key(public_key))
        .on_conflict_do_nothing(index_elements=[NodeKey.key_id])
    )
    row = (await session.execute(select(NodeKey).where(NodeKey.key_id == kid))).scalar_one()
    if row.node_id != node_id:
        raise ValueError(f"key {kid} is enrolled for another node")
    if row.revoked_at is not None:
        raise ValueError(
            f"key {kid} was revoked; a revoked key is never enrolled again (make a new one)"
        )
    return EnrolledKey(kid, node_id, public_key)


async def revoke(session: AsyncSession, node_id: str, kid: str | None = None) -> list[str]:
    """Revoke ``node_id``'s key ``kid`` (every live key of the node when None); returns the key ids
    revoked."""
    statement = update(NodeKey).where(NodeKey.node_id == node_id, NodeKey.revoked_at.is_(None))
    if kid is not None:
        statement = statement.where(NodeKey.key_id == kid)
    result = await session.execute(
        statement.values(revoked_at=func.now()).returning(NodeKey.key_id)
    )
    return sorted(result.scalars())


class KeyCache(Generic[K]):
    """Keys by id, each trusted from memory for ``cache_s`` after its lookup: the revocation bound of a
    registry (see the module docstring). ``load`` reads the keys among a set of ids from the database;
    the node registry and the producer registry (``coordinator.keys.producer_keys``) differ only in that."""

    def __init__(
        self,
        database: Database,
        cache_s: float,
        load: Callable[[AsyncSession, set[str]], Awaitable[dict[str, K]]],
        max_cached: int = MAX_CACHED_KEYS,
    ) -> None:
        if cache_s < 0 or max_cached < 1:
            raise ValueError("cache_s must not be negative and max_cached at least 1")
        self.database = database
        self._cache_s = cache_s
        self._load = load
        self._max_cached = max_cached
        self._cached: collections.OrderedDict[str, tuple[float, K]] = collections.OrderedDict()

    async def lookup(self, key_ids: Iterable[str]) -> dict[str, K]:
        """The keys among ``key_ids`` that ``load`` finds (one query for those not cached)."""
        now = time.monotonic()
        found: dict[str, K] = {}
        missing: set[str] = set()
        for kid in set(key_ids):
            cached = self._cached.get(kid)
            if cached is not None and now - cached[0] < self._cache_s:
                found[kid] = cached[1]
                self._cached.move_to_end(kid)
            else:
                missing.add(kid)
        if missing:
            async with self.database.session() as session:
                found.update(await self._load(session, missing))
            for kid in missing:
                # A known key's revocation must show within the bound, so it is re-read then; an
                # unknown id is not cached at all (enrolling it must work at once, and nobody can
                # sign with it).
                if kid in found:
                    self._cached[kid] = (now, found[kid])
                    self._cached.move_to_end(kid)
                else:
                    self._cached.pop(kid, None)
            while len(self._cached) > self._max_cached:
                self._cached.popitem(last=False)
        return found


async def _live_node_keys(session: AsyncSession, key_ids: set[str]) -> dict[str, EnrolledKey]:
    rows = await session.execute(
        select(NodeKey).where(NodeKey.key_id.in_(key_ids), NodeKey.revoked_at.is_(None))
    )
    return {
        row.key_id: EnrolledKey(row.key_id, row.node_id, public_key_from_raw(row.public_key))
        for row in rows.scalars()
    }


class NodeKeyRegistry(KeyCache[EnrolledKey]):
    """Enrolled, unrevoked node keys by id, cached for ``ledger.node_key_cache_s``
    (:class:`KeyCache`)."""

    def __init__(
        self, database: Database, cache_s: float, max_cached: int = MAX_CACHED_KEYS
    ) -> None:
        super().__init__(database, cache_s, _live_node_keys, max_cached)

    async def authenticate(self, token: str) -> EnrolledKey:
        """The enrolled key whose node made this credential; CredentialError (HTTP 401) otherwise."""
        kid = credential_key_id(token)
        enrolled = (await self.lookup([kid])).get(kid)
        if enrolled is None:
            raise CredentialError(
                "unknown_node_key", "the credential's key is not enrolled, or was revoked"
            )
        verify_node_credential(token, enrolled.public_key, enrolled.node_id)
        return enrolled


class VerifiedRecords:
    """A consumer handler that passes on only records signed by their party; the rest are
    dead-lettered.

    Wraps the kv-events handler (``coordinator.handlers.ingest``) and the ack handler
    (``coordinator.handlers.invalidation``), whose records must be signed by their node
    (:func:`record_problem`, the default ``problem``), and the decisions handler, whose customer
    events must be signed by a producer key bound to their tenant
    (``coordinator.keys.producer_keys.producer_record_problem`` over a ``ProducerKeyRegistry``):
    verification is its own step between decoding and applying. A rejected record goes to
    ``kvledger.dead-letter`` with its reason (the envelope re-encoded: the consumer hands over
    decoded records) and is counted in ``kvledger_unverified_records_total`` and the dead-letter
    tally. Offsets already dead-lettered are remembered, so a batch redelivered after a handler
    failure does not dead-letter or count twice."""

    def __init__(
        self,
        handler: Handler,
        registry: KeyCache[Any],
        dead_letters: EventProducer,
        *,
        group_id: str,
        dead_letter_counter=DEAD_LETTER_TOTAL,
        seal: Seal | None = None,
        problem: Callable[[Envelope, dict[str, Any]], str | None] = record_problem,
    ) -> None:
        """``seal`` signs the dead letters (the coordinator's command key, see
        ``coordinator.consumers``)."""
        self._handler = handler
        self._seal = seal
        self._registry = registry
        self._problem = problem
        self._dead_letters = dead_letters
        self._group_id = group_id
        self._counter = dead_letter_counter
        self._dead_lettered: dict[tuple[str, int], int] = {}

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        enrolled = await self._registry.lookup(
            event.envelope.signature.kid for event in events if event.envelope.signature is not None
        )
        trusted = []
        for event in events:
            problem = self._problem(event.envelope, enrolled)
            if problem is None:
                trusted.append(event)
            else:
                await self._reject(event, problem)
        if trusted:
            await self._handler(trusted)

    async def _reject(self, event: ConsumedEvent, reason: str) -> None:
        partition = (event.topic, event.partition)
        if event.offset <= self._dead_lettered.get(partition, -1):
            return
        record = ConsumerRecord(
            topic=event.topic,
            partition=event.partition,
            offset=event.offset,
            timestamp=event.timestamp_ms,
            timestamp_type=0,
            key=None if event.key is None else encode_key(event.key),
            value=encode_event(event.envelope),
            checksum=None,
            serialized_key_size=-1,
            serialized_value_size=-1,
            headers=(),
        )
        await send_to_dead_letter(
            self._dead_letters,
            record,
            SIGNATURE_ERROR + reason,
            self._group_id,
            self._counter,
            seal=self._seal,
        )
        UNVERIFIED_RECORDS_TOTAL.labels(topic=event.topic, reason=reason).inc()
        self._dead_lettered[partition] = event.offset


async def authenticate_node(request: Request, what: str) -> EnrolledKey:
    """The enrolled key whose node credential is the request's bearer token; :class:`AuthError` (401) for anyone else.

    The node-facing routes (data keys, governance state) share one registry per app and database,
    so its cache — and with it the revocation bound, the app's ``ledger.node_key_cache_s`` — is the
    same for all of them.
    """
    database = request.app.state.database
    registry = getattr(request.app.state, "node_keys", None)
    if registry is None or registry.database is not database:
        registry = request.app.state.node_keys = NodeKeyRegistry(
            database, request.app.state.settings.ledger.node_key_cache_s
        )
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("missing_token", f"{what} needs 'Authorization: Bearer <node credential>'")
    try:
        return await registry.authenticate(token.strip())
    except CredentialError as error:
        raise AuthError(error.code, error.message) from None
