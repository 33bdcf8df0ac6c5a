"""No record stalls a consumer: hostile values are dead-lettered, database refusals isolated, transient failures retried.

Real Postgres (a database of this module, migrated), the real broker, and the
coordinator's consumers in-process (``run_consumers``). Records are hand-built JSON
bytes, so nothing here goes through the pydantic models on the way in: this is what
an attacker with write access to a topic can send.

The broker is shared by the session, so the module first waits until its consumer
groups have caught up with every partition (:func:`caught_up`); after that every
record they dead-letter is one of this module's, and counter deltas are exact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer
from helpers.ledger import (
    RunningConsumers,
    connect,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
    node_key,
    scan_topic,
    sign_customer_event,
)
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from coordinator.consumers import INVALIDATION_GROUP_SUFFIX
from coordinator.ledger.db import Database
from coordinator.ledger.models import Document, InboxEntry, Invalidation, Namespace, Node, Policy
from coordinator.settings import CoordinatorSettings
from events.codec import DeadLetter, encode_event, encode_key
from events.schema import (
    DocumentUpdated,
    ErasureRequested,
    EventPayload,
    NodeHeartbeat,
    NodeStarted,
    PermissionRevoked,
    make_event,
)
from events.topics import (
    DEAD_LETTER,
    DOCUMENTS,
    ERASURES,
    KV_EVENTS,
    PERMISSIONS,
    document_key,
    route,
)
from identity.signing import sign_envelope

BAD_IDS = {
    "NUL": "a\x00b",
    "newline": "a\nb",
    "escape": "a\x1b[31mb",
    "DEL": "a\x7fb",
    "C1": "a\x9bb",
    "257 characters": "x" * 257,
    "empty": "",
}
BAD_COUNTS = {"2^53": 2**53, "2^63": 2**63, "-1": -1}


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap, ledger={"inventory_retry_s": 3600})


@pytest.fixture(scope="module")
async def raw_producer(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    yield producer
    await producer.stop()


async def applied(database: Database, *event_ids: uuid.UUID) -> bool:
    async with database.session() as session:
        found = await session.scalar(select(func.count()).where(InboxEntry.event_id.in_(event_ids)))
    return found == len(event_ids)


@pytest.fixture(scope="module")
async def coordinator(
    settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
):
    """The consumers, caught up: a marker event on every partition of every topic they read has been
    applied."""
    consumers = await RunningConsumers(settings).start()
    uid = uuid.uuid4().hex[:8]
    markers = []
    for topic in (KV_EVENTS, DOCUMENTS, PERMISSIONS, ERASURES):
        for partition in sorted(await raw_producer.partitions_for(topic)):
            name = f"sync-{uid}-{partition}"
            payload, tenant = {
                KV_EVENTS: (NodeStarted(node_id=name, epoch=1, seq=0, namespace="ns-sync"), None),
                DOCUMENTS: (DocumentUpdated(doc_id=name, version=1), f"sync-{uid}"),
                PERMISSIONS: (PermissionRevoked(auth_scope=name, policy_version=1), f"sync-{uid}"),
                ERASURES: (ErasureRequested(subject_id=name, reason="sync"), f"sync-{uid}"),
            }[topic]
            envelope = make_event(payload, tenant_id=tenant)
            value, key = await record_value(settings, envelope), encode_key(route(envelope)[1])
            await raw_producer.send_and_wait(topic, value, key=key, partition=partition)
            markers.append(envelope.event_id)
    await eventually(
        lambda: applied(database, *markers), timeout_s=120, what="the consumers to catch up"
    )
    yield
    await consumers.stop()


async def record_value(settings: CoordinatorSettings, envelope) -> bytes:
    """The bytes a real producer would send: node events signed with their node's enrolled test key,
    customer events with the tests' producer key."""
    if route(envelope)[0] != KV_EVENTS:
        return encode_event(sign_customer_event(envelope))
    node_id = envelope.payload.node_id
    await enroll_nodes(settings.database.url.get_secret_value(), [node_id])
    return encode_event(sign_envelope(envelope, node_key(node_id)))


def dead_letter_count(topic: str) -> float:
    return REGISTRY.get_sample_value("kvledger_dead_letter_total", {"topic": topic}) or 0.0


def handler_failures(group: str) -> float:
    return (
        REGISTRY.get_sample_value("kvledger_consumer_handler_failures_total", {"group": group})
        or 0.0
    )


async def dead_letters_of(bootstrap: str, values: list[bytes]) -> list[DeadLetter]:
    """The dead letters wrapping ``values`` (each found once; raises TimeoutError if one never
    appears)."""
    found: dict[bytes, DeadLetter] = {}

    def visit(record) -> bool:
        letter = DeadLetter.model_validate_json(record.value)
        if letter.raw_value() in values:
            assert letter.raw_value() not in found, "a record was dead-lettered twice"
            found[letter.raw_value()] = letter
        return len(found) == len(values)

    await scan_topic(bootstrap, DEAD_LETTER, visit)
    return [found[value] for value in values]


def _replace(envelope_json: dict, path: str, value) -> bytes:
    node = envelope_json
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return json.dumps(envelope_json).encode()


def _case(topic: str, uid: str) -> tuple[EventPayload, str | None, list[str], list[str]]:
    """A valid event of ``topic`` with the paths of its identifier and count fields."""
    if topic == KV_EVENTS:
        return (
            NodeHeartbeat(node_id=f"n-{uid}", epoch=1, seq=0),
            None,
            ["payload.node_id"],
            ["payload.epoch", "payload.seq"],
        )
    if topic == DOCUMENTS:
        return (
            DocumentUpdated(doc_id=f"d-{uid}", version=1),
            f"t-{uid}",
            ["tenant_id", "payload.doc_id"],
            ["payload.version"],
        )
    if topic == PERMISSIONS:
        return (
            PermissionRevoked(auth_scope=f"s-{uid}", policy_version=1),
            f"t-{uid}",
            ["payload.auth_scope"],
            ["payload.policy_version"],
        )
    return (
        ErasureRequested(subject_id=f"u-{uid}", reason="test"),
        f"t-{uid}",
        ["payload.subject_id", "tenant_id"],
        [],
    )


BAD_RECORDS = [
    (topic, label, bad)
    for topic in (KV_EVENTS, DOCUMENTS, PERMISSIONS, ERASURES)
    for label, bad in [
        *(("id", v) for v in BAD_IDS.values()),
        *(("count", v) for v in BAD_COUNTS.values()),
    ]
    if not (topic == ERASURES and label == "count")
] + [(ERASURES, "reason", "a\x00b"), (ERASURES, "reason", "r" * 2001)]


@pytest.mark.parametrize(("topic", "kind", "bad"), BAD_RECORDS, ids=lambda v: repr(v)[:24])
async def test_a_hostile_value_is_dead_lettered_and_the_partition_keeps_flowing(
    coordinator,
    settings: CoordinatorSettings,
    database: Database,
    raw_producer: AIOKafkaProducer,
    caplog: pytest.LogCaptureFixture,
    topic: str,
    kind: str,
    bad,
) -> None:
    uid = uuid.uuid4().hex[:8]
    payload, tenant, id_paths, count_paths = _case(topic, uid)
    valid = make_event(payload, tenant_id=tenant)
    _, key = route(valid)
    raw = json.loads(encode_event(make_event(payload, tenant_id=tenant)))
    paths = {"id": id_paths, "count": count_paths, "reason": ["payload.reason"]}[kind]
    bad_values = [_replace(json.loads(json.dumps(raw)), path, bad) for path in paths]
    before = dead_letter_count(topic)
    with caplog.at_level(logging.WARNING, logger="events.kafka"):
        for value in bad_values:
            await raw_producer.send_and_wait(topic, value, key=encode_key(key))
        # The same key, so the same partition: it is consumed only after the bad records.
        metadata = await raw_producer.send_and_wait(
            topic, await record_value(settings, valid), key=encode_key(key)
        )
        await eventually(
            lambda: applied(database, valid.event_id), what="the valid event after the bad ones"
        )
        letters = await dead_letters_of(settings.kafka.bootstrap, bad_values)
    group = settings.kafka.group_id + ("" if topic == KV_EVENTS else INVALIDATION_GROUP_SUFFIX)
    for letter, path in zip(letters, paths, strict=True):
        assert (letter.topic, letter.partition, letter.raw_key(), letter.group_id) == (
            topic,
            metadata.partition,
            key.encode(),
            group,
        )
        assert letter.offset < metadata.offset
        assert letter.error.startswith(path)
    assert dead_letter_count(topic) - before == len(bad_values)
    alerts = [r for r in caplog.records if r.getMessage().startswith(f"dead-lettered {topic}")]
    assert [r.levelno for r in alerts] == [
        logging.ERROR if topic in (PERMISSIONS, ERASURES) else logging.WARNING
    ] * len(paths)
    if topic == DOCUMENTS:
        async with database.session() as session:
            document = await session.get(Document, (tenant, f"d-{uid}"))
        assert (document.version, document.deleted) == (1, False)
    elif topic == PERMISSIONS:
        async with database.session() as session:
            assert (await session.get(Policy, (tenant, f"s-{uid}"))).policy_version == 1
    elif topic == KV_EVENTS:
        async with database.session() as session:
            assert (await session.get(Node, f"n-{uid}")).epoch == 1


async def test_a_lone_surrogate_is_dead_lettered(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    uid = uuid.uuid4().hex[:8]
    valid = sign_customer_event(
        make_event(DocumentUpdated(doc_id=f"d-{uid}", version=1), tenant_id=f"t-{uid}")
    )
    bad = encode_event(valid).replace(f"d-{uid}".encode(), b"d-\\ud800")
    before = dead_letter_count(DOCUMENTS)
    await raw_producer.send_and_wait(DOCUMENTS, bad, key=encode_key(f"t-{uid}:d-{uid}"))
    await raw_producer.send_and_wait(
        DOCUMENTS, encode_event(valid), key=encode_key(f"t-{uid}:d-{uid}")
    )
    await eventually(
        lambda: applied(database, valid.event_id), what="the valid event after the bad one"
    )
    (letter,) = await dead_letters_of(settings.kafka.bootstrap, [bad])
    assert letter.error.startswith("Invalid JSON")
    assert dead_letter_count(DOCUMENTS) - before == 1


# --- records the schema accepts but the database refuses -------------------------------------


async def _refuse(url: str, table: str, column: str, value: str) -> str:
    """A CHECK constraint of this module's database that refuses ``value``: the lowest-level way to
    make Postgres refuse one record that satisfies the contract. Returns the constraint's name."""
    name = f"poison_{uuid.uuid4().hex[:8]}"
    connection = await connect(url)
    try:
        await connection.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({column} <> '{value}') NOT VALID"
        )
    finally:
        await connection.close()
    return name


async def _drop(url: str, table: str, name: str) -> None:
    connection = await connect(url)
    try:
        await connection.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    finally:
        await connection.close()


async def test_a_document_the_database_refuses_is_isolated_and_the_rest_of_its_batch_applied_once(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    uid = uuid.uuid4().hex[:8]
    tenant = f"t-{uid}"
    constraint = await _refuse(
        settings.database.url.get_secret_value(), "documents", "doc_id", f"poison-{uid}"
    )
    try:
        names = [f"a-{uid}", f"b-{uid}", f"poison-{uid}", f"c-{uid}", f"d-{uid}"]
        events = [
            sign_customer_event(
                make_event(DocumentUpdated(doc_id=name, version=3), tenant_id=tenant)
            )
            for name in names
        ]
        before = dead_letter_count(DOCUMENTS)
        # One partition, so the consumer fetches them as one batch (and in this order); each under
        # its own key.
        sent = [
            await raw_producer.send(
                DOCUMENTS,
                encode_event(e),
                key=encode_key(document_key(tenant, e.payload.doc_id)),
                partition=0,
            )
            for e in events
        ]
        metadata = [await future for future in sent]
        good = [e.event_id for e in events if e.payload.doc_id != f"poison-{uid}"]
        await eventually(lambda: applied(database, *good), what="the good documents of the batch")
        (letter,) = await dead_letters_of(settings.kafka.bootstrap, [encode_event(events[2])])
    finally:
        await _drop(settings.database.url.get_secret_value(), "documents", constraint)
    assert (letter.topic, letter.partition, letter.offset) == (
        DOCUMENTS,
        metadata[2].partition,
        metadata[2].offset,
    )
    assert letter.group_id == settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    assert letter.error == (
        f"refused by the {settings.kafka.group_id}{INVALIDATION_GROUP_SUFFIX} handler: CheckViolationError (SQLSTATE 23514)"
    )
    assert dead_letter_count(DOCUMENTS) - before == 1
    async with database.session() as session:
        documents = {
            d.doc_id: d.version
            for d in (
                await session.scalars(select(Document).where(Document.tenant_id == tenant))
            ).all()
        }
        decided = (
            await session.execute(
                select(Invalidation.source_event_id, func.count())
                .where(Invalidation.source_event_id.in_([e.event_id for e in events]))
                .group_by(Invalidation.source_event_id)
            )
        ).all()
    assert documents == {name: 3 for name in names if name != f"poison-{uid}"}
    assert dict(decided) == {event_id: 1 for event_id in good}  # applied exactly once
    assert not await applied(database, events[2].event_id)


async def test_a_kv_event_the_database_refuses_is_isolated(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    uid = uuid.uuid4().hex[:8]
    constraint = await _refuse(
        settings.database.url.get_secret_value(), "namespaces", "namespace", f"ns-poison-{uid}"
    )
    try:
        events = [
            make_event(NodeStarted(node_id=f"n{i}-{uid}", epoch=1, seq=0, namespace=namespace))
            for i, namespace in enumerate([f"ns-{uid}", f"ns-poison-{uid}", f"ns-{uid}"])
        ]
        values = [await record_value(settings, e) for e in events]
        sent = [await raw_producer.send(KV_EVENTS, value, key=b"one-partition") for value in values]
        await asyncio.gather(*sent)
        await eventually(
            lambda: applied(database, events[0].event_id, events[2].event_id),
            what="the good node events",
        )
        (letter,) = await dead_letters_of(settings.kafka.bootstrap, [values[1]])
    finally:
        await _drop(settings.database.url.get_secret_value(), "namespaces", constraint)
    assert (
        letter.error
        == f"refused by the {settings.kafka.group_id} handler: CheckViolationError (SQLSTATE 23514)"
    )
    async with database.session() as session:
        nodes = (
            await session.scalars(select(Node.node_id).where(Node.node_id.like(f"%-{uid}")))
        ).all()
        namespaces = (
            await session.scalars(
                select(Namespace.namespace).where(Namespace.namespace.like(f"%{uid}"))
            )
        ).all()
    assert sorted(nodes) == [f"n0-{uid}", f"n2-{uid}"]
    assert namespaces == [f"ns-{uid}"]


# --- transient failures ---------------------------------------------------------------------


async def test_a_transient_failure_is_retried_and_nothing_is_dead_lettered(
    coordinator, settings: CoordinatorSettings, database: Database, raw_producer: AIOKafkaProducer
) -> None:
    """The consumer's connection is killed mid-batch (pg_terminate_backend): the batch is retried, not dead-lettered."""
    uid = uuid.uuid4().hex[:8]
    tenant = f"t-{uid}"
    event = sign_customer_event(
        make_event(DocumentUpdated(doc_id=f"d-{uid}", version=2), tenant_id=tenant)
    )
    group = settings.kafka.group_id + INVALIDATION_GROUP_SUFFIX
    failures_before, letters_before = handler_failures(group), dead_letter_count(DOCUMENTS)
    blocker = await connect(settings.database.url.get_secret_value())
    try:
        async with blocker.transaction():
            # Hold the documents table: the consumer's transaction waits on this lock.
            await blocker.execute("LOCK TABLE documents IN ACCESS EXCLUSIVE MODE")
            await raw_producer.send_and_wait(
                DOCUMENTS, encode_event(event), key=encode_key(f"{tenant}:d-{uid}")
            )

            async def waiting() -> list[int]:
                return [
                    row["pid"]
                    for row in await blocker.fetch(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                        " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
                    )
                ]

            await eventually(lambda: _nonempty(waiting()), what="the consumer to wait on the lock")
            for pid in await waiting():
                await blocker.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await blocker.close()
    await eventually(lambda: applied(database, event.event_id), what="the retried event")
    assert handler_failures(group) - failures_before >= 1
    assert dead_letter_count(DOCUMENTS) == letters_before
    async with database.session() as session:
        assert (await session.get(Document, (tenant, f"d-{uid}"))).version == 2


async def _nonempty(values) -> bool:
    return bool(await values)
