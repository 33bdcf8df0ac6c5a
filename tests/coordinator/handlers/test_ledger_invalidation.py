"""Invalidation, coordinator side: user events → ledger decision → Invalidate command → acks →
complete.

Real Postgres (a database for this module) and the real broker; the coordinator's
consumers run in-process (``run_consumers``) and the HTTP API is served by the same
app a coordinator runs. Nodes are played by this test: it publishes their kv-events
and, after reading the Invalidate commands, their CommandAcks.

The broker and its topics are shared by the whole session, so this module's
consumers also ingest other modules' nodes and events. Every assertion is therefore
scoped to this module's own ids (tenants, documents, nodes), and acks are sent for
*every* expected target an invalidation lists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import uvicorn
from aiokafka import AIOKafkaProducer
from helpers.ledger import (
    JWT_SECRET,
    OPERATOR_PRIVATE_KEY_PEM,
    PRODUCER_KEY,
    FakeNode,
    RunningConsumers,
    coordinator_settings,
    eventually,
    fresh_database,
    scan_topic,
    sign_command,
    signed_customer_value,
    stored,
)
from prometheus_client import REGISTRY
from sqlalchemy import func, inspect, pool, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator.api.app import create_app
from coordinator.audit.audit_log import ReceiptKeys
from coordinator.handlers.erasure import ErasureService
from coordinator.handlers.invalidation import InvalidationHandler
from coordinator.ledger import migrate
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    DeadLetterCount,
    Document,
    Invalidation,
    InvalidationTarget,
    Namespace,
    Node,
    OutboxEntry,
    Placement,
    Policy,
)
from coordinator.ledger.transactions import lock_decisions
from coordinator.settings import CoordinatorSettings, DatabaseSettings
from events.codec import DeadLetter, encode_key
from events.kafka.consumer import ConsumedEvent
from events.kafka.producer import EventProducer
from events.schema import (
    ANY_VERSION,
    BlockRemoved,
    CommandAck,
    DocumentDeleted,
    DocumentUpdated,
    Invalidate,
    PermissionRevoked,
    RemovedBlock,
    TierEvidence,
    make_event,
    parse_event,
)
from events.topics import COMMANDS, DEAD_LETTER, DOCUMENTS, PERMISSIONS
from identity.signing import private_key_pem
from identity.tokens import issue_token
from kvledger import admin, publish


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(url, kafka_bootstrap, ledger={"inventory_retry_s": 3600})


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[None]:
    consumers = await RunningConsumers(settings).start()
    yield
    await consumers.stop()


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:8]


def token(*roles: str, tenant: str = "ops") -> dict[str, str]:
    """An operator token (the tests' operator issuer) with ``roles``, bound to ``tenant``."""
    return {
        "Authorization": f"Bearer {issue_token(tenant=tenant, sub='op', roles=roles, private_key_pem=OPERATOR_PRIVATE_KEY_PEM)}"
    }


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _nodes_applied(database: Database, *nodes: FakeNode) -> None:
    async def applied() -> bool:
        async with database.session() as session:
            for node in nodes:
                row = await session.get(Node, node.node_id)
                if row is None or (row.epoch, row.last_seq) < (node.epoch, node.seq):
                    return False
        return True

    await eventually(applied, what="the nodes' kv-events to be applied")


async def _invalidations(database: Database, **where) -> list[Invalidation]:
    async with database.session() as session:
        query = select(Invalidation).order_by(Invalidation.seq)
        for column, value in where.items():
            query = query.where(getattr(Invalidation, column) == value)
        return list((await session.scalars(query)).all())


async def _one_invalidation(database: Database, **where) -> Invalidation:
    async def decided() -> bool:
        return len(await _invalidations(database, **where)) >= 1

    await eventually(decided, what=f"an invalidation with {where}")
    (invalidation,) = await _invalidations(database, **where)
    return invalidation


async def _targets(database: Database, command_id: uuid.UUID) -> dict[str, InvalidationTarget]:
    async with database.session() as session:
        rows = await session.scalars(
            select(InvalidationTarget).where(InvalidationTarget.command_id == command_id)
        )
        return {row.node_id: row for row in rows}


async def _placements(database: Database, node_ids: set[str]) -> dict[tuple[str, str, str], tuple]:
    async with database.session() as session:
        rows = await session.scalars(select(Placement).where(Placement.node_id.in_(node_ids)))
        return {
            (p.block_hash.hex(), p.node_id, p.tier): (p.state, p.reason, p.invalidation_id)
            for p in rows
        }


async def _command(bootstrap: str, command_id: uuid.UUID) -> tuple[bytes, Invalidate]:
    found: list[tuple[bytes, Invalidate]] = []

    def visit(record) -> bool:
        payload = parse_event(record.value).payload
        if isinstance(payload, Invalidate) and payload.command_id == command_id:
            found.append((record.key, payload))
        return bool(found)

    await scan_topic(bootstrap, COMMANDS, visit)
    return found[0]


def _evidence(tier: str, hashes: list[str]) -> TierEvidence:
    method, check = (
        ("overwrite", "readback_zero") if tier in ("device", "host") else ("unlink", "file_absent")
    )
    return TierEvidence(
        tier=tier,
        removed=len(hashes),
        block_hashes=hashes,
        method=method,
        post_check=check,
        verified=True,
    )


async def _ack_all(
    producer: EventProducer,
    database: Database,
    command_id: uuid.UUID,
    evidence: dict[str, list[TierEvidence]],
) -> None:
    """Every expected target acks (foreign nodes of other modules with no evidence), as nodes would."""
    for node_id in await _targets(database, command_id):
        ack = CommandAck(
            command_id=command_id, node_id=node_id, epoch=1, evidence=evidence.get(node_id, [])
        )
        await producer.send(make_event(ack))


async def _status_is(database: Database, command_id: uuid.UUID, status: str) -> None:
    async def reached() -> bool:
        async with database.session() as session:
            return (await session.get(Invalidation, command_id)).status == status

    await eventually(reached, what=f"invalidation {command_id} to be {status}")


async def test_document_update_from_a_plain_producer(
    coordinator,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings,
    uid: str,
) -> None:
    tenant = f"acme-{uid}"
    a, b = FakeNode(producer, f"a-{uid}"), FakeNode(producer, f"b-{uid}")
    public = stored(f"{uid}/public", "device")
    old = stored(
        f"{uid}/old",
        "device",
        tenant_id=tenant,
        scope="tenant",
        auth_scopes=[("hr", 1)],
        documents=["handbook@1"],
    )
    old_disk = stored(
        f"{uid}/old-disk", "disk", tenant_id=tenant, scope="tenant", documents=["handbook@1"]
    )
    other = stored(f"{uid}/other", "device", tenant_id=tenant, scope="tenant", documents=["faq@1"])
    await a.start()
    await b.start()
    await a.store(public, old, other)
    await b.store(old, old_disk)
    await _nodes_applied(database, a, b)

    # A user's system: a plain producer, JSON bytes built by hand (then signed with its producer
    # key).
    event_id = str(uuid.uuid4())
    value = signed_customer_value(
        json.dumps(
            {
                "event_id": event_id,
                "type": "DocumentUpdated",
                "schema_version": 1,
                "occurred_at": datetime.now(UTC).isoformat(),
                "tenant_id": tenant,
                "payload": {"doc_id": "handbook", "version": 2},
            }
        ).encode()
    )
    plain = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all")
    await plain.start()
    try:
        await plain.send_and_wait(DOCUMENTS, value, key=f"{tenant}:handbook".encode())
        invalidation = await _one_invalidation(database, source_event_id=uuid.UUID(event_id))
        # The very same record again (redelivery) and an older version: neither decides anything.
        superseded = counter(
            "kvledger_invalidation_events_total", type="DocumentUpdated", outcome="superseded"
        )
        await plain.send_and_wait(DOCUMENTS, value, key=f"{tenant}:handbook".encode())
        older = json.loads(value) | {
            "event_id": str(uuid.uuid4()),
            "payload": {"doc_id": "handbook", "version": 1},
        }
        await plain.send_and_wait(
            DOCUMENTS,
            signed_customer_value(json.dumps(older).encode()),
            key=f"{tenant}:handbook".encode(),
        )
    finally:
        await plain.stop()

    command_id = invalidation.command_id
    predicate = {"kind": "document", "tenant": tenant, "doc_id": "handbook", "below_version": 2}
    assert (invalidation.kind, invalidation.predicate, invalidation.trigger) == (
        "document",
        predicate,
        "event",
    )
    assert (invalidation.status, invalidation.completed_at) == ("pending", None)
    async with database.session() as session:
        document = await session.get(Document, (tenant, "handbook"))
        registered = set((await session.scalars(select(Node.node_id))).all())
    assert (document.version, document.deleted, document.invalidation_id) == (2, False, command_id)
    targets = await _targets(database, command_id)
    assert {a.node_id, b.node_id} <= set(targets) <= registered
    assert {t.status for t in targets.values()} == {"pending"}

    key, command = await _command(settings.kafka.bootstrap, command_id)
    assert key == b"*"
    assert command.predicate.model_dump() == predicate and command.cutoff == invalidation.cutoff

    # Published by the deciding process itself (leased in the decision), then stamped sent.
    async def outbox_entry() -> OutboxEntry | None:
        async with database.session() as session:
            return await session.scalar(
                select(OutboxEntry).where(
                    OutboxEntry.payload["payload"]["command_id"].astext == str(command_id)
                )
            )

    async def sent() -> bool:
        return (await outbox_entry()).sent_at is not None

    await eventually(sent, what="the command's outbox row to be stamped sent")
    entry = await outbox_entry()
    assert entry.lease_until == invalidation.cutoff + timedelta(
        seconds=settings.ledger.outbox_lease_s
    )

    # Only the old version's copies are marked for deletion.
    marks = {k: v[2] for k, v in (await _placements(database, {a.node_id, b.node_id})).items()}
    assert marks == {
        (public.block_hash, a.node_id, "device"): None,
        (other.block_hash, a.node_id, "device"): None,
        (old.block_hash, a.node_id, "device"): command_id,
        (old.block_hash, b.node_id, "device"): command_id,
        (old_disk.block_hash, b.node_id, "disk"): command_id,
    }

    async def duplicates_seen() -> bool:
        return (
            counter(
                "kvledger_invalidation_events_total", type="DocumentUpdated", outcome="superseded"
            )
            > superseded
        )

    await eventually(duplicates_seen, what="the older version to be ignored")
    assert len(await _invalidations(database, source_event_id=uuid.UUID(event_id))) == 1
    async with database.session() as session:
        mine = await session.scalar(
            select(func.count())
            .select_from(Invalidation)
            .where(Invalidation.predicate["tenant"].astext == tenant)
        )
    assert mine == 1

    await _ack_all(
        producer,
        database,
        command_id,
        {
            a.node_id: [_evidence("device", [old.block_hash])],
            b.node_id: [
                _evidence("device", [old.block_hash]),
                _evidence("disk", [old_disk.block_hash]),
            ],
        },
    )
    await _status_is(database, command_id, "complete")
    placements = await _placements(database, {a.node_id, b.node_id})
    assert placements[(old_disk.block_hash, b.node_id, "disk")] == (
        "deleted",
        "invalidated",
        command_id,
    )
    assert placements[(old.block_hash, a.node_id, "device")] == (
        "deleted",
        "invalidated",
        command_id,
    )
    assert placements[(other.block_hash, a.node_id, "device")] == ("live", None, None)
    assert placements[(public.block_hash, a.node_id, "device")] == ("live", None, None)

    response = await client.get(
        f"/v1/invalidations/{command_id}", headers=token("auditor", tenant=tenant)
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "complete" and body["predicate"] == predicate
    assert body["source_event_id"] == event_id and body["trigger"] == "event"
    assert body["latency_ms"] >= 0 and body["completed_at"] is not None
    by_node = {t["node_id"]: t for t in body["targets"]}
    tiers_b = by_node[b.node_id]["tiers"]
    assert by_node[b.node_id]["status"] == "acked" and by_node[b.node_id]["latency_ms"] >= 0
    assert tiers_b["disk"]["status"] == "verified"
    assert tiers_b["disk"]["evidence"]["block_hashes"] == [old_disk.block_hash]
    assert tiers_b["disk"]["ledger"] == {"live": 0, "deleted": 1}
    assert tiers_b["host"] == {
        "status": "untouched",
        "evidence": None,
        "ledger": {"live": 0, "deleted": 0},
    }
    assert set(tiers_b) == {"device", "host", "disk", "snapshot"}

    # A late BlockStored of the superseded version: the decision is re-issued at once.
    late = stored(f"{uid}/late", "host", tenant_id=tenant, scope="tenant", documents=["handbook@1"])
    current = stored(
        f"{uid}/current", "host", tenant_id=tenant, scope="tenant", documents=["handbook@2"]
    )
    await a.store(current)
    await _nodes_applied(database, a)
    assert await _invalidations(database, parent_command_id=command_id) == []
    await a.store(late)
    reissued = await _one_invalidation(database, parent_command_id=command_id)
    assert (reissued.trigger, reissued.predicate, reissued.source_event_id) == (
        "late_block",
        predicate,
        None,
    )
    assert reissued.cutoff >= invalidation.cutoff
    key, command = await _command(settings.kafka.bootstrap, reissued.command_id)
    assert key == b"*" and command.predicate.model_dump() == predicate
    placements = await _placements(database, {a.node_id})
    assert placements[(late.block_hash, a.node_id, "host")] == ("live", None, reissued.command_id)
    assert placements[(current.block_hash, a.node_id, "host")] == ("live", None, None)

    # Deleting the document invalidates every version of it.
    await producer.send(make_event(DocumentDeleted(doc_id="handbook"), tenant_id=tenant))

    async def deleted() -> bool:
        async with database.session() as session:
            return (await session.get(Document, (tenant, "handbook"))).deleted

    await eventually(deleted, what="the document to be marked deleted")
    async with database.session() as session:
        document = await session.get(Document, (tenant, "handbook"))
        deletion = await session.get(Invalidation, document.invalidation_id)
    assert deletion.predicate == {**predicate, "below_version": ANY_VERSION}
    assert document.version == 2


async def test_permission_revocation_invalidates_the_whole_scope(
    coordinator,
    database: Database,
    producer: EventProducer,
    caplog: pytest.LogCaptureFixture,
    uid: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    tenant = f"acme-{uid}"
    node = FakeNode(producer, f"p-{uid}")
    hr1 = stored(f"{uid}/hr1", "device", tenant_id=tenant, scope="tenant", auth_scopes=[("hr", 1)])
    hr2 = stored(f"{uid}/hr2", "device", tenant_id=tenant, scope="tenant", auth_scopes=[("hr", 2)])
    sales = stored(
        f"{uid}/sales", "device", tenant_id=tenant, scope="tenant", auth_scopes=[("sales", 1)]
    )
    await node.start()
    await node.store(hr1, hr2, sales)
    await _nodes_applied(database, node)

    subject = f"alice-{uid}"
    event = make_event(
        PermissionRevoked(auth_scope="hr", policy_version=2, subject_id=subject), tenant_id=tenant
    )
    await producer.send(event)
    invalidation = await _one_invalidation(database, source_event_id=event.event_id)
    # Narrowed to one subject, yet the whole scope below the new version goes (tenant blocks name no
    # subject).
    assert invalidation.predicate == {
        "kind": "policy",
        "tenant": tenant,
        "auth_scope": "hr",
        "below_version": 2,
    }
    async with database.session() as session:
        policy = await session.get(Policy, (tenant, "hr"))
    assert (policy.policy_version, policy.invalidation_id) == (2, invalidation.command_id)
    marks = {k[0]: v[2] for k, v in (await _placements(database, {node.node_id})).items()}
    assert marks == {
        hr1.block_hash: invalidation.command_id,
        hr2.block_hash: None,
        sales.block_hash: None,
    }

    await _ack_all(
        producer,
        database,
        invalidation.command_id,
        {node.node_id: [_evidence("device", [hr1.block_hash])]},
    )
    await _status_is(database, invalidation.command_id, "complete")
    # The coordinator's own records (aiokafka's debug output quotes the test producer's bytes).
    ours = [
        record.getMessage() for record in caplog.records if not record.name.startswith("aiokafka")
    ]
    assert subject not in "\n".join(ours)
    assert subject not in json.dumps(invalidation.predicate)


async def test_unverified_ack_keeps_the_command_open(
    coordinator, database: Database, producer: EventProducer, uid: str
) -> None:
    tenant = f"acme-{uid}"
    node = FakeNode(producer, f"u-{uid}")
    block = stored(f"{uid}/b", "disk", tenant_id=tenant, scope="tenant", documents=["d@1"])
    await node.start()
    await node.store(block)
    await _nodes_applied(database, node)
    event = make_event(DocumentDeleted(doc_id="d"), tenant_id=tenant)
    await producer.send(event)
    invalidation = await _one_invalidation(database, source_event_id=event.event_id)
    bad = _evidence("disk", [block.block_hash]).model_copy(update={"verified": False})
    await _ack_all(producer, database, invalidation.command_id, {node.node_id: [bad]})
    await _status_is(database, invalidation.command_id, "failed")
    assert (await _placements(database, {node.node_id}))[(block.block_hash, node.node_id, "disk")][
        0
    ] == "live"
    # The node retries and verifies: the command completes.
    good = CommandAck(
        command_id=invalidation.command_id,
        node_id=node.node_id,
        epoch=1,
        evidence=[_evidence("disk", [block.block_hash])],
    )
    await producer.send(make_event(good))
    await _status_is(database, invalidation.command_id, "complete")
    assert (await _placements(database, {node.node_id}))[(block.block_hash, node.node_id, "disk")][
        0
    ] == "deleted"


async def test_malformed_events_are_dead_lettered_and_counted(
    coordinator,
    database: Database,
    producer: EventProducer,
    settings,
    caplog: pytest.LogCaptureFixture,
    uid: str,
) -> None:
    caplog.set_level(logging.WARNING)
    bad = {
        DOCUMENTS: json.dumps(
            {"event_id": str(uuid.uuid4()), "type": "DocumentUpdated", "marker": uid}
        ).encode(),
        PERMISSIONS: json.dumps(
            {
                "event_id": str(uuid.uuid4()),
                "type": "PermissionRevoked",
                "schema_version": 1,
                "occurred_at": datetime.now(UTC).isoformat(),
                "tenant_id": f"t-{uid}",
                "payload": {"auth_scope": "hr", "policy_version": "3"},  # a string is not a version
            }
        ).encode(),
    }
    async with database.session() as session:
        before = dict(
            (
                await session.execute(select(DeadLetterCount.topic, DeadLetterCount.num_records))
            ).all()
        )
    for topic, value in bad.items():
        await producer.send_raw(topic, value, encode_key(f"t-{uid}:x"))

    letters: dict[str, DeadLetter] = {}

    def visit(record) -> bool:
        letter = DeadLetter.model_validate_json(record.value)
        if letter.raw_value() in bad.values():
            letters[letter.topic] = letter
        return len(letters) == len(bad)

    await scan_topic(settings.kafka.bootstrap, DEAD_LETTER, visit)
    assert {letter.group_id for letter in letters.values()} == {
        settings.kafka.group_id + "-invalidations"
    }

    async def counted() -> bool:
        async with database.session() as session:
            now = dict(
                (
                    await session.execute(
                        select(DeadLetterCount.topic, DeadLetterCount.num_records)
                    )
                ).all()
            )
        return all(now.get(topic, 0) > before.get(topic, 0) for topic in bad)

    await eventually(counted, what="both dead letters to be counted")
    alerts = [
        r for r in caplog.records if r.levelno == logging.ERROR and PERMISSIONS in r.getMessage()
    ]
    assert alerts, "a dead-lettered permission event must be logged as an error (alert)"
    bad_id = uuid.UUID(json.loads(bad[PERMISSIONS])["event_id"])
    assert not await _invalidations(database, source_event_id=bad_id)


async def test_namespace_retirement(
    coordinator,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    uid: str,
) -> None:
    old_ns, new_ns = f"ns-old-{uid}", f"ns-new-{uid}"
    node = FakeNode(producer, f"n-{uid}", namespace=old_ns)
    block = stored(f"{uid}/ns", "disk", namespace=old_ns)
    await node.start()
    await node.store(block)
    await _nodes_applied(database, node)

    admin_headers = token("platform-admin")
    refused = await client.post(f"/v1/namespaces/{old_ns}/retire", headers=admin_headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "namespace_in_use"
    missing = await client.post(f"/v1/namespaces/ns-none-{uid}/retire", headers=admin_headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "namespace_not_found"
    for role in ("tenant-admin", "privacy-officer", "auditor"):
        forbidden = await client.post(f"/v1/namespaces/{old_ns}/retire", headers=token(role))
        assert (forbidden.status_code, forbidden.json()["error"]["code"]) == (
            403,
            "insufficient_role",
        )

    await node.start(namespace=new_ns)  # the rollout: the node now serves the new model
    await _nodes_applied(database, node)

    # Through the operator CLI, against a real HTTP server running this app.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: _started(server), what="the API server to start")
        # The CLI signs a platform-admin token with the stack's operator key.
        (tmp_path / "operator_key.pem").write_bytes(OPERATOR_PRIVATE_KEY_PEM)
        (tmp_path / "stack.json").write_text(
            json.dumps({"operator_private_key_file": str(tmp_path / "operator_key.pem")})
        )
        args = argparse.Namespace(
            namespace=old_ns,
            coordinator_url=f"http://127.0.0.1:{port}",
            token=None,
            stack=str(tmp_path),
        )
        monkeypatch.setenv("KVLEDGER_JWT_SECRET", JWT_SECRET)
        assert await asyncio.to_thread(admin.retire_namespace_cli, args) == 0
    finally:
        server.should_exit = True
        await serving

    async with database.session() as session:
        namespace = await session.get(Namespace, old_ns)
    assert namespace.status == "draining" and namespace.invalidation_id is not None
    command_id = namespace.invalidation_id
    key, command = await _command(settings.kafka.bootstrap, command_id)
    assert command.predicate.model_dump() == {"kind": "namespace", "ns": old_ns}

    again = await client.post(f"/v1/namespaces/{old_ns}/retire", headers=admin_headers)
    assert again.status_code == 200 and again.json()["invalidation_id"] == str(command_id)

    await _ack_all(
        producer, database, command_id, {node.node_id: [_evidence("disk", [block.block_hash])]}
    )
    await _status_is(database, command_id, "complete")
    assert (await client.get("/v1/namespaces", headers=token("auditor"))).status_code == 403
    listed = await client.get("/v1/namespaces", headers=token("platform-admin"))
    by_name = {ns["namespace"]: ns for ns in listed.json()["namespaces"]}
    assert by_name[old_ns]["status"] == "retired" and by_name[old_ns]["nodes"] == []
    assert by_name[new_ns]["status"] == "active" and by_name[new_ns]["nodes"] == [node.node_id]

    # A block of the retired namespace reported late is deleted again at once.
    await node.store(stored(f"{uid}/ns-late", "disk", namespace=old_ns))
    reissued = await _one_invalidation(database, parent_command_id=command_id)
    assert reissued.predicate == {"kind": "namespace", "ns": old_ns}


async def _started(server: uvicorn.Server) -> bool:
    return server.started


async def test_publish_cli(
    coordinator,
    database: Database,
    settings,
    capsys: pytest.CaptureFixture,
    uid: str,
    tmp_path,
    monkeypatch,
) -> None:
    tenant = f"cli-{uid}"
    key_file = tmp_path / "producer_key.pem"
    key_file.write_bytes(private_key_pem(PRODUCER_KEY))
    monkeypatch.chdir(tmp_path)  # no stack file: the key comes from --producer-key only

    def run(kind: str, producer_key: str | None = str(key_file), **fields) -> int:
        args = argparse.Namespace(
            kafka_bootstrap=settings.kafka.bootstrap,
            event_kind=kind,
            tenant=tenant,
            producer_key=producer_key,
            **fields,
        )
        return publish.cli(args)

    assert (
        await asyncio.to_thread(run, "document-updated", producer_key=None, doc="guide", version=5)
        == 2
    )
    assert "no producer key" in capsys.readouterr().err

    assert await asyncio.to_thread(run, "document-updated", doc="guide", version=5) == 0
    event_id = uuid.UUID(capsys.readouterr().out.strip())
    invalidation = await _one_invalidation(database, source_event_id=event_id)
    assert invalidation.predicate == {
        "kind": "document",
        "tenant": tenant,
        "doc_id": "guide",
        "below_version": 5,
    }

    assert (
        await asyncio.to_thread(
            run, "permission-revoked", auth_scope="hr", policy_version=4, subject=None
        )
        == 0
    )
    event_id = uuid.UUID(capsys.readouterr().out.strip())
    assert (await _one_invalidation(database, source_event_id=event_id)).kind == "policy"

    assert await asyncio.to_thread(run, "document-updated", doc="guide", version=-1) == 2
    assert "version" in capsys.readouterr().err
    bad_id = {"subject": "s", "reason": "r", "erasure_id": "not-a-uuid"}
    assert await asyncio.to_thread(run, "erasure-requested", **bad_id) == 2


async def test_a_decision_with_no_registered_node_is_complete_at_once(
    database_url: str, ledger_template: str
) -> None:
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url))
        try:
            erasures = ErasureService(
                database,
                subject_key=None,
                receipt_keys=ReceiptKeys(None, None),
                command_signer=sign_command,
            )
            handler = InvalidationHandler(database, erasures=erasures, command_signer=sign_command)
            event = make_event(DocumentUpdated(doc_id="guide", version=2), tenant_id="solo")
            consumed = ConsumedEvent(
                topic=DOCUMENTS,
                partition=0,
                offset=0,
                key="solo:guide",
                timestamp_ms=0,
                envelope=event,
            )
            await handler([consumed])
            (invalidation,) = await _invalidations(database, source_event_id=event.event_id)
            assert (invalidation.status, invalidation.completed_at) == (
                "complete",
                invalidation.created_at,
            )
            assert await _targets(database, invalidation.command_id) == {}
            async with database.session() as session:
                document = await session.get(Document, ("solo", "guide"))
            assert (document.version, document.invalidation_id) == (2, invalidation.command_id)
        finally:
            await database.dispose()


async def test_a_removals_only_batch_does_not_wait_for_a_decision_but_a_store_does(
    coordinator, database: Database, producer: EventProducer, uid: str
) -> None:
    """A deciding transaction holds the advisory lock: a node's removals are applied meanwhile
    (they cannot hide a copy from the decision), a new copy only once the decision committed."""
    node = FakeNode(producer, f"lock-{uid}")
    kept, removed, added = (
        stored(f"{uid}/{label}", "device") for label in ("kept", "removed", "added")
    )
    await node.start()
    await node.store(kept, removed)
    await _nodes_applied(database, node)

    async def live() -> set[str]:
        rows = await _placements(database, {node.node_id})
        return {block for (block, _, _), (state, _, _) in rows.items() if state == "live"}

    async with database.session() as deciding, deciding.begin():
        await lock_decisions(deciding)
        node.seq += 1
        await producer.send(
            make_event(
                BlockRemoved(
                    node_id=node.node_id,
                    epoch=node.epoch,
                    seq=node.seq,
                    blocks=[RemovedBlock(block_hash=removed.block_hash, tier="device")],
                    reason="evicted",
                )
            )
        )
        await _nodes_applied(database, node)
        assert await live() == {kept.block_hash}
        await node.store(added)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_nodes_applied(database, node), timeout=1.0)
    await _nodes_applied(database, node)
    assert await live() == {kept.block_hash, added.block_hash}


async def test_decisions_survive_the_database_dropping_every_connection(
    coordinator, database: Database, producer: EventProducer, uid: str
) -> None:
    """As after a failover: the consumers do not test connections on checkout, so the batch that
    meets a dropped one fails and is retried on fresh connections — nothing is lost."""
    tenant = f"drop-{uid}"

    async def decided(version: int) -> Invalidation:
        event = make_event(DocumentUpdated(doc_id="handbook", version=version), tenant_id=tenant)
        await producer.send(event)
        return await _one_invalidation(database, source_event_id=event.event_id)

    await decided(2)
    async with database.session() as session:
        dropped = await session.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
    assert dropped >= 1, "the consumers hold pooled connections"
    invalidation = await decided(3)
    assert invalidation.predicate["below_version"] == 3


async def test_api_auth_shapes_and_listing(
    coordinator, database: Database, producer: EventProducer, client: httpx.AsyncClient, uid: str
) -> None:
    tenant = f"api-{uid}"
    events = [
        make_event(PermissionRevoked(auth_scope=f"s{i}", policy_version=1), tenant_id=tenant)
        for i in range(3)
    ]
    for event in events:
        await producer.send(event)
    ids = [
        (await _one_invalidation(database, source_event_id=e.event_id)).command_id for e in events
    ]

    url = f"/v1/invalidations/{ids[0]}"
    assert (await client.get(url)).status_code == 401
    assert (await client.get(url)).json()["error"]["type"] == "authentication_error"
    forbidden = await client.get(url, headers=token("user", tenant=tenant))
    assert forbidden.status_code == 403 and set(forbidden.json()["error"]) == {
        "message",
        "type",
        "code",
    }
    for role in ("tenant-admin", "privacy-officer", "auditor"):
        assert (await client.get(url, headers=token(role, tenant=tenant))).status_code == 200
    assert (await client.get(url, headers=token("platform-admin"))).status_code == 200
    assert (
        await client.get("/v1/invalidations/not-a-uuid", headers=token("platform-admin"))
    ).status_code == 400
    missing = await client.get(f"/v1/invalidations/{uuid.uuid4()}", headers=token("platform-admin"))
    assert (
        missing.status_code == 404 and missing.json()["error"]["code"] == "invalidation_not_found"
    )
    assert (
        await client.get("/v1/invalidations?status=bogus", headers=token("platform-admin"))
    ).status_code == 400
    assert (await client.get("/v1/namespaces")).status_code == 401

    seen, cursor = [], None
    while True:
        params = {"kind": "policy", "limit": 2, **({"before": cursor} if cursor else {})}
        page = (
            await client.get(
                "/v1/invalidations", params=params, headers=token("auditor", tenant=tenant)
            )
        ).json()
        seen += [(item["seq"], uuid.UUID(item["command_id"])) for item in page["invalidations"]]
        assert all(item["kind"] == "policy" for item in page["invalidations"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [seq for seq, _ in seen] == sorted(
        (seq for seq, _ in seen), reverse=True
    )  # newest first, no repeats
    # A tenant's auditor lists exactly its tenant's commands.
    assert len(seen) == len(set(seen)) and {command_id for _, command_id in seen} == set(ids)
    page = await client.get(
        "/v1/invalidations", params={"limit": 1}, headers=token("auditor", tenant=tenant)
    )
    (item,) = page.json()["invalidations"]
    assert {
        "command_id",
        "kind",
        "predicate",
        "cutoff",
        "status",
        "created_at",
        "completed_at",
        "latency_ms",
        "num_targets",
        "num_acked",
    } <= set(item)


async def test_migration_0002_up_and_down(database_url: str) -> None:
    async with fresh_database(database_url) as url:

        async def schema() -> tuple[set[str], set[str]]:
            engine = create_async_engine(url, poolclass=pool.NullPool)
            try:
                async with engine.connect() as connection:
                    return await connection.run_sync(
                        lambda sync: (
                            set(inspect(sync).get_table_names()),
                            {c["name"] for c in inspect(sync).get_columns("documents")},
                        )
                    )
            finally:
                await engine.dispose()

        await asyncio.to_thread(migrate.upgrade, url, "0002_invalidation")
        tables, columns = await schema()
        assert {"invalidations", "invalidation_targets"} <= tables and "invalidation_id" in columns
        await asyncio.to_thread(migrate.downgrade, url, "0001")
        tables, columns = await schema()
        assert (
            not {"invalidations", "invalidation_targets"} & tables
            and "invalidation_id" not in columns
        )
        await asyncio.to_thread(migrate.upgrade, url, "0002_invalidation")
        assert "invalidations" in (await schema())[0]
