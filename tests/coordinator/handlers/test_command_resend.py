"""Command re-send (``coordinator.handlers.resend``): a target that has not acked gets its command
again, with backoff.

Two levels, both on real services:

* the re-sender alone on a migrated ledger (no broker needed: it only writes the outbox):
  when a re-send is due, its exact backoff, two replicas claiming the same targets, and
  that nothing is re-sent once every target acked;
* end to end: the coordinator's consumers (``run_consumers``, which run the re-sender) and
  a real node on the session's broker — a node whose ack is lost is re-sent the command
  and answers with the *same* ack without applying the command twice; a node whose
  consumer group was positioned past the command while it was down gets it re-sent after
  its restart and applies it. Both invalidations complete.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from helpers.ledger import (
    COMMAND_KEY,
    JWT_SECRET,
    RunningConsumers,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
    sign_command,
    sign_customer_event,
)
from helpers.node import RunningNode, node_settings
from prometheus_client import REGISTRY
from sqlalchemy import func, select, update

from bench.common import start_groups_at_end
from coordinator.consumers import consumer_groups
from coordinator.handlers.decisions import decide
from coordinator.handlers.resend import CommandResender
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation, InvalidationTarget, Node, OutboxEntry
from coordinator.settings import CoordinatorSettings, DatabaseSettings, kafka_settings
from events import schema, topics
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from gpu_node.settings import CacheSettings
from identity.signing import signature_problem
from identity.tokens import issue_token

AFTER_S = 0.2
MAX_S = 0.8
TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- the re-sender on its
# own


@pytest.fixture
async def ledger(database_url: str, ledger_template: str) -> AsyncIterator[Database]:
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url), pre_ping=False)
        try:
            yield database
        finally:
            await database.dispose()


def resender(database: Database, after_s: float = AFTER_S) -> CommandResender:
    return CommandResender(
        database,
        command_signer=sign_command,
        resend_after_s=after_s,
        resend_max_s=max(after_s, MAX_S),
        poll_s=0.05,
    )


async def decided(database: Database, node_ids: list[str]) -> uuid.UUID:
    """A tenant invalidation decided with ``node_ids`` registered (all its targets), as the API decides one."""
    async with database.session() as session, session.begin():
        for node_id in node_ids:
            session.add(Node(node_id=node_id, epoch=1, last_seq=0))
        await session.flush()
        now = await session.scalar(select(func.now()))
        decision = await decide(
            session,
            schema.TenantPredicate(tenant="acme"),
            signer=sign_command,
            now=now,
            trigger="api",
            requested_at=now,
        )
    return decision.command_id


async def targets(database: Database, command_id: uuid.UUID) -> dict[str, InvalidationTarget]:
    async with database.session() as session:
        rows = await session.scalars(
            select(InvalidationTarget).where(InvalidationTarget.command_id == command_id)
        )
        return {row.node_id: row for row in rows}


async def commands_in_outbox(database: Database, command_id: uuid.UUID) -> list[schema.Envelope]:
    async with database.session() as session:
        rows = await session.scalars(select(OutboxEntry.payload).order_by(OutboxEntry.id))
        envelopes = [schema.Envelope.model_validate(payload) for payload in rows]
    return [
        e
        for e in envelopes
        if isinstance(e.payload, schema.Invalidate) and e.payload.command_id == command_id
    ]


async def set_acked(database: Database, command_id: uuid.UUID, node_ids: list[str]) -> None:
    async with database.session() as session, session.begin():
        await session.execute(
            update(InvalidationTarget)
            .where(
                InvalidationTarget.command_id == command_id,
                InvalidationTarget.node_id.in_(node_ids),
            )
            .values(status="acked", acked_at=func.now(), evidence=[])
        )


async def resent_once_more(database: Database, command_id: uuid.UUID, expected_count: int) -> None:
    """Run the re-sender until the pending targets reached ``expected_count`` re-sends."""

    async def reached() -> bool:
        await resender(database).resend_due()
        pending = [
            t for t in (await targets(database, command_id)).values() if t.status == "pending"
        ]
        return all(t.resend_count == expected_count for t in pending)

    await eventually(reached, timeout_s=TIMEOUT_S, what=f"re-send number {expected_count}")


async def test_resends_pending_targets_with_capped_exponential_backoff_and_stops_once_acked(
    ledger: Database,
) -> None:
    command_id = await decided(ledger, ["n1", "n2", "n3"])
    (original,) = await commands_in_outbox(ledger, command_id)
    assert await resender(ledger, after_s=3600).resend_due() == 0, (
        "nothing is due before command_resend_after_s"
    )
    await set_acked(ledger, command_id, ["n1"])

    # Two replicas at once: every due target is claimed by exactly one of them, each command re-sent
    # once.
    async def due() -> bool:
        async with ledger.session() as session:
            created_at = await session.scalar(
                select(Invalidation.created_at).where(Invalidation.command_id == command_id)
            )
            return await session.scalar(select(func.now())) >= created_at + timedelta(
                seconds=AFTER_S
            )

    await eventually(due, what="the first re-send to be due")
    assert sorted(
        await asyncio.gather(resender(ledger).resend_due(), resender(ledger).resend_due())
    ) == [0, 1]
    rows = await targets(ledger, command_id)
    assert {node_id: row.resend_count for node_id, row in rows.items()} == {
        "n1": 0,
        "n2": 1,
        "n3": 1,
    }
    assert rows["n1"].next_resend_at is None and rows["n1"].last_resent_at is None

    intervals = [rows["n2"].next_resend_at - rows["n2"].last_resent_at]
    for count in (2, 3):
        await resent_once_more(ledger, command_id, count)
        intervals.append(
            (await targets(ledger, command_id))["n2"].next_resend_at
            - (await targets(ledger, command_id))["n2"].last_resent_at
        )
    assert intervals == [timedelta(seconds=0.4), timedelta(seconds=0.8), timedelta(seconds=0.8)]

    commands = await commands_in_outbox(ledger, command_id)
    assert len(commands) == 4 and commands[0] == original
    assert len({command.event_id for command in commands}) == 4
    for command in commands[1:]:
        assert command.payload == original.payload
        assert command.tenant_id == original.tenant_id
        assert signature_problem(command, COMMAND_KEY.public_key()) is None

    await set_acked(ledger, command_id, ["n2", "n3"])
    last_due = max(
        row.next_resend_at
        for row in (await targets(ledger, command_id)).values()
        if row.next_resend_at
    )

    async def past_due() -> bool:
        async with ledger.session() as session:
            return await session.scalar(select(func.now())) > last_due

    await eventually(past_due, what="the last scheduled re-send to be due")
    assert await resender(ledger).resend_due() == 0
    assert len(await commands_in_outbox(ledger, command_id)) == 4
    assert {
        node_id: row.resend_count for node_id, row in (await targets(ledger, command_id)).items()
    } == {"n1": 0, "n2": 3, "n3": 3}


async def test_settings_refuse_a_maximum_below_the_first_wait() -> None:
    with pytest.raises(ValueError, match="command_resend_max_s"):
        CoordinatorSettings(ledger={"command_resend_after_s": 30, "command_resend_max_s": 10})


# --------------------------------------------------------------------------- end to end with a real
# node


class ChatNode(RunningNode):
    """A node as ``serve`` runs it (``helpers.node.RunningNode``); ``apply_counts`` counts applications per command,
    ``drop_next_ack`` loses the next ack on its way."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.apply_counts: dict[uuid.UUID, int] = {}
        self.dropped_acks: list[schema.Envelope] = []
        self.drop_next_ack = False

    def assemble(self) -> None:
        super().assemble()
        real_apply_batch = self.commands.handler.apply_batch
        real_send_many = self.commands._producer.send_many

        async def apply_batch_counted(commands):
            async for command, evidence in real_apply_batch(commands):
                self.apply_counts[command.command_id] = (
                    self.apply_counts.get(command.command_id, 0) + 1
                )
                yield command, evidence

        async def send_dropping(envelopes):
            """Fault injection: the ack (every record of it) is lost on its way (reported sent, never written)."""
            envelopes = list(envelopes)
            if self.drop_next_ack and any(
                isinstance(envelope.payload, schema.CommandAck) for envelope in envelopes
            ):
                self.drop_next_ack = False
                self.dropped_acks.extend(envelopes)
                return []
            return await real_send_many(envelopes)

        self.commands.handler.apply_batch = apply_batch_counted
        self.commands._producer.send_many = send_dropping

    async def start(self) -> ChatNode:
        await super().start()
        await self.replayed(TIMEOUT_S)
        return self

    async def cache(self, tenant: str, doc_id: str, version: int) -> None:
        token = issue_token(
            tenant=tenant, sub="alice", scopes=["hr"], pv={"hr": 1}, ttl_s=600, secret=JWT_SECRET
        )
        text_ = " ".join(
            f"{doc_id} section {i} version {version} says staff rest" for i in range(10)
        )
        messages = [
            {"role": "system", "content": "You answer from the handbook.", "cache_scope": "public"},
            {
                "role": "user",
                "content": text_,
                "document": {"id": doc_id, "version": version, "auth_scope": "hr"},
            },
            {"role": "user", "content": "What is the leave policy?"},
        ]
        body = {
            "model": self.engine.model_name,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
        }
        async with httpx.AsyncClient(base_url=self.http.url, timeout=60) as client:
            response = await client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
            )
        assert response.status_code == 200, response.text

    def holdings(self, tenant: str, doc_id: str) -> set[str]:
        return {
            entry.block_hash.hex()
            for entry in self.engine.pool.ready_entries()
            if entry.provenance.tenant_id == tenant
            and any(tag.rpartition("@")[0] == doc_id for tag in entry.provenance.documents)
        }


@dataclass(frozen=True)
class Ledger:
    url: str
    database: Database


@pytest.fixture(scope="module")
async def coordinator(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[Ledger]:
    """The coordinator's consumers with fast re-sends, on a fresh ledger whose groups start at the
    topics' ends."""
    async with fresh_database(database_url, ledger_template) as url:
        group = f"resend-{uuid.uuid4().hex[:8]}"
        settings = coordinator_settings(
            url,
            kafka_bootstrap,
            kafka={"group_id": group},
            ledger={
                "command_resend_after_s": 0.5,
                "command_resend_max_s": 2.0,
                "command_resend_poll_s": 0.1,
            },
        )
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(kafka_bootstrap, consumer_groups(group))
        consumers = await RunningConsumers(settings).start()
        database = Database(settings.database, pre_ping=False)
        try:
            yield Ledger(url, database)
        finally:
            await database.dispose()
            await consumers.stop()


@pytest.fixture(scope="module")
async def node(
    coordinator: Ledger, tiny_model_dir: Path, tmp_path_factory, kafka_bootstrap: str
) -> AsyncIterator[ChatNode]:
    """The module's one node, enrolled and registered in the ledger (so every decision targets it, and only it)."""
    node_id = f"resend-{uuid.uuid4().hex[:6]}"
    await enroll_nodes(coordinator.url, [node_id])
    cache = CacheSettings(num_device_blocks=64, num_host_blocks=64, max_disk_blocks=128)
    data_dir = tmp_path_factory.mktemp("resend-node")
    started = await ChatNode(
        node_settings(node_id, tiny_model_dir, data_dir, kafka_bootstrap, cache)
    ).start()

    async def registered() -> bool:
        async with coordinator.database.session() as session:
            return await session.get(Node, node_id) is not None

    try:
        await eventually(registered, timeout_s=TIMEOUT_S, what=f"{node_id} registered")
        yield started
    finally:
        await started.stop()


async def update_document(
    kafka_bootstrap: str, tenant: str, doc_id: str, version: int
) -> uuid.UUID:
    """A user's DocumentUpdated (signed with the tests' producer key); returns its event id."""
    event = schema.make_event(
        schema.DocumentUpdated(doc_id=doc_id, version=version), tenant_id=tenant
    )
    async with EventProducer(
        KafkaSettings(bootstrap=kafka_bootstrap), sign=sign_customer_event
    ) as producer:
        await producer.send(event)
    return event.event_id


async def invalidation_of(database: Database, event_id: uuid.UUID, status: str) -> Invalidation:
    async def reached() -> bool:
        async with database.session() as session:
            found = await session.scalar(
                select(Invalidation).where(Invalidation.source_event_id == event_id)
            )
            return found is not None and found.status == status

    await eventually(
        reached, timeout_s=TIMEOUT_S, what=f"the invalidation of {event_id} to be {status}"
    )
    async with database.session() as session:
        return await session.scalar(
            select(Invalidation).where(Invalidation.source_event_id == event_id)
        )


async def records_of(
    kafka_bootstrap: str, topic: str, command_id: uuid.UUID
) -> list[schema.Envelope]:
    """Every envelope on ``topic`` whose payload names ``command_id``, read up to the end.

    The end is where a poll returns nothing once the end offsets seen at the start are
    reached (Tansu reports the end of a multi-record batch inside it, see
    ``bench.common.start_groups_at_end``).
    """
    found: list[schema.Envelope] = []
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))
        ]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                batch = await consumer.getmany(timeout_ms=300)
                for records in batch.values():
                    for record in records:
                        try:
                            envelope = schema.parse_event(record.value)
                        except schema.EventValidationError:
                            continue  # the worker's broker is shared: other modules write garbage here on purpose
                        if getattr(envelope.payload, "command_id", None) == command_id:
                            found.append(envelope)
                if not batch and all(
                    [await consumer.position(tp) >= end for tp, end in ends.items()]
                ):
                    return found
    finally:
        await consumer.stop()


def reacked(node: ChatNode) -> float:
    return node.engine.metrics.registry.get_sample_value("kvledger_commands_reacked_total") or 0.0


def resends(kind: str) -> float:
    return REGISTRY.get_sample_value("kvledger_command_resends_total", {"kind": kind}) or 0.0


async def test_a_lost_ack_is_recovered_by_a_resend_that_is_acked_again_not_applied_again(
    coordinator, node, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    await node.cache(tenant, "handbook", 1)
    held = node.holdings(tenant, "handbook")
    assert held
    resends_before = resends("document")
    reacked_before = reacked(node)

    node.drop_next_ack = True
    invalidation = await invalidation_of(
        coordinator.database,
        await update_document(kafka_bootstrap, tenant, "handbook", 2),
        "complete",
    )

    command_id = invalidation.command_id
    (dropped,) = node.dropped_acks
    assert dropped.payload.command_id == command_id
    assert node.apply_counts[command_id] == 1, "a re-sent command is not applied again"
    assert node.holdings(tenant, "handbook") == set()
    target = (await targets(coordinator.database, command_id))[node.node_id]
    assert target.status == "acked" and target.resend_count >= 1
    assert {h for item in target.evidence for h in item["block_hashes"]} == held, (
        "the re-ack carries the first application's evidence"
    )
    acks = [
        ack
        for ack in await records_of(kafka_bootstrap, topics.ACKS, command_id)
        if ack.payload.node_id == node.node_id
    ]
    assert acks and {ack.event_id for ack in acks} == {dropped.event_id}, (
        "the re-ack is the very ack that was lost"
    )
    assert reacked(node) >= reacked_before + 1
    assert resends("document") >= resends_before + 1

    # Complete: nothing more goes out, even once the next re-send would have been due.
    sent = len(await records_of(kafka_bootstrap, topics.COMMANDS, command_id))
    due_at = target.next_resend_at

    async def past_due() -> bool:
        async with coordinator.database.session() as session:
            return await session.scalar(select(func.now())) > due_at + timedelta(seconds=0.5)

    await eventually(past_due, what="the next re-send to have been due")
    assert len(await records_of(kafka_bootstrap, topics.COMMANDS, command_id)) == sent
    assert (await targets(coordinator.database, command_id))[
        node.node_id
    ].resend_count == target.resend_count


async def test_a_node_positioned_past_a_command_while_down_gets_it_resent_after_restart(
    coordinator, node, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    first_epoch = node.publisher.epoch
    await node.stop()

    event_id = await update_document(kafka_bootstrap, tenant, "handbook", 2)
    invalidation = await invalidation_of(coordinator.database, event_id, "pending")

    async def published() -> bool:
        async with coordinator.database.session() as session:
            return not await session.scalar(
                select(func.count()).select_from(OutboxEntry).where(OutboxEntry.sent_at.is_(None))
            )

    await eventually(published, what="the command to be published")
    # The record is lost for this node: its group's committed position is moved past it.
    await start_groups_at_end(kafka_bootstrap, {node.commands.group_id: [topics.COMMANDS]})

    await node.start()
    await invalidation_of(coordinator.database, event_id, "complete")
    target = (await targets(coordinator.database, invalidation.command_id))[node.node_id]
    assert target.status == "acked" and target.resend_count >= 1
    assert target.epoch == node.publisher.epoch > first_epoch
    assert node.apply_counts[invalidation.command_id] == 1
