"""Invalidation end to end on the node side: real nodes, real broker, commands published as the
coordinator would.

Each node is what ``gpu_node.entrypoints.server.serve`` runs — engine, publisher, command
consumer — in-process, with its HTTP app driven over ASGI. Commands are written
to ``kvledger.commands`` signed with the tests' command key (``helpers.ledger.SigningProducer``),
which the nodes pin; acks are read back from ``kvledger.acks``.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from helpers.ledger import JWT_SECRET, SUBJECT_KEY, SigningProducer, eventually, scan_topic
from helpers.node import NodeServices, node_settings
from prometheus_client import REGISTRY

from events import schema, topics
from events.kafka.settings import KafkaSettings
from events.tiers import Tier
from gpu_node.entrypoints.routes import create_app
from gpu_node.governance.predicates import block_predicate
from gpu_node.settings import CacheSettings, NodeSettings
from identity.tokens import TokenVerifier, issue_token

SYSTEM = "You answer questions from the tenant handbook, briefly."
KEY = SUBJECT_KEY.encode()


class Node(NodeServices):
    def __init__(self, settings: NodeSettings) -> None:
        super().__init__(settings)
        self.assemble()
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(
                app=create_app(self.engine, TokenVerifier(settings.auth))
            ),
            base_url="http://node",
            timeout=60,
        )

    async def start(self, wait_ready: bool = True) -> Node:
        """As ``serve`` does: engine.start → publisher.start → command replay → ready."""
        await self.engine.start(ready=False)
        await self.start_replay()
        if wait_ready:
            await eventually(self._ready, timeout_s=30, what=f"{self.node_id} ready")
        return self

    async def _ready(self) -> bool:
        return self.commands.replayed.is_set()

    async def stop(self) -> None:
        await self.http.aclose()
        await self.stop_replay()
        await self.engine.stop()

    async def chat(self, token: str, messages: list[dict]) -> httpx.Response:
        body = {
            "model": self.engine.model_name,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
        }
        return await self.http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        )

    async def cached(self, token: str, messages: list[dict]) -> int:
        response = await self.chat(token, messages)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def holdings(self, predicate) -> set[tuple[str, str]]:
        """(block hash, tier) of every matching block the node holds, snapshots as tier
        ``snapshot``."""
        held = {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in self.engine.pool.ready_entries()
            if predicate(entry.provenance)
        }
        for keys in self.engine.snapshot_inventory().values():
            held.update(
                (key.block_hash.hex(), "snapshot") for key in keys if predicate(key.provenance)
            )
        return held


def settings_for(
    node_id: str, model_dir: Path, data_dir: Path, kafka_bootstrap: str
) -> NodeSettings:
    cache = CacheSettings(num_device_blocks=64, num_host_blocks=64, max_disk_blocks=128)
    return node_settings(node_id, model_dir, data_dir, kafka_bootstrap, cache)


@pytest.fixture
def make_settings(tiny_model_dir, tmp_path, kafka_bootstrap):
    suffix = uuid.uuid4().hex[:6]

    def make(name: str) -> NodeSettings:
        return settings_for(f"{name}-{suffix}", tiny_model_dir, tmp_path / name, kafka_bootstrap)

    return make


def token(tenant: str, pv: int = 1) -> str:
    return issue_token(
        tenant=tenant, sub="alice", scopes=["hr"], pv={"hr": pv}, ttl_s=600, secret=JWT_SECRET
    )


def chat(doc_id: str, version: int, question: str = "What is the leave policy?") -> list[dict]:
    text = " ".join(f"{doc_id} section {i} version {version} says staff rest" for i in range(10))
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {
            "role": "user",
            "content": text,
            "document": {"id": doc_id, "version": version, "auth_scope": "hr"},
        },
        {"role": "user", "content": question},
    ]


async def publish(kafka_bootstrap: str, predicate, tenant: str | None) -> schema.Invalidate:
    command = schema.Invalidate(
        command_id=uuid.uuid4(), predicate=predicate, cutoff=datetime.now(UTC)
    )
    async with SigningProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as producer:
        await producer.send(schema.make_event(command, tenant_id=tenant))
    return command


async def acks_for(
    kafka_bootstrap: str, command_id: uuid.UUID, node_ids: set[str], timeout_s: float = 30
) -> dict[str, schema.CommandAck]:
    found: dict[str, schema.CommandAck] = {}

    def visit(record) -> bool:
        payload = schema.parse_event(record.value).payload
        if payload.command_id == command_id and payload.node_id in node_ids:
            found[payload.node_id] = payload
        return set(found) == node_ids

    await scan_topic(kafka_bootstrap, topics.ACKS, visit, timeout_s=timeout_s)
    return found


async def events_behind_fence(
    kafka_bootstrap: str, ack: schema.CommandAck, expected: set[tuple[str, str]]
) -> dict[tuple[str, str], int]:
    """Seq of the kv-event that reported each of ``expected`` (hash, tier) gone in ``ack``'s epoch: a ``BlockRemoved``
    for a pool tier, the ``SnapshotWritten`` that listed it for the snapshot tier (whose removal only the ack reports)."""
    seqs: dict[tuple[str, str], int] = {}

    def visit(record) -> bool:
        payload = schema.parse_event(record.value).payload
        if (
            getattr(payload, "node_id", None) != ack.node_id
            or getattr(payload, "epoch", None) != ack.epoch
        ):
            return False
        if isinstance(payload, schema.BlockRemoved):
            seqs.update({(block.block_hash, block.tier): payload.seq for block in payload.blocks})
        elif isinstance(payload, schema.SnapshotWritten):
            seqs.update(
                {(block_hash, "snapshot"): payload.seq for block_hash in payload.block_hashes}
            )
        return expected <= set(seqs)

    await scan_topic(kafka_bootstrap, topics.KV_EVENTS, visit)
    return {key: seqs[key] for key in expected}


def evidence_set(ack: schema.CommandAck) -> set[tuple[str, str]]:
    return {(block_hash, item.tier) for item in ack.evidence for block_hash in item.block_hashes}


async def spread_over_tiers(node: Node, predicate) -> None:
    """Move matching blocks so the node holds them on device, host and disk, and in a snapshot."""
    matching = [
        entry.block_hash
        for entry in node.engine.pool.ready_entries()
        if predicate(entry.provenance)
    ]
    assert len(matching) >= 3
    assert node.engine.pool.demote(matching[0], Tier.HOST)
    assert node.engine.pool.demote(matching[1], Tier.DISK)
    await node.engine.write_snapshot()


async def test_document_update_is_applied_and_acked_by_every_node(make_settings, kafka_bootstrap):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = token(tenant)
    nodes = [await Node(make_settings(name)).start() for name in ("a", "b")]
    try:
        expected: dict[str, set[tuple[str, str]]] = {}
        predicate = schema.DocumentPredicate(tenant=tenant, doc_id="handbook", below_version=2)
        public_only = [
            {"role": "system", "content": SYSTEM, "cache_scope": "public"},
            {"role": "user", "content": "Hello there"},
        ]
        baseline = {}
        for node in nodes:
            await node.cached(alice, chat("handbook", 1))
            await node.cached(alice, chat("policies", 1))
            baseline[node.node_id] = (
                await node.cached(alice, chat("policies", 1)),
                await node.cached(alice, public_only),
            )
            assert baseline[node.node_id][0] > 16 and baseline[node.node_id][1] > 0
            await spread_over_tiers(node, block_predicate(predicate, datetime.now(UTC), KEY))
            expected[node.node_id] = node.holdings(
                block_predicate(predicate, datetime.now(UTC), KEY)
            )
            assert {tier for _, tier in expected[node.node_id]} == {
                "device",
                "host",
                "disk",
                "snapshot",
            }

        command = await publish(kafka_bootstrap, predicate, tenant)
        acks = await acks_for(kafka_bootstrap, command.command_id, {node.node_id for node in nodes})

        matches = block_predicate(predicate, command.cutoff, KEY)
        for node in nodes:
            ack = acks[node.node_id]
            assert ack.epoch == node.publisher.epoch
            assert evidence_set(ack) == expected[node.node_id]
            fenced = await events_behind_fence(kafka_bootstrap, ack, expected[node.node_id])
            assert ack.after_seq is not None and max(fenced.values()) <= ack.after_seq, (
                ack.after_seq,
                fenced,
            )
            assert all(item.verified for item in ack.evidence)
            methods = {item.tier: (item.method, item.post_check) for item in ack.evidence}
            assert methods == {
                "device": ("overwrite", "readback_zero"),
                "host": ("overwrite", "readback_zero"),
                "disk": ("unlink", "file_absent"),
                "snapshot": ("unlink", "file_absent"),
            }
            assert node.holdings(matches) == set()
            stale = await node.chat(alice, chat("handbook", 1))
            assert stale.status_code == 409
            error = stale.json()["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "stale_document_version",
                "invalid_request_error",
                "messages[1].document.version",
            )
            assert (
                await node.cached(alice, chat("policies", 1)),
                await node.cached(alice, public_only),
            ) == baseline[node.node_id]
            assert (
                await node.cached(alice, chat("handbook", 2)) == 16
            )  # only the public system block
    finally:
        for node in nodes:
            await node.stop()


async def test_policy_revocation_refuses_old_tokens_and_rebuilds_under_new_ones(
    make_settings, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    node = await Node(make_settings("p")).start()
    try:
        assert await node.cached(token(tenant, pv=1), chat("handbook", 1)) == 0
        full = await node.cached(token(tenant, pv=1), chat("handbook", 1))
        assert full > 16
        command = await publish(
            kafka_bootstrap,
            schema.PolicyPredicate(tenant=tenant, auth_scope="hr", below_version=2),
            tenant,
        )
        (ack,) = (await acks_for(kafka_bootstrap, command.command_id, {node.node_id})).values()
        assert sum(item.removed for item in ack.evidence) > 0
        assert node.holdings(block_predicate(command.predicate, command.cutoff, KEY)) == set()

        refused = await node.chat(token(tenant, pv=1), chat("handbook", 1))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "stale_authorization"
        assert refused.headers["www-authenticate"] == "Bearer"
        assert await node.cached(token(tenant, pv=2), chat("handbook", 1)) == 16
        assert await node.cached(token(tenant, pv=2), chat("handbook", 1)) == full
    finally:
        await node.stop()


async def test_node_down_during_the_command_applies_it_before_ready_then_acks(
    make_settings, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = token(tenant)
    settings = make_settings("r")
    predicate = schema.DocumentPredicate(
        tenant=tenant, doc_id="handbook", below_version=schema.ANY_VERSION
    )  # deleted
    node = await Node(settings).start()
    try:
        await node.cached(alice, chat("handbook", 1))
        await spread_over_tiers(node, block_predicate(predicate, datetime.now(UTC), KEY))
        survivors = {
            (block, tier)
            for block, tier in node.holdings(block_predicate(predicate, datetime.now(UTC), KEY))
            if tier in ("disk", "snapshot")
        }
        assert {tier for _, tier in survivors} == {"disk", "snapshot"}
    finally:
        await node.stop()

    command = await publish(kafka_bootstrap, predicate, tenant)
    restarted = Node(settings)
    await restarted.start(wait_ready=False)
    try:
        not_ready = await restarted.http.get("/readyz")
        assert not_ready.status_code == 503
        assert json.loads(not_ready.text)["error"]["code"] == "not_ready"
        await eventually(restarted._ready, timeout_s=30, what="replay")
        # ready implies: applied (nothing matching is held) and acked
        assert restarted.engine.ready
        assert restarted.holdings(block_predicate(predicate, command.cutoff, KEY)) == set()
        (ack,) = (
            await acks_for(kafka_bootstrap, command.command_id, {restarted.node_id}, timeout_s=5)
        ).values()
        assert ack.epoch == restarted.publisher.epoch == node.publisher.epoch + 1
        assert evidence_set(ack) == survivors
        assert (await restarted.http.get("/readyz")).status_code == 200
        gone = await restarted.chat(alice, chat("handbook", 1))
        assert gone.status_code == 409 and gone.json()["error"]["code"] == "stale_document_version"
    finally:
        await restarted.stop()


async def test_inventory_requests_are_answered_and_malformed_commands_dead_lettered(
    make_settings, kafka_bootstrap
):
    node = await Node(make_settings("i")).start()
    try:
        request_id = uuid.uuid4()
        async with SigningProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as producer:
            await producer.send_raw(
                topics.COMMANDS,
                b'{"type": "Invalidate", "not": "an envelope"}',
                topics.BROADCAST_TARGET.encode(),
            )
            await producer.send(
                schema.make_event(
                    schema.InventoryRequested(node_id=node.node_id, request_id=request_id)
                )
            )
        tenant = f"acme-{uuid.uuid4().hex[:6]}"
        command = await publish(kafka_bootstrap, schema.TenantPredicate(tenant=tenant), tenant)
        (ack,) = (await acks_for(kafka_bootstrap, command.command_id, {node.node_id})).values()
        assert ack.evidence == []  # nothing matched, acked all the same

        def answered(record) -> bool:
            payload = schema.parse_event(record.value).payload
            return (
                isinstance(payload, schema.Inventory)
                and payload.request_id == request_id
                and payload.node_id == node.node_id
            )

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, answered)

        def dead_lettered(record) -> bool:
            return json.loads(record.value).get("group_id") == node.commands.group_id

        await scan_topic(kafka_bootstrap, topics.NODE_DEAD_LETTER, dead_lettered)
    finally:
        await node.stop()


async def test_a_command_that_fails_is_retried_and_nothing_after_it_is_skipped(
    make_settings, kafka_bootstrap
):
    """Fault injection in the node's own handler: the second of three commands fails once."""
    node = await Node(make_settings("f")).start()
    real_apply_batch = node.commands.handler.apply_batch
    tenants = [f"acme-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    failures: list[str] = []

    async def apply_batch_failing_once(commands):
        """The real handler, except that the first batch reaching tenants[1]'s command fails there,
        before applying it."""
        failing = [
            i for i, command in enumerate(commands) if command.predicate.tenant == tenants[1]
        ]
        applying = commands if failures or not failing else commands[: failing[0]]
        async for item in real_apply_batch(applying):
            yield item
        if len(applying) < len(commands):
            failures.append(tenants[1])
            raise RuntimeError("injected failure")

    node.commands.handler.apply_batch = apply_batch_failing_once
    try:

        def num_handler_failures() -> float:
            return (
                REGISTRY.get_sample_value(
                    "kvledger_consumer_handler_failures_total", {"group": node.commands.group_id}
                )
                or 0.0
            )

        failures_before = num_handler_failures()
        commands = [
            await publish(kafka_bootstrap, schema.TenantPredicate(tenant=tenant), tenant)
            for tenant in tenants
        ]
        acks = [
            (await acks_for(kafka_bootstrap, command.command_id, {node.node_id}))[node.node_id]
            for command in commands
        ]
        assert [ack.command_id for ack in acks] == [command.command_id for command in commands]
        assert failures == [tenants[1]]
        assert num_handler_failures() == failures_before + 1
    finally:
        await node.stop()


async def test_an_ack_that_could_not_be_published_is_sent_again_without_applying_twice(
    make_settings, kafka_bootstrap
):
    """Fault injection in the node's ack producer: the first ack fails. Acks and offset commits run in the
    background while the next commands are applied; the failure surfaces at the next poll, the node rewinds
    to its committed offset, and the command is acked with the evidence of its one application."""
    node = await Node(make_settings("p")).start()
    tenants = [f"acme-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    applied: list[uuid.UUID] = []
    real_apply_batch = node.commands.handler.apply_batch
    real_send_many = node.commands._producer.send_many
    num_sends = 0

    async def apply_batch_counted(commands):
        async for command, evidence in real_apply_batch(commands):
            applied.append(command.command_id)
            yield command, evidence

    async def send_failing_first(envelopes):
        """An ack's records (one here) go out in one call: the first ack's call fails."""
        nonlocal num_sends
        num_sends += 1
        if num_sends == 1:
            raise ConnectionError("injected: broker unreachable")
        return await real_send_many(envelopes)

    node.commands.handler.apply_batch = apply_batch_counted
    node.commands._producer.send_many = send_failing_first
    try:
        holdings = {}
        for tenant in tenants:
            await node.cached(token(tenant), chat("handbook", 1))
            holdings[tenant] = node.holdings(
                block_predicate(schema.TenantPredicate(tenant=tenant), datetime.now(UTC), KEY)
            )
            assert holdings[tenant]
        commands = [
            await publish(kafka_bootstrap, schema.TenantPredicate(tenant=tenant), tenant)
            for tenant in tenants
        ]
        acks = [
            (await acks_for(kafka_bootstrap, command.command_id, {node.node_id}))[node.node_id]
            for command in commands
        ]
        assert [evidence_set(ack) for ack in acks] == [holdings[tenant] for tenant in tenants]
        assert sorted(applied) == sorted(command.command_id for command in commands)
        assert num_sends >= 3, "the failed ack was sent again"
    finally:
        await node.stop()


async def test_copies_of_a_command_in_one_batch_are_applied_once_and_acked_with_the_same_ack(
    make_settings, kafka_bootstrap
):
    """A node that was down while the coordinator re-sent a command finds several records of it past
    its committed offset, fetched in one batch: the first is applied, the others are answered with
    its ack."""
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    settings = make_settings("c")
    await (
        await Node(settings).start()
    ).stop()  # the node's group has a committed position before the command

    command = schema.Invalidate(
        command_id=uuid.uuid4(),
        predicate=schema.TenantPredicate(tenant=tenant),
        cutoff=datetime.now(UTC),
    )
    async with SigningProducer(KafkaSettings(bootstrap=kafka_bootstrap)) as producer:
        for _ in range(3):  # the command and two re-sends: new envelopes, the same command
            await producer.send(schema.make_event(command, tenant_id=tenant))
    restarted = Node(settings)
    applied: list[uuid.UUID] = []
    real_apply_batch = restarted.commands.handler.apply_batch

    async def apply_batch_counted(commands):
        async for applied_command, evidence in real_apply_batch(commands):
            applied.append(applied_command.command_id)
            yield applied_command, evidence

    restarted.commands.handler.apply_batch = apply_batch_counted
    await restarted.start()
    try:
        acks: list[schema.Envelope] = []

        def visit(record) -> bool:
            envelope = schema.parse_event(record.value)
            if (
                envelope.payload.command_id == command.command_id
                and envelope.payload.node_id == restarted.node_id
            ):
                acks.append(envelope)
            return len(acks) == 3

        await scan_topic(kafka_bootstrap, topics.ACKS, visit)
        assert applied.count(command.command_id) == 1
        assert len({ack.event_id for ack in acks}) == 1, (
            "every copy is answered with the one application's ack"
        )
        assert (
            restarted.engine.metrics.registry.get_sample_value("kvledger_commands_reacked_total")
            == 2
        )
    finally:
        await restarted.stop()


async def test_a_command_that_keeps_failing_marks_the_command_consumer_stalled_until_it_passes(
    make_settings, kafka_bootstrap
):
    """The node retries a failing command forever (never skipping it); ``kvledger_consumer_stalled``
    makes that visible."""
    node = await Node(make_settings("s")).start()
    node.commands.stall.stall_after_s = 0.5
    real_apply_batch = node.commands.handler.apply_batch
    failing = True

    async def apply_batch_failing(commands):
        if failing:
            raise ConnectionError("injected: keeps failing")
        async for item in real_apply_batch(commands):
            yield item

    def stalled() -> float | None:
        return node.engine.metrics.registry.get_sample_value(
            "kvledger_consumer_stalled", {"group": node.commands.group_id}
        )

    node.commands.handler.apply_batch = apply_batch_failing
    try:
        assert stalled() == 0
        tenant = f"acme-{uuid.uuid4().hex[:6]}"
        command = await publish(kafka_bootstrap, schema.TenantPredicate(tenant=tenant), tenant)
        await eventually(
            lambda: stalled() == 1, what="the node's command consumer reported stalled"
        )
        failing = False
        await acks_for(kafka_bootstrap, command.command_id, {node.node_id})
        await eventually(lambda: stalled() == 0, what="the stall cleared once the command passed")
    finally:
        await node.stop()
