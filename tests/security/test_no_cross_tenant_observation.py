"""Nothing another tenant can read depends on what this tenant cached.

Tenant ``acme`` caches a prompt; tenant ``globex`` then sends the very same prompt (a
guess at what acme asked). Everything globex can observe — its response (content,
usage, headers), ``/v1/cache/stats``, the ``/metrics`` counters a scraper sees, and
error messages — must be exactly what it observes when it sends that prompt to a node
on which nobody cached it. Two real nodes (uvicorn on loopback, the tiny model) run
the two histories side by side. The prompts carry no ``public`` segment: public blocks
are shared by design, and their timing is the documented residual channel.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers.node import node_on_thread

from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.metrics import MissReason
from gpu_node.settings import CacheSettings, NodeSettings
from identity.settings import IssuerSettings
from identity.tokens import TokenVerifier, issue_token

SECRET = "cross-tenant-test-secret-0123456789abcdef"
METRICS_TOKEN = "cross-tenant-test-metrics-token"
SCRAPER = {"Authorization": f"Bearer {METRICS_TOKEN}"}
_COUNTER = re.compile(r"^(kvledger_[a-z_]+_total)(\{[^}]*\})? ([0-9.e+]+)$", re.MULTILINE)
# Headers that differ between any two responses (time, per-request ids, body size of ids).
_VOLATILE_HEADERS = {
    "date",
    "content-length",
    "x-request-id",
}  # x-request-id: fresh and random per request


@contextmanager
def served_node(model_dir: Path, data_dir: Path) -> Iterator[str]:
    settings = NodeSettings(
        model_dir=model_dir,
        data_dir=data_dir,
        auth=IssuerSettings(jwt_secret=SECRET),
        cache=CacheSettings(
            block_size=16, num_device_blocks=256, num_host_blocks=256, max_disk_blocks=512
        ),
        metrics={"token": METRICS_TOKEN},
    )
    engine = AsyncEngine.from_settings(settings)
    with node_on_thread(
        engine, create_app(engine, TokenVerifier(settings.auth)), "cross-tenant-test-node"
    ) as url:
        yield url


def _bearer(tenant: str, sub: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {issue_token(tenant=tenant, sub=sub, scopes=['hr'], pv=1, roles=[], ttl_s=600, secret=SECRET)}"
    }


def acme() -> dict[str, str]:
    """Alice of acme, minted per request: a token minted at import would expire during a slow
    session."""
    return _bearer("acme", "alice")


def globex() -> dict[str, str]:
    return _bearer("globex", "bob")


def _counters(http: httpx.Client) -> dict[str, float]:
    scrape = http.get("/metrics", headers=SCRAPER)
    assert scrape.status_code == 200
    return {
        name + (labels or ""): float(value) for name, labels, value in _COUNTER.findall(scrape.text)
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        name: after[name] - before.get(name, 0.0)
        for name in after
        if after[name] != before.get(name, 0.0)
    }


def _observable(response: httpx.Response) -> tuple:
    """What a caller sees of a response, less what differs on every request (ids, timestamps)."""
    body = response.json()
    if "id" in body:
        body = body | {"id": "chatcmpl-…", "created": 0}
    headers = {
        name: value for name, value in response.headers.items() if name not in _VOLATILE_HEADERS
    }
    return response.status_code, headers, body


def _prompt(scope: str, tag: str) -> list[dict]:
    handbook = f"[{tag}] Salaries of the executive team: " + "confidential figures follow. " * 12
    if scope == "tenant":
        first = {
            "role": "user",
            "content": handbook,
            "document": {"id": f"handbook-{tag}", "version": 1, "auth_scope": "hr"},
        }
    else:
        first = {"role": "user", "content": handbook, "cache_scope": "user"}
    return [first, {"role": "user", "content": "What does the CFO earn?"}]


def _what_globex_sees(url: str, messages: list[dict], acme_first: bool) -> dict:
    with httpx.Client(base_url=url, timeout=120) as http:
        model = http.get("/v1/models", headers=globex()).json()["data"][0]["id"]
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        if acme_first:
            cached = http.post("/v1/chat/completions", json=body, headers=acme())
            assert cached.status_code == 200, cached.text
            again = http.post("/v1/chat/completions", json=body, headers=acme())
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (
                "acme's prompt was not cached"
            )
        before = _counters(http)
        answer = http.post("/v1/chat/completions", json=body, headers=globex())
        after = _counters(http)
        forbidden_document = {
            "role": "user",
            "content": messages[0]["content"],
            "document": {"id": "payroll", "version": 1, "auth_scope": "finance"},
        }
        forbidden = http.post(
            "/v1/chat/completions",
            json=body | {"messages": [forbidden_document, *messages[1:]]},
            headers=globex(),
        )
        return {
            "answer": _observable(answer),
            "forbidden": _observable(forbidden),
            "stats": _observable(http.get("/v1/cache/stats", headers=globex())),
            "metrics": _observable(http.get("/metrics", headers=globex())),
            "counter_deltas": _delta(before, after),
        }


@pytest.mark.parametrize("scope", ["tenant", "user"])
def test_another_tenants_cache_is_unobservable(tiny_model_dir: Path, tmp_path: Path, scope: str):
    messages = _prompt(scope, uuid.uuid4().hex[:8])
    with (
        served_node(tiny_model_dir, tmp_path / "cached") as cached_url,
        served_node(tiny_model_dir, tmp_path / "fresh") as fresh_url,
    ):
        after_acme = _what_globex_sees(cached_url, messages, acme_first=True)
        nobody_cached = _what_globex_sees(fresh_url, messages, acme_first=False)
    assert after_acme == nobody_cached
    # What the comparison covers: globex's miss (no reason naming acme's entry), no hit, refusals.
    miss_deltas = {
        name: value
        for name, value in after_acme["counter_deltas"].items()
        if name.startswith("kvledger_cache_misses_total")
    }
    assert miss_deltas == {f'kvledger_cache_misses_total{{reason="{MissReason.NO_ENTRY}"}}': 1.0}
    assert after_acme["answer"][2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert after_acme["forbidden"][0] == 403
    assert after_acme["stats"][0] == after_acme["metrics"][0] == 401


def test_metrics_need_the_token(tiny_model_dir: Path, tmp_path: Path):
    with served_node(tiny_model_dir, tmp_path / "node") as url, httpx.Client(base_url=url) as http:
        for route in ("/metrics", "/v1/cache/stats"):
            refused = http.get(route)
            assert refused.status_code == 401
            assert refused.json() == {
                "error": {
                    "message": "this route needs the metrics bearer token",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_metrics_token",
                }
            }
            assert refused.headers["www-authenticate"] == "Bearer"
            assert http.get(route, headers=SCRAPER).status_code == 200
