"""A starting node takes the governance state it must enforce from the coordinator (``GET
/v1/governance``).

Everything is real: the coordinator's consumers and HTTP API (uvicorn, in its own thread: nodes
fetch data keys from it synchronously) on a freshly migrated database, a node as
``gpu_node.entrypoints.server.serve`` assembles it with ``coordinator_url`` set, the session's
broker and Postgres. Command re-sends are effectively off (one hour), so a command a node missed can
only reach it through the governance state.

* A node down while a document update, a permission revocation, an erasure and a
  namespace retirement were decided restarts and reads none of the commands' records
  (it consumes the topic from the end it noted before fetching the state — what an
  expired retention leaves it); it refuses the old document version and the old
  policy version, knows the namespace retired, removes what the commands cover (its
  disk tier survived the restart) and acks them, so the invalidations complete, the
  namespace turns ``retired`` and the erasure is ``verified``.
* A man in the middle: the node stays not ready while the state is unreachable,
  tampered with or unsigned, and turns ready once the true state reaches it.
* Only an enrolled, unrevoked node's own credential gets an answer; it is signed, bound
  to the node and the nonce, and paged.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import (
    COMMAND_KEY,
    JWT_SECRET,
    coordinator_settings,
    enroll_nodes,
    eventually,
    node_key,
    operator_headers,
    sign_command,
    sign_customer_event,
)
from helpers.node import CoordinatorThread, ServedNode, demote_to_disk, node_settings
from sqlalchemy import select

from bench.common import start_groups_at_end
from coordinator.consumers import consumer_groups
from coordinator.keys.node_keys import revoke
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation, InvalidationTarget, Namespace
from coordinator.settings import DatabaseSettings, kafka_settings
from events import schema, topics
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from gpu_node.governance.sync import GovernanceClient
from gpu_node.settings import CacheSettings
from identity.node_credentials import issue_node_credential
from identity.signing import GOVERNANCE_CONTEXT, document_signature_problem
from identity.tokens import issue_token

TIMEOUT_S = 60.0
SYSTEM = "You answer from the staff handbook. Be brief."
MASTER_KEY = base64.b64encode(os.urandom(32)).decode()
PLATFORM_ADMIN = operator_headers("platform-admin", "platform")


class GovNode(ServedNode):
    """A node as ``serve`` assembles it, with ``coordinator_url``; ``read_offsets`` lists every
    commands record it read."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.running = False
        self.read_offsets: list[tuple[int, int]] = []

    def assemble(self) -> None:
        super().assemble()
        self.read_offsets = []
        real = self.commands._handle_partition

        async def spying(tp, records, handled, sending):
            self.read_offsets.extend((tp.partition, record.offset) for record in records)
            return await real(tp, records, handled, sending)

        self.commands._handle_partition = spying

    async def start(self, wait_ready: bool = True) -> GovNode:
        await self.engine.start(ready=False)
        self.running = True
        await self.serve_http()
        await self.start_replay()
        if wait_ready:
            await asyncio.wait_for(self.commands.replayed.wait(), TIMEOUT_S)
        return self

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        await self.http.stop()
        await self.stop_replay()
        await self.engine.stop()
        self.engine.pool.key_provider.close()

    def holdings(self, tenant: str) -> set[tuple[str, str]]:
        return {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in self.engine.pool.ready_entries()
            if entry.provenance.tenant_id == tenant
        }


@pytest.fixture(scope="module")
async def stack(
    ledger_url: str, kafka_bootstrap: str, tiny_model_dir: Path, tmp_path_factory
) -> AsyncIterator[dict]:
    settings = coordinator_settings(
        ledger_url,
        kafka_bootstrap,
        ledger={
            "erasure_verify_interval_s": 0.5,
            "command_resend_after_s": 3600,
            "command_resend_max_s": 3600,
        },
        keys={"master_key": MASTER_KEY},
    )
    await ensure_topics(kafka_settings(settings))
    await start_groups_at_end(kafka_bootstrap, consumer_groups(settings.kafka.group_id))
    coordinator = await CoordinatorThread(settings).start()
    database = Database(DatabaseSettings(url=ledger_url), pre_ping=False)
    node_id = f"gov-{uuid.uuid4().hex[:6]}"
    await enroll_nodes(ledger_url, [node_id])
    cache = CacheSettings(num_device_blocks=64, num_host_blocks=16, max_disk_blocks=256)
    settings_of_node = node_settings(
        node_id,
        tiny_model_dir,
        tmp_path_factory.mktemp("gov-node"),
        kafka_bootstrap,
        cache,
        coordinator_url=coordinator.url,
    )
    node = GovNode(settings_of_node)
    try:
        node.assemble()
        await node.start()

        async def registered() -> bool:
            async with httpx.AsyncClient(
                base_url=coordinator.url, headers=PLATFORM_ADMIN, timeout=30
            ) as client:
                listed = (await client.get("/v1/nodes")).json()["nodes"]
            return node_id in {row["node_id"] for row in listed}

        await eventually(registered, timeout_s=TIMEOUT_S, what="the node registered in the ledger")
        yield {
            "url": coordinator.url,
            "database_url": ledger_url,
            "database": database,
            "node": node,
            "kafka": kafka_bootstrap,
        }
    finally:
        await node.stop()
        await database.dispose()
        await coordinator.stop()


# --------------------------------------------------------------------------- helpers


def token(tenant: str, subject: str, pv: int) -> str:
    return issue_token(
        tenant=tenant, sub=subject, scopes=["hr"], pv={"hr": pv}, ttl_s=600, secret=JWT_SECRET
    )


def messages(subject: str, version: int) -> list[dict]:
    handbook = " ".join(
        f"handbook section {i} version {version}: staff rest on day {i}" for i in range(6)
    )
    notes = " ".join(f"{subject} wrote note {i}: my leave started on day {i}" for i in range(6))
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {
            "role": "user",
            "content": handbook,
            "document": {"id": "handbook", "version": version, "auth_scope": "hr"},
        },
        {"role": "user", "content": notes},
    ]


async def chat(node: GovNode, bearer: str, body_messages: list[dict]) -> httpx.Response:
    body = {
        "model": node.engine.model_name,
        "messages": body_messages,
        "max_tokens": 1,
        "temperature": 0,
    }
    async with httpx.AsyncClient(base_url=node.http.url, timeout=60) as client:
        return await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {bearer}"}
        )


async def publish(kafka_bootstrap: str, payload, tenant: str | None) -> uuid.UUID:
    event = schema.make_event(payload, tenant_id=tenant)
    async with EventProducer(
        KafkaSettings(bootstrap=kafka_bootstrap), sign=sign_customer_event
    ) as producer:
        await producer.send(event)
    return event.event_id


async def commands_end(kafka_bootstrap: str) -> dict[int, int]:
    """The end offsets of ``kvledger.commands`` per partition."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None)
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topics.COMMANDS, p)
            for p in sorted(consumer.partitions_for_topic(topics.COMMANDS))
        ]
        return {
            tp.partition: offset for tp, offset in (await consumer.end_offsets(partitions)).items()
        }
    finally:
        await consumer.stop()


async def command_offsets(
    kafka_bootstrap: str, command_ids: set[uuid.UUID]
) -> list[tuple[int, int]]:
    """(partition, offset) of every record on ``kvledger.commands`` carrying one of ``command_ids``,
    read to the end."""
    found: list[tuple[int, int]] = []
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topics.COMMANDS, p)
            for p in sorted(consumer.partitions_for_topic(topics.COMMANDS))
        ]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                batch = await consumer.getmany(timeout_ms=300)
                for tp, records in batch.items():
                    for record in records:
                        if (
                            getattr(schema.parse_event(record.value).payload, "command_id", None)
                            in command_ids
                        ):
                            found.append((tp.partition, record.offset))
                if not batch and all(
                    [await consumer.position(tp) >= end for tp, end in ends.items()]
                ):
                    return found
    finally:
        await consumer.stop()


async def decisions_of(database: Database, event_ids: list[uuid.UUID]) -> list[Invalidation]:
    async with database.session() as session:
        rows = (
            await session.scalars(
                select(Invalidation).where(Invalidation.source_event_id.in_(event_ids))
            )
        ).all()
    return list(rows)


async def governance_get(base_url: str, headers: dict | None, **params) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await client.get(
            "/v1/governance", params={"nonce": "n" * 24} | params, headers=headers or {}
        )


def node_credential(node_id: str, key: Ed25519PrivateKey | None = None) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {issue_node_credential(key or node_key(node_id), node_id, 30)}"
    }


# --------------------------------------------------------------------------- tests


async def test_a_node_down_while_governance_changed_restarts_from_the_coordinators_state_alone(
    stack,
):
    url, database, node, bootstrap = stack["url"], stack["database"], stack["node"], stack["kafka"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = f"alice-{uuid.uuid4().hex[:8]}"
    response = await chat(node, token(tenant, alice, 1), messages(alice, 1))
    assert response.status_code == 200, response.text
    # Push the tenant's blocks (handbook v1 under hr pv 1, and alice's) down to disk: they survive
    # the restart.
    held = sorted(block for block, tier in node.holdings(tenant) if tier == "device")
    assert len(held) >= 4
    for block in held:
        await demote_to_disk(node.engine, block)
    node.engine.manager.drain_events()
    disk = {block for block, tier in node.holdings(tenant) if tier == "disk"}
    assert disk == set(held)

    async def ledger_holds_disk() -> bool:
        async with httpx.AsyncClient(base_url=url, headers=PLATFORM_ADMIN, timeout=30) as client:
            params = {"tenant": tenant, "node": node.node_id, "limit": 1000}
            blocks = (await client.get("/v1/ledger/blocks", params=params)).json()["blocks"]
        live = {
            (b["block_hash"], p["tier"])
            for b in blocks
            for p in b["placements"]
            if p["state"] == "live"
        }
        return live >= {(h, "disk") for h in disk}

    await eventually(
        ledger_holds_disk, timeout_s=TIMEOUT_S, what="the ledger to hold the disk copies"
    )
    first_epoch = node.publisher.epoch
    await node.stop()

    # While it is down: a document update, a permission revocation, an erasure and a namespace
    # retirement.
    other_namespace = f"ns-old-{uuid.uuid4().hex[:8]}"
    async with database.session() as session, session.begin():
        session.add(Namespace(namespace=other_namespace))
    event_ids = [
        await publish(bootstrap, schema.DocumentUpdated(doc_id="handbook", version=2), tenant),
        await publish(
            bootstrap, schema.PermissionRevoked(auth_scope="hr", policy_version=2), tenant
        ),
    ]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        erasure = await client.post(
            "/v1/erasures",
            json={"tenant_id": tenant, "subject_id": alice, "reason": "GDPR art. 17 request"},
            headers=operator_headers("privacy-officer", tenant),
        )
        assert erasure.status_code == 202, erasure.text
        retire = await client.post(
            f"/v1/namespaces/{other_namespace}/retire", headers=PLATFORM_ADMIN
        )
        assert retire.status_code == 202, retire.text
    erasure_id = erasure.json()["id"]

    async def decided() -> bool:
        return len(await decisions_of(database, event_ids)) == 2

    await eventually(decided, timeout_s=TIMEOUT_S, what="the document and permission decisions")
    async with database.session() as session:
        erasure_command = await session.scalar(
            select(Invalidation.command_id).where(
                Invalidation.kind == "subject", Invalidation.predicate["tenant"].astext == tenant
            )
        )
        namespace_command = await session.scalar(
            select(Namespace.invalidation_id).where(Namespace.namespace == other_namespace)
        )
    missed = {row.command_id for row in await decisions_of(database, event_ids)} | {
        erasure_command,
        namespace_command,
    }
    assert len(missed) == 4

    async def published() -> bool:
        return len({offset for offset in await command_offsets(bootstrap, missed)}) >= 4

    await eventually(published, timeout_s=TIMEOUT_S, what="the four commands on the topic")
    # A last record after them in their partition (addressed to no node), so the end the node notes
    # lies past every missed command (Tansu reports the end of a multi-record batch as its first
    # offset).
    marker = sign_command(
        schema.make_event(schema.InventoryRequested(node_id="nobody", request_id=uuid.uuid4()))
    )
    async with EventProducer(KafkaSettings(bootstrap=bootstrap)) as producer:
        await producer.send(marker, key=topics.BROADCAST_TARGET)
    end_before_restart = await commands_end(bootstrap)
    missed_offsets = await command_offsets(bootstrap, missed)
    assert missed_offsets and all(
        offset < end_before_restart[partition] for partition, offset in missed_offsets
    )
    # What an expired retention leaves: nothing of the node's past position to go back to.
    await start_groups_at_end(bootstrap, {node.commands.group_id: [topics.COMMANDS]})

    node.assemble()
    await node.start()
    assert node.publisher.epoch > first_epoch
    assert all(
        offset >= end_before_restart[partition] for partition, offset in node.read_offsets
    ), "read a missed command"

    # It refuses what the decisions superseded ...
    stale_document = await chat(node, token(tenant, alice, 2), messages(alice, 1))
    assert (
        stale_document.status_code == 409
        and stale_document.json()["error"]["code"] == "stale_document_version"
    )
    stale_policy = await chat(node, token(tenant, alice, 1), messages(alice, 2))
    assert (
        stale_policy.status_code == 401
        and stale_policy.json()["error"]["code"] == "stale_authorization"
    )
    assert node.engine.versions.is_retired(other_namespace)
    assert not node.engine.versions.is_retired(node.engine.namespace.namespace)
    # ... removed what they cover from the disk tier it reloaded, and acked every one of them.
    assert node.holdings(tenant) == set()
    assert not any(node.engine.pool.disk_path(bytes.fromhex(block)).exists() for block in disk)

    async def all_complete() -> bool:
        async with database.session() as session:
            statuses = (
                await session.scalars(
                    select(Invalidation.status).where(Invalidation.command_id.in_(missed))
                )
            ).all()
        return sorted(statuses) == ["complete"] * 4

    await eventually(all_complete, timeout_s=TIMEOUT_S, what="the four missed commands complete")
    async with database.session() as session:
        targets = (
            await session.scalars(
                select(InvalidationTarget).where(InvalidationTarget.command_id.in_(missed))
            )
        ).all()
        namespace_status = await session.scalar(
            select(Namespace.status).where(Namespace.namespace == other_namespace)
        )
    assert {(t.node_id, t.status, t.epoch, t.resend_count) for t in targets} == {
        (node.node_id, "acked", node.publisher.epoch, 0)
    }
    assert namespace_status == "retired"

    async def verified() -> bool:
        async with httpx.AsyncClient(base_url=url, headers=PLATFORM_ADMIN, timeout=30) as client:
            return (await client.get(f"/v1/erasures/{erasure_id}")).json()["status"] == "verified"

    await eventually(verified, timeout_s=TIMEOUT_S, what="the erasure verified")
    fresh = await chat(node, token(tenant, alice, 2), messages(alice, 2))
    assert fresh.status_code == 200, fresh.text


class ManInTheMiddle(httpx.AsyncBaseTransport):
    """Sits between the node and the coordinator: each request is answered by the next fault of
    ``faults`` (``unreachable``, ``tampered``: one decision relaxed with the signature kept,
    ``unsigned``), then passed through. ``ready_when_asked`` records whether the node was ready at
    each request; the request of fault number ``hold_at`` waits for ``release`` (``holding`` is set
    meanwhile), so the test can look at the node then."""

    def __init__(self, node: GovNode, faults: list[str], hold_at: int) -> None:
        self.node = node
        self.faults = list(faults)
        self.hold_at = hold_at
        self.ready_when_asked: list[bool] = []
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.ready_when_asked.append(self.node.engine.ready)
        if not self.faults:
            return await self._real.handle_async_request(request)
        if len(self.ready_when_asked) - 1 == self.hold_at:
            self.holding.set()
            await self.release.wait()
        fault = self.faults.pop(0)
        if fault == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        response = await self._real.handle_async_request(request)
        body = json.loads(await response.aread())
        if fault == "tampered":
            body["decisions"] = [
                item for item in body["decisions"] if item["predicate"]["kind"] != "policy"
            ]
        else:
            del body["signature"]
        return httpx.Response(200, json=body)

    async def aclose(self) -> None:
        await self._real.aclose()


def governance_failures(node: GovNode) -> dict[str, float | None]:
    registry = node.engine.metrics.registry
    return {
        reason: registry.get_sample_value(
            "kvledger_governance_sync_failures_total", {"reason": reason}
        )
        for reason in ("unavailable", "refused")
    }


async def test_a_node_stays_not_ready_until_an_untampered_signed_state_reaches_it(stack):
    url, node = stack["url"], stack["node"]
    await node.stop()
    node.assemble()
    faults = ["unreachable", "unreachable", "tampered", "unsigned"]
    middle = ManInTheMiddle(node, faults, hold_at=3)
    node.commands.governance = GovernanceClient(
        url,
        lambda: issue_node_credential(node_key(node.node_id), node.node_id, 30),
        node.node_id,
        COMMAND_KEY.public_key(),
        transport=middle,
    )
    try:
        await node.start(wait_ready=False)
        async with httpx.AsyncClient(base_url=node.http.url, timeout=30) as client:
            # Unreachable twice, then a tampered answer: the node is not ready and says so.
            await asyncio.wait_for(middle.holding.wait(), TIMEOUT_S)
            assert governance_failures(node) == {"unavailable": 2.0, "refused": 1.0}
            assert not node.engine.ready and (await client.get("/readyz")).status_code == 503
            middle.release.set()
            # Then an unsigned one, then the true state: ready only after that.
            await asyncio.wait_for(node.commands.replayed.wait(), TIMEOUT_S)
            assert governance_failures(node) == {"unavailable": 2.0, "refused": 2.0}
            assert middle.ready_when_asked[: len(faults) + 1] == [False] * (len(faults) + 1)
            assert node.engine.ready and (await client.get("/readyz")).status_code == 200
    finally:
        await middle.aclose()


async def test_only_an_enrolled_unrevoked_nodes_own_credential_gets_the_signed_state(stack):
    url, node, database_url = stack["url"], stack["node"], stack["database_url"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    await publish(stack["kafka"], schema.DocumentUpdated(doc_id="memo", version=7), tenant)

    end_user = {"Authorization": f"Bearer {token(tenant, 'alice', 1)}"}
    for headers in (
        None,
        end_user,
        PLATFORM_ADMIN,
        node_credential(node.node_id, Ed25519PrivateKey.generate()),
    ):
        refused = await governance_get(url, headers)
        assert refused.status_code == 401, refused.text
        assert set(refused.json()["error"]) == {"message", "type", "code"}

    def mine() -> dict[str, str]:
        """A fresh credential per request: one lives 30 s."""
        return node_credential(node.node_id)

    assert (await governance_get(url, mine(), nonce="short")).status_code == 400
    forged = (
        base64.urlsafe_b64encode(json.dumps({"section": 2, "after": [1, 2]}).encode())
        .decode()
        .rstrip("=")
    )
    for cursor in ("not-a-cursor", forged):
        refused_cursor = await governance_get(url, mine(), cursor=cursor)
        assert (
            refused_cursor.status_code == 400
            and refused_cursor.json()["error"]["code"] == "invalid_parameter"
        )

    async def memo_listed() -> bool:
        body = (await governance_get(url, mine())).json()
        return {"kind": "document", "tenant": tenant, "doc_id": "memo", "below_version": 7} in [
            d["predicate"] for d in body["decisions"]
        ]

    await eventually(memo_listed, timeout_s=TIMEOUT_S, what="the memo decision in the state")
    response = await governance_get(url, mine(), nonce="a-fresh-nonce-0123456789")
    assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
    body = response.json()
    signature = body.pop("signature")
    assert (
        document_signature_problem(body, signature, COMMAND_KEY.public_key(), GOVERNANCE_CONTEXT)
        is None
    )
    assert (body["node_id"], body["nonce"], body["next_cursor"]) == (
        node.node_id,
        "a-fresh-nonce-0123456789",
        None,
    )
    assert body["as_of_decision"] >= 1

    # Paged one entry at a time, the pages add up to the whole answer.
    paged: list[dict] = []
    cursor = None
    for _ in range(1000):
        answer = await governance_get(
            url, mine(), limit=1, **({} if cursor is None else {"cursor": cursor})
        )
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert len(page["decisions"]) + len(page["pending_commands"]) <= 1
        paged.extend(page["decisions"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == body["decisions"]

    # A revoked node is refused (within the registry's revocation bound).
    revoked_id = f"gov-revoked-{uuid.uuid4().hex[:6]}"
    await enroll_nodes(database_url, [revoked_id])
    assert (await governance_get(url, node_credential(revoked_id))).status_code == 200
    database = Database(DatabaseSettings(url=database_url), pre_ping=False)
    try:
        async with database.session() as session, session.begin():
            assert await revoke(session, revoked_id)
    finally:
        await database.dispose()

    async def refused() -> bool:
        return (await governance_get(url, node_credential(revoked_id))).status_code == 401

    await eventually(refused, timeout_s=TIMEOUT_S, what="the revoked node refused")
