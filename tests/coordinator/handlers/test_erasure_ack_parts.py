"""An erasure too large for one ack record verifies: 100,000 blocks of one subject across tiers, end to end.

Real Postgres and broker; the coordinator's consumers (ledger, decisions, acks, re-sender)
run in-process and the HTTP API is the coordinator's app. The node is played by this test,
but its ack is the node's own: :func:`gpu_node.governance.commands.ack_records` cuts the evidence into
parts, which go out signed with the node's enrolled key. One part is lost on the first
send; the coordinator re-sends the command, the node re-sends every part of the same ack,
and only then is the erasure verified — with a receipt that commits to every hash.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    SUBJECT_KEY,
    FakeNode,
    RunningConsumers,
    coordinator_settings,
    eventually,
    fresh_database,
    operator_headers,
    own_broker,
    scan_topic,
    stored,
)
from sqlalchemy import func, select, text
from test_ledger_erasure import cli_verify, served_documents, status_of, wait_status

from coordinator.audit.verifier import verify_served_receipt
from coordinator.keys.data_keys import KeyService
from coordinator.ledger.db import Database
from coordinator.ledger.models import AckPart, InvalidationTarget, Placement
from coordinator.settings import CoordinatorSettings
from events.ack_parts import TierReport
from events.codec import encode_event
from events.kafka.producer import EventProducer
from events.record_size import MAX_RECORD_BYTES
from events.schema import (
    MAX_BLOCKS_PER_EVENT,
    MAX_HASHES_PER_EVENT,
    BlockRemoved,
    BlockStored,
    Invalidate,
    RemovedBlock,
    SnapshotWritten,
    parse_event,
    subject_digest,
)
from events.tiers import Tier
from events.topics import COMMANDS
from gpu_node.governance.commands import ack_records

TENANT = "erasure-tenant"
MASTER_KEY = base64.b64encode(b"m" * 32).decode()
NUM_BLOCKS = {"device": 40_000, "host": 30_000, "disk": 30_000}
NUM_SNAPSHOT_BLOCKS = MAX_HASHES_PER_EVENT + 3_000
"""The snapshot lists the first disk blocks: more than one SnapshotWritten record carries."""
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
async def kafka_bootstrap(
    kafka_bootstrap: str, service_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """This module's own broker: what it publishes is too large to leave on the shared one
    (``helpers.ledger.own_broker``)."""
    async with own_broker(
        kafka_bootstrap, service_mode, tmp_path_factory.mktemp("kafka")
    ) as bootstrap:
        yield bootstrap


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(
            url,
            kafka_bootstrap,
            ledger={
                "inventory_retry_s": 3600,
                "erasure_verify_interval_s": 0.2,
                "command_resend_after_s": 2.0,
                "command_resend_max_s": 4.0,
                "command_resend_poll_s": 0.2,
            },
            keys={"master_key": MASTER_KEY},
        )


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    running = await RunningConsumers(settings).start()
    yield running
    await running.stop()


async def command_copies(
    bootstrap: str, command_id: uuid.UUID, num_copies: int
) -> list[Invalidate]:
    """The first ``num_copies`` records of ``command_id`` on the commands topic (the original, then
    re-sends)."""
    found: list[Invalidate] = []

    def visit(record) -> bool:
        payload = parse_event(record.value).payload
        if isinstance(payload, Invalidate) and payload.command_id == command_id:
            found.append(payload)
        return len(found) >= num_copies

    await scan_topic(bootstrap, COMMANDS, visit, timeout_s=TIMEOUT_S)
    return found


async def test_an_erasure_of_100k_blocks_acked_in_parts_verifies_after_a_lost_part(
    coordinator: RunningConsumers,
    database: Database,
    producer: EventProducer,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
    tmp_path: Path,
) -> None:
    uid = uuid.uuid4().hex[:8]
    subject = f"big-{uid}@example.com"
    mine = subject_digest(SUBJECT_KEY.encode(), TENANT, subject)
    node = FakeNode(producer, f"parts-{uid}")
    await node.start()
    user = {"tenant_id": TENANT, "scope": "user", "subject_id": mine}
    hashes: dict[str, list[str]] = {}
    for tier, num_blocks in NUM_BLOCKS.items():
        blocks = [stored(f"{uid}-{tier}-{i}", tier, **user) for i in range(num_blocks)]
        hashes[tier] = [block.block_hash for block in blocks]
        await producer.send_many(
            [
                node.event(BlockStored, blocks=blocks[start : start + MAX_BLOCKS_PER_EVENT])
                for start in range(0, num_blocks, MAX_BLOCKS_PER_EVENT)
            ]
        )
    hashes["snapshot"] = hashes["disk"][:NUM_SNAPSHOT_BLOCKS]
    slices = [hashes["snapshot"][:MAX_HASHES_PER_EVENT], hashes["snapshot"][MAX_HASHES_PER_EVENT:]]
    await producer.send_many(
        [
            node.event(
                SnapshotWritten,
                snapshot_id=f"snap-{uid}",
                block_hashes=part,
                part=number,
                parts=len(slices),
            )
            for number, part in enumerate(slices)
        ]
    )
    num_copies = sum(len(tier_hashes) for tier_hashes in hashes.values())

    async def ledger_holds_every_copy() -> bool:
        async with database.session() as session:
            live = select(func.count()).select_from(Placement)
            return (
                await session.scalar(
                    live.where(Placement.node_id == node.node_id, Placement.state == "live")
                )
                == num_copies
            )

    await eventually(
        ledger_holds_every_copy,
        timeout_s=TIMEOUT_S,
        what="every copy in the ledger (snapshot parts joined)",
    )
    data_key_id, _ = await KeyService(
        database, base64.b64decode(MASTER_KEY), SUBJECT_KEY.encode()
    ).resolve(TENANT, mine)

    body = {"tenant_id": TENANT, "subject_id": subject, "reason": "GDPR art. 17 request"}
    started = await client.post(
        "/v1/erasures", json=body, headers=operator_headers("privacy-officer", TENANT)
    )
    assert started.status_code == 202, started.text
    erasure_id = started.json()["id"]
    command_id = uuid.UUID((await status_of(client, erasure_id))["commands"][0]["command_id"])
    (command,) = await command_copies(settings.kafka.bootstrap, command_id, 1)

    # The node's own ack: its real splitter, each part signed with its enrolled key and within the
    # limit.
    reports = [
        TierReport(Tier.DEVICE, hashes["device"], "overwrite", "readback_zero", True),
        TierReport(Tier.HOST, hashes["host"], "overwrite", "readback_zero", True),
        TierReport(Tier.DISK, hashes["disk"], "crypto_erase", "key_destroyed", True, [data_key_id]),
        TierReport(
            Tier.SNAPSHOT, hashes["snapshot"], "crypto_erase", "key_destroyed", True, [data_key_id]
        ),
    ]
    # As the node does: its removals go out as block events first, and the ack is fenced behind
    # them.
    await producer.send_many(
        [
            node.event(
                BlockRemoved,
                reason="invalidated",
                blocks=[RemovedBlock(block_hash=h, tier=tier) for h in run],
            )
            for tier in NUM_BLOCKS
            for run in (
                hashes[tier][start : start + MAX_BLOCKS_PER_EVENT]
                for start in range(0, NUM_BLOCKS[tier], MAX_BLOCKS_PER_EVENT)
            )
        ]
    )
    parts = ack_records(command, node.node_id, node.epoch, reports, node.seq)
    assert len(parts) >= 10 and all(envelope.payload.parts == len(parts) for envelope in parts)
    assert (
        max([len(encode_event(await producer.signed(envelope))) for envelope in parts])
        <= MAX_RECORD_BYTES
    )
    async with database.session() as session:
        others = (
            await session.scalars(
                select(InvalidationTarget.node_id).where(
                    InvalidationTarget.command_id == command_id,
                    InvalidationTarget.node_id != node.node_id,
                )
            )
        ).all()
    for other in others:  # nodes of other modules on the shared broker: nothing of this subject
        await producer.send_many(ack_records(command, other, 1, [], 0))

    # One part lost on its way: the rest is staged, nothing is counted, the erasure is not verified.
    await producer.send_many(parts[:5] + parts[6:])

    async def staged() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(func.count())
                    .select_from(AckPart)
                    .where(AckPart.command_id == command_id)
                )
                == len(parts) - 1
            )

    await eventually(staged, timeout_s=TIMEOUT_S, what="every part but the lost one staged")
    assert (await status_of(client, erasure_id))["status"] in ("pending", "partial")
    async with database.session() as session:
        target = await session.get(InvalidationTarget, (command_id, node.node_id))
        assert (target.status, target.evidence) == ("pending", None)

    # The coordinator re-sends the command; the node answers with the same ack, every part again.
    await command_copies(settings.kafka.bootstrap, command_id, 2)
    await producer.send_many(parts)
    verified = await wait_status(client, erasure_id, "verified")
    assert verified["live_copies"] == 0

    receipt, checkpoint, key_document = await served_documents(client, erasure_id)
    assert verify_served_receipt(receipt, key_document, checkpoint).ok
    completed = await cli_verify(tmp_path, receipt, checkpoint, key_document)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    signed = receipt["receipt"]
    assert signed["block_commitment"]["count"] == sum(NUM_BLOCKS.values())
    tiers = {
        entry["tier"]: entry["count"]
        for entry in signed["tiers"]
        if entry["node_id"] == node.node_id
    }
    assert tiers == {**NUM_BLOCKS, "snapshot": NUM_SNAPSHOT_BLOCKS}
    assert len(json.dumps(receipt)) < 64 * 1024, (
        "a receipt commits to the hashes, it does not list them"
    )

    async with database.session() as session:
        target = await session.get(InvalidationTarget, (command_id, node.node_id))
        assert target.status == "acked"
        assert {item["tier"]: len(item["block_hashes"]) for item in target.evidence} == tiers
        assert {item["tier"]: item["removed"] for item in target.evidence} == tiers
        evidence_bytes = await session.scalar(
            text(
                "SELECT pg_column_size(evidence) FROM invalidation_targets WHERE command_id = :c AND node_id = :n"
            ),
            {"c": command_id, "n": node.node_id},
        )
        assert evidence_bytes < 16 * 1024 * 1024
        assert (
            await session.scalar(
                select(func.count()).select_from(AckPart).where(AckPart.command_id == command_id)
            )
            == 0
        )
        live = (
            select(func.count())
            .select_from(Placement)
            .where(Placement.node_id == node.node_id, Placement.state == "live")
        )
        assert await session.scalar(live) == 0
