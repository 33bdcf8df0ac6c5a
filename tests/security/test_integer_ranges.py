"""One declared range per integer quantity, the same in every layer it crosses.

Policy versions, counts, epochs and seqs: 0..2^53-1 (``events.schema.Count``, ``MAX_SAFE_INT``);
document versions: 0..2^53-2 (``DocumentVersion``); token offsets and inventory chunks: 0..2^31-1
(``SmallCount``). The boundary values below go through every layer — the JWT verifier, the event
contract, the node's key derivation, the ledger's columns, the Kafka consumers and the node's HTTP
API — and each layer accepts exactly the declared range and refuses the rest with its own error
(401/400 on HTTP, a dead letter on Kafka), never a crash or a 500."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import jwt
import pytest
from aiokafka import AIOKafkaProducer
from helpers.ledger import (
    JWT_SECRET,
    RunningConsumers,
    coordinator_settings,
    dead_letters,
    eventually,
    fresh_database,
    signed_customer_value,
)
from helpers.node import node_on_thread
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import BigInteger, Integer, select

from coordinator.consumers import INVALIDATION_GROUP_SUFFIX
from coordinator.ledger.db import Database
from coordinator.ledger.models import Document, InboxEntry, Policy
from coordinator.settings import CoordinatorSettings
from events import topics
from events.codec import encode_key
from events.schema import (
    MAX_DOCUMENT_VERSION,
    MAX_INT32,
    MAX_SAFE_INT,
    DocumentUpdated,
    EventValidationError,
    Inventory,
    NodeHeartbeat,
    PermissionRevoked,
    SmallCount,
    parse_event,
)
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.settings import CacheSettings, NodeSettings
from identity.settings import IssuerSettings
from identity.tokens import AuthError, TokenVerifier
from prefix_keys.blocks import CacheScope, scope_salt

BOUNDARIES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 - 2, 2**53 - 1, 2**53, -1]
"""Where the layers used to disagree: int32, uint32, the largest document version, the largest safe
integer."""

RANGES = {
    "count": (0, MAX_SAFE_INT),
    "document_version": (0, MAX_DOCUMENT_VERSION),
    "small_count": (0, MAX_INT32),
}
"""The declared ranges (inclusive)."""

integers = st.sampled_from(BOUNDARIES) | st.integers(min_value=-(2**64), max_value=2**64)


def within(quantity: str, value: int) -> bool:
    low, high = RANGES[quantity]
    return low <= value <= high


# --- the JWT verifier, the event contract and the key derivation: pure, so hypothesis drives them
# ----------------

VERIFIER = TokenVerifier(IssuerSettings(jwt_secret=JWT_SECRET))


def token_with_pv(pv: object) -> str:
    claims = {
        "tenant": "acme",
        "sub": "alice",
        "scopes": ["hr"],
        "pv": pv,
        "exp": int(time.time()) + 600,
    }
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


def envelope_json(event_type: str, payload: dict, tenant: str | None = "acme") -> str:
    return json.dumps(
        {
            "event_id": str(uuid.uuid4()),
            "type": event_type,
            "schema_version": 1,
            "occurred_at": "2026-12-03T00:00:00+00:00",
            "tenant_id": tenant,
            "payload": payload,
        }
    )


def accepted(text: str) -> bool:
    try:
        parse_event(text)
    except EventValidationError:
        return False
    return True


@given(value=integers)
def test_the_verifier_the_contract_and_the_key_derivation_accept_exactly_the_declared_ranges(
    value: int,
) -> None:
    # The JWT verifier: a policy version, alone or per auth scope.
    for pv in (value, {"hr": value}):
        try:
            principal = VERIFIER.verify(token_with_pv(pv))
        except AuthError as error:
            assert not within("count", value), f"pv {value} refused"
            assert error.code == "invalid_token"
        else:
            assert within("count", value), f"pv {value} accepted"
            assert principal.policy_version("hr") == value
            # Every accepted version has its own tenant-scope salt: nothing truncates it.
            salt = scope_salt(CacheScope.TENANT, principal, (("hr", value),))
            assert salt != scope_salt(CacheScope.TENANT, principal, (("hr", value ^ 1),))

    # The event contract, on the wire.
    cases = {
        "count": [
            envelope_json("PermissionRevoked", {"auth_scope": "hr", "policy_version": value}),
            envelope_json(
                "NodeHeartbeat", {"node_id": "n", "epoch": value, "seq": value}, tenant=None
            ),
        ],
        "document_version": [envelope_json("DocumentUpdated", {"doc_id": "d", "version": value})],
    }
    for quantity, texts in cases.items():
        for text in texts:
            assert accepted(text) == within(quantity, value), (quantity, value, text[:80])
    # Token offsets and inventory chunk numbers (INTEGER columns).
    try:
        TypeAdapter(SmallCount).validate_python(value)
    except ValidationError:
        assert not within("small_count", value)
    else:
        assert within("small_count", value)


def test_the_models_and_the_tokens_name_one_range() -> None:
    from identity.tokens import MAX_VERSION

    assert MAX_VERSION == MAX_SAFE_INT == 2**53 - 1
    assert PermissionRevoked.model_fields["policy_version"].metadata[-1].le == MAX_SAFE_INT
    assert (
        DocumentUpdated.model_fields["version"].metadata[-1].le == MAX_DOCUMENT_VERSION == 2**53 - 2
    )
    assert NodeHeartbeat.model_fields["epoch"].metadata[-1].le == MAX_SAFE_INT
    assert Inventory.model_fields["chunk"].metadata[-1].le == MAX_INT32


def test_each_ledger_column_holds_its_quantity_s_whole_range() -> None:
    """Counts and versions are BIGINT (2^53-1 fits); only the small counts are INTEGER (2^31-1
    fits)."""
    from coordinator.ledger.models import Base

    small = {
        ("placements", "token_offset"),
        ("blocks", "token_offset"),
        ("inventory_chunks", "chunk"),
        ("inventory_chunks", "num_chunks"),
    }
    small |= {("ack_parts", "part"), ("ack_parts", "num_parts")}  # at most MAX_ACK_PARTS
    for table in Base.metadata.sorted_tables:
        for column in table.columns:
            if isinstance(column.type, Integer) and not isinstance(column.type, BigInteger):
                assert (table.name, column.name) in small | {
                    ("snapshots", "num_blocks"),
                    ("invalidation_targets", "resend_count"),
                }, f"{table.name}.{column.name} is INTEGER: a Count there would overflow at 2^31"
    for table, column in (
        ("policies", "policy_version"),
        ("documents", "version"),
        ("nodes", "epoch"),
        ("nodes", "last_seq"),
    ):
        assert isinstance(Base.metadata.tables[table].columns[column].type, BigInteger), (
            f"{table}.{column}"
        )


# --- the ledger and the Kafka consumers: what the contract accepts is stored exactly, the rest
# dead-lettered ------


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    consumers = await RunningConsumers(settings).start()
    yield consumers
    await consumers.stop()


async def test_boundary_versions_on_kafka_are_stored_exactly_or_dead_lettered(
    coordinator, settings: CoordinatorSettings, database: Database, kafka_bootstrap: str
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    sent: dict[tuple[str, int], dict] = {}
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for value in BOUNDARIES:
            # Each value under a scope/document of its own: versions only move forward per key.
            scope, doc = f"hr-{value}", f"doc-{value}"
            for topic, event_type, payload, key in (
                (
                    topics.PERMISSIONS,
                    "PermissionRevoked",
                    {"auth_scope": scope, "policy_version": value},
                    f"{tenant}:{scope}",
                ),
                (
                    topics.DOCUMENTS,
                    "DocumentUpdated",
                    {"doc_id": doc, "version": value},
                    f"{tenant}:{doc}",
                ),
            ):
                document = json.loads(envelope_json(event_type, payload, tenant))
                text = json.dumps(document).encode()
                quantity = "count" if topic == topics.PERMISSIONS else "document_version"
                value_bytes = signed_customer_value(text) if within(quantity, value) else text
                await producer.send_and_wait(topic, value_bytes, key=encode_key(key))
                sent[(topic, value)] = document
    finally:
        await producer.stop()

    refused = {
        uuid.UUID(doc["event_id"])
        for (topic, value), doc in sent.items()
        if not within(_quantity(topic), value)
    }
    group = settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    letters = await dead_letters(settings.kafka.bootstrap, group, refused)
    assert all(error.startswith("payload.") for error in letters.values()), letters

    accepted_ids = {
        uuid.UUID(doc["event_id"])
        for (topic, value), doc in sent.items()
        if within(_quantity(topic), value)
    }

    async def all_applied() -> bool:
        async with database.session() as session:
            found = set(
                await session.scalars(
                    select(InboxEntry.event_id).where(InboxEntry.event_id.in_(accepted_ids))
                )
            )
        return found == accepted_ids

    await eventually(all_applied, what="every in-range event applied")
    async with database.session() as session:
        policies = dict(
            (
                await session.execute(
                    select(Policy.auth_scope, Policy.policy_version).where(
                        Policy.tenant_id == tenant
                    )
                )
            ).all()
        )
        documents = dict(
            (
                await session.execute(
                    select(Document.doc_id, Document.version).where(Document.tenant_id == tenant)
                )
            ).all()
        )
    assert policies == {f"hr-{v}": v for v in BOUNDARIES if within("count", v)}
    assert documents == {f"doc-{v}": v for v in BOUNDARIES if within("document_version", v)}


def _quantity(topic: str) -> str:
    return "count" if topic == topics.PERMISSIONS else "document_version"


# --- the node's HTTP API: a real server, a tenant-scope request
# ----------------------------------------------------


@pytest.fixture(scope="module")
def node_url(tiny_model_dir, tmp_path_factory):
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path_factory.mktemp("ranges-node"),
        auth=IssuerSettings(jwt_secret=JWT_SECRET),
        cache=CacheSettings(
            block_size=16, num_device_blocks=128, num_host_blocks=128, max_disk_blocks=128
        ),
    )
    engine = AsyncEngine.from_settings(settings)
    with node_on_thread(
        engine, create_app(engine, TokenVerifier(settings.auth)), "ranges-node"
    ) as url:
        yield url


def tenant_scope_chat(url: str, pv: object, document_version: int = 1) -> httpx.Response:
    text = " ".join(f"handbook section {i} says staff rest" for i in range(12))
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You answer from the handbook.", "cache_scope": "public"},
            {
                "role": "user",
                "content": text,
                "document": {"id": "handbook", "version": document_version, "auth_scope": "hr"},
            },
            {"role": "user", "content": "What is the leave policy?"},
        ],
        "max_tokens": 1,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {token_with_pv({'hr': pv})}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("pv", [2**32, 2**53 - 1])
def test_a_tenant_scope_request_under_a_large_policy_version_is_served_not_a_500(
    node_url: str, pv: int
) -> None:
    first = tenant_scope_chat(node_url, pv)
    assert first.status_code == 200, first.text
    again = tenant_scope_chat(node_url, pv)
    assert again.status_code == 200, again.text
    assert (
        again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )  # the blocks keyed under pv are reused


@pytest.mark.parametrize("pv", [2**53, -1])
def test_a_policy_version_outside_the_range_is_401(node_url: str, pv: int) -> None:
    answer = tenant_scope_chat(node_url, pv)
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "invalid_token")


@pytest.mark.parametrize(
    ("version", "status"), [(2**53 - 2, 200), (2**53 - 1, 400), (2**53, 400), (-1, 400)]
)
def test_document_versions_at_the_edge_follow_the_contract(
    node_url: str, version: int, status: int
) -> None:
    answer = tenant_scope_chat(node_url, 1, document_version=version)
    assert answer.status_code == status, answer.text
    if status == 400:
        assert answer.json()["error"]["code"] == "invalid_document_version"
