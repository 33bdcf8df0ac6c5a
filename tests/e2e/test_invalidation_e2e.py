"""Invalidation end to end with both real halves: user event → coordinator → nodes → acks → ledger.

The other invalidation tests each simulate one side (``test_ledger_invalidation``
plays the nodes, ``test_node_invalidation`` plays the coordinator). Here everything
is real and talks over real transports:

* the coordinator's consumers (``run_consumers``) and its HTTP API served by uvicorn,
  on a freshly migrated database of the session's Postgres;
* two nodes, each what ``gpu_node.entrypoints.server.serve`` runs (engine, publisher, command
  consumer) with its OpenAI-compatible app served by uvicorn; generation requests
  go through the official ``openai`` client, ledger reads through ``httpx``;
* user events are published with a *plain* aiokafka producer as raw JSON bytes, signed
  with the tests' producer key, exactly as ``docs/events.md`` tells users to.

The nodes' pools are small (24 device blocks, which are also the running requests'
KV memory, and 6 host blocks); a cached document's later blocks are moved down to
host and disk as memory pressure would, so every deletion below covers all three tiers.

The broker is shared by the whole test session. So that other modules' nodes and
events do not enter this module's ledger (an earlier module's stopped node would be
an expected target of every decision here and keep it pending forever), the
coordinator's consumer groups start at the current end of their topics
(:func:`helpers.ledger.start_groups_at_end`). Each test uses its own tenant.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest
import rfc8785
from aiokafka import AIOKafkaProducer
from cryptography.hazmat.primitives import serialization
from helpers.ledger import (
    JWT_SECRET,
    PRODUCER_KEY,
    RunningConsumers,
    coordinator_settings,
    enroll_nodes,
    eventually,
    operator_headers,
)
from helpers.node import RunningNode, Served, node_settings

from bench.common import start_groups_at_end
from coordinator.api.app import create_app as create_coordinator_app
from coordinator.consumers import consumer_groups
from coordinator.settings import kafka_settings
from events import topics
from events.kafka.admin import ensure_topics
from events.tiers import Tier
from gpu_node.settings import CacheSettings
from identity.tokens import issue_token

BLOCK_SIZE = 16
SYSTEM = "You answer questions from the tenant handbook, briefly and only from it."
QUESTION = "What is the leave policy?"
TIMEOUT_S = 30.0
MEMORY_TIERS = ("device", "host", "disk")


# --------------------------------------------------------------------------- nodes


class Node(RunningNode):
    """One GPU node as ``serve`` runs it (``helpers.node.RunningNode``), and what it holds."""

    def holdings(self, tenant: str, doc_id: str | None = None) -> set[tuple[str, str]]:
        """(block hash, tier) of the tenant's READY blocks (holding ``doc_id`` at any version, when
        given)."""
        return {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in self.engine.pool.ready_entries()
            if entry.provenance.tenant_id == tenant
            and (
                doc_id is None
                or any(tag.rpartition("@")[0] == doc_id for tag in entry.provenance.documents)
            )
        }


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
async def coordinator(ledger_url: str, kafka_bootstrap: str) -> AsyncIterator[str]:
    """The coordinator's consumers and HTTP API on a fresh ledger; yields the API's base URL."""
    group = f"e2e-{uuid.uuid4().hex[:8]}"
    settings = coordinator_settings(ledger_url, kafka_bootstrap, kafka={"group_id": group})
    await ensure_topics(kafka_settings(settings))
    await start_groups_at_end(
        kafka_bootstrap,
        consumer_groups(group),
    )
    consumers = await RunningConsumers(settings).start()
    api = await Served(create_coordinator_app(settings)).start()
    try:
        yield api.url
    finally:
        await api.stop()
        await consumers.stop()


@pytest.fixture(scope="module")
async def nodes(
    coordinator: str, ledger_url: str, kafka_bootstrap: str, tiny_model_dir: Path, tmp_path_factory
) -> AsyncIterator[list[Node]]:
    """Two nodes, enrolled, ready, and registered in the coordinator's ledger (so every decision
    targets both)."""
    suffix = uuid.uuid4().hex[:6]
    root = tmp_path_factory.mktemp("e2e-nodes")
    await enroll_nodes(ledger_url, [f"e2e-{name}-{suffix}" for name in ("a", "b")])
    started = []
    try:
        for name in ("a", "b"):
            settings = node_settings(
                f"e2e-{name}-{suffix}",
                tiny_model_dir,
                root / name,
                kafka_bootstrap,
                CacheSettings(
                    block_size=BLOCK_SIZE,
                    num_device_blocks=24,
                    num_host_blocks=6,
                    max_disk_blocks=512,
                ),
            )
            started.append(await Node(settings).start())
        for node in started:
            await eventually(
                node.ready, timeout_s=60, what=f"{node.node_id} replayed the command log"
            )
        node_ids = {node.node_id for node in started}

        async def registered() -> bool:
            listed = (await ledger_get(coordinator, "/v1/nodes"))["nodes"]
            return {row["node_id"] for row in listed} == node_ids

        await eventually(
            registered, timeout_s=TIMEOUT_S, what="both nodes registered in the ledger"
        )
        yield started
    finally:
        for node in started:
            await node.stop()


# --------------------------------------------------------------------------- helpers


def user_token(tenant: str, pv: int = 1) -> str:
    return issue_token(
        tenant=tenant, sub="alice", scopes=["hr"], pv={"hr": pv}, ttl_s=600, secret=JWT_SECRET
    )


ADMIN = operator_headers("platform-admin", "platform")


async def ledger_get(base_url: str, path: str, **params) -> dict:
    async with httpx.AsyncClient(base_url=base_url, headers=ADMIN, timeout=30) as client:
        response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def ledger_blocks(base_url: str, tenant: str, doc_id: str) -> list[dict]:
    """Every block of the tenant's document the ledger ever recorded, with every placement (all
    pages)."""
    blocks, after = [], None
    while True:
        params = {"tenant": tenant, "doc_id": doc_id, "include_deleted": "true", "limit": 1000}
        page = await ledger_get(
            base_url, "/v1/ledger/blocks", **(params | ({"after": after} if after else {}))
        )
        blocks += page["blocks"]
        after = page["next_cursor"]
        if after is None:
            return blocks


def placements(
    blocks: list[dict], *, state: str, reason: str | None = None, version: int | None = None
) -> set[tuple[str, str, str]]:
    """(block hash, node, tier) of placements in ``state`` (and ``reason``) of blocks holding the
    document at ``version``."""
    return {
        (block["block_hash"], placement["node_id"], placement["tier"])
        for block in blocks
        if version is None or any(doc["version"] == version for doc in block["documents"])
        for placement in block["placements"]
        if placement["state"] == state and (reason is None or placement["reason"] == reason)
    }


def document_chat(doc_id: str, version: int, num_sections: int = 30) -> list[dict]:
    # The same text at every version: only the version in the block keys tells the blocks apart.
    text = " ".join(f"{doc_id} section {i} says staff rest" for i in range(num_sections))
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {
            "role": "user",
            "content": text,
            "document": {"id": doc_id, "version": version, "auth_scope": "hr"},
        },
        {"role": "user", "content": QUESTION},
    ]


PUBLIC_CHAT = [
    {"role": "system", "content": SYSTEM, "cache_scope": "public"},
    {"role": "user", "content": QUESTION},
]


async def publish_raw(
    bootstrap: str, topic: str, key: str, event_type: str, tenant: str, payload: dict
) -> str:
    """A user event as docs/events.md shows it: plain aiokafka, raw JSON bytes signed with rfc8785 and cryptography
    (the tests' producer key), acks=all. Returns the event id."""
    event_id = str(uuid.uuid4())
    event = {
        "event_id": event_id,
        "type": event_type,
        "schema_version": 1,
        "occurred_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tenant_id": tenant,
        "payload": payload,
    }
    raw = PRODUCER_KEY.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    event["signature"] = {
        "kid": hashlib.sha256(raw).digest()[:16].hex(),
        "sig": base64.urlsafe_b64encode(PRODUCER_KEY.sign(rfc8785.dumps(event)))
        .rstrip(b"=")
        .decode(),
    }
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, json.dumps(event).encode(), key=key.encode())
    finally:
        await producer.stop()
    return event_id


async def invalidation_for(base_url: str, event_id: str) -> dict:
    """The invalidation the coordinator decided for a user event (waits for the decision)."""
    found: dict = {}

    async def decided() -> bool:
        listed = (await ledger_get(base_url, "/v1/invalidations", limit=1000))["invalidations"]
        found.update(next((row for row in listed if row["source_event_id"] == event_id), {}))
        return bool(found)

    await eventually(decided, timeout_s=TIMEOUT_S, what=f"a decision for event {event_id}")
    return found


async def until_status(base_url: str, command_id: str, status: str) -> dict:
    described: dict = {}

    async def reached() -> bool:
        described.update(await ledger_get(base_url, f"/v1/invalidations/{command_id}"))
        return described["status"] == status

    await eventually(reached, timeout_s=TIMEOUT_S, what=f"invalidation {command_id} {status}")
    return described


async def ledger_matches(
    base_url: str, tenant: str, doc_id: str, expected: set[tuple[str, str, str]]
) -> None:
    """Wait until the ledger's live placements of the document are exactly ``expected``."""

    async def equal() -> bool:
        return placements(await ledger_blocks(base_url, tenant, doc_id), state="live") == expected

    await eventually(equal, timeout_s=TIMEOUT_S, what=f"ledger placements of {tenant}/{doc_id}")


def by_node(held: set[tuple[str, str, str]], node_id: str, tier: str) -> set[str]:
    return {block for block, node, held_tier in held if node == node_id and held_tier == tier}


async def spread_document(
    node: Node, token: str, tenant: str, doc_id: str
) -> set[tuple[str, str, str]]:
    """Cache the document on ``node`` over device, host and disk; returns its (hash, node, tier)
    holdings.

    The first request builds it on the device, the second hits the full prefix;
    then its later blocks move down as LRU pressure would move them: the last
    third to disk, the middle third to host.
    """
    assert (
        await node.cached(token, document_chat(doc_id, 1))
        == node.prefix_tokens(document_chat(doc_id, 1))[1]
    )
    assert (
        await node.cached(token, document_chat(doc_id, 1))
        == node.prefix_tokens(document_chat(doc_id, 1))[0]
    )
    entries = sorted(
        (
            entry
            for entry in node.engine.pool.ready_entries()
            if entry.provenance.tenant_id == tenant
            and any(tag.rpartition("@")[0] == doc_id for tag in entry.provenance.documents)
        ),
        key=lambda entry: entry.key.index,
    )
    third = len(entries) // 3
    for entry in entries[2 * third :]:
        assert node.engine.pool.demote(entry.block_hash, Tier.DISK)
    for entry in entries[third : 2 * third]:
        assert node.engine.pool.demote(entry.block_hash, Tier.HOST)
    node.engine.manager.drain_events()
    held = {(block, node.node_id, tier) for block, tier in node.holdings(tenant, doc_id)}
    assert {tier for _, _, tier in held} == set(MEMORY_TIERS), (
        f"{node.node_id} holds {doc_id} in {held}"
    )
    return held


def assert_targets_verified(
    described: dict, held: set[tuple[str, str, str]], node_ids: list[str]
) -> None:
    """Every node acked; per tier, its evidence names exactly the blocks it held and the ledger deleted them all."""
    assert [target["node_id"] for target in described["targets"]] == sorted(node_ids)
    for target in described["targets"]:
        assert target["status"] == "acked"
        for tier, detail in target["tiers"].items():
            blocks = by_node(held, target["node_id"], tier)
            if not blocks:
                assert detail == {
                    "status": "untouched",
                    "evidence": None,
                    "ledger": {"live": 0, "deleted": 0},
                }, tier
                continue
            assert detail["status"] == "verified"
            assert set(detail["evidence"]["block_hashes"]) == blocks
            assert detail["evidence"]["removed"] == len(blocks)
            assert detail["ledger"] == {"live": 0, "deleted": len(blocks)}


# --------------------------------------------------------------------------- scenarios


async def test_document_update_deletes_the_old_version_everywhere_and_nothing_else(
    coordinator, nodes, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = user_token(tenant)
    held = set()
    for node in nodes:
        # Other data the event must not touch: a public prefix, another document of the tenant.
        for messages in (PUBLIC_CHAT, document_chat("policies", 1, num_sections=10)):
            await node.cached(alice, messages)
            full, _ = node.prefix_tokens(messages)
            assert full > 0
            assert await node.cached(alice, messages) == full
        held |= await spread_document(node, alice, tenant, "handbook")
    await ledger_matches(coordinator, tenant, "handbook", held)
    policies_before = placements(await ledger_blocks(coordinator, tenant, "policies"), state="live")
    assert {node for _, node, _ in policies_before} == {node.node_id for node in nodes}

    event_id = await publish_raw(
        kafka_bootstrap,
        topics.DOCUMENTS,
        f"{tenant}:handbook",
        "DocumentUpdated",
        tenant,
        {"doc_id": "handbook", "version": 2},
    )
    decided = await invalidation_for(coordinator, event_id)
    described = await until_status(coordinator, decided["command_id"], "complete")

    assert described["kind"] == "document" and described["trigger"] == "event"
    assert described["predicate"] == {
        "kind": "document",
        "tenant": tenant,
        "doc_id": "handbook",
        "below_version": 2,
    }
    assert_targets_verified(described, held, [node.node_id for node in nodes])
    blocks = await ledger_blocks(coordinator, tenant, "handbook")
    assert placements(blocks, state="live", version=1) == set()
    assert placements(blocks, state="deleted", reason="invalidated", version=1) == held
    for node in nodes:
        assert node.holdings(tenant, "handbook") == set()
        with pytest.raises(openai.ConflictError) as refused:
            await node.cached(alice, document_chat("handbook", 1))
        assert (refused.value.status_code, refused.value.code) == (409, "stale_document_version")
        assert refused.value.param == "messages[1].document.version"
        # The same text under the new version reuses only the public system prompt, never an old
        # block.
        full, public = node.prefix_tokens(document_chat("handbook", 2))
        assert await node.cached(alice, document_chat("handbook", 2)) == public
        assert await node.cached(alice, document_chat("handbook", 2)) == full
        # Untouched: the public prefix and the other document still hit in full.
        for messages in (PUBLIC_CHAT, document_chat("policies", 1, num_sections=10)):
            assert await node.cached(alice, messages) == node.prefix_tokens(messages)[0]
    policies_after = await ledger_blocks(coordinator, tenant, "policies")
    assert placements(policies_after, state="deleted", reason="invalidated") == set()
    assert {block for block, _, _ in placements(policies_after, state="live")} == {
        block for block, _, _ in policies_before
    }


async def test_permission_revocation_refuses_old_tokens_and_rebuilds_under_the_new_policy(
    coordinator, nodes, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    old = user_token(tenant, pv=1)
    held = set()
    for node in nodes:
        # A user-scope block holds no auth scope: the revocation must leave it cached.
        await node.cached(old, PUBLIC_CHAT)
        assert await node.cached(old, PUBLIC_CHAT) == node.prefix_tokens(PUBLIC_CHAT)[0]
        held |= await spread_document(node, old, tenant, "handbook")
    await ledger_matches(coordinator, tenant, "handbook", held)

    event_id = await publish_raw(
        kafka_bootstrap,
        topics.PERMISSIONS,
        f"{tenant}:hr",
        "PermissionRevoked",
        tenant,
        {"auth_scope": "hr", "policy_version": 2, "subject_id": None},
    )
    decided = await invalidation_for(coordinator, event_id)
    described = await until_status(coordinator, decided["command_id"], "complete")

    assert described["predicate"] == {
        "kind": "policy",
        "tenant": tenant,
        "auth_scope": "hr",
        "below_version": 2,
    }
    assert_targets_verified(described, held, [node.node_id for node in nodes])
    blocks = await ledger_blocks(coordinator, tenant, "handbook")
    assert all(
        block["auth_scopes"] == [{"auth_scope": "hr", "policy_version": 1}] for block in blocks
    )
    assert placements(blocks, state="live") == set()
    assert placements(blocks, state="deleted", reason="invalidated") == held
    fresh = user_token(tenant, pv=2)
    for node in nodes:
        assert node.holdings(tenant, "handbook") == set()
        with pytest.raises(openai.AuthenticationError) as refused:
            await node.cached(old, document_chat("handbook", 1))
        assert (refused.value.status_code, refused.value.code) == (401, "stale_authorization")
        full, public = node.prefix_tokens(document_chat("handbook", 1))
        assert await node.cached(fresh, document_chat("handbook", 1)) == public
        assert await node.cached(fresh, document_chat("handbook", 1)) == full
        assert await node.cached(fresh, PUBLIC_CHAT) == node.prefix_tokens(PUBLIC_CHAT)[0]

    async def rebuilt_recorded() -> bool:
        blocks = await ledger_blocks(coordinator, tenant, "handbook")
        live = [block for block in blocks if any(p["state"] == "live" for p in block["placements"])]
        return bool(live) and all(
            block["auth_scopes"] == [{"auth_scope": "hr", "policy_version": 2}] for block in live
        )

    await eventually(
        rebuilt_recorded,
        timeout_s=TIMEOUT_S,
        what="blocks rebuilt under policy version 2 in the ledger",
    )
    assert (
        placements(
            await ledger_blocks(coordinator, tenant, "handbook"),
            state="deleted",
            reason="invalidated",
        )
        == held
    )


async def test_a_node_down_during_the_invalidation_applies_it_on_restart_before_serving(
    coordinator, nodes, kafka_bootstrap
):
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = user_token(tenant)
    up, down = nodes
    held = set()
    for node in nodes:
        held |= await spread_document(node, alice, tenant, "handbook")
    await ledger_matches(coordinator, tenant, "handbook", held)
    await down.stop()
    # Device and host bytes die with the process; its disk blocks wait for it.
    survivors = {(block, down.node_id, "disk") for block in by_node(held, down.node_id, "disk")}
    assert survivors

    event_id = await publish_raw(
        kafka_bootstrap,
        topics.DOCUMENTS,
        f"{tenant}:handbook",
        "DocumentDeleted",
        tenant,
        {"doc_id": "handbook"},
    )
    decided = await invalidation_for(coordinator, event_id)
    command_id = decided["command_id"]

    async def up_acked() -> bool:
        described = await ledger_get(coordinator, f"/v1/invalidations/{command_id}")
        return {t["node_id"]: t["status"] for t in described["targets"]} == {
            up.node_id: "acked",
            down.node_id: "pending",
        }

    await eventually(up_acked, timeout_s=TIMEOUT_S, what="the live node's ack")
    await asyncio.sleep(1.0)  # give a wrong completion time to show
    pending = await ledger_get(coordinator, f"/v1/invalidations/{command_id}")
    assert pending["status"] == "pending" and pending["completed_at"] is None
    waiting = next(t for t in pending["targets"] if t["node_id"] == down.node_id)
    assert {tier: detail["status"] for tier, detail in waiting["tiers"].items()} == dict.fromkeys(
        (*MEMORY_TIERS, "snapshot"), "pending"
    )
    epoch_before = down.publisher.epoch

    await down.start(replay=False)
    async with httpx.AsyncClient(base_url=down.http.url) as client:
        not_ready = await client.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["error"]["code"] == "not_ready"
    with pytest.raises(openai.InternalServerError) as unavailable:
        await down.cached(alice, PUBLIC_CHAT)
    assert (unavailable.value.status_code, unavailable.value.code) == (503, "not_ready")
    assert {
        (block, down.node_id, tier) for block, tier in down.holdings(tenant, "handbook")
    } == survivors

    await down.replay()
    async with asyncio.timeout(TIMEOUT_S):
        while not await down.ready():
            await asyncio.sleep(0.01)
    # Ready implies the missed command is applied: nothing of the document is left to serve.
    assert down.holdings(tenant, "handbook") == set()
    assert down.publisher.epoch == epoch_before + 1

    described = await until_status(coordinator, command_id, "complete")
    target = next(t for t in described["targets"] if t["node_id"] == down.node_id)
    assert target["epoch"] == epoch_before + 1
    assert {tier for tier, detail in target["tiers"].items() if detail["status"] == "verified"} == {
        "disk"
    }
    assert set(target["tiers"]["disk"]["evidence"]["block_hashes"]) == by_node(
        survivors, down.node_id, "disk"
    )

    async def nothing_live() -> bool:
        return (
            placements(await ledger_blocks(coordinator, tenant, "handbook"), state="live") == set()
        )

    await eventually(
        nothing_live, timeout_s=TIMEOUT_S, what="no live placement of the deleted document"
    )
    blocks = await ledger_blocks(coordinator, tenant, "handbook")
    applied_live = {held_by for held_by in held if held_by[1] == up.node_id}
    assert placements(blocks, state="deleted", reason="invalidated") == applied_live | survivors
    for node in nodes:
        with pytest.raises(openai.ConflictError) as refused:
            await node.cached(alice, document_chat("handbook", 1))
        assert refused.value.code == "stale_document_version"
