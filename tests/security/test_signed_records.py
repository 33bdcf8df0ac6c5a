"""No Kafka record can forge governance: commands must carry the coordinator's signature, kv-events and acks
their node's enrolled key. Forged, tampered, wrongly keyed and relabelled records are dead-lettered, counted,
and never applied, replayed or counted as evidence; the genuine record next to each is (positive control).

Real broker and Postgres; a real node (engine, publisher, command consumer) and the coordinator's real
consumers in-process.
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import (
    JWT_SECRET,
    SUBJECT_KEY,
    RunningConsumers,
    SigningProducer,
    coordinator_settings,
    dead_letters,
    eventually,
    fresh_database,
    node_key,
    scan_topic,
    sign_command,
    stored,
)
from helpers.node import NodeServices, node_settings
from prometheus_client import REGISTRY
from sqlalchemy import select

from bench.common import start_groups_at_end
from coordinator.consumers import ACK_GROUP_SUFFIX, INVALIDATION_GROUP_SUFFIX, consumer_groups
from coordinator.handlers.erasure import start_erasure
from coordinator.ledger.db import Database
from coordinator.ledger.models import Erasure, InvalidationTarget, Placement, Receipt
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from coordinator.settings import CoordinatorSettings, kafka_settings
from events import schema, topics
from events.codec import decode_event
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.tiers import Tier
from gpu_node.entrypoints.routes import create_app
from gpu_node.governance.predicates import block_predicate
from gpu_node.settings import CacheSettings, NodeSettings
from identity.signing import key_id, sign_envelope
from identity.tokens import TokenVerifier, issue_token

KEY = SUBJECT_KEY.encode()
SYSTEM = "You answer questions from the tenant handbook, briefly."


# --------------------------------------------------------------------------- helpers


def unverified(topic: str, reason: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "kvledger_unverified_records_total", {"topic": topic, "reason": reason}
        )
        or 0.0
    )


async def acked(bootstrap: str, command_id: uuid.UUID, node_id: str) -> schema.CommandAck:
    found: list[schema.CommandAck] = []

    def visit(record) -> bool:
        payload = decode_event(record.value).payload
        if payload.command_id == command_id and payload.node_id == node_id:
            found.append(payload)
        return bool(found)

    await scan_topic(bootstrap, topics.ACKS, visit)
    return found[0]


def forged_by(envelope: schema.Envelope) -> schema.Envelope:
    """``envelope`` signed by a key nobody enrolled or pinned."""
    return sign_envelope(envelope, Ed25519PrivateKey.generate())


# --------------------------------------------------------------------------- the node refuses
# forged commands


class Node(NodeServices):
    def __init__(self, settings: NodeSettings) -> None:
        super().__init__(settings)
        self.assemble()
        app = create_app(self.engine, TokenVerifier(settings.auth))
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://node", timeout=60
        )

    async def start(self) -> Node:
        await self.engine.start(ready=False)
        await self.start_replay()
        await asyncio.wait_for(self.commands.replayed.wait(), 60)
        return self

    async def stop(self) -> None:
        await self.http.aclose()
        await self.stop_replay()
        await self.engine.stop()

    async def chat(self, token: str, version: int) -> httpx.Response:
        text = " ".join(
            f"handbook section {i} version {version} says staff rest" for i in range(10)
        )
        messages = [
            {"role": "system", "content": SYSTEM, "cache_scope": "public"},
            {
                "role": "user",
                "content": text,
                "document": {"id": "handbook", "version": version, "auth_scope": "hr"},
            },
            {"role": "user", "content": "What is the leave policy?"},
        ]
        body = {
            "model": self.engine.model_name,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
        }
        return await self.http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        )

    def unverified(self, reason: str) -> float:
        """This node's count of commands dead-lettered for ``reason`` (as its /metrics reports it)."""
        sample = self.engine.metrics.registry.get_sample_value(
            "kvledger_unverified_commands_total", {"reason": reason}
        )
        return sample or 0.0

    def holdings(self, predicate) -> set[tuple[str, str]]:
        return {
            (e.block_hash.hex(), e.tier.value)
            for e in self.engine.pool.ready_entries()
            if predicate(e.provenance)
        }


def _node_settings(
    name: str, tiny_model_dir, tmp_path, kafka_bootstrap: str, **extra
) -> NodeSettings:
    cache = CacheSettings(num_device_blocks=64, num_host_blocks=64, max_disk_blocks=128)
    return node_settings(
        f"{name}-{uuid.uuid4().hex[:6]}",
        tiny_model_dir,
        tmp_path / name,
        kafka_bootstrap,
        cache,
        **extra,
    )


async def test_forged_tampered_and_wrongly_keyed_commands_are_dead_lettered_never_applied_or_replayed(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = issue_token(
        tenant=tenant, sub="alice", scopes=["hr"], pv={"hr": 1}, ttl_s=600, secret=JWT_SECRET
    )
    settings = _node_settings("forged", tiny_model_dir, tmp_path, kafka_bootstrap)
    node = await Node(settings).start()
    try:
        assert (await node.chat(alice, 1)).status_code == 200
        predicate = schema.DocumentPredicate(tenant=tenant, doc_id="handbook", below_version=2)
        matches = block_predicate(predicate, datetime.now(UTC), KEY)
        held = node.holdings(matches)
        assert held

        def invalidate(on: schema.Predicate) -> schema.Envelope:
            command = schema.Invalidate(
                command_id=uuid.uuid4(), predicate=on, cutoff=datetime.now(UTC)
            )
            return schema.make_event(command, tenant_id=tenant)

        unsigned = invalidate(predicate)
        decoy = sign_command(
            invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="decoy", below_version=2))
        )
        tampered = decoy.model_copy(
            update={"payload": decoy.payload.model_copy(update={"predicate": predicate})}
        )
        wrong_key = forged_by(invalidate(predicate))
        # An unsigned inventory request would make the node publish its whole inventory on demand.
        inventory = schema.make_event(
            schema.InventoryRequested(node_id=node.node_id, request_id=uuid.uuid4())
        )
        reasons = [
            (unsigned, "unsigned"),
            (tampered, "bad_signature"),
            (wrong_key, "unknown_key"),
            (inventory, "unsigned"),
        ]
        before = {reason: node.unverified(reason) for _, reason in reasons}
        # A customer event signed with the command key itself: the commands topic does not carry
        # that type.
        misplaced = sign_command(
            schema.make_event(
                schema.DocumentUpdated(doc_id="handbook", version=99), tenant_id=tenant
            )
        )
        async with EventProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as plain:
            for envelope, _ in reasons:
                await plain.send(envelope)
            await plain.send(misplaced, topic=topics.COMMANDS, key=topics.BROADCAST_TARGET)
        # Positive control, after them in the same partition: a command the coordinator really
        # signed.
        control = sign_command(
            invalidate(schema.DocumentPredicate(tenant=tenant, doc_id="other", below_version=2))
        )
        async with SigningProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as signing:
            await signing.send(control)
        await acked(kafka_bootstrap, control.payload.command_id, node.node_id)

        event_ids = {e.event_id for e, _ in reasons} | {misplaced.event_id}
        letters = await dead_letters(
            kafka_bootstrap, node.commands.group_id, event_ids, topics.NODE_DEAD_LETTER
        )
        assert letters == {e.event_id: f"signature: {reason}" for e, reason in reasons} | {
            misplaced.event_id: "routing: wrong_topic"
        }
        misrouted = node.engine.metrics.registry.get_sample_value(
            "kvledger_misrouted_commands_total", {"reason": "wrong_topic"}
        )
        assert misrouted == 1
        assert {reason: node.unverified(reason) - before[reason] for reason in before} == {
            "unsigned": 2,
            "bad_signature": 1,
            "unknown_key": 1,
        }
        assert node.holdings(matches) == held
        assert (await node.chat(alice, 1)).status_code == 200
        # A copy on disk survives the restart, so the replay below has something it could wrongly
        # delete.
        assert node.engine.pool.demote(
            bytes.fromhex(sorted(node.holdings(matches))[0][0]), Tier.DISK
        )
        on_disk = {item for item in node.holdings(matches) if item[1] == "disk"}
        assert on_disk
    finally:
        await node.stop()

    # The replay at start reads the forged records again: still not applied, not remembered, not
    # dead-lettered again.
    restarted = await Node(settings).start()
    try:
        assert restarted.holdings(matches) == on_disk
        assert (await restarted.chat(alice, 1)).status_code == 200
        assert {reason: restarted.unverified(reason) for reason in before} == dict.fromkeys(
            before, 0.0
        )

        # The same predicate, genuinely signed: applied, acked, the old version refused.
        genuine = sign_command(invalidate(predicate))
        async with SigningProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as signing:
            await signing.send(genuine)
        ack = await acked(kafka_bootstrap, genuine.payload.command_id, restarted.node_id)
        assert sum(item.removed for item in ack.evidence) >= 1
        assert restarted.holdings(matches) == set()
        assert (await restarted.chat(alice, 1)).status_code == 409
    finally:
        await restarted.stop()


async def test_a_node_on_kafka_without_a_pinned_command_key_refuses_to_start(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    settings = _node_settings("unpinned", tiny_model_dir, tmp_path, kafka_bootstrap, identity={})
    with pytest.raises(ValueError, match="coordinator_public_key_file"):
        NodeServices(settings).assemble()


# --------------------------------------------------------------------------- the coordinator
# refuses forged node records


@pytest.fixture(scope="module")
async def coordinator(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(
            url,
            kafka_bootstrap,
            ledger={"inventory_retry_s": 3600, "erasure_verify_interval_s": 0.2},
            keys={
                "master_key": base64.b64encode(os.urandom(32)).decode()
            },  # receipts are signed with a stored key
        )
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(kafka_bootstrap, consumer_groups(settings.kafka.group_id))
        running = await RunningConsumers(settings).start()
        try:
            yield settings
        finally:
            await running.stop()


@pytest.fixture(scope="module")
async def ledger(coordinator: CoordinatorSettings) -> AsyncIterator[Database]:
    database = Database(coordinator.database)
    try:
        yield database
    finally:
        await database.dispose()


async def _registered(database: Database, *node_ids: str) -> None:
    from coordinator.ledger.models import Node as NodeRow

    async def all_there() -> bool:
        async with database.session() as session:
            rows = await session.scalars(
                select(NodeRow.node_id).where(NodeRow.node_id.in_(node_ids))
            )
            return set(rows) == set(node_ids)

    await eventually(all_there, what=f"nodes {node_ids} in the ledger")


async def test_a_relabelled_ack_is_no_evidence_until_the_node_really_acks(
    coordinator, ledger, kafka_bootstrap
):
    uid = uuid.uuid4().hex[:6]
    one, two = f"node-1-{uid}", f"node-2-{uid}"
    tenant = f"t-{uid}"
    async with SigningProducer(
        kafka_settings(coordinator), coordinator.database.url.get_secret_value()
    ) as producer:
        for node_id in (one, two):
            await producer.send(
                schema.make_event(
                    schema.NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-test")
                )
            )
        await _registered(ledger, one, two)
        # Started as the erasure API starts one (not via kvledger.erasures: other modules'
        # coordinators read that topic).
        async with ledger.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            await lock_decisions(session)
            started_erasure = await start_erasure(
                session,
                subject_key=KEY,
                command_signer=sign_command,
                tenant_id=tenant,
                subject_id=f"alice-{uid}",
                reason="art. 17",
                idempotency_key=f"req-{uid}",
                now=now,
                trigger="api",
            )
        erasure_id, command_id = started_erasure.erasure.id, started_erasure.erasure.command_id

        async def started() -> Erasure:
            async with ledger.session() as session:
                return await session.get(Erasure, erasure_id)

        async def status() -> str:
            return (await started()).status

        def ack(node_id: str) -> schema.Envelope:
            return schema.make_event(
                schema.CommandAck(command_id=command_id, node_id=node_id, epoch=1, evidence=[])
            )

        real = await producer.signed(ack(one))
        await producer.send(real)

        async def partial() -> bool:
            return await status() == "partial"

        await eventually(partial, what="node-1's ack to count")

        # node-1's real, signed ack copied with node-2's id (and a fresh event id, past the inbox).
        relabelled = real.model_copy(
            update={
                "event_id": uuid.uuid4(),
                "payload": real.payload.model_copy(update={"node_id": two}),
            }
        )
        unsigned = ack(two)
        signed_by_other = forged_by(ack(two))
        reasons = [
            (relabelled, "wrong_node"),
            (unsigned, "unsigned"),
            (signed_by_other, "unknown_key"),
        ]
        before = {reason: unverified(topics.ACKS, reason) for _, reason in reasons}
        async with EventProducer(kafka_settings(coordinator)) as plain:
            for envelope, _ in reasons:
                await plain.send(envelope)
            # The same forgery on a customer topic: an ack is not a type that topic carries, so the
            # decisions consumer refuses it before anything looks at it.
            misplaced = ack(two)
            await plain.send(misplaced, topic=topics.DOCUMENTS, key=f"{tenant}:doc")

        misplaced_letters = await dead_letters(
            kafka_bootstrap,
            coordinator.kafka.group_id + INVALIDATION_GROUP_SUFFIX,
            {misplaced.event_id},
        )
        assert misplaced_letters == {misplaced.event_id: "routing: wrong_topic"}
        group = coordinator.kafka.group_id + ACK_GROUP_SUFFIX
        letters = await dead_letters(kafka_bootstrap, group, {e.event_id for e, _ in reasons})
        assert letters == {e.event_id: f"signature: {reason}" for e, reason in reasons}
        assert {
            reason: unverified(topics.ACKS, reason) - before[reason] for reason in before
        } == dict.fromkeys(before, 1)
        async with ledger.session() as session:
            target = await session.get(InvalidationTarget, (command_id, two))
            assert target.status == "pending" and target.evidence is None
        assert await status() == "partial"

        # node-2 really acks: verified, and the receipt names both nodes' keys.
        await producer.send(ack(two))

        async def verified() -> bool:
            return await status() == "verified"

        await eventually(verified, what="the erasure to be verified")
        async with ledger.session() as session:
            receipt = await session.scalar(select(Receipt).where(Receipt.erasure_id == erasure_id))
        assert receipt.document["receipt"]["node_keys"] == [
            {"node_id": one, "key_id": key_id(node_key(one).public_key())},
            {"node_id": two, "key_id": key_id(node_key(two).public_key())},
        ]


async def test_unsigned_and_forged_kv_events_never_reach_the_ledger(
    coordinator, ledger, kafka_bootstrap
):
    uid = uuid.uuid4().hex[:6]
    one, two = f"kv-1-{uid}", f"kv-2-{uid}"
    async with SigningProducer(
        kafka_settings(coordinator), coordinator.database.url.get_secret_value()
    ) as producer:
        for node_id in (one, two):
            await producer.send(
                schema.make_event(
                    schema.NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-test")
                )
            )
        await _registered(ledger, one, two)

        def block_stored(label: str) -> schema.Envelope:
            return schema.make_event(
                schema.BlockStored(
                    node_id=one, epoch=1, seq=1, blocks=[stored(f"{uid}/{label}", "device")]
                )
            )

        unsigned, forged, by_other_node = (
            block_stored("unsigned"),
            forged_by(block_stored("forged")),
            block_stored("other"),
        )
        by_other_node = sign_envelope(
            by_other_node, node_key(two)
        )  # node-2's enrolled key claiming to be node-1
        reasons = [(unsigned, "unsigned"), (forged, "unknown_key"), (by_other_node, "wrong_node")]
        before = {reason: unverified(topics.KV_EVENTS, reason) for _, reason in reasons}
        async with EventProducer(kafka_settings(coordinator)) as plain:
            for envelope, _ in reasons:
                await plain.send(envelope)
        # Positive control with the same seq: applied only because none of the forged ones was.
        genuine = block_stored("genuine")
        await producer.send(genuine)

        letters = await dead_letters(
            kafka_bootstrap, coordinator.kafka.group_id, {e.event_id for e, _ in reasons}
        )
        assert letters == {e.event_id: f"signature: {reason}" for e, reason in reasons}
        assert {
            reason: unverified(topics.KV_EVENTS, reason) - before[reason] for reason in before
        } == dict.fromkeys(before, 1)

        genuine_hash = bytes.fromhex(genuine.payload.blocks[0].block_hash)

        async def placed() -> set[bytes]:
            async with ledger.session() as session:
                rows = await session.scalars(
                    select(Placement.block_hash).where(
                        Placement.node_id == one, Placement.state == "live"
                    )
                )
                return set(rows)

        async def genuine_applied() -> bool:
            return genuine_hash in await placed()

        await eventually(genuine_applied, what="the genuine kv-event to be applied")
        assert await placed() == {genuine_hash}
