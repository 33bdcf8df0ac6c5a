"""Operators act only inside the tenant of their token; ``platform-admin`` on every tenant.

Attacks from tenant B's operators on tenant A, against the real coordinator API over a
real, migrated Postgres with the coordinator's consumers running (receipts are issued by
them): erasing A's subject, reading A's ledger, erasures, receipts, proofs and
invalidations, and probing whether an id or a subject exists in A. Every such request
gets the same 403 ``tenant_forbidden`` that a made-up id gets, so the answers are no
oracle. Same-tenant operators and the platform admin are the positive controls.
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from helpers.ledger import (
    SUBJECT_KEY,
    RunningConsumers,
    coordinator_settings,
    eventually,
    fresh_database,
    operator_headers,
    sign_command,
    stored,
)
from sqlalchemy import func, select

from coordinator.handlers.decisions import decide
from coordinator.handlers.ingest import LedgerIngest
from coordinator.ledger.db import Database
from coordinator.ledger.models import Erasure
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from coordinator.settings import CoordinatorSettings
from events.kafka.consumer import ConsumedEvent
from events.schema import (
    BlockStored,
    DocumentPredicate,
    NamespacePredicate,
    NodeStarted,
    make_event,
    subject_digest,
)
from events.topics import KV_EVENTS

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
TENANT_ROLES = ("tenant-admin", "privacy-officer", "auditor")
FORBIDDEN = {
    "error": {
        "message": "operators act only inside the tenant of their token",
        "type": "permission_error",
        "code": "tenant_forbidden",
    }
}

ALICE_A = stored(
    "tenancy/alice-a",
    "device",
    namespace="ns-live",
    tenant_id=TENANT_A,
    scope="user",
    subject_id=subject_digest(SUBJECT_KEY.encode(), TENANT_A, "alice"),
)
BOB_B = stored(
    "tenancy/bob-b",
    "device",
    namespace="ns-live",
    tenant_id=TENANT_B,
    scope="user",
    subject_id=subject_digest(SUBJECT_KEY.encode(), TENANT_B, "bob"),
)


@pytest.fixture(scope="module")
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        yield coordinator_settings(
            url,
            kafka_bootstrap,
            ledger={"erasure_verify_interval_s": 0.2},
            keys={"master_key": base64.b64encode(os.urandom(32)).decode()},
        )


def _consumed(envelope) -> ConsumedEvent:
    return ConsumedEvent(
        topic=KV_EVENTS,
        partition=0,
        offset=0,
        key=envelope.payload.node_id,
        timestamp_ms=int(time.time() * 1000),
        envelope=envelope,
    )


async def _decide(database: Database, predicate) -> str:
    async with database.session() as session, session.begin():
        now = await begin_ledger_transaction(session)
        await lock_decisions(session)
        decision = await decide(
            session, predicate, now=now, trigger="api", requested_at=now, signer=sign_command
        )
    return str(decision.command_id)


@pytest.fixture(scope="module")
async def world(
    settings: CoordinatorSettings, database: Database, client: httpx.AsyncClient
) -> AsyncIterator[dict]:
    """Tenant A's verified erasure (with receipt) and invalidation, a namespace-wide invalidation;
    then a node holding a user block of A and one of B, and a stale node on a namespace to retire."""
    consumers = await RunningConsumers(settings).start()
    try:
        # With no node registered yet, A's erasure completes at once and gets its receipt.
        started = await client.post(
            "/v1/erasures",
            json={"tenant_id": TENANT_A, "subject_id": "carol", "reason": "GDPR art. 17 request"},
            headers=operator_headers("privacy-officer", TENANT_A),
        )
        assert started.status_code == 202, started.text
        erasure_id = started.json()["id"]
        admin = operator_headers("platform-admin", "platform")

        async def verified() -> bool:
            return (await client.get(f"/v1/erasures/{erasure_id}", headers=admin)).json()[
                "status"
            ] == "verified"

        await eventually(verified, what="tenant A's erasure to be verified")
        receipt_id = (await client.get(f"/v1/erasures/{erasure_id}", headers=admin)).json()[
            "receipt_id"
        ]
        invalidation_id = await _decide(
            database, DocumentPredicate(tenant=TENANT_A, doc_id="handbook", below_version=2)
        )
        namespace_invalidation_id = await _decide(database, NamespacePredicate(ns="ns-gone"))

        hour_ago = datetime.now(UTC) - timedelta(hours=1)
        await LedgerIngest(database, inventory_retry_s=60, command_signer=sign_command)(
            [
                _consumed(
                    make_event(
                        NodeStarted(node_id="node-live", epoch=1, seq=0, namespace="ns-live")
                    )
                ),
                _consumed(
                    make_event(
                        BlockStored(node_id="node-live", epoch=1, seq=1, blocks=[ALICE_A, BOB_B])
                    )
                ),
                _consumed(
                    make_event(
                        NodeStarted(node_id="node-stale", epoch=1, seq=0, namespace="ns-old")
                    ).model_copy(update={"occurred_at": hour_ago})
                ),
            ]
        )
        yield {
            "erasure": erasure_id,
            "receipt": receipt_id,
            "invalidation": invalidation_id,
            "namespace_invalidation": namespace_invalidation_id,
        }
    finally:
        await consumers.stop()


def _paths(world: dict, *, missing: bool = False) -> list[str]:
    """The per-id read endpoints, for tenant A's ids (or made-up ones)."""
    erasure = uuid.uuid4() if missing else world["erasure"]
    receipt = uuid.uuid4() if missing else world["receipt"]
    invalidation = uuid.uuid4() if missing else world["invalidation"]
    return [
        f"/v1/erasures/{erasure}",
        f"/v1/erasures/{erasure}/receipt",
        f"/v1/audit/proof/{receipt}",
        f"/v1/invalidations/{invalidation}",
    ]


async def _erasures_of(database: Database, tenant: str) -> int:
    async with database.session() as session:
        return await session.scalar(
            select(func.count()).select_from(Erasure).where(Erasure.tenant_id == tenant)
        )


async def test_privacy_officer_of_b_cannot_erase_a_subject_of_a(world, client, database) -> None:
    before = await _erasures_of(database, TENANT_A)
    for subject in ("alice", "nobody-of-that-name"):
        response = await client.post(
            "/v1/erasures",
            json={"tenant_id": TENANT_A, "subject_id": subject, "reason": "hostile"},
            headers={
                **operator_headers("privacy-officer", TENANT_B),
                "Idempotency-Key": f"attack-{subject}",
            },
        )
        assert (response.status_code, response.json()) == (403, FORBIDDEN)
    assert await _erasures_of(database, TENANT_A) == before
    # A tenant-admin or auditor of A may not order an erasure even in A.
    for role in ("tenant-admin", "auditor"):
        response = await client.post(
            "/v1/erasures",
            json={"tenant_id": TENANT_A, "subject_id": "alice", "reason": "not my job"},
            headers=operator_headers(role, TENANT_A),
        )
        assert (response.status_code, response.json()["error"]["code"]) == (
            403,
            "insufficient_role",
        )
    assert await _erasures_of(database, TENANT_A) == before


@pytest.mark.parametrize("role", TENANT_ROLES)
async def test_operators_of_b_read_nothing_of_a_and_learn_nothing_from_ids(
    world, client, role
) -> None:
    headers = operator_headers(role, TENANT_B)
    for existing, made_up in zip(_paths(world), _paths(world, missing=True), strict=True):
        real = await client.get(existing, headers=headers)
        fake = await client.get(made_up, headers=headers)
        assert (real.status_code, real.json()) == (403, FORBIDDEN), existing
        assert (fake.status_code, fake.json()) == (403, FORBIDDEN), made_up
        assert real.headers.get("content-length") == fake.headers.get("content-length")
    # A namespace-wide command belongs to no tenant: platform-admin only.
    namespace_wide = await client.get(
        f"/v1/invalidations/{world['namespace_invalidation']}", headers=headers
    )
    assert (namespace_wide.status_code, namespace_wide.json()) == (403, FORBIDDEN)


@pytest.mark.parametrize("role", TENANT_ROLES)
async def test_no_subject_id_oracle_across_tenants(world, client, role) -> None:
    headers = operator_headers(role, TENANT_B)
    for subject in ("alice", "nobody-of-that-name"):
        response = await client.get(
            "/v1/ledger/blocks", params={"tenant": TENANT_A, "subject": subject}, headers=headers
        )
        assert (response.status_code, response.json()) == (403, FORBIDDEN)
    for params in (
        {"tenant": TENANT_A},
        {"tenant": TENANT_A, "doc_id": "handbook", "include_deleted": "true"},
    ):
        response = await client.get("/v1/ledger/blocks", params=params, headers=headers)
        assert (response.status_code, response.json()) == (403, FORBIDDEN)
    listing = await client.get("/v1/invalidations", params={"tenant": TENANT_A}, headers=headers)
    assert (listing.status_code, listing.json()) == (403, FORBIDDEN)
    # Without a tenant filter an operator of B sees B only.
    own = await client.get("/v1/ledger/blocks", headers=headers)
    assert [block["block_hash"] for block in own.json()["blocks"]] == [BOB_B.block_hash]
    own_subject = await client.get("/v1/ledger/blocks", params={"subject": "bob"}, headers=headers)
    assert [block["block_hash"] for block in own_subject.json()["blocks"]] == [BOB_B.block_hash]
    assert (await client.get("/v1/invalidations", headers=headers)).json()["invalidations"] == []


async def test_tenant_operators_cannot_retire_namespaces_or_list_nodes(world, client) -> None:
    for role in TENANT_ROLES:
        headers = operator_headers(role, TENANT_A)
        for method, path in (
            ("POST", "/v1/namespaces/ns-old/retire"),
            ("GET", "/v1/nodes"),
            ("GET", "/v1/namespaces"),
        ):
            response = await client.request(method, path, headers=headers)
            assert (response.status_code, response.json()["error"]["code"]) == (
                403,
                "insufficient_role",
            ), (role, path)
    admin = operator_headers("platform-admin", "platform")
    nodes = await client.get("/v1/nodes", headers=admin)
    assert {node["node_id"] for node in nodes.json()["nodes"]} == {"node-live", "node-stale"}
    retired = await client.post("/v1/namespaces/ns-old/retire", headers=admin)
    assert retired.status_code == 202, retired.text
    assert retired.json()["status"] == "draining"
    in_use = await client.post("/v1/namespaces/ns-live/retire", headers=admin)
    assert (in_use.status_code, in_use.json()["error"]["code"]) == (409, "namespace_in_use")


@pytest.mark.parametrize("role", TENANT_ROLES)
async def test_same_tenant_operators_read_their_tenant(world, client, role) -> None:
    headers = operator_headers(role, TENANT_A)
    erasure = await client.get(f"/v1/erasures/{world['erasure']}", headers=headers)
    assert erasure.status_code == 200 and erasure.json()["tenant_id"] == TENANT_A
    receipt = await client.get(f"/v1/erasures/{world['erasure']}/receipt", headers=headers)
    proof = await client.get(f"/v1/audit/proof/{world['receipt']}", headers=headers)
    assert receipt.status_code == 200 and proof.json() == receipt.json()
    invalidation = await client.get(f"/v1/invalidations/{world['invalidation']}", headers=headers)
    assert (
        invalidation.status_code == 200 and invalidation.json()["predicate"]["tenant"] == TENANT_A
    )
    listed = await client.get("/v1/invalidations", headers=headers)
    assert {item["command_id"] for item in listed.json()["invalidations"]} >= {
        world["invalidation"]
    }
    assert {item["predicate"].get("tenant") for item in listed.json()["invalidations"]} == {
        TENANT_A
    }
    blocks = await client.get(
        "/v1/ledger/blocks", params={"tenant": TENANT_A, "subject": "alice"}, headers=headers
    )
    assert [block["block_hash"] for block in blocks.json()["blocks"]] == [ALICE_A.block_hash]
    # An id that does not exist is the same 403 inside the own tenant: no id oracle at all.
    for path in _paths(world, missing=True):
        response = await client.get(path, headers=headers)
        assert (response.status_code, response.json()) == (403, FORBIDDEN)


async def test_platform_admin_sees_every_tenant_and_gets_404_for_missing_ids(world, client) -> None:
    admin = operator_headers("platform-admin", "platform")
    for path in _paths(world):
        assert (await client.get(path, headers=admin)).status_code == 200, path
    assert (
        await client.get(f"/v1/invalidations/{world['namespace_invalidation']}", headers=admin)
    ).status_code == 200
    codes = []
    for path in _paths(world, missing=True):
        response = await client.get(path, headers=admin)
        assert response.status_code == 404, path
        codes.append(response.json()["error"]["code"])
    assert codes == [
        "erasure_not_found",
        "erasure_not_found",
        "receipt_not_found",
        "invalidation_not_found",
    ]
    everything = await client.get("/v1/ledger/blocks", headers=admin)
    assert {block["block_hash"] for block in everything.json()["blocks"]} == {
        ALICE_A.block_hash,
        BOB_B.block_hash,
    }
    erased = await client.post(
        "/v1/erasures",
        json={"tenant_id": TENANT_B, "subject_id": "dave", "reason": "platform request"},
        headers=admin,
    )
    assert erased.status_code == 202, erased.text
