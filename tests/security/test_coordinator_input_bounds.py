"""Every identifier an operator or a node sends to the coordinator's HTTP API obeys the contract's
bounds.

A NUL byte, a control character or an over-long identifier in a query, path or body
parameter is a 400 ``invalid_parameter`` in the error shape — never a database error
(500) and never a row. Real Postgres (a fresh, migrated ledger), the real coordinator
app over HTTP, operator tokens of the tests' operator issuer and a real enrolled node
credential for the key service.
"""

from __future__ import annotations

import base64
import os
import urllib.parse
from collections.abc import AsyncIterator

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import coordinator_settings, operator_headers
from sqlalchemy import func, select

from coordinator.api.app import create_app
from coordinator.keys.data_keys import DataKey
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation, Namespace
from coordinator.settings import DatabaseSettings
from identity.node_credentials import issue_node_credential
from kvledger.nodes import enroll_node_key

HOSTILE = {
    "NUL": "a\x00b",
    "newline": "a\nb",
    "DEL": "a\x7fb",
    "C1": "a\x9bb",
    "257 characters": "x" * 257,
}


@pytest.fixture(scope="module")
async def client(ledger_url: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = coordinator_settings(
        ledger_url, keys={"master_key": base64.b64encode(os.urandom(32)).decode()}
    )
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        yield client


async def row_counts(ledger_url: str) -> tuple[int, int, int]:
    database = Database(DatabaseSettings(url=ledger_url))
    try:
        async with database.session() as session:
            return tuple(
                [
                    await session.scalar(select(func.count()).select_from(model))
                    for model in (Namespace, Invalidation, DataKey)
                ]
            )
    finally:
        await database.dispose()


def assert_invalid(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "code"}
    assert response.json()["error"]["code"] == "invalid_parameter"


@pytest.mark.parametrize("bad", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("parameter", ["tenant", "doc_id", "subject", "node"])
async def test_a_hostile_ledger_filter_is_400(
    client: httpx.AsyncClient, parameter: str, bad: str
) -> None:
    params = {"tenant": "acme", parameter: bad}
    response = await client.get(
        "/v1/ledger/blocks", params=params, headers=operator_headers("platform-admin", "platform")
    )
    assert_invalid(response)


@pytest.mark.parametrize("bad", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_invalidation_filter_is_400(client: httpx.AsyncClient, bad: str) -> None:
    response = await client.get(
        "/v1/invalidations",
        params={"tenant": bad},
        headers=operator_headers("platform-admin", "platform"),
    )
    assert_invalid(response)


@pytest.mark.parametrize("bad", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_namespace_is_400_and_retires_nothing(
    client: httpx.AsyncClient, ledger_url: str, bad: str
) -> None:
    before = await row_counts(ledger_url)
    path = f"/v1/namespaces/{urllib.parse.quote(bad, safe='')}/retire"
    response = await client.post(path, headers=operator_headers("platform-admin", "platform"))
    assert_invalid(response)
    assert await row_counts(ledger_url) == before


@pytest.mark.parametrize("bad", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_tenant_at_the_key_service_is_400_and_creates_no_key(
    client: httpx.AsyncClient, ledger_url: str, bad: str
) -> None:
    key = Ed25519PrivateKey.generate()
    await enroll_node_key(ledger_url, "bounds-node", key.public_key())
    headers = {"Authorization": f"Bearer {issue_node_credential(key, 'bounds-node')}"}
    before = await row_counts(ledger_url)
    assert_invalid(await client.post("/v1/keys/resolve", json={"tenant_id": bad}, headers=headers))
    assert await row_counts(ledger_url) == before
    # Positive control: the same credential and a valid tenant get a key.
    assert (
        await client.post("/v1/keys/resolve", json={"tenant_id": "acme"}, headers=headers)
    ).status_code == 200
