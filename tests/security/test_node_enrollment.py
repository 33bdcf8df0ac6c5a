"""Only an enrolled, unrevoked node key opens the key service; the enrollment CLI works end to end.

Real Postgres (a fresh, migrated ledger for this module), the real coordinator app over
HTTP (httpx against its ASGI app, lifespan included) and the real ``kvledger nodes`` CLI
as subprocesses.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.fork_server import ForkServer
from helpers.ledger import (
    JWT_SECRET,
    NODE_KEY_CACHE_S,
    coordinator_settings,
    eventually,
    operator_token,
)

from coordinator.api.app import create_app
from identity.node_credentials import issue_node_credential
from identity.signing import key_id, load_or_create_private_key
from identity.tokens import issue_token
from kvledger.nodes import enroll_node_key, revoke_node_keys

MASTER_KEY = base64.b64encode(os.urandom(32)).decode()


@pytest.fixture(scope="module")
async def client(ledger_url: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = coordinator_settings(ledger_url, keys={"master_key": MASTER_KEY})
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        yield client


async def resolve(client: httpx.AsyncClient, token: str) -> tuple[int, str | None]:
    """Status and error code (None on success) of a key resolve with ``token``."""
    response = await client.post(
        "/v1/keys/resolve", json={"tenant_id": "acme"}, headers={"Authorization": f"Bearer {token}"}
    )
    if response.status_code == 200:
        assert set(response.json()) == {"key_id", "key"}
        return 200, None
    body = response.json()["error"]
    assert set(body) == {"message", "type", "code"}
    if response.status_code == 401:
        assert body["type"] == "authentication_error"
    return response.status_code, body["code"]


async def test_an_unenrolled_key_is_refused_and_an_enrolled_one_served(client, ledger_url):
    key = Ed25519PrivateKey.generate()
    assert await resolve(client, issue_node_credential(key, "node-enroll")) == (
        401,
        "unknown_node_key",
    )
    await enroll_node_key(ledger_url, "node-enroll", key.public_key())
    assert await resolve(client, issue_node_credential(key, "node-enroll")) == (200, None)
    # The credential must name the node its key is enrolled for: the key cannot speak for another
    # node.
    assert await resolve(client, issue_node_credential(key, "node-other")) == (401, "invalid_token")


async def test_a_revoked_key_is_refused_within_the_documented_bound(client, ledger_url):
    key = Ed25519PrivateKey.generate()
    await enroll_node_key(ledger_url, "node-revoked", key.public_key())
    assert await resolve(client, issue_node_credential(key, "node-revoked")) == (
        200,
        None,
    )  # now cached
    assert await revoke_node_keys(ledger_url, "node-revoked", None) == [key_id(key.public_key())]
    revoked_at = time.monotonic()

    async def refused() -> bool:
        return await resolve(client, issue_node_credential(key, "node-revoked")) == (
            401,
            "unknown_node_key",
        )

    await eventually(refused, timeout_s=NODE_KEY_CACHE_S + 2, what="the revoked key to be refused")
    assert time.monotonic() - revoked_at <= NODE_KEY_CACHE_S + 2
    with pytest.raises(ValueError, match="revoked"):
        await enroll_node_key(ledger_url, "node-revoked", key.public_key())


async def test_end_user_and_operator_tokens_are_no_node_credentials(client, ledger_url):
    end_user = issue_token(
        tenant="acme", sub="node-enroll", roles=["node"], ttl_s=60, secret=JWT_SECRET
    )
    assert await resolve(client, end_user) == (401, "invalid_token")
    for role in ("platform-admin", "privacy-officer", "tenant-admin"):
        assert await resolve(client, operator_token(role, "acme")) == (401, "invalid_token")
    # Signed by an enrolled node key, but an end-user token's shape (no node issuer or key-service
    # audience).
    key = Ed25519PrivateKey.generate()
    await enroll_node_key(ledger_url, "node-shape", key.public_key())
    now = int(time.time())
    claims = {"sub": "node-shape", "tenant": "acme", "roles": ["node"], "iat": now, "exp": now + 30}
    wrong_purpose = jwt.encode(
        claims, key, algorithm="EdDSA", headers={"kid": key_id(key.public_key())}
    )
    assert await resolve(client, wrong_purpose) == (401, "invalid_token")
    assert await resolve(client, issue_node_credential(key, "node-shape")) == (
        200,
        None,
    )  # the same key, as a node
    response = await client.post("/v1/keys/resolve", json={"tenant_id": "acme"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_token"


def _cli(fork_server: ForkServer, work_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``kvledger ARGS`` as a process of its own, forked from the session's fork server."""
    return fork_server.run(list(args), dict(os.environ), work_dir, timeout_s=120)


async def test_the_enroll_and_revoke_cli_end_to_end(
    client, ledger_url, tmp_path: Path, fork_server: ForkServer
):
    data_dir = tmp_path / "node-cli"
    made = await asyncio.to_thread(
        _cli, fork_server, tmp_path / "cli", "nodes", "key", "--data-dir", str(data_dir)
    )
    assert made.returncode == 0, made.stderr
    key = load_or_create_private_key(data_dir / "node_key.pem")
    assert (data_dir / "node_key.pem").stat().st_mode & 0o777 == 0o600
    kid = key_id(key.public_key())
    assert kid in made.stderr and made.stdout.startswith("-----BEGIN PUBLIC KEY-----")
    public_file = tmp_path / "node-cli.pub"
    public_file.write_text(made.stdout)
    assert await resolve(client, issue_node_credential(key, "node-cli")) == (
        401,
        "unknown_node_key",
    )

    enrolled = await asyncio.to_thread(
        _cli,
        fork_server,
        tmp_path / "cli",
        "nodes",
        "enroll",
        "--node-id",
        "node-cli",
        "--public-key",
        str(public_file),
        "--database-url",
        ledger_url,
    )
    assert enrolled.returncode == 0, enrolled.stderr
    assert enrolled.stdout.strip() == f"enrolled key {kid} for node node-cli"
    assert await resolve(client, issue_node_credential(key, "node-cli")) == (200, None)
    taken = await asyncio.to_thread(
        _cli,
        fork_server,
        tmp_path / "cli",
        "nodes",
        "enroll",
        "--node-id",
        "node-thief",
        "--public-key",
        str(public_file),
        "--database-url",
        ledger_url,
    )
    assert taken.returncode == 2 and "enrolled for another node" in taken.stderr

    revoked = await asyncio.to_thread(
        _cli,
        fork_server,
        tmp_path / "cli",
        "nodes",
        "revoke",
        "--node-id",
        "node-cli",
        "--key-id",
        kid,
        "--database-url",
        ledger_url,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.strip() == f"revoked key {kid} of node node-cli"

    async def refused() -> bool:
        return await resolve(client, issue_node_credential(key, "node-cli")) == (
            401,
            "unknown_node_key",
        )

    await eventually(refused, timeout_s=NODE_KEY_CACHE_S + 2, what="the revoked key to be refused")
    again = await asyncio.to_thread(
        _cli,
        fork_server,
        tmp_path / "cli",
        "nodes",
        "revoke",
        "--node-id",
        "node-cli",
        "--database-url",
        ledger_url,
    )
    assert again.returncode == 1 and "no such live key" in again.stderr
    nowhere = await asyncio.to_thread(
        lambda: subprocess.run(
            [sys.executable, "-m", "kvledger.cli", "nodes", "revoke", "--node-id", "node-cli"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "KVLEDGER_DATABASE_URL"},
        )
    )
    assert nowhere.returncode == 2 and "no database" in nowhere.stderr
