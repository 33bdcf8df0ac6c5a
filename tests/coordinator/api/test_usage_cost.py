"""``kvledger cost report`` from what real nodes served: responses' ``usage`` → signed
``UsageReported`` kv-events → the ledger → ``GET /v1/usage`` → per-tenant costs under the model's
formula.

Two real nodes (engine, publisher, command consumer, OpenAI-compatible app on uvicorn) serve two
tenants through the official client, streamed and not; the coordinator's consumers and HTTP API
run on a freshly migrated database. Counts must match the responses exactly.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import httpx
import pytest
from helpers.ledger import (
    JWT_SECRET,
    RunningConsumers,
    enroll_nodes,
    eventually,
    fresh_database,
    operator_headers,
    operator_token,
    settings_at_topic_ends,
)
from helpers.node import Served, ServedNode, node_settings

from coordinator.api.app import create_app as create_coordinator_app
from gpu_node.settings import CacheSettings
from identity.tokens import issue_token
from kvledger.cli import main

SYSTEM = (
    "You are the assistant of the finance team. Answer in one short sentence, and cite the policy."
)
PRICES = {"input": 1.0, "cached_input": 0.1, "output": 2.0}


class Node(ServedNode):
    async def start(self) -> Node:
        self.assemble()
        await self.engine.start(ready=False)
        await self.start_replay()
        await asyncio.wait_for(self.commands.replayed.wait(), 60)
        await self.serve_http()
        return self

    async def stop(self) -> None:
        await self.http.stop()
        await self.stop_replay()
        await self.engine.stop()


@pytest.fixture
async def stack(database_url, ledger_template, kafka_bootstrap, tiny_model_dir, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    async with fresh_database(database_url, ledger_template) as url:
        # At the topics' ends: re-reading what earlier modules left on the worker's broker is not
        # this test's to wait for.
        settings = await settings_at_topic_ends(url, kafka_bootstrap)
        node_ids = [f"usage-{i}-{suffix}" for i in range(2)]
        await enroll_nodes(url, node_ids)
        consumers = await RunningConsumers(settings).start()
        api = await Served(create_coordinator_app(settings)).start()
        nodes = []
        try:
            for node_id in node_ids:
                cache = CacheSettings(block_size=16)
                nodes.append(
                    await Node(
                        node_settings(
                            node_id, tiny_model_dir, tmp_path / node_id, kafka_bootstrap, cache
                        )
                    ).start()
                )
            yield api.url, nodes, suffix
        finally:
            for node in nodes:
                await node.stop()
            await api.stop()
            await consumers.stop()


def _user_token(tenant: str) -> str:
    return issue_token(
        tenant=tenant,
        sub="alice",
        scopes=["finance"],
        pv={"finance": 1},
        ttl_s=600,
        secret=JWT_SECRET,
    )


async def _streamed_usage(node: Node, token: str, messages: list[dict]) -> dict:
    async with node.client(token) as client:
        stream = await client.chat.completions.create(
            model=node.engine.model_name, messages=messages, max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None
    return {
        "prompt": usage.prompt_tokens,
        "cached": usage.prompt_tokens_details.cached_tokens,
        "output": usage.completion_tokens,
    }


async def _usage(node: Node, token: str, messages: list[dict]) -> dict:
    async with node.client(token) as client:
        response = await client.chat.completions.create(
            model=node.engine.model_name, messages=messages, max_tokens=2, temperature=0
        )
    usage = response.usage
    return {
        "prompt": usage.prompt_tokens,
        "cached": usage.prompt_tokens_details.cached_tokens,
        "output": usage.completion_tokens,
    }


async def _ledger_usage(url: str, headers: dict, **params) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.get(
            "/v1/usage", params={"since": "2000-01-01T00:00:00Z"} | params, headers=headers
        )


async def test_cost_report_equals_what_the_responses_said(stack, capsys):
    url, nodes, suffix = stack
    tenants = [f"fin-{suffix}", f"ops-{suffix}"]
    expected: dict[str, Counter] = {tenant: Counter() for tenant in tenants}
    # tenant 0: 3 requests on node 0 (the shared public system prompt is hit after the first), 1
    # streamed on node 1; tenant 1: 2 requests on node 1
    plan = [(0, 0, False), (0, 0, False), (0, 0, False), (0, 1, True), (1, 1, False), (1, 1, True)]
    for number, (tenant_index, node_index, streamed) in enumerate(plan):
        tenant = tenants[tenant_index]
        messages = [
            {"role": "system", "content": SYSTEM, "cache_scope": "public"},
            {"role": "user", "content": f"question {number}"},
        ]
        served = await (_streamed_usage if streamed else _usage)(
            nodes[node_index], _user_token(tenant), messages
        )
        expected[tenant].update(requests=1, **served)
    assert expected[tenants[0]]["cached"] > 0, "later requests must hit the cached system prompt"
    for node in nodes:
        await node.publisher.publish_usage()

    admin = operator_headers("platform-admin", "platform")

    async def ledger_has_everything() -> bool:
        rows = {
            row["tenant_id"]: row for row in (await _ledger_usage(url, admin)).json()["tenants"]
        }
        return all(
            tenant in rows and rows[tenant]["num_requests"] == expected[tenant]["requests"]
            for tenant in tenants
        )

    await eventually(
        ledger_has_everything, timeout_s=60, what="usage of both tenants in the ledger"
    )

    token = operator_token("platform-admin", "platform")
    args = ["cost", "report", "--since", "1h", "--coordinator-url", url, "--token", token, "--json",
            "--price-input", "1", "--price-cached-input", "0.1", "--price-output", "2"]  # fmt: skip
    capsys.readouterr()
    assert await asyncio.to_thread(main, args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["tenant_id"]: row for row in report["tenants"]}
    assert report["prices"] == PRICES
    for tenant in tenants:
        want, row = expected[tenant], rows[tenant]
        assert (
            row["num_requests"],
            row["num_prompt_tokens"],
            row["num_cached_tokens"],
            row["num_output_tokens"],
        ) == (
            want["requests"],
            want["prompt"],
            want["cached"],
            want["output"],
        )
        without = (want["prompt"] * PRICES["input"] + want["output"] * PRICES["output"]) / 1e6
        with_cache = ((want["prompt"] - want["cached"]) * PRICES["input"] + want["cached"] * PRICES["cached_input"]
                      + want["output"] * PRICES["output"]) / 1e6  # fmt: skip
        assert row["cost_without_cache_usd"] == round(without, 10)
        assert row["cost_with_cache_usd"] == round(with_cache, 10)
        assert row["net_saving_usd"] == round(without - with_cache, 10)
    assert rows[tenants[0]]["net_saving_usd"] > 0

    # the table names both tenants
    assert await asyncio.to_thread(main, args[:-7] + args[-6:]) == 0
    table = capsys.readouterr().out
    assert all(tenant in table for tenant in tenants)


async def test_usage_is_tenant_scoped_for_tenant_operators(stack):
    url, nodes, suffix = stack
    mine, other = f"own-{suffix}", f"other-{suffix}"
    messages = [{"role": "user", "content": "hello"}]
    served = {
        tenant: await _usage(nodes[0], _user_token(tenant), messages) for tenant in (mine, other)
    }
    await nodes[0].publisher.publish_usage()

    auditor = operator_headers("auditor", mine)

    async def own_usage_arrived() -> bool:
        return [
            row["tenant_id"] for row in (await _ledger_usage(url, auditor)).json()["tenants"]
        ] == [mine]

    await eventually(own_usage_arrived, timeout_s=60, what="the auditor's own tenant's usage")
    (row,) = (await _ledger_usage(url, auditor)).json()["tenants"]
    assert (row["num_prompt_tokens"], row["num_cached_tokens"], row["num_output_tokens"]) == (
        served[mine]["prompt"],
        served[mine]["cached"],
        served[mine]["output"],
    )
    refused = await _ledger_usage(url, auditor, tenant=other)
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "tenant_forbidden")
    unauthenticated = await _ledger_usage(url, {})
    assert unauthenticated.status_code == 401
    bad_window = await _ledger_usage(url, auditor, until="1999-01-01T00:00:00Z")
    assert (bad_window.status_code, bad_window.json()["error"]["code"]) == (400, "bad_window")
    naive = await _ledger_usage(url, auditor, since="2026-01-01T00:00:00")
    assert naive.status_code == 400
