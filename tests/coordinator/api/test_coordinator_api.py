"""The coordinator HTTP API on a real, migrated Postgres: roles, error shape, ledger filters, liveness, health.

The ledger is filled through the real ingest handler (the same code the kv-events
consumer calls), without Kafka: this module is about the API on top.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from helpers.ledger import (
    JWT_SECRET,
    OPERATOR_PRIVATE_KEY_PEM,
    SUBJECT_KEY,
    coordinator_settings,
    fresh_database,
    stored,
)
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.app import create_app
from coordinator.handlers.ingest import LedgerIngest
from coordinator.ledger import migrate
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorSettings
from events.kafka.consumer import ConsumedEvent
from events.schema import (
    BlockRemoved,
    BlockStored,
    NodeHeartbeat,
    NodeStarted,
    RemovedBlock,
    SnapshotWritten,
    make_event,
    subject_digest,
)
from events.topics import KV_EVENTS
from identity.tokens import issue_token

ALICE = subject_digest(SUBJECT_KEY.encode(), "acme", "alice")
BOB = subject_digest(SUBJECT_KEY.encode(), "acme", "bob")

PUBLIC = stored("api/public", "device")
HANDBOOK = stored(
    "api/handbook",
    "device",
    tenant_id="acme",
    scope="tenant",
    auth_scopes=[("hr", 2)],
    documents=["handbook@3"],
    token_offset=16,
    parent="api/public",
)
ALICE_CHAT = stored(
    "api/alice",
    "host",
    tenant_id="acme",
    scope="user",
    subject_id=ALICE,
    documents=["handbook@3"],
    auth_scopes=[("hr", 2)],
    token_offset=32,
    parent="api/handbook",
)
BOB_CHAT = stored(
    "api/bob", "disk", tenant_id="acme", scope="user", subject_id=BOB, token_offset=16
)
OTHER_TENANT = stored(
    "api/globex", "device", tenant_id="globex", scope="tenant", auth_scopes=[("*", 0)]
)

METRICS_TOKEN = "coordinator-api-test-metrics-token"


def _consumed(envelope) -> ConsumedEvent:
    return ConsumedEvent(
        topic=KV_EVENTS,
        partition=0,
        offset=0,
        key=envelope.payload.node_id,
        timestamp_ms=int(time.time() * 1000),
        envelope=envelope,
    )


def _at(envelope, occurred_at: datetime):
    return envelope.model_copy(update={"occurred_at": occurred_at})


@pytest.fixture(scope="module")
async def settings(database_url: str, ledger_template: str) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(
            url, ledger={"heartbeat_timeout_s": 30}, metrics={"token": METRICS_TOKEN}
        )


@pytest.fixture(scope="module")
async def seeded(settings: CoordinatorSettings) -> None:
    """node-a (alive): public + handbook on device, alice on host, removed handbook, snapshot of alice.
    node-b (silent for an hour): bob on disk, globex on device."""
    database = Database(settings.database)
    ingest = LedgerIngest(database, inventory_retry_s=60, command_signer=settings.command_signer())
    now = datetime.now(UTC)
    a = [
        make_event(NodeStarted(node_id="node-a", epoch=1, seq=0, namespace="ns-test")),
        make_event(
            BlockStored(node_id="node-a", epoch=1, seq=1, blocks=[PUBLIC, HANDBOOK, ALICE_CHAT])
        ),
        make_event(
            BlockRemoved(
                node_id="node-a",
                epoch=1,
                seq=2,
                reason="evicted",
                blocks=[RemovedBlock(block_hash=HANDBOOK.block_hash, tier="device")],
            )
        ),
        make_event(
            SnapshotWritten(
                node_id="node-a",
                epoch=1,
                seq=3,
                snapshot_id="s1",
                block_hashes=[ALICE_CHAT.block_hash],
            )
        ),
        make_event(NodeHeartbeat(node_id="node-a", epoch=1, seq=3)),
    ]
    hour_ago = now - timedelta(hours=1)
    b = [
        _at(
            make_event(NodeStarted(node_id="node-b", epoch=1, seq=0, namespace="ns-test")), hour_ago
        ),
        _at(
            make_event(
                BlockStored(node_id="node-b", epoch=1, seq=1, blocks=[BOB_CHAT, OTHER_TENANT])
            ),
            hour_ago,
        ),
    ]
    try:
        await ingest([_consumed(e) for e in a + b])
    finally:
        await database.dispose()


@pytest.fixture(scope="module")
async def client(settings: CoordinatorSettings, seeded) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        yield client


def token(*roles: str, tenant: str = "acme", now: float | None = None) -> dict[str, str]:
    """An operator token (the tests' operator issuer) with ``roles``, bound to ``tenant``."""
    signed = issue_token(
        tenant=tenant,
        sub="operator-1",
        roles=roles,
        private_key_pem=OPERATOR_PRIVATE_KEY_PEM,
        now=now,
    )
    return {"Authorization": f"Bearer {signed}"}


def assert_error(response: httpx.Response, status: int, error_type: str, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (error_type, code)


async def test_ledger_requires_a_reader_role(client: httpx.AsyncClient) -> None:
    assert_error(
        await client.get("/v1/ledger/blocks"), 401, "authentication_error", "missing_token"
    )
    assert_error(
        await client.get("/v1/ledger/blocks", headers={"Authorization": "Basic abc"}),
        401,
        "authentication_error",
        "invalid_token",
    )
    # The end users' secret signs no operator token, whatever roles it claims.
    end_user = issue_token(tenant="acme", sub="op", roles=["platform-admin"], secret=JWT_SECRET)
    assert_error(
        await client.get("/v1/ledger/blocks", headers={"Authorization": f"Bearer {end_user}"}),
        401,
        "authentication_error",
        "invalid_token",
    )
    assert_error(
        await client.get(
            "/v1/ledger/blocks", headers=token("platform-admin", now=time.time() - 7200)
        ),
        401,
        "authentication_error",
        "token_expired",
    )
    assert_error(
        await client.get("/v1/nodes", headers=token()), 403, "permission_error", "insufficient_role"
    )
    assert_error(
        await client.get("/v1/ledger/blocks", headers=token("user")),
        403,
        "permission_error",
        "insufficient_role",
    )
    assert_error(
        await client.get("/v1/ledger/blocks", headers=token("admin")),
        403,
        "permission_error",
        "insufficient_role",
    )
    for role in ("tenant-admin", "privacy-officer", "auditor"):
        assert (await client.get("/v1/ledger/blocks", headers=token(role))).status_code == 200
        assert_error(
            await client.get("/v1/nodes", headers=token(role)),
            403,
            "permission_error",
            "insufficient_role",
        )
    assert (
        await client.get("/v1/ledger/blocks", headers=token("platform-admin"))
    ).status_code == 200
    assert (await client.get("/v1/nodes", headers=token("platform-admin"))).status_code == 200


async def _hashes(client: httpx.AsyncClient, **params) -> set[str]:
    response = await client.get("/v1/ledger/blocks", params=params, headers=token("platform-admin"))
    assert response.status_code == 200, response.text
    return {block["block_hash"] for block in response.json()["blocks"]}


async def test_filters(client: httpx.AsyncClient) -> None:
    # Default: blocks with a live copy only (the handbook was evicted everywhere).
    assert await _hashes(client) == {
        b.block_hash for b in (PUBLIC, ALICE_CHAT, BOB_CHAT, OTHER_TENANT)
    }
    assert await _hashes(client, include_deleted="true") == {
        b.block_hash for b in (PUBLIC, HANDBOOK, ALICE_CHAT, BOB_CHAT, OTHER_TENANT)
    }
    assert await _hashes(client, tenant="acme") == {ALICE_CHAT.block_hash, BOB_CHAT.block_hash}
    assert await _hashes(client, tenant="acme", doc_id="handbook") == {ALICE_CHAT.block_hash}
    assert await _hashes(client, tenant="acme", doc_id="handbook", include_deleted="true") == {
        HANDBOOK.block_hash,
        ALICE_CHAT.block_hash,
    }
    assert await _hashes(client, tenant="acme", subject="alice") == {ALICE_CHAT.block_hash}
    assert await _hashes(client, tenant="acme", subject="bob") == {BOB_CHAT.block_hash}
    assert await _hashes(client, tenant="globex", subject="alice") == set()
    assert await _hashes(client, node="node-b") == {BOB_CHAT.block_hash, OTHER_TENANT.block_hash}
    assert await _hashes(client, tier="snapshot") == {ALICE_CHAT.block_hash}
    assert await _hashes(client, node="node-a", tier="device") == {PUBLIC.block_hash}
    assert await _hashes(client, node="node-a", tier="device", include_deleted="true") == {
        PUBLIC.block_hash,
        HANDBOOK.block_hash,
    }


async def test_block_shape_and_paging(client: httpx.AsyncClient) -> None:
    response = await client.get(
        "/v1/ledger/blocks",
        params={"tenant": "acme", "subject": "alice"},
        headers=token("privacy-officer"),
    )
    (block,) = response.json()["blocks"]
    assert block == {
        "block_hash": ALICE_CHAT.block_hash,
        "parent_hash": HANDBOOK.block_hash,
        "namespace": "ns-test",
        "tenant_id": "acme",
        "scope": "user",
        "subject_hash": ALICE,
        "token_offset": 32,
        "created_at": ALICE_CHAT.created_at.isoformat(),
        "auth_scopes": [{"auth_scope": "hr", "policy_version": 2}],
        "documents": [{"doc_id": "handbook", "version": 3}],
        "placements": [
            {
                "node_id": "node-a",
                "tier": "host",
                "snapshot_id": None,
                "state": "live",
                "epoch": 1,
                "reason": None,
                "updated_at": block["placements"][0]["updated_at"],
                "replica_of": None,
            },
            {
                "node_id": "node-a",
                "tier": "snapshot",
                "snapshot_id": "s1",
                "state": "live",
                "epoch": 1,
                "reason": None,
                "updated_at": block["placements"][1]["updated_at"],
                "replica_of": None,
            },
        ],
    }
    assert "alice" not in response.text

    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"after": cursor} if cursor else {})}
        page = (
            await client.get("/v1/ledger/blocks", params=params, headers=token("platform-admin"))
        ).json()
        seen += [b["block_hash"] for b in page["blocks"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(await _hashes(client))


async def test_bad_parameters(client: httpx.AsyncClient) -> None:
    headers = token("platform-admin")
    assert_error(
        await client.get("/v1/ledger/blocks", params={"subject": "alice"}, headers=headers),
        400,
        "invalid_request_error",
        "tenant_required",
    )
    for params in (
        {"tier": "ssd"},
        {"limit": 0},
        {"limit": 5000},
        {"after": "xyz"},
        {"after": "abc"},
    ):
        assert_error(
            await client.get("/v1/ledger/blocks", params=params, headers=headers),
            400,
            "invalid_request_error",
            "invalid_parameter",
        )


async def test_nodes_liveness(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/nodes", headers=token("platform-admin"))
    nodes = {
        node["node_id"]: node
        for node in response.json()["nodes"]
        if node["node_id"] in ("node-a", "node-b")
    }
    assert nodes["node-a"]["alive"] is True and nodes["node-a"]["last_heartbeat"] is not None
    assert nodes["node-b"]["alive"] is False and nodes["node-b"]["last_seen_age_s"] > 3000
    assert nodes["node-a"]["num_live_placements"] == {
        "device": 1,
        "host": 1,
        "disk": 0,
        "snapshot": 1,
    }
    assert nodes["node-b"]["num_live_placements"] == {
        "device": 1,
        "host": 0,
        "disk": 1,
        "snapshot": 0,
    }
    assert {n["status"] for n in nodes.values()} == {"active"}


async def test_metrics_need_the_metrics_token(client: httpx.AsyncClient) -> None:
    """Ledger gauges span every tenant: an operator's JWT, even a platform admin's, is not the
    scraper's token."""
    for headers in ({}, token("admin"), {"Authorization": f"Bearer {METRICS_TOKEN}x"}):
        response = await client.get("/metrics", headers=headers)
        assert response.status_code == 401
        assert response.json() == {
            "error": {
                "message": "this route needs the metrics bearer token",
                "type": "authentication_error",
                "code": "invalid_metrics_token",
            }
        }


async def test_metrics_are_disabled_without_a_metrics_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVLEDGER_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("KVLEDGER_COORDINATOR_METRICS__TOKEN", raising=False)
    settings = coordinator_settings()
    assert settings.metrics.token is None
    transport = httpx.ASGITransport(app=create_app(settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        for headers in ({}, token("platform-admin")):
            response = await client.get("/metrics", headers=headers)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "metrics_disabled"


async def test_open_endpoints(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["revision"] == migrate.head_revision()
    scrape = await client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert scrape.status_code == 200
    for name in (
        "kvledger_ledger_events_total",
        "kvledger_ledger_batch_size",
        "kvledger_ledger_ingest_lag_seconds",
        "kvledger_outbox_pending",
        'kvledger_ledger_nodes{liveness="alive"}',
    ):
        assert name in scrape.text


async def test_metrics_report_stale_nodes_and_open_erasures_from_the_ledger(
    client: httpx.AsyncClient,
) -> None:
    """The cluster-wide gauges come from the ledger on each scrape; responses echo the caller's request id."""
    requested = await client.post(
        "/v1/erasures",
        json={"tenant_id": "metrics-tenant", "subject_id": "erin", "reason": "metrics test"},
        headers=token("privacy-officer", tenant="metrics-tenant")
        | {"X-Request-Id": "scrape-test-1"},
    )
    assert requested.status_code == 202, requested.text
    assert requested.headers["x-request-id"] == "scrape-test-1"
    scrape = await client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    samples = {
        (family.name, sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[
            (
                name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count"),
                name,
                tuple(sorted(labels.items())),
            )
        ]

    assert value("kvledger_ledger_nodes", liveness="stale") == 1  # node-b: silent for an hour
    assert value("kvledger_ledger_nodes", liveness="alive") == 1
    assert value("kvledger_ledger_erasures_unverified", status="pending", age="lt_5m") == 1
    for age in ("lt_1h", "lt_24h", "ge_24h"):
        assert value("kvledger_ledger_erasures_unverified", status="pending", age=age) == 0
    assert 0 <= value("kvledger_ledger_oldest_unverified_erasure_age_seconds") < 300
    assert value("kvledger_ledger_invalidations_open", status="pending") >= 1
    assert 0 <= value("kvledger_ledger_oldest_open_invalidation_age_seconds") < 300
    # node-b's events were an hour old when ingested: they are in the ingest-lag histogram's +Inf
    # bucket only.
    assert (
        value("kvledger_ledger_ingest_lag_seconds_bucket", le="+Inf")
        - value("kvledger_ledger_ingest_lag_seconds_bucket", le="900.0")
        >= 2
    )
    assert (
        value(
            "kvledger_http_request_seconds_count", method="POST", route="/v1/erasures", status="202"
        )
        >= 1
    )


async def test_readyz_is_false_until_migrated(database_url: str) -> None:
    async with fresh_database(database_url) as url:
        settings = coordinator_settings(url)
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://c") as client,
        ):
            response = await client.get("/readyz")
            assert response.status_code == 503 and response.json()["status"] == "not_ready"
            await asyncio.to_thread(migrate.upgrade, url)
            assert (await client.get("/readyz")).status_code == 200


async def test_subjects_never_reach_the_logs(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    params = {"tenant": "acme", "subject": "carol-7f3a"}
    assert (
        await client.get("/v1/ledger/blocks", params=params, headers=token("auditor"))
    ).status_code == 200
    assert (
        await client.get(
            "/v1/ledger/blocks", params={**params, "limit": -1}, headers=token("auditor")
        )
    ).status_code == 400
    # Server-side records only: the test's own HTTP client (httpx) logs the URL it requested.
    server_logs = "\n".join(
        r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))
    )
    assert "GET /v1/ledger/blocks 200" in server_logs  # the access log is there…
    assert "carol-7f3a" not in server_logs  # …without the query string
