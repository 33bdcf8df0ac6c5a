"""The node's OpenAI-compatible HTTP API, end to end over a real socket.

A real uvicorn server runs in a background thread around a real engine on the
tiny local model. The official ``openai`` client is used unchanged for the
happy paths (the compatibility promise of docs/design.md §4); raw httpx checks every
error's exact status and OpenAI error body. Isolation is checked where users
see it: ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers.ledger import OPERATOR_AUTH, eventually, operator_headers
from helpers.node import node_on_thread

from events.logs import make_handler
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.settings import CacheSettings, NodeSettings
from identity.settings import IssuerSettings
from identity.tokens import TokenVerifier, issue_token
from prefix_keys.blocks import CacheScope, DocumentRef
from prefix_keys.prompt import ChatMessage, render_prompt

SECRET = "api-test-secret-0123456789abcdef0123456789"
METRICS_TOKEN = "api-test-metrics-token"
BLOCK_SIZE = 16


@dataclass
class Node:
    base_url: str
    engine: AsyncEngine

    def client(self, token: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=token, max_retries=0, timeout=120
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120)


@pytest.fixture(scope="module")
def node(tiny_model_dir, tmp_path_factory):
    """Serve like ``gpu_node.entrypoints.server.serve``: the engine starts on the server's own event
    loop."""
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path_factory.mktemp("api-node"),
        auth=IssuerSettings(jwt_secret=SECRET),
        operator_auth=OPERATOR_AUTH,
        cache=CacheSettings(
            block_size=BLOCK_SIZE, num_device_blocks=256, num_host_blocks=256, max_disk_blocks=512
        ),
        metrics={"token": METRICS_TOKEN},
    )
    engine = AsyncEngine.from_settings(settings)
    app = create_app(
        engine,
        TokenVerifier(settings.auth),
        operator_verifier=TokenVerifier(settings.operator_auth, secret_env=None),
    )
    with node_on_thread(engine, app, "api-test-server") as url:
        yield Node(base_url=url, engine=engine)


def token(
    tenant: str = "acme", sub: str = "alice", scopes=("hr",), pv=1, roles=(), ttl_s: int = 600
) -> str:
    return issue_token(
        tenant=tenant, sub=sub, scopes=scopes, pv=pv, roles=roles, ttl_s=ttl_s, secret=SECRET
    )


def unique(text: str) -> str:
    """Distinct text per test: the node's cache is shared by the whole module, so the
    tag goes first — a common leading text would be a shared, already-cached prefix."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def cacheable(num_prompt_tokens: int) -> int:
    """Tokens a fully cached prompt reports: full blocks only, and the last prompt token is always
    recomputed."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def greedy(client: openai.OpenAI, model: str, messages: list[dict], **kwargs):
    return client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=8, **kwargs
    )


# --------------------------------------------------------------------------- openai client, happy
# paths


def test_models_list(node):
    models = node.client(token()).models.list()
    assert [model.id for model in models.data] == [node.engine.model_name]
    assert node.client(token()).models.retrieve(node.engine.model_name).id == node.engine.model_name


def test_non_streaming_then_cached(node):
    client = node.client(token())
    messages = [
        {
            "role": "system",
            "content": unique("You are a careful assistant for the finance team."),
            "cache_scope": "public",
        },
        {
            "role": "user",
            "content": "Summarise the quarterly report in three short bullet points please.",
        },
    ]
    first = greedy(client, node.engine.model_name, messages, n=1, logprobs=False)
    assert first.object == "chat.completion"
    assert first.model == node.engine.model_name
    assert len(first.choices) == 1 and first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    usage = first.usage
    assert usage.prompt_tokens > BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 8

    second = greedy(client, node.engine.model_name, messages)
    assert second.usage.prompt_tokens == usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == cacheable(usage.prompt_tokens)
    # Greedy output does not depend on whether the prefix came from cache.
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].finish_reason == first.choices[0].finish_reason


def test_streaming_matches_non_streaming(node):
    client = node.client(token())
    parts = [
        {"type": "text", "text": unique("Write a haiku about")},
        {"type": "text", "text": " autumn rain."},
    ]
    messages = [{"role": "user", "content": parts}]
    full = greedy(client, node.engine.model_name, messages)
    chunks = list(
        greedy(
            client,
            node.engine.model_name,
            messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [chunk for chunk in chunks if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert text == full.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in content_chunks[:-1])
    # include_usage: one last chunk with no choices carries the usage; the others carry none.
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == cacheable(
        full.usage.prompt_tokens
    )


def test_stream_without_usage_ends_with_done(node):
    with node.http() as http:
        response = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {token()}"},
            json={
                "model": node.engine.model_name,
                "messages": [{"role": "user", "content": unique("hi")}],
                "stream": True,
                "max_tokens": 4,
            },
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_disconnect_mid_stream_leaves_the_node_serving(node):
    messages = [
        {"role": "user", "content": unique("Describe every tool in the shed, one by one. ") * 2}
    ]
    body = {
        "model": node.engine.model_name,
        "messages": messages,
        "stream": True,
        "max_tokens": 200,
    }
    headers = {"Authorization": f"Bearer {token(sub='dora')}"}
    with (
        node.http() as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        first_line = next(line for line in response.iter_lines() if line)
        assert first_line.startswith("data: ")
    # The abandoned request committed its prompt blocks, and the node keeps serving them.
    usage = greedy(node.client(token(sub="dora")), node.engine.model_name, messages).usage
    assert usage.prompt_tokens_details.cached_tokens == cacheable(usage.prompt_tokens)


def test_max_tokens_is_honoured(node):
    response = node.client(token()).chat.completions.create(
        model=node.engine.model_name,
        messages=[{"role": "user", "content": unique("Count to one hundred.")}],
        max_completion_tokens=2,
        temperature=0.0,
    )
    assert response.usage.completion_tokens <= 2


# --------------------------------------------------------------------------- errors, exact bodies


def post(
    node: Node, body, headers: dict | None = None, bearer: str | None = None
) -> httpx.Response:
    headers = dict(headers or {})
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    with node.http() as http:
        if isinstance(body, (bytes, str)):
            headers["content-type"] = "application/json"
            return http.post("/v1/chat/completions", content=body, headers=headers)
        return http.post("/v1/chat/completions", json=body, headers=headers)


def assert_error(
    response: httpx.Response, status: int, code: str, type_: str, param: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (code, type_, param)
    assert error["message"]
    return error


def simple(node: Node, **extra) -> dict:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": node.engine.model_name, "messages": messages, "max_tokens": 2, **extra}


def test_missing_token_is_401(node):
    response = post(node, simple(node))
    assert_error(response, 401, "missing_token", "authentication_error")
    assert response.headers["www-authenticate"] == "Bearer"


def test_non_bearer_scheme_is_401(node):
    response = post(node, simple(node), headers={"Authorization": "Basic YTpi"})
    assert_error(response, 401, "invalid_token", "authentication_error")


def test_wrongly_signed_token_is_401(node):
    forged = issue_token(tenant="acme", sub="alice", secret="not-the-node-secret-0123456789abcdef")
    assert_error(
        post(node, simple(node), bearer=forged), 401, "invalid_token", "authentication_error"
    )


def test_expired_token_is_401(node):
    expired = issue_token(
        tenant="acme", sub="alice", ttl_s=60, secret=SECRET, now=time.time() - 3600
    )
    assert_error(
        post(node, simple(node), bearer=expired), 401, "token_expired", "authentication_error"
    )


def test_openai_client_sees_authentication_error(node):
    with pytest.raises(openai.AuthenticationError) as excinfo:
        greedy(node.client("garbage"), node.engine.model_name, [{"role": "user", "content": "x"}])
    assert excinfo.value.code == "invalid_token"


def test_auth_is_checked_before_the_body(node):
    assert_error(post(node, b"{not json"), 401, "missing_token", "authentication_error")


def test_malformed_json_is_400(node):
    assert_error(
        post(node, b"{not json", bearer=token()), 400, "invalid_json", "invalid_request_error"
    )


@pytest.mark.parametrize(
    ("mutate", "param", "code"),
    [
        (lambda body: body.pop("messages"), "messages", "invalid_value"),
        (lambda body: body.update(messages=[]), "messages", "invalid_value"),
        (lambda body: body.update(max_tokens=0), "max_tokens", "invalid_max_tokens"),
        (lambda body: body.update(temperature=-1), "temperature", "invalid_value"),
        (lambda body: body["messages"][0].update(role="tool"), "messages[0].role", "invalid_value"),
        (
            lambda body: body["messages"][0].update(cache_scope="global"),
            "messages[0].cache_scope",
            "invalid_value",
        ),
        (
            lambda body: body["messages"][0].update(
                content=[{"type": "image_url", "image_url": {"url": "x"}}]
            ),
            "messages[0].content[0].type",
            "invalid_value",
        ),
        (
            lambda body: body["messages"][0].update(
                document={"id": "d", "version": -1, "auth_scope": "hr"}
            ),
            "messages[0].document.version",
            "invalid_document_version",
        ),
    ],
)
def test_validation_errors_are_400_not_422(node, mutate, param, code):
    body = simple(node)
    mutate(body)
    assert_error(post(node, body, bearer=token()), 400, code, "invalid_request_error", param)


def test_document_with_contrary_scope_is_400(node):
    body = simple(node)
    body["messages"][0].update(
        cache_scope="user", document={"id": "handbook", "version": 1, "auth_scope": "hr"}
    )
    response = post(node, body, bearer=token())
    assert_error(response, 400, "invalid_value", "invalid_request_error", "messages[0].cache_scope")


def test_n_greater_than_one_is_400(node):
    assert_error(
        post(node, simple(node, n=2), bearer=token()),
        400,
        "unsupported_value",
        "invalid_request_error",
        "n",
    )


def test_fields_at_their_no_op_value_are_accepted(node):
    body = simple(
        node, n=1, logprobs=False, tools=[], presence_penalty=0, frequency_penalty=0.0, stop=None
    )
    assert post(node, body, bearer=token()).status_code == 200


@pytest.mark.parametrize(
    ("mutate", "param"),
    [
        (lambda body: body.update(user="alice"), "user"),
        (lambda body: body.update(logit_bias={"50": 100}), "logit_bias"),
        (lambda body: body.update(response_format={"type": "json_object"}), "response_format"),
        (lambda body: body.update(top_k=5), "top_k"),
        (lambda body: body.update(some_future_field={"x": 1}), "some_future_field"),
        (lambda body: body["messages"][0].update(name="alice"), "messages[0].name"),
        (
            lambda body: body["messages"][0].update(
                content=[{"type": "text", "text": "hi", "cache": 1}]
            ),
            "messages[0].content[0].cache",
        ),
        (
            lambda body: body.update(
                stream=True, stream_options={"include_usage": True, "chunk_size": 4}
            ),
            "stream_options.chunk_size",
        ),
    ],
)
def test_fields_the_node_does_not_implement_are_refused_by_name(node, mutate, param):
    body = simple(node)
    mutate(body)
    error = assert_error(
        post(node, body, bearer=token()),
        400,
        "unsupported_parameter",
        "invalid_request_error",
        param,
    )
    assert param in error["message"]


def test_unsupported_field_name_is_echoed_cut_short(node):
    error = assert_error(
        post(node, simple(node, **{"x" * 5000: 1}), bearer=token()),
        400,
        "unsupported_parameter",
        "invalid_request_error",
        "x" * 100,
    )
    assert len(error["message"]) < 200


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_penalties_other_than_zero_are_400(node, name):
    assert_error(
        post(node, simple(node, **{name: 0.5}), bearer=token()),
        400,
        "unsupported_value",
        "invalid_request_error",
        name,
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 300}, "min_tokens"),  # above the default max_tokens (256)
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [3072]}, "stop_token_ids"),  # the tiny model's vocabulary is 0..3071
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
    ],
)
def test_invalid_stop_extensions_are_400(node, extra, param):
    body = simple(node) | extra
    if "max_tokens" not in extra and extra.get("min_tokens") == 300:
        del body["max_tokens"]
    assert_error(
        post(node, body, bearer=token()), 400, "invalid_value", "invalid_request_error", param
    )


def first_greedy_token(node: Node, messages: list[dict]) -> int:
    """The token the model picks first for ``messages``, from one forward pass outside the node."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt_ids = render(node, messages).token_ids
    model = AutoModelForCausalLM.from_pretrained(
        node.engine.runner.model_dir, local_files_only=True, dtype=torch.float32
    )
    with torch.inference_mode():
        return int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax())


def test_stop_token_ids_min_tokens_and_ignore_eos_reach_the_engine(node):
    messages = [{"role": "user", "content": unique("Tell me about the handbook.")}]
    client = node.client(token())
    first = first_greedy_token(node, messages)
    stopped = greedy(
        client, node.engine.model_name, messages, extra_body={"stop_token_ids": [first]}
    )
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("", "stop")
    assert stopped.usage.completion_tokens == 0
    # greedy() asks for 8 tokens
    held = greedy(
        client,
        node.engine.model_name,
        messages,
        extra_body={"stop_token_ids": [first], "min_tokens": 8},
    )
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("length", 8)
    assert held.choices[0].message.content
    ignored = greedy(
        client, node.engine.model_name, messages, extra_body={"ignore_eos": True, "min_tokens": 8}
    )
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 8)


def test_continuous_usage_stats_count_every_chunk(node):
    messages = [{"role": "user", "content": unique("Write a haiku about rain.")}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        greedy(
            node.client(token()),
            node.engine.model_name,
            messages,
            stream=True,
            stream_options=options,
        )
    )
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counts == sorted(counts) and counts[0] == 0
    assert counts[-1] == chunks[-1].usage.completion_tokens == 8
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}


def test_unknown_model_is_404(node):
    body = simple(node)
    body["model"] = "gpt-4o"
    assert_error(
        post(node, body, bearer=token()), 404, "model_not_found", "invalid_request_error", "model"
    )


def test_document_scope_not_granted_is_403(node):
    body = simple(node)
    document = {"id": "salaries", "version": 3, "auth_scope": "payroll"}
    body["messages"].insert(0, {"role": "system", "content": "Salary bands.", "document": document})
    response = post(node, body, bearer=token(scopes=["hr"]))
    error = assert_error(
        response,
        403,
        "document_scope_forbidden",
        "permission_error",
        "messages[0].document.auth_scope",
    )
    assert "payroll" in error["message"]


def test_oversize_prompt_is_400_naming_the_limit(node):
    limit = node.engine.max_context_tokens
    body = simple(node)
    body["messages"][0]["content"] = "lorem ipsum " * (limit + 8)
    response = post(node, body, bearer=token())
    error = assert_error(
        response, 400, "context_length_exceeded", "invalid_request_error", "messages"
    )
    assert str(limit) in error["message"]
    # Streaming requests are refused the same way, before any event is sent.
    body["stream"] = True
    assert_error(
        post(node, body, bearer=token()),
        400,
        "context_length_exceeded",
        "invalid_request_error",
        "messages",
    )


def test_unknown_route_is_404_in_openai_shape(node):
    with node.http() as http:
        assert_error(http.get("/v1/nothing-here"), 404, "not_found", "invalid_request_error")


# --------------------------------------------------------------------------- operational endpoints


def test_health_ready_metrics(node):
    greedy(
        node.client(token()), node.engine.model_name, [{"role": "user", "content": unique("ping")}]
    )
    with node.http() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").status_code == 200
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "kvledger_requests_total" in metrics.text
    assert "kvledger_hit_tokens_total" in metrics.text


def test_access_line_has_the_request_id_and_no_prompt_or_caller(node):
    """Every response echoes X-Request-Id; the node's lines for it carry the id, never the prompt,
    tenant or subject."""
    stream = io.StringIO()
    handler = make_handler("json", stream)
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    secret_prompt = unique("the patient's diagnosis is confidential")
    body = {
        "model": node.engine.model_name,
        "messages": [{"role": "user", "content": secret_prompt}],
        "max_tokens": 2,
    }
    try:
        with node.http() as http:
            served = http.post(
                "/v1/chat/completions",
                json=body,
                headers={
                    "Authorization": f"Bearer {token(tenant='tenant-x9', sub='subject-q7')}",
                    "X-Request-Id": "req-abc.1",
                },
            )
            refused = http.post(
                "/v1/chat/completions", json=body, headers={"X-Request-Id": "req-abc.2"}
            )

        def node_lines() -> list[dict]:
            return [
                line
                for line in map(json.loads, stream.getvalue().splitlines())
                if line["logger"].startswith("gpu_node")
            ]

        # Only this test's requests, and only once both are written: a request's access line is
        # written after its response went out (its time includes sending), so it may land after the
        # client has the response.
        def access() -> list[tuple[str, str]]:
            return [
                (line["request_id"], line["message"].rsplit(" ", 1)[0])
                for line in node_lines()
                if line["logger"] == "gpu_node.access" and line["request_id"].startswith("req-abc.")
            ]

        def refusals_observed() -> float:
            labels = {"method": "POST", "route": "/v1/chat/completions", "status": "401"}
            return (
                node.engine.metrics.registry.get_sample_value(
                    "kvledger_http_request_seconds_count", labels
                )
                or 0.0
            )

        # the latency metric is observed right after the access line
        asyncio.run(
            eventually(
                lambda: len(access()) == 2 and refusals_observed() >= 1,
                timeout_s=30,
                what="both access lines",
            )
        )
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)
    assert (served.status_code, served.headers["x-request-id"]) == (200, "req-abc.1")
    assert (refused.status_code, refused.headers["x-request-id"]) == (401, "req-abc.2")
    assert access() == [
        ("req-abc.1", "POST /v1/chat/completions 200"),
        ("req-abc.2", "POST /v1/chat/completions 401"),
    ]
    completion = [line for line in node_lines() if line["message"].startswith("completion ")]
    assert [line["request_id"] for line in completion] == ["req-abc.1"]
    logged = json.dumps(node_lines())
    for private in (secret_prompt, "diagnosis", "tenant-x9", "subject-q7"):
        assert private not in logged
    assert refusals_observed() >= 1


def test_not_ready_node_refuses_traffic(tiny_model_dir, tmp_path):
    """Before ``engine.start()`` (pending invalidations not yet replayed) nothing is served."""
    settings = NodeSettings(
        model_dir=tiny_model_dir, data_dir=tmp_path, auth=IssuerSettings(jwt_secret=SECRET)
    )
    engine = AsyncEngine.from_settings(settings)
    with TestClient(create_app(engine, TokenVerifier(settings.auth))) as http:
        assert_error(http.get("/readyz"), 503, "not_ready", "server_error")
        assert http.get("/healthz").status_code == 200
        body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}]}
        response = http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token()}"}
        )
        assert_error(response, 503, "not_ready", "server_error")


def test_concurrent_identical_requests(node):
    messages = [
        {"role": "user", "content": unique("Tell me about watering cans and their many uses. ") * 2}
    ]
    client = node.client(token(sub="zoe"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda _: greedy(client, node.engine.model_name, messages), range(4))
        )
    assert len({result.choices[0].message.content for result in results}) == 1
    assert len({result.usage.prompt_tokens for result in results}) == 1


@pytest.mark.parametrize("route", ["/metrics", "/v1/cache/stats"])
def test_operational_views_need_the_metrics_token(node, route):
    """They aggregate every tenant's traffic: a user's token, even an admin's, is not enough."""
    with node.http() as http:
        assert_error(http.get(route), 401, "invalid_metrics_token", "authentication_error")
        for bearer in (token(), token(roles=["admin"]), METRICS_TOKEN + "x"):
            assert_error(
                http.get(route, headers={"Authorization": f"Bearer {bearer}"}),
                401,
                "invalid_metrics_token",
                "authentication_error",
            )
        response = http.get(route, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200


def test_cache_stats_report_each_tiers_capacity(node):
    with node.http() as http:
        stats = http.get(
            "/v1/cache/stats", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        ).json()
    block_bytes = (
        4 * 2 * 2 * 32 * BLOCK_SIZE * 4
    )  # the tiny model: 4 layers, k and v, 2 KV heads, head dim 32, float32
    assert stats["block_bytes"] == block_bytes
    assert stats["capacity"] == {
        tier: {"num_blocks": num, "num_tokens": num * BLOCK_SIZE, "num_bytes": num * block_bytes}
        for tier, num in (("device", 256), ("host", 256), ("disk", 512))
    }
    # 256 blocks of 16 tokens hold one request of the model's 4,096-token context
    assert stats["max_concurrency"] == {"context_tokens": 4096, "num_requests": 1.0}


@pytest.mark.parametrize("route", ["/metrics", "/v1/cache/stats"])
def test_operational_views_are_disabled_without_a_metrics_token(
    tiny_model_dir, tmp_path, monkeypatch, route
):
    monkeypatch.delenv("KVLEDGER_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("KVLEDGER_NODE_METRICS__TOKEN", raising=False)
    settings = NodeSettings(
        model_dir=tiny_model_dir, data_dir=tmp_path, auth=IssuerSettings(jwt_secret=SECRET)
    )
    assert settings.metrics.token is None
    engine = AsyncEngine.from_settings(settings)
    with TestClient(create_app(engine, TokenVerifier(settings.auth))) as http:
        for headers in ({}, {"Authorization": f"Bearer {token(roles=['admin'])}"}):
            assert_error(
                http.get(route, headers=headers), 404, "metrics_disabled", "invalid_request_error"
            )


def test_snapshot_requires_a_platform_admin_operator(node):
    with node.http() as http:
        assert_error(http.post("/v1/cache/snapshots"), 401, "missing_token", "authentication_error")
        # End users' tokens are never operator tokens, whatever role they claim.
        for roles in ((), ("admin",), ("platform-admin",)):
            claimed = http.post(
                "/v1/cache/snapshots", headers={"Authorization": f"Bearer {token(roles=roles)}"}
            )
            assert_error(claimed, 401, "invalid_token", "authentication_error")
        tenant_admin = http.post("/v1/cache/snapshots", headers=operator_headers("tenant-admin"))
        assert_error(tenant_admin, 403, "insufficient_role", "permission_error")
        created = http.post(
            "/v1/cache/snapshots", headers=operator_headers("platform-admin", "platform")
        )
    assert created.status_code == 201, created.text
    assert isinstance(created.json(), dict)


# --------------------------------------------------------------------------- isolation, as the
# caller sees it


def render(node: Node, messages: list[dict]):
    """The node's own rendering of ``messages``: token ids plus per-scope segments."""
    chat = []
    for message in messages:
        document = message.get("document")
        chat.append(
            ChatMessage(
                role=message["role"],
                content=message["content"],
                scope=CacheScope.TENANT
                if document
                else CacheScope.parse(message.get("cache_scope", "user")),
                document=DocumentRef(document["id"], document["version"], document["auth_scope"])
                if document
                else None,
            )
        )
    return render_prompt(node.engine.runner.tokenizer, tuple(chat))


def shareable_tokens(node: Node, messages: list[dict], widest_shared: CacheScope) -> int:
    """Cached tokens another caller may get: the full blocks inside the leading run of
    segments no stricter than ``widest_shared`` (and never the last prompt token)."""
    prompt = render(node, messages)
    shared_end = 0
    for segment in prompt.segments:
        if segment.scope > widest_shared:
            break
        shared_end = segment.end
    return min(shared_end // BLOCK_SIZE, (len(prompt.token_ids) - 1) // BLOCK_SIZE) * BLOCK_SIZE


SYSTEM_PROMPT = (
    "You are the support assistant of a company that sells garden tools. Answer politely, "
    "cite the order number when one is given, never promise refunds, and keep every answer "
    "under one hundred words. If the question is about something else, say so briefly."
)


def cached(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[int, int]:
    usage = greedy(client, model, messages).usage
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_other_tenant_reuses_only_the_public_system_prompt(node):
    model = node.engine.model_name
    messages = [
        {"role": "system", "content": unique(SYSTEM_PROMPT), "cache_scope": "public"},
        {
            "role": "user",
            "content": "My order 1234 arrived with a broken rake handle; what now? " * 3,
        },
    ]
    public_tokens = shareable_tokens(node, messages, CacheScope.PUBLIC)
    assert public_tokens >= BLOCK_SIZE, "the public system prompt must span at least one full block"

    alice = node.client(token(tenant="acme", sub="alice"))
    num_prompt_tokens, first = cached(alice, model, messages)
    assert first == 0
    assert num_prompt_tokens > public_tokens + BLOCK_SIZE, (
        "the private part must span full blocks too"
    )
    assert cached(alice, model, messages) == (num_prompt_tokens, cacheable(num_prompt_tokens))

    # Same subject name, other tenant, byte-identical prompt: only the public blocks are shared.
    mallory = node.client(token(tenant="globex", sub="alice"))
    assert cached(mallory, model, messages) == (num_prompt_tokens, public_tokens)


def test_two_subjects_never_share_user_scope_blocks(node):
    model = node.engine.model_name
    messages = [
        {
            "role": "user",
            "content": unique("My home address is 12 Elm Street and my card ends in 4242. ") * 3,
        },
        {"role": "assistant", "content": "Thank you, I have noted your address and card."},
        {"role": "user", "content": "Please repeat what you know about me."},
    ]
    shared = shareable_tokens(node, messages, CacheScope.TENANT)
    alice = node.client(token(tenant="acme", sub="alice"))
    bob = node.client(token(tenant="acme", sub="bob"))

    num_prompt_tokens, _ = cached(alice, model, messages)
    assert cached(alice, model, messages) == (num_prompt_tokens, cacheable(num_prompt_tokens))
    assert cacheable(num_prompt_tokens) > shared
    # Bob, same tenant and same scopes, identical prompt: none of Alice's user-scope blocks.
    assert cached(bob, model, messages) == (num_prompt_tokens, shared)
    # …and his own blocks serve him afterwards.
    assert cached(bob, model, messages) == (num_prompt_tokens, cacheable(num_prompt_tokens))


def test_tenant_document_is_shared_within_tenant_scope_and_policy_version_only(node):
    model = node.engine.model_name
    messages = [
        {"role": "system", "content": unique(SYSTEM_PROMPT), "cache_scope": "public"},
        {
            "role": "system",
            "content": "Staff handbook: returns are accepted within thirty days with a receipt. "
            * 4,
            "document": {"id": "handbook", "version": 2, "auth_scope": "hr"},
        },
        {"role": "user", "content": "Can a customer return a shovel after five weeks?"},
    ]
    public_tokens = shareable_tokens(node, messages, CacheScope.PUBLIC)
    tenant_tokens = shareable_tokens(node, messages, CacheScope.TENANT)
    assert BLOCK_SIZE <= public_tokens < tenant_tokens

    author = node.client(token(tenant="acme", sub="alice", scopes=["hr"], pv=1))
    num_prompt_tokens, first = cached(author, model, messages)
    assert first == 0
    colleague = node.client(token(tenant="acme", sub="bob", scopes=["hr", "eng"], pv=1))
    assert cached(colleague, model, messages) == (num_prompt_tokens, tenant_tokens)
    other_tenant = node.client(token(tenant="globex", sub="bob", scopes=["hr"], pv=1))
    assert cached(other_tenant, model, messages) == (num_prompt_tokens, public_tokens)
    newer_policy = node.client(token(tenant="acme", sub="carol", scopes=["hr"], pv={"hr": 2}))
    assert cached(newer_policy, model, messages) == (num_prompt_tokens, public_tokens)


def test_document_needs_its_auth_scope_even_when_cached(node):
    model = node.engine.model_name
    messages = [
        {
            "role": "system",
            "content": unique("Payroll table: grade A earns 100, grade B earns 120. ") * 3,
            "document": {"id": "payroll", "version": 1, "auth_scope": "payroll"},
        },
        {"role": "user", "content": "What does grade B earn?"},
    ]
    cached(node.client(token(sub="paula", scopes=["payroll"])), model, messages)
    body = {"model": model, "messages": messages, "max_tokens": 2}
    response = post(node, body, bearer=token(sub="henry", scopes=["hr"]))
    assert_error(
        response,
        403,
        "document_scope_forbidden",
        "permission_error",
        "messages[0].document.auth_scope",
    )


def test_streams_complete_after_another_server_in_the_process_shut_down(node):
    """Regression: sse-starlette's process-wide exit flag once ended every stream after any
    uvicorn server in the process had stopped (as the integration tests' servers do)."""
    other = uvicorn.Server(uvicorn.Config(FastAPI(), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=other.run)
    thread.start()
    deadline = time.monotonic() + 30
    while not other.started:
        assert time.monotonic() < deadline, "helper server did not start"
        time.sleep(0.01)
    other.handle_exit(signal.SIGTERM, None)  # what a stopping server does on SIGTERM
    thread.join(timeout=30)
    with node.http() as http:
        response = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {token()}"},
            json={
                "model": node.engine.model_name,
                "messages": [{"role": "user", "content": unique("hi")}],
                "stream": True,
                "max_tokens": 3,
            },
        )
    events = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
