"""The node's API enforces the wire contract's list limits, so every block it serves reaches the
ledger.

A block's provenance lists every document and auth scope before it, and a kv-event carries at
most ``MAX_LIST_ITEMS`` of each (``events.schema.BlockProvenance``). A prompt past that limit was
once served while the publisher left its later blocks out of the kv-events (the user-scope ones
among them): cached and served, unknown to the ledger. Now the API refuses it with 400, naming
the limit, before anything is rendered or cached.

Everything is real: a node (engine, publisher, command consumer, uvicorn) publishing to the
session's broker and the coordinator's consumers ingesting into a migrated Postgres, on an event
loop of their own in a thread, because the property test is synchronous (Hypothesis draws
examples outside any event loop) and shares that one cluster across its examples.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.ledger import (
    JWT_SECRET,
    RunningConsumers,
    connect,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
)
from helpers.node import RunningNode, node_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.schema import MAX_LIST_ITEMS
from gpu_node.settings import CacheSettings
from identity.tokens import issue_token

TENANT = f"limits-{uuid.uuid4().hex[:6]}"
SCOPES = [f"scope-{i}" for i in range(MAX_LIST_ITEMS)]
"""As many auth scopes as a token may carry (``identity.tokens.MAX_CLAIM_ITEMS``), every one
granted."""
TOKEN = issue_token(tenant=TENANT, sub="alice", scopes=SCOPES, secret=JWT_SECRET)
TIMEOUT_S = 60.0


class Cluster:
    """A node and the coordinator's consumers on an event loop of their own in a thread; :meth:`run`
    waits on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="contract-limits-cluster", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 2 * TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=TIMEOUT_S)
        self.loop.close()


class Node(RunningNode):
    def holdings(self) -> set[tuple[str, str]]:
        return {
            (entry.block_hash.hex(), entry.tier.value) for entry in self.engine.pool.ready_entries()
        }


@pytest.fixture(scope="module")
def cluster(
    database_url: str,
    ledger_template: str,
    kafka_bootstrap: str,
    tiny_model_dir: Path,
    tmp_path_factory,
) -> Iterator[dict]:
    cluster = Cluster()
    database = fresh_database(database_url, ledger_template)
    url = cluster.run(database.__aenter__())
    consumers = cluster.run(RunningConsumers(coordinator_settings(url, kafka_bootstrap)).start())
    node_id = f"limits-{uuid.uuid4().hex[:6]}"
    cluster.run(enroll_nodes(url, [node_id]))
    # A device tier that holds the model's whole context: a prompt of 257 documents must fit to be
    # served.
    cache = CacheSettings(num_device_blocks=320, num_host_blocks=64, max_disk_blocks=64)
    node = cluster.run(
        Node(
            node_settings(
                node_id,
                tiny_model_dir,
                tmp_path_factory.mktemp("limits-node"),
                kafka_bootstrap,
                cache,
            )
        ).start()
    )
    cluster.run(node.replayed(TIMEOUT_S))
    try:
        yield {"run": cluster.run, "node": node, "url": url}
    finally:
        cluster.run(node.stop())
        cluster.run(consumers.stop())
        cluster.run(database.__aexit__(None, None, None))
        cluster.close()


def documents(num_documents: int, tag: str, auth_scope=lambda i: "scope-0") -> list[dict]:
    return [
        {
            "role": "system",
            "content": f"{tag} {i}"
            if i == 0
            else f"{i}",  # short: 257 of them must fit the model's context
            "document": {"id": f"{tag}-{i}", "version": 1, "auth_scope": auth_scope(i)},
        }
        for i in range(num_documents)
    ]


def post(cluster: dict, messages: list[dict]) -> httpx.Response:
    node: Node = cluster["node"]
    body = {
        "model": node.engine.model_name,
        "max_tokens": 1,
        "temperature": 0,
        "messages": messages,
    }
    return httpx.post(
        f"{node.http.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=120,
    )


async def ledger_live(url: str, node_id: str) -> set[tuple[str, str]]:
    connection = await connect(url)
    try:
        rows = await connection.fetch(
            "SELECT block_hash, tier FROM placements WHERE node_id = $1 AND state = 'live'", node_id
        )
    finally:
        await connection.close()
    return {(bytes(row["block_hash"]).hex(), row["tier"]) for row in rows}


async def ledger_knows_everything_held(url: str, node: Node) -> set[tuple[str, str]]:
    """Wait until the ledger's live placements of the node are exactly what it holds; returns them."""
    await node.publisher.flush()

    async def equal() -> bool:
        return await ledger_live(url, node.node_id) == node.holdings()

    await eventually(
        equal, timeout_s=TIMEOUT_S, what="the ledger's live placements == what the node holds"
    )
    return node.holdings()


async def num_ledger_documents(url: str, block_hash: str) -> int:
    connection = await connect(url)
    try:
        return await connection.fetchval(
            "SELECT count(*) FROM block_documents WHERE block_hash = $1", bytes.fromhex(block_hash)
        )
    finally:
        await connection.close()


def assert_refused(response: httpx.Response, code: str, limit_text: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        code,
        "messages",
    )
    assert limit_text in error["message"] and "MAX_LIST_ITEMS" in error["message"]


def test_documents_at_the_contract_limit_are_served_and_recorded_one_more_is_refused(cluster):
    node: Node = cluster["node"]
    tag = uuid.uuid4().hex[:8]
    question = {
        "role": "user",
        "content": f"my own question about {tag}: " + " ".join(f"w{i}" for i in range(12)),
    }
    response = post(cluster, documents(MAX_LIST_ITEMS, tag) + [question])
    assert response.status_code == 200, response.text
    held = {
        block_hash
        for block_hash, _ in cluster["run"](ledger_knows_everything_held(cluster["url"], node))
    }
    # The blocks after the last document list all of them, and the ledger records every one (the
    # user's too).
    entries = [
        e for e in node.engine.pool.ready_entries() if f"{tag}-0@1" in e.provenance.documents
    ]
    full = [e for e in entries if len(e.provenance.documents) == MAX_LIST_ITEMS]
    assert full and any(e.provenance.scope.label == "user" for e in full)
    assert {e.block_hash.hex() for e in entries} <= held
    assert (
        cluster["run"](num_ledger_documents(cluster["url"], full[-1].block_hash.hex()))
        == MAX_LIST_ITEMS
    )

    before = node.holdings()
    # One more distinct document (the same one twice is still one document of the provenance).
    over = documents(MAX_LIST_ITEMS + 1, uuid.uuid4().hex[:8])
    assert_refused(
        post(cluster, over),
        "too_many_documents",
        f"{MAX_LIST_ITEMS + 1} distinct documents; at most {MAX_LIST_ITEMS}",
    )
    assert node.holdings() == before
    repeated = documents(MAX_LIST_ITEMS, tag) * 2 + [{"role": "user", "content": "again"}]
    assert post(cluster, repeated).status_code == 200


def test_auth_scopes_at_the_contract_limit_are_served_one_more_is_refused(cluster):
    node: Node = cluster["node"]
    tag = uuid.uuid4().hex[:8]
    every_scope = documents(MAX_LIST_ITEMS, tag, auth_scope=lambda i: SCOPES[i])
    assert (
        post(cluster, every_scope + [{"role": "user", "content": "which scopes?"}]).status_code
        == 200
    )
    cluster["run"](ledger_knows_everything_held(cluster["url"], node))
    before = node.holdings()
    # A tenant-wide message adds the tenant-wide auth scope "*": one more than a block's provenance
    # carries.
    tenant_wide = {"role": "user", "content": f"shared note {tag}", "cache_scope": "tenant"}
    refused = post(
        cluster,
        documents(MAX_LIST_ITEMS, uuid.uuid4().hex[:8], auth_scope=lambda i: SCOPES[i])
        + [tenant_wide],
    )
    assert_refused(
        refused,
        "too_many_auth_scopes",
        f"{MAX_LIST_ITEMS + 1} distinct auth scopes; at most {MAX_LIST_ITEMS}",
    )
    assert node.holdings() == before


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    num_documents=st.one_of(st.integers(0, 4), st.integers(MAX_LIST_ITEMS - 2, MAX_LIST_ITEMS + 2)),
    scopes=st.lists(st.sampled_from(["public", "tenant", "user"]), min_size=1, max_size=3),
)
def test_every_block_a_node_serves_is_known_to_the_ledger(
    cluster, num_documents: int, scopes: list[str]
):
    """Drawn prompts up to and past the document limit: served ones are in the ledger block for block, the rest refused."""
    node: Node = cluster["node"]
    tag = uuid.uuid4().hex[:8]
    tail = [
        {"role": "user", "content": f"{scope} note {i} of {tag}", "cache_scope": scope}
        for i, scope in enumerate(scopes)
    ]
    before = node.holdings()
    response = post(cluster, documents(num_documents, tag) + tail)
    if num_documents > MAX_LIST_ITEMS:
        assert_refused(response, "too_many_documents", f"at most {MAX_LIST_ITEMS}")
        assert node.holdings() == before
        return
    assert response.status_code == 200, response.text
    cluster["run"](ledger_knows_everything_held(cluster["url"], node))
