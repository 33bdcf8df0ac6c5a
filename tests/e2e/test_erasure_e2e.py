"""Privacy erasure end to end: ``POST /v1/erasures`` → coordinator → both nodes → acks → verified → a
signed receipt that ``kvledger verify-receipt`` accepts offline.

Everything is real: the coordinator's consumers and HTTP API (uvicorn) on a freshly
migrated database, two nodes as ``gpu_node.entrypoints.server.serve`` assembles them (engine,
publisher, command consumer, OpenAI-compatible app on uvicorn) whose data keys live in
the coordinator (``CoordinatorKeyProvider``), the session's broker and Postgres.

The coordinator runs in a thread with its own event loop: a node's pool asks the key
service synchronously (from whatever thread touches the pool), which must never wait
on the loop that is making the call. As in ``test_invalidation_e2e``, the coordinator's
consumer groups start at the end of their topics so nodes of other modules (stopped
long ago) never become targets here. Each test uses its own tenant.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    JWT_SECRET,
    SUBJECT_KEY,
    connect,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
    operator_headers,
)
from helpers.node import CoordinatorThread, RunningNode, demote_to_disk, node_settings

from bench.common import start_groups_at_end
from coordinator.consumers import consumer_groups
from coordinator.settings import kafka_settings
from events.kafka.admin import ensure_topics
from events.schema import subject_digest
from events.tiers import Tier
from gpu_node.keys.remote_keys import data_key_provider
from gpu_node.pool.block_records import BlockRestoreError, decode_block_record
from gpu_node.pool.vocabulary import BlockState
from gpu_node.settings import CacheSettings
from identity.tokens import issue_token
from prefix_keys.blocks import CacheProvenance, CacheScope, Principal, compute_block_keys
from prefix_keys.prompt import ChatMessage, render_prompt

BLOCK_SIZE = 16
TIMEOUT_S = 30.0
SYSTEM = "You are the assistant of the people team. Answer briefly and kindly."
MASTER_KEY = base64.b64encode(os.urandom(32)).decode()
KVLEDGER = str(Path(sys.executable).with_name("kvledger"))


PLATFORM_ADMIN = operator_headers("platform-admin", "platform")


def officer(tenant: str) -> dict[str, str]:
    return operator_headers("privacy-officer", tenant)


# --------------------------------------------------------------------------- coordinator and nodes


class Node(RunningNode):
    """One GPU node as ``serve`` runs it (``helpers.node.RunningNode``), keeping its data keys in the coordinator."""

    async def start(self, *, replay: bool = True) -> Node:
        await super().start(replay=replay)
        await self.replayed()
        return self

    async def stop(self) -> None:
        if self.running:
            await super().stop()
            self.engine.pool.key_provider.close()

    async def holdings(self, tenant: str, subject: str) -> set[tuple[str, str]]:
        """(block hash, tier) of the subject's blocks this node holds, snapshots as tier
        ``snapshot``."""

        def mine(provenance) -> bool:
            return provenance.tenant_id == tenant and provenance.subject_id == subject

        held = {
            (entry.block_hash.hex(), entry.tier.value)
            for entry in self.engine.pool.ready_entries()
            if mine(entry.provenance)
        }
        for keys in (await asyncio.to_thread(self.engine.snapshot_inventory)).values():
            held.update((key.block_hash.hex(), "snapshot") for key in keys if mine(key.provenance))
        return held


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
async def stack(
    database_url: str,
    ledger_template: str,
    kafka_bootstrap: str,
    tiny_model_dir: Path,
    tmp_path_factory,
) -> AsyncIterator[dict]:
    """The coordinator (own thread) and two registered, ready nodes keeping their data keys in it."""
    async with fresh_database(database_url, ledger_template) as url:
        group = f"erasure-e2e-{uuid.uuid4().hex[:8]}"
        settings = coordinator_settings(
            url,
            kafka_bootstrap,
            kafka={"group_id": group},
            ledger={"erasure_verify_interval_s": 0.5},
            keys={"master_key": MASTER_KEY},
        )
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(
            kafka_bootstrap,
            consumer_groups(group),
        )
        coordinator = await CoordinatorThread(settings).start()
        suffix = uuid.uuid4().hex[:6]
        root = tmp_path_factory.mktemp("erasure-nodes")
        nodes: list[Node] = []
        await enroll_nodes(url, [f"erase-{name}-{suffix}" for name in ("a", "b")])
        try:
            for name in ("a", "b"):
                settings_of_node = node_settings(
                    f"erase-{name}-{suffix}",
                    tiny_model_dir,
                    root / name,
                    kafka_bootstrap,
                    CacheSettings(
                        block_size=BLOCK_SIZE,
                        num_device_blocks=64,
                        num_host_blocks=8,
                        max_disk_blocks=512,
                    ),
                    coordinator_url=coordinator.url,
                )
                nodes.append(await Node(settings_of_node).start())
            node_ids = {node.node_id for node in nodes}

            async def registered() -> bool:
                listed = (await api_get(coordinator.url, "/v1/nodes"))["nodes"]
                return {row["node_id"] for row in listed} == node_ids

            await eventually(
                registered, timeout_s=TIMEOUT_S, what="both nodes registered in the ledger"
            )
            yield {"url": coordinator.url, "database_url": url, "nodes": nodes}
        finally:
            for node in nodes:
                await node.stop()
            await coordinator.stop()


# --------------------------------------------------------------------------- helpers


async def api_get(base_url: str, path: str, headers: dict | None = None, **params) -> dict:
    async with httpx.AsyncClient(
        base_url=base_url, headers=PLATFORM_ADMIN if headers is None else headers, timeout=30
    ) as client:
        response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def request_erasure(
    base_url: str, tenant: str, subject: str, headers: dict | None = None, key: str | None = None
) -> httpx.Response:
    extra = {} if key is None else {"Idempotency-Key": key}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await client.post(
            "/v1/erasures",
            json={"tenant_id": tenant, "subject_id": subject, "reason": "GDPR art. 17 request"},
            headers=(officer(tenant) if headers is None else headers) | extra,
        )


async def erasure(base_url: str, erasure_id: str) -> dict:
    return await api_get(base_url, f"/v1/erasures/{erasure_id}", PLATFORM_ADMIN)


async def wait_status(base_url: str, erasure_id: str, status: str, timeout_s: float = 60) -> dict:
    seen: dict = {}

    async def reached() -> bool:
        seen.update(await erasure(base_url, erasure_id))
        return seen["status"] == status

    await eventually(
        reached,
        timeout_s=timeout_s,
        what=f"erasure {erasure_id} {status} (last: {seen.get('status')})",
    )
    return seen


async def ledger_live(base_url: str, tenant: str, subject: str) -> set[tuple[str, str, str]]:
    """(block hash, node, tier) of the subject's live placements in the ledger (tier ``snapshot`` for snapshots)."""
    page = await api_get(
        base_url, "/v1/ledger/blocks", officer(tenant), tenant=tenant, subject=subject, limit=1000
    )
    assert page["next_cursor"] is None
    return {
        (block["block_hash"], placement["node_id"], placement["tier"])
        for block in page["blocks"]
        for placement in block["placements"]
        if placement["state"] == "live"
    }


async def ledger_knows(stack: dict, tenant: str, subject: str) -> set[tuple[str, str, str]]:
    """Wait until the ledger's live placements of the subject are exactly what the nodes hold; returns them."""
    expected = set()
    for node in stack["nodes"]:
        await node.publisher.flush()
        expected |= {
            (block, node.node_id, tier) for block, tier in await node.holdings(tenant, subject)
        }

    async def equal() -> bool:
        return await ledger_live(stack["url"], tenant, subject) == expected

    await eventually(
        equal, timeout_s=TIMEOUT_S, what="ledger == the subject's holdings on both nodes"
    )
    return expected


async def count_erasures(database_url: str, tenant: str) -> int:
    connection = await connect(database_url)
    try:
        return await connection.fetchval(
            "SELECT count(*) FROM erasures WHERE tenant_id = $1", tenant
        )
    finally:
        await connection.close()


def user_token(tenant: str, subject: str) -> str:
    return issue_token(tenant=tenant, sub=subject, scopes=[], ttl_s=600, secret=JWT_SECRET)


def history(subject: str, turns: int = 12) -> list[dict]:
    """A user's private chat: a public system prompt, then user-scope turns (every block after it is
    the user's)."""
    text = " ".join(
        f"{subject} wrote note {i}: my sick leave started on day {i}" for i in range(turns)
    )
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {"role": "user", "content": text},
    ]


async def spread(node: Node, tenant: str, subject: str) -> None:
    """Leave the subject's blocks on device, host and disk, and in a snapshot (key resolves go to the coordinator)."""
    mine = sorted(block for block, tier in await node.holdings(tenant, subject) if tier == "device")
    assert len(mine) >= 3
    assert await asyncio.to_thread(node.engine.pool.demote, bytes.fromhex(mine[0]), Tier.HOST)
    await demote_to_disk(node.engine, mine[1])
    await node.engine.write_snapshot()
    node.engine.manager.drain_events()


def verify_receipt(
    tmp_path: Path, served: dict, checkpoint: dict, keys: dict
) -> subprocess.CompletedProcess:
    files = {}
    for name, document in (("receipt", served), ("checkpoint", checkpoint), ("keys", keys)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(document, indent=2))
    return subprocess.run(
        [
            KVLEDGER,
            "verify-receipt",
            str(files["receipt"]),
            "--checkpoint",
            str(files["checkpoint"]),
            "--public-key",
            str(files["keys"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- tests


async def test_erasure_removes_the_subject_everywhere_and_issues_a_verifiable_receipt(
    stack, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    url, nodes = stack["url"], stack["nodes"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice, bob = f"alice-{uuid.uuid4().hex[:8]}", f"bob-{uuid.uuid4().hex[:8]}"
    public_chat = [
        history("nobody")[0],
        {"role": "user", "content": "hello", "cache_scope": "public"},
    ]
    for node in nodes:
        for subject, chat in ((bob, history(bob)), (alice, history(alice)), ("carol", public_chat)):
            await node.cached(user_token(tenant, subject), chat)
            assert (
                await node.cached(user_token(tenant, subject), chat) == node.prefix_tokens(chat)[0]
            )
        await spread(node, tenant, alice)
        assert {tier for _, tier in await node.holdings(tenant, alice)} == {
            "device",
            "host",
            "disk",
            "snapshot",
        }
    before = await ledger_knows(stack, tenant, alice)
    disk_files = [
        node.engine.pool.disk_path(bytes.fromhex(block))
        for block, node_id, tier in before
        for node in nodes
        if tier == "disk" and node.node_id == node_id
    ]
    assert disk_files and all(path.exists() for path in disk_files)
    copied = tmp_path / "copied-away.kvb"
    shutil.copyfile(disk_files[0], copied)

    # Refused requests start nothing.
    assert (await request_erasure(url, tenant, alice, headers={})).status_code == 401
    assert (
        await request_erasure(url, tenant, alice, headers=operator_headers("auditor", tenant))
    ).status_code == 403
    assert (
        await request_erasure(url, tenant, alice, headers=officer("another-tenant"))
    ).status_code == 403
    assert await count_erasures(stack["database_url"], tenant) == 0
    checkpoint_before = (
        await api_get(url, "/v1/audit/checkpoint", {})
        if (await _has_checkpoint(url))
        else {"tree_size": 0}
    )

    first = await request_erasure(url, tenant, alice, key="ticket-1")
    assert first.status_code == 202, first.text
    duplicate = await request_erasure(url, tenant, alice, key="ticket-1")
    assert duplicate.status_code == 202 and duplicate.json()["id"] == first.json()["id"]
    erasure_id = first.json()["id"]
    done = await wait_status(url, erasure_id, "verified")
    assert await count_erasures(stack["database_url"], tenant) == 1
    assert {row["node_id"] for row in done["nodes"]} == {node.node_id for node in nodes}
    assert all(row["status"] == "acked" for row in done["nodes"]) and done["live_copies"] == 0

    # The receipt verifies offline against the published checkpoint and key document.
    served = await api_get(url, f"/v1/erasures/{erasure_id}/receipt", officer(tenant))
    checkpoint = await api_get(url, "/v1/audit/checkpoint", {})
    keys = await api_get(url, "/v1/receipts/keys", {})
    result = verify_receipt(tmp_path, served, checkpoint, keys)
    assert result.returncode == 0, result.stdout + result.stderr
    assert checkpoint["tree_size"] == checkpoint_before["tree_size"] + 1, "one erasure, one receipt"
    assert (await api_get(url, f"/v1/erasures/{erasure_id}/receipt", officer(tenant)))[
        "receipt"
    ] == served["receipt"]
    body = served["receipt"]
    assert body["erasure_id"] == erasure_id and body["tenant_id"] == tenant
    assert body["subject_hash"] == subject_digest(SUBJECT_KEY.encode(), tenant, alice)
    assert alice not in json.dumps(served)
    assert {(t["node_id"], t["tier"]): t["method"] for t in body["tiers"]} == {
        (node.node_id, tier): method
        for node in nodes
        for tier, method in (
            ("device", "clear"),
            ("host", "clear"),
            ("disk", "purge-crypto-erase"),
            ("snapshot", "purge-crypto-erase"),
        )
    }
    assert body["block_commitment"]["count"] == len({block for block, _, _ in before})
    assert body["key_ids_destroyed"]

    # Nothing of alice is left: ledger, tiers, files, snapshots, copies taken away.
    assert await ledger_live(url, tenant, alice) == set()
    for node in nodes:
        assert await node.holdings(tenant, alice) == set()
    assert not any(path.exists() for path in disk_files)
    fresh_provider = data_key_provider(nodes[0].settings, tmp_path / "fresh-node")
    for provider in (nodes[0].engine.pool.key_provider, fresh_provider):
        with pytest.raises(BlockRestoreError) as undecryptable:
            await asyncio.to_thread(decode_block_record, copied.read_bytes(), provider)
        assert undecryptable.value.reason == "key_unavailable"
    fresh_provider.close()

    # alice's request now hits only the public system prompt; bob's and the public blocks still hit.
    for node in nodes:
        assert (
            await node.cached(user_token(tenant, alice), history(alice))
            == node.prefix_tokens(history(alice))[1]
            > 0
        )
        assert (
            await node.cached(user_token(tenant, bob), history(bob))
            == node.prefix_tokens(history(bob))[0]
        )
        assert (
            await node.cached(user_token(tenant, "carol"), public_chat)
            == node.prefix_tokens(public_chat)[0]
        )
    # alice's next key (issued after the erasure) is live at the coordinator: a node never destroys
    # or reports it.
    provider = nodes[0].engine.pool.key_provider.blocking()
    provenance = CacheProvenance(
        nodes[0].engine.namespace.namespace, tenant, CacheScope.USER, (), alice, (), time.time()
    )
    newer_id, newer_key = await asyncio.to_thread(provider.key_for, provenance)
    assert newer_id not in body["key_ids_destroyed"]
    assert await asyncio.to_thread(provider.destroy, newer_id) is False
    assert await asyncio.to_thread(provider.key_by_id, newer_id) == newer_key

    # The test's own HTTP clients log the URLs it asks for (?subject=...); every other record is the
    # system's.
    client_loggers = ("httpx", "httpcore", "openai")
    logged = "\n".join(
        r.getMessage() for r in caplog.records if not r.name.startswith(client_loggers)
    )
    assert alice not in logged, "the subject appeared in clear in a log"


async def _has_checkpoint(base_url: str) -> bool:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return (await client.get("/v1/audit/checkpoint")).status_code == 200


async def test_erasure_during_a_streaming_generation_lets_it_finish_and_leaves_nothing(stack):
    url, nodes = stack["url"], stack["nodes"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = f"alice-{uuid.uuid4().hex[:8]}"
    node = nodes[0]
    await node.cached(user_token(tenant, alice), history(alice))
    await ledger_knows(stack, tenant, alice)

    # Hold the node's model worker: the next request claims its new blocks (BUILDING) and waits to
    # prefill.
    gate = threading.Event()
    held = asyncio.ensure_future(node.engine.run_exclusive(gate.wait, 60))
    longer = history(alice) + [
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Please also add my doctor's note from day 3."},
    ]

    async def stream() -> tuple[str, str | None]:
        text, finish = "", None
        async with node.client(user_token(tenant, alice)) as client:
            chunks = await client.chat.completions.create(
                model=node.engine.model_name,
                messages=longer,
                max_tokens=16,
                temperature=0,
                stream=True,
            )
            async for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        return text, finish

    streaming = asyncio.create_task(stream())

    engine_messages = [
        ChatMessage(m["role"], m["content"], CacheScope.parse(m.get("cache_scope", "user")))
        for m in longer
    ]
    prompt = render_prompt(node.engine.runner.tokenizer, engine_messages)
    principal = Principal(tenant, alice, frozenset(), {})
    keys = compute_block_keys(
        node.engine.namespace.namespace, prompt.token_ids, prompt.segments, principal, BLOCK_SIZE
    )
    new_blocks = [
        key.block_hash for key in keys if node.engine.pool.state_of(key.block_hash) is None
    ]
    assert new_blocks, "the longer chat must add blocks of its own"

    async def claimed() -> bool:
        return all(node.engine.pool.state_of(block) is BlockState.BUILDING for block in new_blocks)

    await eventually(
        claimed, timeout_s=TIMEOUT_S, what="the streaming request claimed its new blocks"
    )
    started = await request_erasure(url, tenant, alice)
    assert started.status_code == 202, started.text

    users = [key.block_hash for key in keys if key.provenance.scope is CacheScope.USER]

    async def tombstoned() -> bool:
        # The request holds its hits (READY) and builds the rest: once removed, none of them is
        # READY any more.
        return not any(node.engine.pool.state_of(block) is BlockState.READY for block in users)

    await eventually(
        tombstoned, timeout_s=TIMEOUT_S, what="the node tombstoned the subject's blocks in use"
    )
    gate.set()
    await held
    text, finish = await asyncio.wait_for(streaming, 60)
    assert finish in ("stop", "length")
    await wait_status(url, started.json()["id"], "verified")
    assert all(node.engine.pool.state_of(block) is None for block in new_blocks), (
        "blocks of the in-flight request survived"
    )
    for each in nodes:
        assert await each.holdings(tenant, alice) == set()
    assert await ledger_live(url, tenant, alice) == set()


async def test_a_node_down_keeps_the_erasure_partial_until_it_replays_and_acks(stack):
    url, nodes = stack["url"], stack["nodes"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    alice = f"alice-{uuid.uuid4().hex[:8]}"
    for node in nodes:
        await node.cached(user_token(tenant, alice), history(alice))
        await spread(node, tenant, alice)
    await ledger_knows(stack, tenant, alice)
    down = nodes[1]
    await down.stop()
    try:
        started = await request_erasure(url, tenant, alice)
        assert started.status_code == 202, started.text
        erasure_id = started.json()["id"]
        partial = await wait_status(url, erasure_id, "partial")
        assert {row["node_id"]: row["status"] for row in partial["nodes"]} == {
            nodes[0].node_id: "acked",
            down.node_id: "pending",
        }
        async with httpx.AsyncClient(base_url=url, headers=officer(tenant), timeout=30) as client:
            missing = await client.get(f"/v1/erasures/{erasure_id}/receipt")
        assert (
            missing.status_code == 404 and missing.json()["error"]["code"] == "receipt_not_issued"
        )
    finally:
        await down.start()  # replays kvledger.commands before it is ready, then acks
    verified = await wait_status(url, erasure_id, "verified")
    assert all(row["status"] == "acked" for row in verified["nodes"])
    for node in nodes:
        assert await node.holdings(tenant, alice) == set()
    assert await ledger_live(url, tenant, alice) == set()


async def creators_in_ledger(database_url: str, tenant: str, subject: str) -> dict[str, int]:
    """Scope → how many blocks the ledger records the subject's requests created
    (``block_creators``)."""
    connection = await connect(database_url)
    try:
        rows = await connection.fetch(
            "SELECT b.scope, count(*) FROM block_creators c JOIN blocks b USING (block_hash) WHERE c.subject_hash = $1 GROUP BY b.scope",
            bytes.fromhex(subject_digest(SUBJECT_KEY.encode(), tenant, subject)),
        )
    finally:
        await connection.close()
    return {row["scope"]: row["count"] for row in rows}


async def test_erasure_covers_what_the_subject_sent_in_tenant_and_public_scope(stack, tmp_path):
    """A subject who shared their text (``cache_scope`` tenant or public) is erased from every scope: afterwards
    another user of the tenant and another tenant get nothing of it from the cache, and the receipt counts the
    erased blocks per scope."""
    url, nodes = stack["url"], stack["nodes"]
    tenant, elsewhere = f"acme-{uuid.uuid4().hex[:6]}", f"globex-{uuid.uuid4().hex[:6]}"
    alice, bob, carol = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("alice", "bob", "carol"))
    marker = uuid.uuid4().hex
    shared_with_tenant = [
        {
            "role": "user",
            "content": f"{marker} "
            + " ".join(f"my salary in month {i} was {1000 + i}" for i in range(24)),
            "cache_scope": "tenant",
        }
    ]
    shared_with_everyone = [
        {
            "role": "user",
            "content": f"{marker} "
            + " ".join(f"my diagnosis on day {i} was code {i * 7}" for i in range(24)),
            "cache_scope": "public",
        }
    ]
    full = {
        id(chat): nodes[0].prefix_tokens(chat)[0]
        for chat in (shared_with_tenant, shared_with_everyone)
    }
    assert all(tokens >= 10 * BLOCK_SIZE for tokens in full.values())
    for node in nodes:
        assert await node.cached(user_token(tenant, alice), shared_with_tenant) == 0
        assert await node.cached(user_token(tenant, alice), shared_with_everyone) == 0
        # The leak the erasure must close: what alice sent is served from the cache to others.
        assert (
            await node.cached(user_token(tenant, bob), shared_with_tenant)
            == full[id(shared_with_tenant)]
        )
        assert (
            await node.cached(user_token(elsewhere, carol), shared_with_everyone)
            == full[id(shared_with_everyone)]
        )
        await node.publisher.flush()
    expected = {
        "tenant": full[id(shared_with_tenant)] // BLOCK_SIZE,
        "public": full[id(shared_with_everyone)] // BLOCK_SIZE,
    }

    async def recorded() -> bool:
        return await creators_in_ledger(stack["database_url"], tenant, alice) == expected

    await eventually(
        recorded,
        timeout_s=TIMEOUT_S,
        what="the ledger records alice as the creator of her shared blocks",
    )

    started = await request_erasure(url, tenant, alice)
    assert started.status_code == 202, started.text
    erasure_id = started.json()["id"]
    await wait_status(url, erasure_id, "verified")

    for node in nodes:
        assert await node.cached(user_token(tenant, bob), shared_with_tenant) == 0
        assert await node.cached(user_token(elsewhere, carol), shared_with_everyone) == 0
    served = await api_get(url, f"/v1/erasures/{erasure_id}/receipt", officer(tenant))
    body = served["receipt"]
    assert body["blocks_by_scope"] == {**expected, "user": 0, "unrecorded": 0}
    assert body["block_commitment"]["count"] == sum(expected.values())
    checkpoint = await api_get(url, "/v1/audit/checkpoint", {})
    keys = await api_get(url, "/v1/receipts/keys", {})
    result = verify_receipt(tmp_path, served, checkpoint, keys)
    assert result.returncode == 0, result.stdout + result.stderr
    coverage = f"public {expected['public']}, tenant {expected['tenant']}, user 0, unrecorded 0"
    assert f"✓ scope_coverage: erased blocks by scope: {coverage}" in result.stdout
