"""Hostile request fields are refused with 400 over HTTP before anything is cached, published or
stored.

A real node (engine, publisher, command consumer, uvicorn) publishes to the real broker
and a real coordinator ingests into a migrated Postgres. Each refused request leaves the
node exactly as it was (no new block, no new kv-event, no request counted); a valid
request right after is cached, published and lands in the ledger, so the refusals
stalled nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

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
from helpers.node import ServedNode, node_settings

from gpu_node.settings import CacheSettings, RequestLimits
from identity.tokens import issue_token

TENANT = f"bounds-{uuid.uuid4().hex[:6]}"
TOKEN = issue_token(tenant=TENANT, sub="alice", scopes=["hr"], secret=JWT_SECRET)
DOCUMENT_TEXT = " ".join(f"clause{i} of the staff handbook" for i in range(40))


@pytest.fixture(scope="module")
async def ledger_url(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[str]:
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(url, kafka_bootstrap)
        consumers = await RunningConsumers(settings).start()
        yield url
        await consumers.stop()


@pytest.fixture(scope="module")
async def node(
    ledger_url: str, kafka_bootstrap: str, tiny_model_dir, tmp_path_factory
) -> AsyncIterator[ServedNode]:
    node_id = f"bounds-{uuid.uuid4().hex[:6]}"
    await enroll_nodes(ledger_url, [node_id])
    settings = node_settings(
        node_id,
        tiny_model_dir,
        tmp_path_factory.mktemp("bounds-node"),
        kafka_bootstrap,
        CacheSettings(num_device_blocks=64, num_host_blocks=64, max_disk_blocks=64),
    )
    served = ServedNode(settings)
    served.assemble()
    await served.engine.start(ready=False)
    await served.serve_http()
    await served.start_replay()
    await asyncio.wait_for(served.commands.replayed.wait(), 60)
    yield served
    await served.http.stop()
    await served.stop_replay()
    await served.engine.stop()


def body(node: ServedNode, **document) -> dict:
    doc = {"id": "handbook", "version": 1, "auth_scope": "hr"} | document
    return {
        "model": node.engine.model_name,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": DOCUMENT_TEXT, "document": doc},
            {"role": "user", "content": "What does clause 3 say?"},
        ],
    }


async def post(
    node: ServedNode, content: bytes | dict | AsyncIterator[bytes], headers: dict | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"} | (
        headers or {}
    )
    data = json.dumps(content).encode() if isinstance(content, dict) else content
    async with httpx.AsyncClient(base_url=node.http.url, timeout=60) as client:
        return await client.post("/v1/chat/completions", content=data, headers=headers)


async def node_state(node: ServedNode) -> tuple:
    """Everything a request could have changed: the blocks held, the kv-events published or queued, the requests counted."""
    await node.publisher.flush()
    blocks = frozenset((entry.block_hash, entry.tier) for entry in node.engine.pool.ready_entries())
    requests = node.engine.metrics.registry.get_sample_value("kvledger_requests_total") or 0
    return blocks, node.publisher.seq, requests


def assert_refused(
    response: httpx.Response, status: int, code: str, param: str | None, limit: str
) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert limit in error["message"]


BAD_IDS = {
    "NUL": "hand\x00book",
    "newline": "hand\nbook",
    "carriage return": "hand\rbook",
    "tab": "hand\tbook",
    "escape": "hand\x1b[2Jbook",
    "DEL": "hand\x7fbook",
    "C1": "hand\x85book",
    "257 characters": "h" * 257,
    "empty": "",
}
BAD_VERSIONS = {
    "2^53-1": 2**53 - 1,
    "2^53": 2**53,
    "2^63": 2**63,
    "-1": -1,
    "string": "1",
    "float": 1.5,
}


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize(
    ("field", "code"), [("id", "invalid_document_id"), ("auth_scope", "invalid_auth_scope")]
)
async def test_a_bad_document_identifier_is_400_and_changes_nothing(
    node, field: str, code: str, bad: str
) -> None:
    before = await node_state(node)
    response = await post(node, body(node, **{field: bad}))
    limit = (
        "256 characters"
        if len(bad) > 256
        else "at least 1 character"
        if not bad
        else "control characters"
    )
    assert_refused(response, 400, code, f"messages[0].document.{field}", limit)
    assert await node_state(node) == before


@pytest.mark.parametrize("bad", BAD_VERSIONS.values(), ids=BAD_VERSIONS.keys())
async def test_a_bad_document_version_is_400_and_changes_nothing(node, bad) -> None:
    before = await node_state(node)
    response = await post(node, body(node, version=bad))
    limit = {
        2**53 - 1: "9007199254740990",
        2**53: "9007199254740990",
        2**63: "9007199254740990",
        -1: "greater than or equal to 0",
    }.get(bad, "integer")
    assert_refused(response, 400, "invalid_document_version", "messages[0].document.version", limit)
    assert await node_state(node) == before


async def test_a_lone_surrogate_is_400_and_changes_nothing(node) -> None:
    # Not representable in UTF-8 (Postgres refuses it): the JSON text itself is refused.
    before = await node_state(node)
    raw = json.dumps(body(node, id="hand\ud800book")).encode()
    assert b"\\ud800" in raw
    assert_refused(await post(node, raw), 400, "invalid_json", None, "not valid JSON")
    assert await node_state(node) == before


@pytest.mark.parametrize(
    ("field", "value", "code", "limit"),
    [
        ("seed", 2**53, "invalid_seed", "9007199254740991"),
        ("seed", -1, "invalid_seed", "greater than or equal to 0"),
        ("max_tokens", 2**63, "invalid_max_tokens", "9007199254740991"),
        ("max_tokens", 0, "invalid_max_tokens", "greater than or equal to 1"),
        (
            "max_completion_tokens",
            RequestLimits().max_completion_tokens + 1,
            "invalid_max_tokens",
            "at most",
        ),
        ("model", "tiny\nmodel", "invalid_value", "control characters"),
    ],
)
async def test_other_bounded_fields(node, field: str, value, code: str, limit: str) -> None:
    before = await node_state(node)
    request = body(node)
    request[field] = value
    assert_refused(await post(node, request), 400, code, field, limit)
    assert await node_state(node) == before


async def test_max_tokens_above_the_model_context_is_400(node) -> None:
    request = body(node)
    request["max_tokens"] = node.engine.max_context_tokens + 1
    response = await post(node, request)
    assert_refused(
        response,
        400,
        "invalid_max_tokens",
        "max_tokens",
        f"at most {node.engine.max_context_tokens}",
    )


async def test_an_oversize_body_is_413_by_content_length_and_while_streaming(node) -> None:
    limit = node.settings.limits.max_request_bytes
    before = await node_state(node)
    request = body(node)
    request["messages"][1]["content"] = "x" * limit
    oversize = json.dumps(request).encode()
    response = await post(node, oversize)
    assert_refused(response, 413, "request_too_large", None, f"{limit} bytes")

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(oversize), 65536):
            yield oversize[start : start + 65536]

    response = await post(node, chunked())
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert_refused(response, 413, "request_too_large", None, f"{limit} bytes")
    assert await node_state(node) == before


async def test_too_many_messages_is_400(node) -> None:
    maximum = node.settings.limits.max_messages
    before = await node_state(node)
    request = body(node)
    request["messages"] = [{"role": "user", "content": "x"}] * (maximum + 1)
    response = await post(node, request)
    assert_refused(response, 400, "too_many_messages", "messages", f"at most {maximum}")
    assert await node_state(node) == before


async def test_a_valid_request_after_the_refusals_is_cached_published_and_in_the_ledger(
    node, ledger_url: str
) -> None:
    doc_id = f"handbook-{uuid.uuid4().hex[:6]}"
    blocks_before, seq_before, _ = await node_state(node)
    response = await post(node, body(node, id=doc_id))
    assert response.status_code == 200, response.text
    held = {
        entry.block_hash
        for entry in node.engine.pool.ready_entries()
        if f"{doc_id}@1" in entry.provenance.documents
    }
    assert held and not held & {block_hash for block_hash, _ in blocks_before}
    await node.publisher.flush()
    assert node.publisher.seq > seq_before

    async def in_ledger() -> bool:
        connection = await connect(ledger_url)
        try:
            rows = await connection.fetch(
                "SELECT block_hash FROM block_documents WHERE doc_id = $1 AND version = 1", doc_id
            )
        finally:
            await connection.close()
        return {bytes(row["block_hash"]) for row in rows} == held

    await eventually(in_ledger, what="the document's blocks in the ledger")
