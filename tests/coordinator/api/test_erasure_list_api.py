"""``GET /v1/erasures`` (the list the console shows) and ``GET /v1/invalidations?doc_id=``: tenancy,
order, paging, bad input.

Real Postgres (a database of this module) and the coordinator's app over ASGI; erasures are
started through ``POST /v1/erasures`` (no node is needed to list them).
"""

from __future__ import annotations

import base64

import httpx
import pytest
from helpers.ledger import coordinator_settings, operator_headers

from coordinator.settings import CoordinatorSettings

TENANT_A, TENANT_B = "list-acme", "list-globex"


@pytest.fixture(scope="module")
def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return coordinator_settings(
        ledger_url, kafka_bootstrap, keys={"master_key": base64.b64encode(b"l" * 32).decode()}
    )


async def _erase(client: httpx.AsyncClient, tenant: str, subject: str) -> str:
    response = await client.post(
        "/v1/erasures",
        json={"tenant_id": tenant, "subject_id": subject, "reason": "gdpr-art17"},
        headers=operator_headers("privacy-officer", tenant),
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


async def test_erasures_are_listed_newest_first_per_tenant_and_paged(
    client: httpx.AsyncClient,
) -> None:
    mine = [await _erase(client, TENANT_A, f"subject-{n}") for n in range(3)]
    theirs = await _erase(client, TENANT_B, "subject-b")
    auditor = operator_headers("auditor", TENANT_A)

    listed = (await client.get("/v1/erasures", headers=auditor)).json()
    assert [item["id"] for item in listed["erasures"]] == mine[::-1]
    assert {item["tenant_id"] for item in listed["erasures"]} == {TENANT_A}
    assert set(listed["erasures"][0]) == {
        "id",
        "tenant_id",
        "reason",
        "status",
        "requested_at",
        "verified_at",
        "receipt_id",
    }
    assert listed["next_cursor"] is None

    first = (await client.get("/v1/erasures", params={"limit": 2}, headers=auditor)).json()
    assert [item["id"] for item in first["erasures"]] == mine[:0:-1]
    second = (
        await client.get(
            "/v1/erasures", params={"limit": 2, "before": first["next_cursor"]}, headers=auditor
        )
    ).json()
    assert ([item["id"] for item in second["erasures"]], second["next_cursor"]) == ([mine[0]], None)

    admin = (
        await client.get("/v1/erasures", headers=operator_headers("platform-admin", "platform"))
    ).json()
    assert [item["id"] for item in admin["erasures"]] == [theirs, *mine[::-1]]
    only_b = (
        await client.get(
            "/v1/erasures",
            params={"tenant": TENANT_B},
            headers=operator_headers("platform-admin", "platform"),
        )
    ).json()
    assert [item["id"] for item in only_b["erasures"]] == [theirs]
    (status,) = {item["status"] for item in listed["erasures"]}
    same = (await client.get("/v1/erasures", params={"status": status}, headers=auditor)).json()
    assert [item["id"] for item in same["erasures"]] == mine[::-1]
    other_status = "failed" if status != "failed" else "verified"
    assert (
        await client.get("/v1/erasures", params={"status": other_status}, headers=auditor)
    ).json()["erasures"] == []


async def test_erasure_list_refuses_other_tenants_and_bad_input(client: httpx.AsyncClient) -> None:
    other = await client.get(
        "/v1/erasures", params={"tenant": TENANT_A}, headers=operator_headers("auditor", TENANT_B)
    )
    assert (other.status_code, other.json()["error"]["code"]) == (403, "tenant_forbidden")
    assert (await client.get("/v1/erasures")).status_code == 401
    for params in (
        {"before": "yesterday"},
        {"before": "2026-01-01T00:00:00+00:00~not-a-uuid"},
        {"limit": 0},
        {"status": "gone"},
    ):
        refused = await client.get(
            "/v1/erasures", params=params, headers=operator_headers("auditor", TENANT_A)
        )
        assert (
            refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_parameter"
        ), params


async def test_invalidations_filter_by_document(client: httpx.AsyncClient) -> None:
    """The erasures above decided subject invalidations only: a document filter matches none of
    them."""
    auditor = operator_headers("auditor", TENANT_A)
    every = (await client.get("/v1/invalidations", headers=auditor)).json()["invalidations"]
    assert len(every) == 3 and {item["kind"] for item in every} == {"subject"}
    assert (
        await client.get("/v1/invalidations", params={"doc_id": "handbook"}, headers=auditor)
    ).json()["invalidations"] == []
