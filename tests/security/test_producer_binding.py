"""Who may publish what: every topic carries only its event types, a customer event's record key names its envelope's
tenant, and a customer event is decided only when signed by a producer key bound to its tenant.

Real Postgres (a migrated database of this module), the real broker, the coordinator's consumers in-process and its
API over ASGI. Each case publishes its hostile records on partition 0 of one topic, then a valid marker behind them:
once the marker is applied, the records before it were handled, so what is missing from the ledger was refused, and
the dead-letter topic says why.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import (
    RunningConsumers,
    coordinator_settings,
    dead_letters,
    eventually,
    fresh_database,
    operator_headers,
    sign_customer_event,
)
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from coordinator.consumers import INVALIDATION_GROUP_SUFFIX
from coordinator.ledger.db import Database
from coordinator.ledger.models import Document, Erasure, InboxEntry, Policy
from coordinator.settings import CoordinatorSettings
from events import topics
from events.codec import encode_event, encode_key
from events.schema import (
    EVENT_TYPES,
    MAX_SAFE_INT,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    EventPayload,
    PermissionRevoked,
    make_event,
)
from identity.signing import public_key_pem, sign_envelope


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def raw_producer(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    yield producer
    await producer.stop()


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    consumers = await RunningConsumers(settings).start()
    yield consumers
    await consumers.stop()


def uid() -> str:
    return uuid.uuid4().hex[:8]


async def applied(database: Database, event_id: uuid.UUID) -> bool:
    async with database.session() as session:
        return await session.get(InboxEntry, event_id) is not None


async def publish_then_marker(
    raw_producer: AIOKafkaProducer,
    database: Database,
    topic: str,
    records: list[tuple[Envelope, str]],
    marker: EventPayload,
) -> None:
    """``records`` (envelope, record key) on partition 0 of ``topic``, then a valid signed marker;
    waits until it is applied."""
    for envelope, key in records:
        await raw_producer.send_and_wait(
            topic, encode_event(envelope), key=encode_key(key), partition=0
        )
    valid = sign_customer_event(make_event(marker, tenant_id=f"marker-{uid()}"))
    await raw_producer.send_and_wait(
        topic, encode_event(valid), key=encode_key(topics.route(valid)[1]), partition=0
    )
    await eventually(
        lambda: applied(database, valid.event_id), what=f"the marker behind the records on {topic}"
    )


def counted(metric: str, topic: str, reason: str) -> float:
    return REGISTRY.get_sample_value(metric, {"topic": topic, "reason": reason}) or 0.0


async def num_rows(database: Database, model, **equal) -> int:
    async with database.session() as session:
        where = [getattr(model, name) == value for name, value in equal.items()]
        return await session.scalar(select(func.count()).select_from(model).where(*where))


# --- 1. every topic carries only its types
# ------------------------------------------------------------------------


def test_every_event_type_has_one_topic_and_every_other_topic_refuses_it() -> None:
    assert sorted(topics.TOPIC_BY_TYPE) == sorted(EVENT_TYPES)
    assert sum(len(types) for types in topics.TYPES_BY_TOPIC.values()) == len(EVENT_TYPES)
    tenant = "acme"
    samples = {
        DocumentUpdated.TYPE: make_event(DocumentUpdated(doc_id="d", version=1), tenant_id=tenant),
        ErasureRequested.TYPE: make_event(
            ErasureRequested(subject_id="s", reason="r"), tenant_id=tenant
        ),
        PermissionRevoked.TYPE: make_event(
            PermissionRevoked(auth_scope="hr", policy_version=2), tenant_id=tenant
        ),
    }
    for envelope in samples.values():
        home, key = topics.route(envelope)
        assert topics.routing_problem(home, key, envelope) is None
        for topic in set(topics.TYPES_BY_TOPIC) - {home}:
            assert topics.routing_problem(topic, key, envelope) == topics.WRONG_TOPIC, (
                envelope.type,
                topic,
            )
        assert (
            topics.routing_problem(home, f"globex:{key.partition(':')[2]}", envelope)
            == topics.KEY_TENANT_MISMATCH
        )
        assert topics.routing_problem(home, None, envelope) == topics.KEY_TENANT_MISMATCH


async def test_an_event_on_a_topic_that_does_not_carry_its_type_is_dead_lettered_never_decided(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    """A principal allowed to write kvledger.documents or kvledger.permissions cannot start an erasure there, and an
    update on kvledger.erasures decides nothing: per-topic ACLs mean something."""
    tenant = f"t-{uid()}"
    erase = sign_customer_event(
        make_event(ErasureRequested(subject_id="alice", reason="misrouted"), tenant_id=tenant)
    )
    erase_again = sign_customer_event(
        make_event(ErasureRequested(subject_id="alice", reason="misrouted"), tenant_id=tenant)
    )
    update = sign_customer_event(
        make_event(DocumentUpdated(doc_id="handbook", version=9), tenant_id=tenant)
    )
    cases = [
        (topics.DOCUMENTS, erase),
        (topics.PERMISSIONS, erase_again),
        (topics.ERASURES, update),
    ]
    before = {
        topic: counted("kvledger_misrouted_records_total", topic, "wrong_topic")
        for topic, _ in cases
    }
    markers: dict[str, EventPayload] = {
        topics.DOCUMENTS: DocumentUpdated(doc_id="marker", version=1),
        topics.PERMISSIONS: PermissionRevoked(auth_scope="marker", policy_version=1),
        topics.ERASURES: ErasureRequested(subject_id="marker", reason="marker"),
    }
    for topic, envelope in cases:
        await publish_then_marker(
            raw_producer, database, topic, [(envelope, topics.route(envelope)[1])], markers[topic]
        )
    group = settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    letters = await dead_letters(
        settings.kafka.bootstrap, group, {envelope.event_id for _, envelope in cases}
    )
    assert set(letters.values()) == {"routing: wrong_topic"}
    assert {
        topic: counted("kvledger_misrouted_records_total", topic, "wrong_topic") - before[topic]
        for topic, _ in cases
    } == {topic: 1.0 for topic, _ in cases}
    assert await num_rows(database, Erasure, tenant_id=tenant) == 0
    assert await num_rows(database, Document, tenant_id=tenant) == 0


async def test_a_record_keyed_for_one_tenant_whose_envelope_names_another_is_dead_lettered(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    acme, globex = f"acme-{uid()}", f"globex-{uid()}"
    erase = sign_customer_event(
        make_event(ErasureRequested(subject_id="bob", reason="cross-tenant"), tenant_id=globex)
    )
    before = counted("kvledger_misrouted_records_total", topics.ERASURES, "key_tenant_mismatch")
    marker = ErasureRequested(subject_id="marker", reason="marker")
    await publish_then_marker(
        raw_producer, database, topics.ERASURES, [(erase, f"{acme}:bob")], marker
    )
    group = settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    assert await dead_letters(settings.kafka.bootstrap, group, {erase.event_id}) == {
        erase.event_id: "routing: key_tenant_mismatch"
    }
    assert (
        counted("kvledger_misrouted_records_total", topics.ERASURES, "key_tenant_mismatch") - before
        == 1
    )
    assert await num_rows(database, Erasure, tenant_id=globex) == 0


# --- 2. customer events are signed by a producer key bound to their tenant
# -----------------------------------------


@pytest.fixture(scope="module")
async def client(settings: CoordinatorSettings) -> AsyncIterator[httpx.AsyncClient]:
    from coordinator.api.app import create_app

    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        yield client


async def enroll(
    client: httpx.AsyncClient, key: Ed25519PrivateKey, role: str, tenant: str, **binding
) -> httpx.Response:
    body = {
        "public_key_pem": public_key_pem(key.public_key()).decode(),
        "name": f"producer-{uid()}",
        **binding,
    }
    return await client.post("/v1/producer-keys", json=body, headers=operator_headers(role, tenant))


async def test_only_events_signed_by_a_live_key_bound_to_their_tenant_are_decided(
    coordinator,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
    database: Database,
    raw_producer: AIOKafkaProducer,
) -> None:
    """PermissionRevoked(globex, hr, 2^53-1) from anyone but globex's producers locks nobody out."""
    acme, globex = f"acme-{uid()}", f"globex-{uid()}"
    acme_key, revoked_key, stranger = (
        Ed25519PrivateKey.generate(),
        Ed25519PrivateKey.generate(),
        Ed25519PrivateKey.generate(),
    )
    assert (await enroll(client, acme_key, "tenant-admin", acme, tenants=[acme])).status_code == 201
    revoked = await enroll(client, revoked_key, "tenant-admin", globex, tenants=[globex])
    revoke = await client.post(
        f"/v1/producer-keys/{revoked.json()['key_id']}/revoke",
        headers=operator_headers("tenant-admin", globex),
    )
    assert revoke.status_code == 200, revoke.text

    def lockout(tenant: str) -> Envelope:
        return make_event(
            PermissionRevoked(auth_scope="hr", policy_version=MAX_SAFE_INT), tenant_id=tenant
        )

    signed_by_acme = sign_envelope(lockout(acme), acme_key)
    tampered = signed_by_acme.model_copy(update={"tenant_id": globex})
    hostile = {
        "unsigned": lockout(globex),
        "unknown_key": sign_envelope(lockout(globex), stranger),
        "revoked_key": sign_envelope(lockout(globex), revoked_key),
        "tenant_not_bound": sign_envelope(lockout(globex), acme_key),
        "bad_signature": tampered,
    }
    before = {
        reason: counted("kvledger_unverified_records_total", topics.PERMISSIONS, reason)
        for reason in hostile
    }
    records = [
        (envelope, topics.route(envelope)[1]) for envelope in (*hostile.values(), signed_by_acme)
    ]
    await publish_then_marker(
        raw_producer,
        database,
        topics.PERMISSIONS,
        records,
        PermissionRevoked(auth_scope="m", policy_version=1),
    )

    group = settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    letters = await dead_letters(
        settings.kafka.bootstrap, group, {envelope.event_id for envelope in hostile.values()}
    )
    assert letters == {
        envelope.event_id: f"signature: {reason}" for reason, envelope in hostile.items()
    }
    assert {
        reason: counted("kvledger_unverified_records_total", topics.PERMISSIONS, reason)
        - before[reason]
        for reason in hostile
    } == dict.fromkeys(hostile, 1.0)
    assert await num_rows(database, Policy, tenant_id=globex) == 0
    assert (
        await num_rows(database, Policy, tenant_id=acme) == 1
    )  # acme's own producer decides for acme


async def test_tenant_admins_bind_keys_to_their_own_tenant_only_and_platform_admins_to_any(
    client: httpx.AsyncClient,
) -> None:
    acme, globex = f"acme-{uid()}", f"globex-{uid()}"
    refused = [
        await enroll(client, Ed25519PrivateKey.generate(), "tenant-admin", acme, tenants=[globex]),
        await enroll(
            client, Ed25519PrivateKey.generate(), "tenant-admin", acme, tenants=[acme, globex]
        ),
        await enroll(client, Ed25519PrivateKey.generate(), "tenant-admin", acme, all_tenants=True),
    ]
    assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [
        (403, "tenant_forbidden")
    ] * 3
    auditor = await enroll(client, Ed25519PrivateKey.generate(), "auditor", acme, tenants=[acme])
    assert (auditor.status_code, auditor.json()["error"]["code"]) == (403, "insufficient_role")

    own = await enroll(client, Ed25519PrivateKey.generate(), "tenant-admin", acme, tenants=[acme])
    shared = await enroll(
        client, Ed25519PrivateKey.generate(), "platform-admin", "platform", tenants=[acme, globex]
    )
    everyone = await enroll(
        client, Ed25519PrivateKey.generate(), "platform-admin", "platform", all_tenants=True
    )
    assert [r.status_code for r in (own, shared, everyone)] == [201, 201, 201]
    assert (everyone.json()["all_tenants"], everyone.json()["tenants"]) == (True, [])

    seen = (
        await client.get("/v1/producer-keys", headers=operator_headers("tenant-admin", acme))
    ).json()["producer_keys"]
    by_id = {key["key_id"]: key for key in seen}
    assert {own.json()["key_id"], shared.json()["key_id"], everyone.json()["key_id"]} <= set(by_id)
    assert by_id[shared.json()["key_id"]]["tenants"] == [acme]  # globex is none of acme's business
    other = await client.get(
        "/v1/producer-keys",
        params={"tenant": globex},
        headers=operator_headers("tenant-admin", acme),
    )
    assert other.status_code == 403

    for key_id in (shared.json()["key_id"], everyone.json()["key_id"], "0" * 32):
        answer = await client.post(
            f"/v1/producer-keys/{key_id}/revoke", headers=operator_headers("tenant-admin", acme)
        )
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "tenant_forbidden")
    revoked = await client.post(
        f"/v1/producer-keys/{own.json()['key_id']}/revoke",
        headers=operator_headers("tenant-admin", acme),
    )
    assert revoked.json() == {"key_id": own.json()["key_id"], "revoked": True}
    again = await client.post(
        f"/v1/producer-keys/{own.json()['key_id']}/revoke",
        headers=operator_headers("tenant-admin", acme),
    )
    assert again.status_code == 404
    reenrolled = await client.post(
        "/v1/producer-keys",
        json={"public_key_pem": "not a key", "name": "x", "tenants": [acme]},
        headers=operator_headers("tenant-admin", acme),
    )
    assert (reenrolled.status_code, reenrolled.json()["error"]["code"]) == (
        400,
        "invalid_public_key",
    )


def test_an_event_signed_without_kvledger_code_as_docs_events_md_shows_is_trusted() -> None:
    """The recipe of docs/events.md ("Publishing without kvledger code"): sign the JSON you send,
    written as kvledger reads it back (every payload field, UTC ``Z`` time), with rfc8785 and
    cryptography only."""
    import base64
    import hashlib
    import json
    from datetime import UTC, datetime

    import rfc8785
    from cryptography.hazmat.primitives import serialization

    from coordinator.keys.producer_keys import ProducerBinding, producer_record_problem
    from events.schema import parse_event

    key = Ed25519PrivateKey.generate()
    event = {
        "event_id": str(uuid.uuid4()),
        "type": "PermissionRevoked",
        "schema_version": 1,
        "occurred_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tenant_id": "acme",
        "payload": {"auth_scope": "hr", "policy_version": 8, "subject_id": None},
    }
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    kid = hashlib.sha256(raw).digest()[:16].hex()
    event["signature"] = {
        "kid": kid,
        "sig": base64.urlsafe_b64encode(key.sign(rfc8785.dumps(event))).rstrip(b"=").decode(),
    }
    received = parse_event(json.dumps(event))
    binding = ProducerBinding(
        kid,
        "hr-system",
        key.public_key(),
        all_tenants=False,
        tenants=frozenset({"acme"}),
        revoked=False,
    )
    assert producer_record_problem(received, {kid: binding}) is None
    # Omitting an optional field changes what kvledger reads back: the signature no longer matches.
    del event["payload"]["subject_id"], event["signature"]
    event["signature"] = {
        "kid": kid,
        "sig": base64.urlsafe_b64encode(key.sign(rfc8785.dumps(event))).rstrip(b"=").decode(),
    }
    assert (
        producer_record_problem(parse_event(json.dumps(event)), {kid: binding}) == "bad_signature"
    )
