"""``kvledger advise`` against a real node: a per-request timestamp in the system message, before a
long stable document, is named as the segment that breaks the prefix, with a positive expected gain;
and neither the node's sample nor its endpoint carries any of the prompts' words."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers.ledger import JWT_SECRET
from helpers.node import Served

from gpu_node.cache.layout_sampler import layout_sampler
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.settings import CacheSettings, NodeSettings
from identity.tokens import TokenVerifier, issue_token
from kvledger.cli import main

METRICS_TOKEN = "layout-advice-metrics-token-0123456789"
NUM_REQUESTS = 6
DOCUMENT = " ".join(
    f"quartzmoon{i} clause about travel expenses and per diem rates" for i in range(12)
)
QUESTION = "zebracorn: what does the travel policy allow for hotels?"
CONTENT_WORDS = ("quartzmoon", "zebracorn", "timestamp", "12:00", "travel", "hotels")


def _messages(request: int) -> list[dict]:
    return [
        {"role": "system", "content": f"You are helpful. Current timestamp: 2026-12-01T12:00:{request:02d}Z, request {request * 7919}.",
         "cache_scope": "public"},
        {"role": "system", "content": DOCUMENT, "document": {"id": "travel-policy", "version": 1, "auth_scope": "finance"}},
        {"role": "user", "content": QUESTION, "cache_scope": "tenant"},
    ]  # fmt: skip


@pytest.fixture
async def node(tiny_model_dir, tmp_path):
    settings = NodeSettings(
        node_id="layout-node",
        model_dir=tiny_model_dir,
        data_dir=tmp_path / "node",
        auth={"jwt_secret": JWT_SECRET},
        metrics={"token": METRICS_TOKEN},
        cache=CacheSettings(block_size=16, layout_sample_size=100),
    )
    engine = AsyncEngine.from_settings(settings)
    await engine.start()
    served = await Served(create_app(engine, TokenVerifier(settings.auth))).start()
    try:
        yield engine, served.url
    finally:
        await served.stop()
        await engine.stop()


async def test_advise_names_the_timestamp_segment_and_the_sample_holds_no_text(node, capsys):
    engine, url = node
    token = issue_token(
        tenant="acme",
        sub="alice",
        scopes=["finance"],
        pv={"finance": 1},
        ttl_s=600,
        secret=JWT_SECRET,
    )
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for request in range(NUM_REQUESTS):
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": engine.model_name,
                    "messages": _messages(request),
                    "max_tokens": 1,
                    "temperature": 0,
                },
                headers={"Authorization": f"Bearer {token}"},
            )
            assert response.status_code == 200, response.text
        refused = await client.get("/v1/cache/layout")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] is not None
        raw = await client.get(
            "/v1/cache/layout", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        )
    assert raw.status_code == 200
    body = raw.text
    assert not [word for word in CONTENT_WORDS if word in body], (
        "the layout sample must hold no prompt text"
    )
    assert "acme" not in body and "alice" not in body and "travel-policy" not in body
    layout = raw.json()
    assert (layout["enabled"], layout["num_observed"], len(layout["samples"])) == (
        True,
        NUM_REQUESTS,
        NUM_REQUESTS,
    )
    assert layout == layout_sampler(engine).snapshot()
    assert [segment["role"] for segment in layout["samples"][0]["segments"]] == [
        "system",
        "system",
        "user",
        "generation",
    ]

    capsys.readouterr()
    assert (
        await asyncio.to_thread(
            main, ["advise", "--node", url, "--metrics-token", METRICS_TOKEN, "--json"]
        )
        == 0
    )
    (report,) = json.loads(capsys.readouterr().out)
    advice = report["advice"]
    assert (report["node"], report["enabled"], advice["num_samples"]) == (url, True, NUM_REQUESTS)
    (breaking,) = advice["breaking"]
    assert (breaking["segment_index"], breaking["role"], breaking["scope"]) == (
        0,
        "system",
        "public",
    )
    assert (breaking["num_requests"], breaking["num_distinct_hashes"]) == (
        NUM_REQUESTS,
        NUM_REQUESTS,
    )
    assert breaking["hit_ratio_gain"] > 0.5, (
        "the document and question repeat on every later request"
    )
    assert advice["hit_ratio_gain"] == breaking["hit_ratio_gain"]
    # every request after the first missed inside the system message, because of the timestamp
    first_miss = {
        (point["segment_index"], point["role"]): point["num_requests"]
        for point in advice["divergence"]
    }
    assert first_miss == {(0, "system"): NUM_REQUESTS}
    assert advice["observed_hit_ratio"] < 0.1

    assert (
        await asyncio.to_thread(main, ["advise", "--node", url, "--metrics-token", METRICS_TOKEN])
        == 0
    )
    text = capsys.readouterr().out
    assert "segment 0 (system, public)" in text and "moved to the end" in text
