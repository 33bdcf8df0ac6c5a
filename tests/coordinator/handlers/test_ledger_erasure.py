"""Privacy erasure, coordinator side: request → subject Invalidate → node acks → verified → signed
receipt.

Real Postgres (a database for this module) and the real broker; the coordinator's
consumers run in-process and the HTTP API is the app a coordinator serves. Nodes are
played by this test: it publishes their kv-events (the subject's blocks in every tier
and a snapshot) and their CommandAcks with per-tier evidence.

The broker is shared by the whole session, so this module's coordinator also learns
of other modules' nodes; every command lists them as targets, so the test acks for
every expected target (empty evidence for the nodes it does not play).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    SUBJECT_KEY,
    FakeNode,
    RunningConsumers,
    block_hash,
    coordinator_settings,
    eventually,
    fresh_database,
    operator_headers,
    scan_topic,
    stored,
)
from prometheus_client import REGISTRY
from sqlalchemy import func, select, text

from coordinator.audit.verifier import verify_served_receipt
from coordinator.keys.data_keys import DataKey, KeyService
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    AuditLogEntry,
    DeferredAck,
    Erasure,
    Invalidation,
    InvalidationTarget,
    Node,
    Placement,
    Receipt,
)
from coordinator.settings import CoordinatorSettings
from events.codec import DeadLetter
from events.kafka.producer import EventProducer
from events.schema import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    CommandAck,
    ErasureRequested,
    Invalidate,
    MovedBlock,
    RemovedBlock,
    SnapshotWritten,
    SubjectPredicate,
    TierEvidence,
    make_event,
    parse_event,
    subject_digest,
)
from events.topics import COMMANDS, DEAD_LETTER, ERASURES

TENANT = "erasure-tenant"
MASTER_KEY = base64.b64encode(b"m" * 32).decode()


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(
            url,
            kafka_bootstrap,
            ledger={"inventory_retry_s": 3600, "erasure_verify_interval_s": 0.2},
            keys={"master_key": MASTER_KEY},
        )


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    running = await RunningConsumers(settings).start()
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def receipts_seen() -> list[str]:
    """Erasure ids whose receipts earlier tests of this module verified (the tamper test re-fetches
    them)."""
    return []


def token(role: str) -> dict[str, str]:
    """An operator of this module's tenant."""
    return operator_headers(role, TENANT)


OFFICER = token("privacy-officer")


def digest(subject: str) -> str:
    return subject_digest(SUBJECT_KEY.encode(), TENANT, subject)


async def ack(
    producer: EventProducer, command_id: uuid.UUID, node_id: str, *evidence: TierEvidence
) -> None:
    await producer.send(
        make_event(
            CommandAck(command_id=command_id, node_id=node_id, epoch=1, evidence=list(evidence))
        )
    )


def evidence(
    tier: str, hashes: list[str], method: str, check: str, key_ids: tuple[str, ...] = ()
) -> TierEvidence:
    return TierEvidence(
        tier=tier,
        removed=len(hashes),
        block_hashes=hashes,
        method=method,
        post_check=check,
        verified=True,
        key_ids=list(key_ids),
    )


async def targets(database: Database, command_id: uuid.UUID) -> set[str]:
    async with database.session() as session:
        return set(
            (
                await session.scalars(
                    select(InvalidationTarget.node_id).where(
                        InvalidationTarget.command_id == command_id
                    )
                )
            ).all()
        )


async def status_of(client: httpx.AsyncClient, erasure_id: str) -> dict:
    response = await client.get(f"/v1/erasures/{erasure_id}", headers=token("auditor"))
    assert response.status_code == 200, response.text
    return response.json()


async def wait_status(client: httpx.AsyncClient, erasure_id: str, wanted: str) -> dict:
    async def reached() -> bool:
        return (await status_of(client, erasure_id))["status"] == wanted

    await eventually(reached, what=f"erasure {erasure_id} to be {wanted}")
    return await status_of(client, erasure_id)


async def placement_states(database: Database, hashes: list[str]) -> set[str]:
    async with database.session() as session:
        return set(
            (
                await session.scalars(
                    select(Placement.state).where(
                        Placement.block_hash.in_([bytes.fromhex(h) for h in hashes])
                    )
                )
            ).all()
        )


async def served_documents(client: httpx.AsyncClient, erasure_id: str) -> tuple[dict, dict, dict]:
    receipt = await client.get(f"/v1/erasures/{erasure_id}/receipt", headers=token("auditor"))
    checkpoint = await client.get("/v1/audit/checkpoint")
    keys = await client.get("/v1/receipts/keys")
    assert (receipt.status_code, checkpoint.status_code, keys.status_code) == (200, 200, 200), (
        receipt.text
    )
    return receipt.json(), checkpoint.json(), keys.json()


async def cli_verify(
    tmp_path: Path, receipt: dict, checkpoint: dict, keys: dict
) -> subprocess.CompletedProcess:
    paths = {}
    for name, document in (("receipt", receipt), ("checkpoint", checkpoint), ("keys", keys)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(document, indent=2))
    command = [
        sys.executable,
        "-m",
        "kvledger.cli",
        "verify-receipt",
        str(paths["receipt"]),
        "--checkpoint",
        str(paths["checkpoint"]),
        "--public-key",
        str(paths["keys"]),
    ]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )


async def test_erasure_across_nodes_tiers_and_snapshot_with_restart(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
    receipts_seen: list[str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    uid = uuid.uuid4().hex[:8]
    subject = f"alice-{uid}@example.com"
    mine, other = digest(subject), digest(f"bob-{uid}")
    node_a, node_b = FakeNode(producer, f"erase-a-{uid}"), FakeNode(producer, f"erase-b-{uid}")
    user = {"tenant_id": TENANT, "scope": "user", "subject_id": mine}
    h = {
        name: block_hash(f"{uid}-{name}")
        for name in ("a-dev", "a-host", "a-disk", "b-dev", "b-snap")
    }
    keep = [block_hash(f"{uid}-other"), block_hash(f"{uid}-public")]
    for node in (node_a, node_b):
        await node.start()
    await node_a.publish(
        BlockStored,
        blocks=[
            stored(f"{uid}-a-dev", "device", **user),
            stored(f"{uid}-a-host", "host", **user),
            stored(f"{uid}-a-disk", "disk", **user),
            stored(f"{uid}-other", "device", tenant_id=TENANT, scope="user", subject_id=other),
            stored(f"{uid}-public", "host"),
        ],
    )
    await node_b.publish(
        BlockStored,
        blocks=[stored(f"{uid}-b-dev", "device", **user), stored(f"{uid}-b-snap", "disk", **user)],
    )
    await node_b.publish(SnapshotWritten, snapshot_id=f"snap-{uid}", block_hashes=[h["b-snap"]])
    keys = KeyService(database, base64.b64decode(MASTER_KEY), SUBJECT_KEY.encode())
    data_key_id, _ = await keys.resolve(TENANT, mine)

    async def ledger_has_blocks() -> bool:
        # Both nodes: their records lie on different partitions, which the consumer may reach at
        # different times.
        async with database.session() as session:
            placed_on_a = await session.scalar(
                select(func.count())
                .select_from(Placement)
                .where(Placement.node_id == node_a.node_id)
            )
            snapshot_on_b = await session.scalar(
                select(func.count())
                .select_from(Placement)
                .where(Placement.node_id == node_b.node_id, Placement.tier == "snapshot")
            )
            return placed_on_a == 5 and snapshot_on_b == 1

    await eventually(ledger_has_blocks, what="the subject's blocks in the ledger")

    # Unauthorized callers start nothing.
    body = {"tenant_id": TENANT, "subject_id": subject, "reason": "GDPR art. 17 request"}
    assert (await client.post("/v1/erasures", json=body)).status_code == 401
    assert (
        await client.post("/v1/erasures", json=body, headers=token("auditor"))
    ).status_code == 403
    assert (
        await client.post("/v1/erasures", json=body, headers=token("tenant-admin"))
    ).status_code == 403
    bad = await client.post("/v1/erasures", json={**body, "reason": ""}, headers=OFFICER)
    assert bad.status_code == 400 and "error" in bad.json() and subject not in bad.text
    async with database.session() as session:
        assert await session.scalar(select(func.count()).select_from(Erasure)) == 0

    headers = {**OFFICER, "Idempotency-Key": f"req-{uid}"}
    first = await client.post("/v1/erasures", json=body, headers=headers)
    assert first.status_code == 202, first.text
    erasure_id = first.json()["id"]
    assert first.json()["status"] == "pending"
    again = await client.post("/v1/erasures", json=body, headers=headers)
    assert (again.status_code, again.json()["id"]) == (202, erasure_id)
    other_subject = await client.post(
        "/v1/erasures", json={**body, "subject_id": "someone-else"}, headers=headers
    )
    assert other_subject.status_code == 409

    described = await status_of(client, erasure_id)
    assert described["status"] == "pending" and described["subject_hash"] == mine
    assert data_key_id in described["key_ids_destroyed"]
    async with database.session() as session:
        assert (await session.get(DataKey, data_key_id)).destroyed_at is not None
    command_id = uuid.UUID(described["commands"][0]["command_id"])
    expected = await targets(database, command_id)
    assert {node_a.node_id, node_b.node_id} <= expected

    found: list[Invalidate] = []

    def visit(record) -> bool:
        payload = parse_event(record.value).payload
        if isinstance(payload, Invalidate) and payload.command_id == command_id:
            found.append(payload)
        return bool(found)

    await scan_topic(settings.kafka.bootstrap, COMMANDS, visit)
    assert found[0].predicate == SubjectPredicate(tenant=TENANT, subject_id=mine)

    # Node A (and every node this test does not play) acks: partial, never verified with B missing.
    await ack(
        producer,
        command_id,
        node_a.node_id,
        evidence("device", [h["a-dev"]], "overwrite", "readback_zero"),
        evidence("host", [h["a-host"]], "overwrite", "readback_zero"),
        evidence("disk", [h["a-disk"]], "crypto_erase", "key_destroyed", (data_key_id,)),
    )
    for foreign in expected - {node_a.node_id, node_b.node_id}:
        await ack(producer, command_id, foreign)
    partial = await wait_status(client, erasure_id, "partial")
    nodes = {node["node_id"]: node for node in partial["nodes"]}
    assert (
        nodes[node_a.node_id]["status"] == "acked" and nodes[node_b.node_id]["status"] == "pending"
    )
    assert nodes[node_b.node_id]["tiers"]["snapshot"]["live"] == 1
    await asyncio.sleep(1.0)  # several verifier passes
    assert (await status_of(client, erasure_id))["status"] == "partial"

    # The coordinator dies mid-erasure; a new one finishes it.
    await coordinator.stop()
    await coordinator.start()
    await ack(
        producer,
        command_id,
        node_b.node_id,
        evidence("device", [h["b-dev"]], "overwrite", "readback_zero"),
        evidence("disk", [h["b-snap"]], "crypto_erase", "key_destroyed", (data_key_id,)),
        evidence("snapshot", [h["b-snap"]], "crypto_erase", "key_destroyed", (data_key_id,)),
    )
    verified = await wait_status(client, erasure_id, "verified")
    assert verified["live_copies"] == 0 and verified["receipt_id"]
    assert await placement_states(database, list(h.values())) == {"deleted"}
    assert await placement_states(database, keep) == {"live"}

    receipt, checkpoint, key_document = await served_documents(client, erasure_id)
    result = verify_served_receipt(receipt, key_document, checkpoint)
    assert result.ok, [check for check in result.checks if not check.ok]
    body_ = receipt["receipt"]
    assert (
        body_["erasure_id"] == erasure_id
        and body_["subject_hash"] == mine
        and body_["tenant_id"] == TENANT
    )
    tiers = {
        (entry["node_id"], entry["tier"]): (entry["count"], entry["method"])
        for entry in body_["tiers"]
    }
    assert tiers == {
        (node_a.node_id, "device"): (1, "clear"),
        (node_a.node_id, "host"): (1, "clear"),
        (node_a.node_id, "disk"): (1, "purge-crypto-erase"),
        (node_b.node_id, "device"): (1, "clear"),
        (node_b.node_id, "disk"): (1, "purge-crypto-erase"),
        (node_b.node_id, "snapshot"): (1, "purge-crypto-erase"),
    }
    assert body_["block_commitment"]["count"] == 5
    assert data_key_id in body_["key_ids_destroyed"]
    completed = await cli_verify(tmp_path, receipt, checkpoint, key_document)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    proof = await client.get(
        f"/v1/audit/proof/{verified['receipt_id']}", headers=token("privacy-officer")
    )
    assert proof.status_code == 200 and proof.json() == receipt

    # A duplicate request after the fact: the same erasure, still exactly one receipt.
    duplicate = await client.post("/v1/erasures", json=body, headers=headers)
    assert duplicate.json() == {"id": erasure_id, "status": "verified"}
    await asyncio.sleep(0.5)
    async with database.session() as session:
        assert await session.scalar(select(func.count()).select_from(Receipt)) == 1
        assert await session.scalar(select(func.count()).select_from(Erasure)) == 1

    # Nothing of the subject in clear: not in any row of any table, not in any log line.
    async with database.session() as session:
        tables = (
            await session.scalars(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            )
        ).all()
        for table in tables:
            hits = await session.scalar(
                text(f'SELECT count(*) FROM "{table}" AS row WHERE row::text LIKE :raw'),
                {"raw": f"%{subject}%"},
            )
            assert hits == 0, f"the raw subject is stored in {table}"
    assert subject not in caplog.text
    receipts_seen.append(erasure_id)


async def test_erasure_requested_event_late_block_and_idempotency(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    receipts_seen: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    uid = uuid.uuid4().hex[:8]
    subject = f"carol-{uid}"
    mine = digest(subject)
    node = FakeNode(producer, f"erase-c-{uid}")
    erasure_id = uuid.uuid4()
    request = ErasureRequested(erasure_id=erasure_id, subject_id=subject, reason="user asked")
    await producer.send(make_event(request, tenant_id=TENANT))
    await producer.send(
        make_event(request, tenant_id=TENANT)
    )  # a re-publish: same erasure id, new event id

    async def started() -> bool:
        async with database.session() as session:
            return await session.get(Erasure, erasure_id) is not None

    await eventually(started, what="the erasure from the event")
    erasure = await status_of(client, str(erasure_id))
    assert erasure["subject_hash"] == mine and erasure["status"] == "pending"
    command_id = uuid.UUID(erasure["commands"][0]["command_id"])
    # The node registers after the erasure was decided, so it is not a target of the subject
    # command: its copies are covered by nothing it acked until the re-sends reach it. (Registered
    # before the decision, its ack of the subject command would cover everything it holds, and a
    # copy recorded after that ack counts as data built after the erasure: docs/design.md §6,
    # "Erasure".)
    await node.start()
    assert node.node_id not in await targets(database, command_id)

    # A block built from the subject before the cutoff arrives late: a re-send goes out at once.
    await node.publish(
        BlockStored,
        blocks=[stored(f"{uid}-late", "device", tenant_id=TENANT, scope="user", subject_id=mine)],
    )

    async def resent() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(func.count())
                    .select_from(Invalidation)
                    .where(Invalidation.parent_command_id == command_id)
                )
                == 1
            )

    await eventually(resent, what="the late-block re-send of the subject command")
    async with database.session() as session:
        resend = await session.scalar(
            select(Invalidation).where(Invalidation.parent_command_id == command_id)
        )
        assert (resend.kind, resend.trigger, resend.predicate["subject_id"]) == (
            "subject",
            "late_block",
            mine,
        )
    for target in await targets(database, command_id):
        await ack(producer, command_id, target)
    await asyncio.sleep(1.0)
    assert (await status_of(client, str(erasure_id)))[
        "status"
    ] == "partial"  # the re-send is not acked yet

    # Meanwhile the ledger records the block moving to host, after the re-send was decided: when
    # every command is complete and that copy is still live, the verifier sends the subject command
    # once more.
    late = block_hash(f"{uid}-late")
    await node.publish(
        BlockMoved, blocks=[MovedBlock(block_hash=late, from_tier="device", to_tier="host")]
    )

    async def moved() -> bool:
        return await placement_states(database, [late]) == {"deleted", "live"}

    await eventually(moved, what="the move in the ledger")
    for target in await targets(database, resend.command_id):
        items = (
            [evidence("device", [late], "overwrite", "readback_zero")]
            if target == node.node_id
            else []
        )
        await ack(producer, resend.command_id, target, *items)

    async def sent_again() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(func.count())
                    .select_from(Invalidation)
                    .where(Invalidation.parent_command_id == command_id)
                )
                == 2
            )

    await eventually(sent_again, what="a second re-send for the copy recorded after the first")
    assert (await status_of(client, str(erasure_id)))["status"] == "partial"
    async with database.session() as session:
        second = await session.scalar(
            select(Invalidation)
            .where(Invalidation.parent_command_id == command_id)
            .order_by(Invalidation.seq.desc())
            .limit(1)
        )
    for target in await targets(database, second.command_id):
        items = (
            [evidence("host", [late], "overwrite", "readback_zero")]
            if target == node.node_id
            else []
        )
        await ack(producer, second.command_id, target, *items)
    verified = await wait_status(client, str(erasure_id), "verified")
    assert verified["live_copies"] == 0 and len(verified["commands"]) == 3
    receipt, checkpoint, key_document = await served_documents(client, str(erasure_id))
    assert verify_served_receipt(receipt, key_document, checkpoint).ok
    assert [
        (e["node_id"], e["tier"], e["count"], e["method"]) for e in receipt["receipt"]["tiers"]
    ] == [
        (node.node_id, "device", 1, "clear"),
        (node.node_id, "host", 1, "clear"),
    ]
    assert receipt["audit"]["tree_head"]["tree_size"] == receipt["audit"]["leaf_index"] + 1
    async with database.session() as session:
        assert (
            await session.scalar(
                select(func.count()).select_from(Erasure).where(Erasure.id == erasure_id)
            )
            == 1
        )
    assert subject not in caplog.text
    receipts_seen.append(str(erasure_id))


async def test_malformed_erasure_event_is_dead_lettered_with_an_alert(
    coordinator: RunningConsumers,
    producer: EventProducer,
    settings: CoordinatorSettings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uid = uuid.uuid4().hex[:8]
    subject = f"dave-{uid}"
    envelope = make_event(
        ErasureRequested(subject_id=subject, reason="x"), tenant_id=TENANT
    ).model_dump(mode="json")
    del envelope["payload"]["reason"]
    key = f"{TENANT}:malformed-{uid}".encode()
    await producer.send_raw(ERASURES, json.dumps(envelope).encode(), key)
    letters: list[DeadLetter] = []

    def visit(record) -> bool:
        if record.key == key:
            letters.append(DeadLetter.model_validate_json(record.value))
        return bool(letters)

    await scan_topic(settings.kafka.bootstrap, DEAD_LETTER, visit)
    assert letters[0].topic == ERASURES and "reason" in letters[0].error

    async def alerted() -> bool:
        return any(
            r.levelno == logging.ERROR and ERASURES in r.getMessage() for r in caplog.records
        )

    await eventually(alerted, what="an ERROR alert for the dead-lettered erasure request")
    assert subject not in caplog.text


async def test_erasure_waits_for_the_shared_blocks_the_subject_created_and_not_for_another_creators_copy(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
) -> None:
    """Public and tenant blocks the subject's requests created are the erasure's too; a node's own copy of the same
    block that another subject created is not. The erasure waits for the first and still verifies beside the second,
    and the receipt counts the erased blocks per scope."""
    uid = uuid.uuid4().hex[:8]
    subject = f"dora-{uid}"
    mine, other = digest(subject), digest(f"erin-{uid}")
    node_a, node_b = FakeNode(producer, f"erase-d-{uid}"), FakeNode(producer, f"erase-e-{uid}")
    public, shared = block_hash(f"{uid}-public"), block_hash(f"{uid}-tenant")
    for node in (node_a, node_b):
        await node.start()

    def created_by(creator: str, block) -> object:
        return block.model_copy(update={"creator_subject_id": creator})

    await node_a.publish(
        BlockStored,
        blocks=[
            created_by(mine, stored(f"{uid}-public", "device")),
            created_by(
                mine,
                stored(
                    f"{uid}-tenant",
                    "host",
                    tenant_id=TENANT,
                    scope="tenant",
                    auth_scopes=[("*", 0)],
                ),
            ),
        ],
    )
    await node_b.publish(BlockStored, blocks=[created_by(other, stored(f"{uid}-public", "device"))])

    async def recorded() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(func.count())
                    .select_from(Placement)
                    .where(Placement.block_hash.in_([bytes.fromhex(public), bytes.fromhex(shared)]))
                )
                == 3
            )

    await eventually(recorded, what="both nodes' copies in the ledger")
    started = await client.post(
        "/v1/erasures",
        json={"tenant_id": TENANT, "subject_id": subject, "reason": "art. 17"},
        headers=OFFICER,
    )
    assert started.status_code == 202, started.text
    erasure_id = started.json()["id"]
    command_id = uuid.UUID((await status_of(client, erasure_id))["commands"][0]["command_id"])
    # node_b's copy is erin's: its node keeps it and acks with nothing removed.
    for target in await targets(database, command_id) - {node_a.node_id}:
        await ack(producer, command_id, target)

    async def others_acked() -> bool:
        async with database.session() as session:
            pending = select(InvalidationTarget.node_id).where(
                InvalidationTarget.command_id == command_id, InvalidationTarget.status != "acked"
            )
            return set((await session.scalars(pending)).all()) == {node_a.node_id}

    await eventually(others_acked, what="every target but node_a acked")
    waiting = await wait_status(client, erasure_id, "partial")
    assert waiting["live_copies"] == 2, waiting  # node_a's two copies, not node_b's

    await ack(
        producer,
        command_id,
        node_a.node_id,
        evidence("device", [public], "overwrite", "readback_zero"),
        evidence("host", [shared], "overwrite", "readback_zero"),
    )
    verified = await wait_status(client, erasure_id, "verified")
    assert verified["live_copies"] == 0
    receipt, checkpoint, key_document = await served_documents(client, erasure_id)
    assert receipt["receipt"]["blocks_by_scope"] == {
        "public": 1,
        "tenant": 1,
        "user": 0,
        "unrecorded": 0,
    }
    result = verify_served_receipt(receipt, key_document, checkpoint)
    assert (
        result.ok
        and "public 1, tenant 1, user 0"
        in {c.name: c.message for c in result.checks}["scope_coverage"]
    )
    async with database.session() as session:
        kept = await session.scalar(
            select(Placement.state).where(
                Placement.block_hash == bytes.fromhex(public), Placement.node_id == node_b.node_id
            )
        )
    assert kept == "live"


def live_on(database: Database, node: FakeNode, num_copies: int) -> Callable[[], Awaitable[bool]]:
    """A condition: the ledger holds ``num_copies`` live copies on ``node``."""

    async def holds() -> bool:
        async with database.session() as session:
            live = (
                select(func.count())
                .select_from(Placement)
                .where(Placement.node_id == node.node_id, Placement.state == "live")
            )
            return await session.scalar(live) == num_copies

    return holds


def ack_outcomes() -> tuple[float, float]:
    """(deferred, released) acks counted by this process's coordinator so far."""
    counts = [
        REGISTRY.get_sample_value(
            "kvledger_invalidation_events_total", {"type": "CommandAck", "outcome": outcome}
        )
        or 0.0
        for outcome in ("deferred", "released")
    ]
    return counts[0], counts[1]


async def erasure_command(
    client: httpx.AsyncClient, settings: CoordinatorSettings, subject: str
) -> tuple[str, uuid.UUID]:
    """Start an erasure of ``subject``; (erasure id, its command id) once the command is on the
    topic."""
    body = {"tenant_id": TENANT, "subject_id": subject, "reason": "GDPR art. 17 request"}
    started = await client.post("/v1/erasures", json=body, headers=OFFICER)
    assert started.status_code == 202, started.text
    erasure_id = started.json()["id"]
    command_id = uuid.UUID((await status_of(client, erasure_id))["commands"][0]["command_id"])

    def visit(record) -> bool:
        payload = parse_event(record.value).payload
        return isinstance(payload, Invalidate) and payload.command_id == command_id

    await scan_topic(settings.kafka.bootstrap, COMMANDS, visit)
    return erasure_id, command_id


async def test_an_ack_that_overtakes_its_nodes_kv_events_waits_for_them(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
) -> None:
    """The node wrote a snapshot, then the erasure removed the subject's blocks and rewrote the
    snapshot. Its ack, fenced behind those events, reaches the coordinator before them (another
    topic, another consumer group): applied then, it would delete nothing and the snapshot copy
    would arrive afterwards, live for good."""
    uid = uuid.uuid4().hex[:8]
    subject = f"carol-{uid}@example.com"
    user = {"tenant_id": TENANT, "scope": "user", "subject_id": digest(subject)}
    node = FakeNode(producer, f"fence-{uid}")
    await node.start()
    device, disk = block_hash(f"{uid}-dev"), block_hash(f"{uid}-disk")
    await node.publish(
        BlockStored,
        blocks=[stored(f"{uid}-dev", "device", **user), stored(f"{uid}-disk", "disk", **user)],
    )
    await eventually(live_on(database, node, 2), what="the subject's blocks in the ledger")
    erasure_id, command_id = await erasure_command(client, settings, subject)
    for foreign in await targets(database, command_id) - {node.node_id}:
        await ack(producer, command_id, foreign)

    # The node's events, built (seqs taken) but not yet delivered, and its ack fenced behind them.
    snapshot = node.event(SnapshotWritten, snapshot_id=f"snap-{uid}", block_hashes=[disk])
    removed = node.event(
        BlockRemoved,
        reason="invalidated",
        blocks=[
            RemovedBlock(block_hash=device, tier="device"),
            RemovedBlock(block_hash=disk, tier="disk"),
        ],
    )
    deferred_before, released_before = ack_outcomes()
    fenced = CommandAck(
        command_id=command_id,
        node_id=node.node_id,
        epoch=node.epoch,
        evidence=[
            evidence("device", [device], "overwrite", "readback_zero"),
            evidence("disk", [disk], "unlink", "file_absent"),
            evidence("snapshot", [disk], "unlink", "file_absent"),
        ],
        after_seq=node.seq,
    )
    await producer.send(make_event(fenced))

    async def deferred() -> bool:
        async with database.session() as session:
            return await session.get(DeferredAck, (command_id, node.node_id)) is not None

    await eventually(deferred, what="the ack deferred")
    assert ack_outcomes() == (deferred_before + 1, released_before)
    async with database.session() as session:
        assert (
            await session.get(InvalidationTarget, (command_id, node.node_id))
        ).status == "pending"
    assert (await status_of(client, erasure_id))["status"] in ("pending", "partial")

    await producer.send_many([snapshot, removed])
    verified = await wait_status(client, erasure_id, "verified")
    assert verified["live_copies"] == 0
    assert ack_outcomes() == (deferred_before + 1, released_before + 1)
    async with database.session() as session:
        copies = (
            await session.execute(
                select(Placement.tier, Placement.state, Placement.reason, Placement.invalidation_id)
                .where(Placement.node_id == node.node_id)
                .order_by(Placement.tier)
            )
        ).all()
        assert await session.get(DeferredAck, (command_id, node.node_id)) is None
    # The pool copies were deleted by the node's own removal events, the snapshot copy by the ack.
    assert [tuple(row) for row in copies] == [
        ("device", "deleted", "invalidated", command_id),
        ("disk", "deleted", "invalidated", command_id),
        ("snapshot", "deleted", "invalidated", command_id),
    ]


async def test_a_fenced_ack_never_deletes_a_copy_the_node_stored_again_after_its_removal(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
) -> None:
    """The node removed the block for the command, then built it again (the subject's new request after the
    erasure) and reported both before its ack was applied: the ack lists the block, yet the copy is live."""
    uid = uuid.uuid4().hex[:8]
    subject = f"dave-{uid}@example.com"
    user = {"tenant_id": TENANT, "scope": "user", "subject_id": digest(subject)}
    node = FakeNode(producer, f"restore-{uid}")
    await node.start()
    again = block_hash(f"{uid}-again")
    await node.publish(BlockStored, blocks=[stored(f"{uid}-again", "device", **user)])
    await eventually(live_on(database, node, 1), what="the subject's block in the ledger")
    _, command_id = await erasure_command(client, settings, subject)
    await node.publish(
        BlockRemoved, reason="invalidated", blocks=[RemovedBlock(block_hash=again, tier="device")]
    )
    fence = node.seq
    await node.publish(BlockStored, blocks=[stored(f"{uid}-again", "device", **user)])

    async def stored_again() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(select(Node.last_seq).where(Node.node_id == node.node_id))
                == node.seq
            )

    await eventually(stored_again, what="the removal and the new copy in the ledger")
    ack_event = CommandAck(
        command_id=command_id,
        node_id=node.node_id,
        epoch=node.epoch,
        evidence=[evidence("device", [again], "overwrite", "readback_zero")],
        after_seq=fence,
    )
    await producer.send(make_event(ack_event))

    async def acked() -> bool:
        async with database.session() as session:
            return (
                await session.get(InvalidationTarget, (command_id, node.node_id))
            ).status == "acked"

    await eventually(acked, what="the ack applied")
    assert await placement_states(database, [again]) == {"live"}


async def test_rewritten_audit_log_fails_verification_against_an_earlier_checkpoint(
    coordinator: RunningConsumers,
    database: Database,
    client: httpx.AsyncClient,
    receipts_seen: list[str],
) -> None:
    assert len(receipts_seen) == 2, "runs after the tests that issue receipts"
    receipt, checkpoint, key_document = await served_documents(client, receipts_seen[1])
    assert verify_served_receipt(receipt, key_document, checkpoint).ok
    async with database.session() as session, session.begin():
        await session.execute(
            AuditLogEntry.__table__.update()
            .where(AuditLogEntry.leaf_index == 0)
            .values(leaf_hash=hashlib.sha256(b"rewritten").digest())
        )
    tampered, _, _ = await served_documents(client, receipts_seen[1])
    result = verify_served_receipt(tampered, key_document, checkpoint)
    assert not result.ok
    assert [check.name for check in result.checks if not check.ok] == ["inclusion"]
