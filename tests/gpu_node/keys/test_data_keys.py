"""Data keys held by the coordinator: get-or-create under concurrency, destruction, the HTTP API, and a node
pool that seals blocks with them — a user block on disk is crypto-erased once its subject's key is destroyed.

Real Postgres (fresh, migrated database for this module) and a real uvicorn coordinator on a loopback port,
so the node side goes through the same HTTP path a deployed node does.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import uvicorn
from helpers.ledger import (
    JWT_SECRET,
    SUBJECT_KEY,
    coordinator_settings,
    enroll_nodes,
    fresh_database,
    node_key,
)
from sqlalchemy import select

from coordinator.api.app import create_app
from coordinator.keys.data_keys import DataKey, KeyService, MasterKeyError
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorSettings
from events.schema import subject_digest
from events.tiers import Tier
from gpu_node.keys.crypto import LocalKeyStore, unseal
from gpu_node.keys.node_identity import NODE_KEY_FILE
from gpu_node.keys.remote_keys import CoordinatorKeyProvider, data_key_provider
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import BlockRestoreError, decode_block_record
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.vocabulary import PoolConfig
from gpu_node.settings import DataKeySettings, NodeSettings
from identity.node_credentials import issue_node_credential
from identity.settings import IssuerSettings
from identity.tokens import issue_token
from kvledger.net import loopback_listener
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

MASTER_KEY = os.urandom(32)
SUBJECT = SUBJECT_KEY.encode()
ALICE = subject_digest(SUBJECT, "acme", "alice")
BOB = subject_digest(SUBJECT, "acme", "bob")
SPEC = KVBlockSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
NO_TTL = {CacheScope.PUBLIC: None, CacheScope.TENANT: None, CacheScope.USER: None}

ISSUED_KEYS: list[bytes] = []
"""Every key material a test saw, for the no-keys-in-logs check at the end of the module."""


NODE_ID = "node-t"
"""The node these tests act as; its test key is enrolled in the module's ledger."""


def _node_token() -> str:
    return issue_node_credential(node_key(NODE_ID), NODE_ID)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {_node_token()}"}


@pytest.fixture(scope="module")
async def settings(database_url: str, ledger_template: str) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        await enroll_nodes(url, [NODE_ID])
        yield coordinator_settings(url, keys={"master_key": base64.b64encode(MASTER_KEY).decode()})


@pytest.fixture(scope="module")
def service(database: Database) -> KeyService:
    return KeyService(database, MASTER_KEY, SUBJECT)


@pytest.fixture(scope="module")
def coordinator_url(settings: CoordinatorSettings) -> Iterator[str]:
    """The real coordinator app under uvicorn on a free loopback port, in a thread with its own event loop."""
    sock = loopback_listener()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the coordinator exited during startup"
        assert time.monotonic() < deadline, "the coordinator did not start within 30 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture
def no_keys_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Capture everything, from every thread (the coordinator's too), and check no key ever reaches a log."""
    caplog.set_level(logging.DEBUG)
    yield
    # caplog.text would be the teardown phase's (empty) log here; the test ran in the "call" phase.
    text = "\n".join(
        record.getMessage() for record in caplog.get_records("setup") + caplog.get_records("call")
    )
    assert text, "no log records captured: the check would prove nothing"
    for key in ISSUED_KEYS:
        for encoded in (key.hex(), base64.b64encode(key).decode(), repr(key)):
            assert encoded not in text, "key material appeared in the logs"


async def _row(database: Database, key_id: str) -> DataKey:
    async with database.session() as session:
        return (await session.scalars(select(DataKey).where(DataKey.key_id == key_id))).one()


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_resolve_is_stable_and_concurrent_resolves_give_one_key(
    service: KeyService, database: Database
) -> None:
    carol = subject_digest(SUBJECT, "acme", "carol")
    user_keys = await asyncio.gather(*(service.resolve("acme", carol) for _ in range(8)))
    tenant_keys = await asyncio.gather(*(service.resolve("initech", None) for _ in range(8)))
    ISSUED_KEYS.extend(key for _, key in user_keys + tenant_keys)
    assert len(set(user_keys)) == 1 and len(set(tenant_keys)) == 1
    (carol_id, carol_key), (tenant_id, tenant_key) = user_keys[0], tenant_keys[0]
    assert len(carol_key) == 32 and carol_id != tenant_id
    assert await service.resolve("acme", carol) == (carol_id, carol_key)
    assert await service.get(carol_id) == carol_key
    assert await service.get(tenant_id) == tenant_key
    assert await service.get("0" * 32) is None
    assert service.subject_hash("acme", "carol") == carol

    async with database.session() as session:
        rows = (
            await session.scalars(select(DataKey).where(DataKey.tenant_id.in_(["acme", "initech"])))
        ).all()
    by_id = {row.key_id: row for row in rows}
    assert (
        set(by_id) >= {carol_id, tenant_id}
        and len([r for r in rows if r.tenant_id == "initech"]) == 1
    )
    assert by_id[tenant_id].scope == "tenant" and by_id[tenant_id].subject_hash is None
    assert by_id[carol_id].scope == "user" and by_id[carol_id].subject_hash == bytes.fromhex(carol)
    assert carol_key not in by_id[carol_id].wrapped_key, "keys are stored only wrapped"

    # Another subject and another tenant get their own keys; bad input is refused.
    (other_id, other_key) = await service.resolve("acme", subject_digest(SUBJECT, "acme", "dave"))
    ISSUED_KEYS.append(other_key)
    assert other_id not in (carol_id, tenant_id)
    with pytest.raises(ValueError):
        await service.resolve("acme", "alice")  # a raw subject id, not its digest
    with pytest.raises(ValueError):
        await service.resolve("", None)

    # A coordinator configured with another master key refuses to hand out what it cannot unwrap.
    with pytest.raises(MasterKeyError):
        await KeyService(database, os.urandom(32), SUBJECT).get(carol_id)


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_destroy_subject_zeroes_the_key_and_the_next_resolve_gets_a_new_one(
    service: KeyService, database: Database
) -> None:
    erin = subject_digest(SUBJECT, "hooli", "erin")
    frank = subject_digest(SUBJECT, "hooli", "frank")
    first_id, first_key = await service.resolve("hooli", erin)
    frank_id, frank_key = await service.resolve("hooli", frank)
    tenant_id, tenant_key = await service.resolve("hooli", None)
    ISSUED_KEYS.extend([first_key, frank_key, tenant_key])

    assert await service.destroy_subject("hooli", erin) == [first_id]
    assert await service.get(first_id) is None
    row = await _row(database, first_id)
    assert (
        row.destroyed_at is not None
        and row.wrapped_key == bytes(len(row.wrapped_key))
        and len(row.wrapped_key) > 0
    )

    second_id, second_key = await service.resolve("hooli", erin)
    ISSUED_KEYS.append(second_key)
    assert second_id != first_id and second_key != first_key
    destroyed_at = row.destroyed_at
    assert await service.destroy_subject("hooli", erin) == sorted(
        [first_id, second_id]
    )  # a retry names every key
    assert (await _row(database, first_id)).destroyed_at == destroyed_at
    assert await service.get(frank_id) == frank_key and await service.get(tenant_id) == tenant_key
    assert await service.destroy_subject("hooli", subject_digest(SUBJECT, "hooli", "nobody")) == []

    assert await service.destroy_tenant("hooli") == sorted(
        [first_id, second_id, frank_id, tenant_id]
    )
    assert await service.get(frank_id) is None and await service.get(tenant_id) is None


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_http_api(
    coordinator_url: str, service: KeyService, settings: CoordinatorSettings
) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url) as client:
        resolved = await client.post(
            "/v1/keys/resolve", json={"tenant_id": "acme", "subject_hash": BOB}, headers=_auth()
        )
        assert resolved.status_code == 200 and resolved.headers["cache-control"] == "no-store"
        key_id, key = resolved.json()["key_id"], base64.b64decode(resolved.json()["key"])
        ISSUED_KEYS.append(key)
        assert (key_id, key) == await service.resolve("acme", BOB)
        fetched = await client.get(f"/v1/keys/{key_id}", headers=_auth())
        assert fetched.status_code == 200 and fetched.json() == resolved.json()

        tenant = await client.post("/v1/keys/resolve", json={"tenant_id": "acme"}, headers=_auth())
        assert tenant.status_code == 200 and tenant.json()["key_id"] != key_id
        ISSUED_KEYS.append(base64.b64decode(tenant.json()["key"]))

        def error(response: httpx.Response) -> tuple[int, str]:
            body = response.json()["error"]
            assert set(body) == {"message", "type", "code"}
            return response.status_code, body["code"]

        assert error(await client.get(f"/v1/keys/{key_id}")) == (401, "missing_token")
        # A token minted with the end-user secret is no node credential, whatever roles it claims.
        user = issue_token(
            tenant="kvledger-nodes",
            sub=NODE_ID,
            roles=["node", "admin"],
            ttl_s=60,
            secret=JWT_SECRET,
        )
        assert error(
            await client.get(f"/v1/keys/{key_id}", headers={"Authorization": f"Bearer {user}"})
        ) == (
            401,
            "invalid_token",
        )
        assert error(await client.get("/v1/keys/" + "0" * 32, headers=_auth())) == (
            404,
            "key_not_found",
        )
        assert error(await client.get("/v1/keys/not-a-key-id", headers=_auth()))[0] == 400
        bad = {"tenant_id": "acme", "subject_hash": "alice"}
        assert error(await client.post("/v1/keys/resolve", json=bad, headers=_auth())) == (
            400,
            "invalid_parameter",
        )

        assert await service.destroy_subject("acme", BOB) == [key_id]
        assert error(await client.get(f"/v1/keys/{key_id}", headers=_auth())) == (
            410,
            "key_destroyed",
        )

    # A coordinator without a master key refuses to serve keys, and says which setting is missing.
    unkeyed = create_app(
        settings.model_copy(update={"keys": settings.keys.model_copy(update={"master_key": None})})
    )
    transport = httpx.ASGITransport(app=unkeyed)
    async with (
        unkeyed.router.lifespan_context(unkeyed),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        response = await client.post(
            "/v1/keys/resolve", json={"tenant_id": "acme"}, headers=_auth()
        )
        assert (
            error(response) == (503, "keys_not_configured")
            and "KVLEDGER_MASTER_KEY" in response.json()["error"]["message"]
        )


def _user_key(i: int, subject: str) -> BlockKey:
    provenance = CacheProvenance(
        namespace="ns-keys",
        tenant_id="acme",
        scope=CacheScope.USER,
        auth_scopes=(),
        subject_id=subject,
        documents=(),
        created_at=0.0,
    )
    block_hash = hashlib.sha256(f"keys-block-{i}".encode()).digest()
    return BlockKey(
        block_hash,
        hashlib.sha256(f"keys-block-{i - 1}".encode()).digest(),
        i,
        SPEC.block_size,
        provenance,
    )


def _store(pool: BlockPool, key: BlockKey, value: float) -> None:
    entry = pool.begin_build(key)
    assert entry is not None
    assert pool.commit_build(entry, torch.full(SPEC.block_shape, value, dtype=SPEC.dtype))


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_node_pool_block_is_crypto_erased_with_its_subject(
    coordinator_url: str, service: KeyService, tmp_path
) -> None:
    provider = CoordinatorKeyProvider(coordinator_url, _node_token, SUBJECT)
    fresh_node = CoordinatorKeyProvider(coordinator_url, _node_token, SUBJECT)
    config = PoolConfig(
        "ns-keys",
        num_device_blocks=1,
        num_host_blocks=0,
        max_disk_blocks=4,
        disk_dir=tmp_path / "disk",
        ttl_s=NO_TTL,
    )
    pool = BlockPool(SPEC, config, provider)
    alice_block, bob_block = _user_key(1, "alice"), _user_key(2, "bob")
    try:
        _store(pool, alice_block, 7.0)
        _store(pool, bob_block, 9.0)  # the device holds one block: alice's is sealed to disk
        alice = pool.get_ready(alice_block.block_hash)
        assert alice is not None and alice.tier is Tier.DISK
        key_id = provider.current_key_id("acme", "alice")
        assert key_id is not None and key_id == (await service.resolve("acme", ALICE))[0]
        ISSUED_KEYS.extend(
            key
            for key in (provider.key_by_id(key_id), await service.get(key_id))
            if key is not None
        )
        assert provider.current_key_id("acme", "carol") is None
        block_file = pool.disk_path(alice_block.block_hash)
        assert (
            key_id.encode() in block_file.read_bytes() and b"alice" not in block_file.read_bytes()
        )
        stolen = tmp_path / "copied-away.kvb"
        shutil.copyfile(block_file, stolen)
        # Before the erasure, a node with an empty cache fetches the key by id and opens the copy.
        assert decode_block_record(stolen.read_bytes(), fresh_node).key == alice_block

        assert await service.destroy_subject("acme", ALICE) == [key_id]
        assert provider.destroy(key_id) is True
        assert (
            provider.key_by_id(key_id) is None and provider.current_key_id("acme", "alice") is None
        )

        pool.inc_lock_ref([alice])
        try:
            with pytest.raises(BlockRestoreError) as raised:
                pool.read_blocks([alice])
            assert raised.value.reason == "key_unavailable"
        finally:
            pool.dec_lock_ref([alice])
        assert pool.get_ready(alice_block.block_hash) is None and not block_file.exists()

        # A node that cached the key keeps it until the erasure's command reaches it (and it forgets
        # it): that is why an erasure is verified only when every node has acked.
        assert decode_block_record(stolen.read_bytes(), fresh_node).key == alice_block
        assert fresh_node.destroy(key_id) is True

        # Then the copy opens with no key any node can get: not by id (410, remembered), not the
        # subject's new key.
        another_node = CoordinatorKeyProvider(coordinator_url, _node_token, SUBJECT)
        for node in (provider, fresh_node, another_node):
            with pytest.raises(BlockRestoreError):
                decode_block_record(stolen.read_bytes(), node)
            assert node.key_by_id(key_id) is None
        new_id, new_key = provider.key_for(alice_block.provenance)
        ISSUED_KEYS.append(new_key)
        assert new_id != key_id
        sealed = stolen.read_bytes()[_sealed_offset(key_id, stolen.read_bytes()) :]
        assert unseal(new_key, key_id, alice_block.block_hash, sealed) is None
        assert unseal(new_key, new_id, alice_block.block_hash, sealed) is None
        another_node.close()

        # Bob's block (another subject) is untouched.
        bob = pool.get_ready(bob_block.block_hash)
        pool.inc_lock_ref([bob])
        try:
            assert torch.equal(pool.read_blocks([bob]), torch.full((1, *SPEC.block_shape), 9.0))
        finally:
            pool.dec_lock_ref([bob])
    finally:
        provider.close()
        fresh_node.close()


def _sealed_offset(key_id: str, record: bytes) -> int:
    """Where the AES-GCM part (nonce ‖ ciphertext ‖ tag) of a sealed record starts: right after its key id."""
    return record.index(key_id.encode()) + len(key_id)


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_provider_is_thread_safe(coordinator_url: str) -> None:
    """Pools call the provider from worker threads; concurrent first uses of one scope all get the one key."""
    provider = CoordinatorKeyProvider(coordinator_url, _node_token, SUBJECT)
    provenance = _user_key(4, "grace").provenance
    try:
        with ThreadPoolExecutor(max_workers=8) as threads:
            results = list(threads.map(lambda _: provider.key_for(provenance), range(16)))
        ISSUED_KEYS.extend(key for _, key in results)
        assert len(set(results)) == 1 and results[0] is not None
        assert provider.key_by_id(results[0][0]) == results[0][1]
    finally:
        provider.close()


@pytest.mark.usefixtures("no_keys_in_logs")
async def test_unreachable_coordinator_means_no_key() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    provider = CoordinatorKeyProvider(
        f"http://127.0.0.1:{closed_port}", _node_token, SUBJECT, DataKeySettings(timeout_s=0.5)
    )
    try:
        assert provider.key_for(_user_key(3, "alice").provenance) is None
        assert provider.key_by_id("a" * 32) is None
        assert provider.key_by_id("../../admin") is None
    finally:
        provider.close()


def test_node_settings_choose_the_key_provider(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLEDGER_JWT_SECRET", raising=False)
    local = NodeSettings(
        data_dir=tmp_path, auth=IssuerSettings(jwt_secret=JWT_SECRET), coordinator_url=None
    )
    assert isinstance(data_key_provider(local, tmp_path), LocalKeyStore)
    remote = NodeSettings(
        data_dir=tmp_path,
        auth=IssuerSettings(jwt_secret=JWT_SECRET),
        coordinator_url="http://c",
        subject_key=SUBJECT_KEY,
    )
    provider = data_key_provider(remote, tmp_path)
    assert isinstance(provider, CoordinatorKeyProvider)
    provider.close()
    # The node signs its key-service credentials with its own key, created at first use, owner-only.
    assert (tmp_path / NODE_KEY_FILE).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="subject key"):
        data_key_provider(remote.model_copy(update={"subject_key": None}), tmp_path)
    # No shared secret is involved any more: a node without one still gets its keys.
    keyless = data_key_provider(remote.model_copy(update={"auth": IssuerSettings()}), tmp_path)
    assert isinstance(keyless, CoordinatorKeyProvider)
    keyless.close()
    monkeypatch.setenv("KVLEDGER_NODE_COORDINATOR_URL", "http://node-specific")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_URL", "http://shared")
    assert NodeSettings().coordinator_url == "http://node-specific"
    monkeypatch.delenv("KVLEDGER_NODE_COORDINATOR_URL")
    assert NodeSettings().coordinator_url == "http://shared"


def test_master_key_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_MASTER_KEY", base64.b64encode(MASTER_KEY).decode())
    assert CoordinatorSettings().keys.master_key_bytes() == MASTER_KEY
    monkeypatch.setenv("KVLEDGER_MASTER_KEY", base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="32 bytes"):
        CoordinatorSettings()
    monkeypatch.setenv("KVLEDGER_MASTER_KEY", "not base64!")
    with pytest.raises(ValueError, match="base64"):
        CoordinatorSettings()
    monkeypatch.delenv("KVLEDGER_MASTER_KEY")
    assert CoordinatorSettings().keys.master_key_bytes() is None
