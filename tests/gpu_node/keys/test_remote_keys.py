"""The node's coordinator key provider never waits on the network under the pool's lock, caches
"unknown" briefly and bounds its memory. Against a real HTTP key service the test controls (delays,
answers, counts)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers.ledger import eventually, read_topic
from helpers.node import node_settings
from helpers.pool import NO_TTL, NS, SPEC, FakeClock, block_hash, block_key, make_kv

from events import schema
from events.codec import decode_event, encode_key
from events.tiers import Tier
from events.topics import KV_EVENTS, node_key
from gpu_node.engine.async_engine import AsyncEngine, GenerationRequest, SamplingParams
from gpu_node.entrypoints.routes import create_app
from gpu_node.entrypoints.server import make_publisher
from gpu_node.governance.applier import InvalidationApplier
from gpu_node.governance.erasure import fetch_snapshot_keys, remove_from_snapshots
from gpu_node.keys.crypto import KeyServiceUnavailable
from gpu_node.keys.remote_keys import UNREACHABLE_RETRY_S, CoordinatorKeyProvider
from gpu_node.pool import snapshots
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import (
    BlockRecord,
    BlockRestoreError,
    decode_block_record,
    encode_block_record,
)
from gpu_node.pool.snapshots import MANIFEST_NAME, readable_blocks, write_snapshot
from gpu_node.pool.vocabulary import PoolConfig, RemovalReason
from gpu_node.settings import CacheSettings, DataKeySettings, NodeSettings
from identity.settings import IssuerSettings
from identity.tokens import Principal, TokenVerifier, issue_token
from prefix_keys.blocks import CacheProvenance, CacheScope, DocumentRef
from prefix_keys.prompt import ChatMessage

SUBJECT_KEY = b"unit-test-subject-key-32-bytes!!"
PREFETCH_WAIT_S = 0.2
SLOW_S = 3.0


def _key_of(name: str) -> tuple[str, bytes]:
    digest = hashlib.sha256(name.encode()).digest()
    return digest.hex()[:32], digest


class KeyService:
    """A key service on a real socket: ``resolve`` answers a key per scope, ``GET`` only ids in
    ``known`` (410 for ``destroyed`` ones); with ``failing_status`` set, ``GET`` answers that error
    (a coordinator starting or failing)."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.requests: Counter[str] = Counter()
        self.known: dict[str, bytes] = {}
        self.destroyed: set[str] = set()
        self.failing_status: int | None = None
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                scope = json.loads(self.rfile.read(int(self.headers["content-length"])))
                service.requests["resolve"] += 1
                time.sleep(service.delay_s)
                key_id, key = _key_of(f"{scope['tenant_id']}/{scope['subject_hash']}")
                service.known[key_id] = key
                self._answer(200, {"key_id": key_id, "key": base64.b64encode(key).decode()})

            def do_GET(self) -> None:  # noqa: N802
                key_id = self.path.rsplit("/", 1)[-1]
                service.requests["get " + key_id] += 1
                time.sleep(service.delay_s)
                if service.failing_status is not None:
                    self._answer(
                        service.failing_status,
                        {
                            "error": {
                                "message": "failing",
                                "type": "api_error",
                                "code": "unavailable",
                            }
                        },
                    )
                elif key_id in service.destroyed:
                    self._answer(
                        410,
                        {
                            "error": {
                                "message": "destroyed",
                                "type": "gone_error",
                                "code": "key_destroyed",
                            }
                        },
                    )
                elif key_id not in service.known:
                    self._answer(
                        404,
                        {
                            "error": {
                                "message": "unknown key",
                                "type": "invalid_request_error",
                                "code": "key_not_found",
                            }
                        },
                    )
                else:
                    self._answer(
                        200,
                        {"key_id": key_id, "key": base64.b64encode(service.known[key_id]).decode()},
                    )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def service() -> Iterator[KeyService]:
    service = KeyService()
    service.thread.start()
    try:
        yield service
    finally:
        service.server.shutdown()
        service.server.server_close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _provider(
    service: KeyService, clock: Clock | None = None, **settings: float
) -> CoordinatorKeyProvider:
    return CoordinatorKeyProvider(
        service.url,
        lambda: "node-credential",
        SUBJECT_KEY,
        DataKeySettings(prefetch_wait_s=PREFETCH_WAIT_S, timeout_s=10, **settings),
        clock=clock or Clock(),
    )


def _tenant_block(tenant: str, i: int = 1) -> BlockRecord:
    provenance = CacheProvenance(NS, tenant, CacheScope.TENANT, (), None, (), 0.0)
    key = block_key(i, provenance)
    return BlockRecord(key, "fp32", None, make_kv(i).numpy().tobytes())


def _timed(function, *args):
    started = time.monotonic()
    result = function(*args)
    return result, time.monotonic() - started


async def test_a_slow_key_service_holds_neither_a_lookup_nor_a_request_past_its_prefetch_wait(
    service: KeyService,
) -> None:
    provider, restarted = _provider(service), _provider(service)
    try:
        # Before the first request (a start-up re-index) a missing key is fetched on the spot.
        sealed = encode_block_record(_tenant_block("acme"), provider)
        assert sealed is not None and service.requests["resolve"] == 1
        service.delay_s = SLOW_S  # ``restarted`` has empty memory, as a node after a restart

        started = time.monotonic()
        await restarted.prefetch(Principal(tenant_id="globex", subject_id="bob"))
        assert time.monotonic() - started < PREFETCH_WAIT_S + 0.5
        # Serving now: the pool's look-ups answer from memory; acme's key is fetched in the
        # background.
        started = time.monotonic()
        with pytest.raises(BlockRestoreError) as unavailable:
            decode_block_record(sealed, restarted)
        assert unavailable.value.reason == "key_unavailable" and time.monotonic() - started < 0.05
        public = CacheProvenance(NS, None, CacheScope.PUBLIC, (), None, (), 0.0)
        (sealing, seconds) = _timed(restarted.key_for, public)
        assert sealing is None and seconds < 0.05
        (sealing, seconds) = _timed(restarted.key_for, _tenant_block("initech").key.provenance)
        assert sealing is None and seconds < 0.05

        async def fetched_in_background() -> bool:
            return restarted.key_by_id(_key_of("acme/None")[0]) is not None

        deadline = time.monotonic() + 3 * SLOW_S
        while not await fetched_in_background():
            assert time.monotonic() < deadline, "the background fetch never completed"
            await asyncio.sleep(0.05)
        assert decode_block_record(sealed, restarted).key == _tenant_block("acme").key
        assert service.requests["get " + _key_of("acme/None")[0]] == 1
    finally:
        provider.close()
        restarted.close()


async def test_unknown_keys_are_asked_for_once_per_negative_ttl(service: KeyService) -> None:
    clock = Clock()
    provider = _provider(service, clock, negative_ttl_s=30)
    try:
        await provider.prefetch(Principal(tenant_id="acme", subject_id="alice"))
        unknown = "ab" * 16

        async def ask_repeatedly(num_requests: int) -> None:
            """Ask until the key service has seen ``num_requests`` requests for the key, then 50 times more:
            the background fetch answers "unknown", and the answer is remembered for the negative TTL."""
            assert provider.key_by_id(unknown) is None
            await eventually(
                lambda: service.requests["get " + unknown] >= num_requests,
                timeout_s=10,
                what="the key asked for",
            )
            for _ in range(50):
                assert provider.key_by_id(unknown) is None
                await asyncio.sleep(0.005)
            assert service.requests["get " + unknown] == num_requests

        await ask_repeatedly(1)
        clock.now += 31
        await ask_repeatedly(2)
    finally:
        provider.close()


def test_a_start_up_reindex_waits_one_timeout_per_key_not_per_block_while_the_key_service_is_slow(
    service: KeyService,
) -> None:
    clock = Clock()
    timeout_s = 0.2
    provider = CoordinatorKeyProvider(
        service.url,
        lambda: "node-credential",
        SUBJECT_KEY,
        DataKeySettings(timeout_s=timeout_s),
        clock=clock,
    )
    key_id, _ = _key_of("acme/None")
    try:
        encode_block_record(_tenant_block("acme"), provider)  # the key service now knows acme's key
        restarted = CoordinatorKeyProvider(
            service.url,
            lambda: "node-credential",
            SUBJECT_KEY,
            DataKeySettings(timeout_s=timeout_s),
            clock=clock,
        )
        service.delay_s = 1.0  # past the node's timeout: every request fails in transit
        try:
            started = time.monotonic()
            for _ in range(
                20
            ):  # twenty sealed blocks under one key, re-indexed before the node serves
                assert restarted.key_by_id(key_id) is None
            assert service.requests["get " + key_id] == 1
            assert time.monotonic() - started < 20 * timeout_s / 2, (
                "each block waited for its own timeout"
            )
            service.delay_s = 0.0
            assert restarted.key_by_id(key_id) is None, (
                "asked again before UNREACHABLE_RETRY_S passed"
            )
            clock.now += UNREACHABLE_RETRY_S + 1
            assert restarted.key_by_id(key_id) == _key_of("acme/None")[1]
            assert service.requests["get " + key_id] == 2
        finally:
            restarted.close()
    finally:
        provider.close()


async def test_every_key_cache_is_bounded_least_recently_used_first(service: KeyService) -> None:
    provider = _provider(service, max_cached_keys=2, max_negative_entries=2)
    blocking = provider.blocking()
    try:
        for tenant in ("t1", "t2", "t3"):
            assert blocking.key_for(_tenant_block(tenant).key.provenance) == _key_of(
                f"{tenant}/None"
            )
        assert [provider.current_key_id(tenant) for tenant in ("t1", "t2", "t3")] == [
            None,
            _key_of("t2/None")[0],
            _key_of("t3/None")[0],
        ]
        assert blocking.key_for(_tenant_block("t1").key.provenance) == _key_of("t1/None")
        assert service.requests["resolve"] == 4  # t1 was evicted, so asked again
        for key_id in ("01" * 16, "02" * 16, "03" * 16):
            assert blocking.key_by_id(key_id) is None
        assert blocking.key_by_id("01" * 16) is None  # its "unknown" was evicted by two newer ones
        assert blocking.key_by_id("03" * 16) is None  # still remembered
        assert (
            service.requests["get " + "01" * 16] == 2 and service.requests["get " + "03" * 16] == 1
        )
    finally:
        provider.close()


NODE_SECRET = "remote-keys-test-secret-0123456789abcdef"
VERY_SLOW_S = 8.0


async def test_a_slow_key_service_delays_neither_healthz_nor_another_tenants_hit_on_a_node(
    service: KeyService, tiny_model_dir, tmp_path
) -> None:
    """A real node (tiny model) whose coordinator key service takes 8 s per answer: requests wait at
    most ``prefetch_wait_s`` for their keys, public blocks are hit, ``/healthz`` answers at once."""
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path,
        auth=IssuerSettings(jwt_secret=NODE_SECRET),
        coordinator_url=service.url,
        subject_key=SUBJECT_KEY.decode(),
        cache=CacheSettings(
            block_size=16, num_device_blocks=64, num_host_blocks=64, max_disk_blocks=64
        ),
        data_keys={"prefetch_wait_s": PREFETCH_WAIT_S},
    )
    engine = AsyncEngine.from_settings(settings)
    app = create_app(engine, TokenVerifier(settings.auth))
    await engine.start()
    system = {
        "role": "system",
        "content": "You are a careful assistant for the finance team. " * 6,
        "cache_scope": "public",
    }

    def completion(tenant: str, subject: str) -> dict:
        return {
            "url": "/v1/chat/completions",
            "json": {
                "model": engine.model_name,
                "messages": [system, {"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "temperature": 0,
            },
            "headers": {
                "Authorization": "Bearer "
                + issue_token(tenant=tenant, sub=subject, scopes=["hr"], pv=1, secret=NODE_SECRET)
            },
        }

    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://node", timeout=60
        ) as client:
            first = await client.post(**completion("acme", "alice"))
            assert first.status_code == 200, first.text
            service.delay_s = VERY_SLOW_S

            started = time.monotonic()
            other_tenant = asyncio.create_task(client.post(**completion("globex", "bob")))
            await asyncio.sleep(PREFETCH_WAIT_S / 2)
            health = await client.get("/healthz")
            health_s = time.monotonic() - started
            answered = await other_tenant
            answered_s = time.monotonic() - started
            assert health.status_code == 200 and health_s < 1.0
            assert answered.status_code == 200, answered.text
            assert (
                answered.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            )  # the public prefix was hit
            assert answered_s < VERY_SLOW_S / 2
            assert (
                service.requests["resolve"] == 4
            )  # acme's two scopes, then globex's two (still in flight)
    finally:
        await engine.stop()
        engine.pool.key_provider.close()


def test_a_snapshot_inventory_never_reports_a_sealed_copy_gone_while_the_key_service_cannot_be_asked(
    service: KeyService, tmp_path
) -> None:
    """The node's inventory lists a snapshot's readable blocks, and the ledger replaces the node's
    placements with it. A restarted node whose key service is down, slow or failing cannot tell its
    sealed copies readable or gone: it must not report them gone (the ledger would drop copies still
    on disk, and the next inventory would bring them back: the soak saw "placements only on the
    node"). Only a definitive answer (410 destroyed) leaves one out."""
    clock = Clock()
    sealing = _provider(service, clock)
    pool = BlockPool(
        SPEC,
        PoolConfig(NS, 2, 2, 2, tmp_path / "disk", NO_TTL),
        sealing,
        clock=FakeClock(),
        wall_clock=lambda: 1e6,
    )
    public = CacheProvenance(NS, None, CacheScope.PUBLIC, (), None, (), 0.0)
    for key in (block_key(0, public), _tenant_block("acme", 1).key):
        assert pool.commit_build(pool.begin_build(key), make_kv(key.token_offset))
    directory = tmp_path / "snapshot"
    write_snapshot(pool, directory)
    key_id, _ = _key_of("acme/None")
    restarted = CoordinatorKeyProvider(
        service.url,
        lambda: "node-credential",
        SUBJECT_KEY,
        DataKeySettings(timeout_s=0.2),
        clock=clock,
    )
    try:
        service.delay_s = 1.0  # past the node's timeout: the request fails in transit
        with pytest.raises(KeyServiceUnavailable):
            readable_blocks(directory, restarted.blocking())
        service.delay_s, service.failing_status = 0.0, 503
        clock.now += UNREACHABLE_RETRY_S + 1
        with pytest.raises(KeyServiceUnavailable):
            readable_blocks(directory, restarted.blocking())
        assert service.requests["get " + key_id] == 2
        with pytest.raises(
            KeyServiceUnavailable
        ):  # remembered as unanswered: not asked again yet, still in doubt
            readable_blocks(directory, restarted.blocking())
        assert service.requests["get " + key_id] == 2

        service.failing_status = None
        clock.now += UNREACHABLE_RETRY_S + 1
        assert [key.block_hash for key in readable_blocks(directory, restarted.blocking())] == [
            block_hash(0),
            block_hash(1),
        ]
    finally:
        restarted.close()
    after_erasure = CoordinatorKeyProvider(
        service.url, lambda: "node-credential", SUBJECT_KEY, DataKeySettings(), clock=clock
    )
    try:
        service.destroyed.add(key_id)
        assert [key.block_hash for key in readable_blocks(directory, after_erasure.blocking())] == [
            block_hash(0)
        ]
    finally:
        after_erasure.close()
        sealing.close()


def _restarted_provider(service: KeyService, clock: Clock) -> CoordinatorKeyProvider:
    """A node's provider after a restart: no key in memory, a short timeout."""
    return CoordinatorKeyProvider(
        service.url,
        lambda: "node-credential",
        SUBJECT_KEY,
        DataKeySettings(timeout_s=0.2),
        clock=clock,
    )


def test_a_restarted_pool_keeps_the_block_files_it_cannot_get_keys_for_and_indexes_them_once_it_can(
    service: KeyService, tmp_path
) -> None:
    """A start-up re-index deletes files it cannot read (corrupt, key destroyed). A key service that is down or
    failing is not "key destroyed": the files stay, nothing is reported removed, and a later attempt indexes them;
    only a definitive answer (410) deletes the file."""

    def pool_on_disk(keys: CoordinatorKeyProvider) -> BlockPool:
        """A pool over the test's disk tier: the same directory in every life."""
        return BlockPool(
            SPEC,
            PoolConfig(NS, 2, 2, 4, tmp_path / "disk", NO_TTL),
            keys,
            clock=FakeClock(),
            wall_clock=lambda: 1e6,
        )

    clock = Clock()
    sealing = _provider(service, clock)
    pool = pool_on_disk(sealing)
    public = CacheProvenance(NS, None, CacheScope.PUBLIC, (), None, (), 0.0)
    for key in (block_key(0, public), _tenant_block("acme", 1).key):
        assert pool.commit_build(pool.begin_build(key), make_kv(key.token_offset))
        assert pool.demote(key.block_hash, Tier.DISK)
    files = sorted(path.name for path in (tmp_path / "disk").iterdir())
    assert files == sorted(f"{block_hash(i).hex()}.kvb" for i in (0, 1))
    key_id = _key_of("acme/None")[0]

    restarted = _restarted_provider(service, clock)
    try:
        service.failing_status = 503
        pool_after_restart = pool_on_disk(restarted)
        with pytest.raises(KeyServiceUnavailable):
            pool_after_restart.load_disk_tier()
        assert sorted(path.name for path in (tmp_path / "disk").iterdir()) == files
        assert pool_after_restart.take_events() == []
        num_indexed = len(
            pool_after_restart.ready_entries()
        )  # files before the sealed one, in name order

        service.failing_status = None
        clock.now += UNREACHABLE_RETRY_S + 1
        assert pool_after_restart.load_disk_tier() == 2 - num_indexed, "a second attempt resumes"
        assert {entry.block_hash for entry in pool_after_restart.ready_entries()} == {
            block_hash(0),
            block_hash(1),
        }
        assert pool_after_restart.take_events() == []
        assert service.requests["get " + key_id] == 2
    finally:
        restarted.close()

    after_erasure = _restarted_provider(service, clock)
    try:
        service.destroyed.add(key_id)
        pool_after_erasure = pool_on_disk(after_erasure)
        assert pool_after_erasure.load_disk_tier() == 1
        assert [(event.block_hash, event.reason) for event in pool_after_erasure.take_events()] == [
            (block_hash(1), RemovalReason.RESTORE_FAILED)
        ]
        assert sorted(path.name for path in (tmp_path / "disk").iterdir()) == [
            f"{block_hash(0).hex()}.kvb"
        ]
    finally:
        after_erasure.close()
        sealing.close()


def test_a_snapshot_pass_keeps_other_scopes_records_while_their_keys_cannot_be_asked_for(
    service: KeyService, tmp_path, monkeypatch
) -> None:
    """An invalidation rewrites each snapshot without its matches, and drops records it cannot decode (their key
    destroyed). A node restarted with no key in memory must not read "not held" as "destroyed": while the key service
    cannot answer the command fails (and is retried) with every snapshot file as it was; once it answers, the keys
    are fetched ahead (``fetch_snapshot_keys``, which the node runs in a thread) and the pass removes exactly the
    matches without asking the service again."""
    monkeypatch.setattr(
        snapshots, "MAX_SHARD_BYTES", 1
    )  # one record per shard: a failed pass has written shards
    clock = Clock()
    sealing = _provider(service, clock)
    pool = BlockPool(
        SPEC,
        PoolConfig(NS, 4, 2, 2, tmp_path / "disk", NO_TTL),
        sealing,
        clock=FakeClock(),
        wall_clock=lambda: 1e6,
    )
    public = CacheProvenance(NS, None, CacheScope.PUBLIC, (), None, (), 0.0)
    for key in (
        block_key(0, public),
        block_key(1, public),
        _tenant_block("acme", 2).key,
        _tenant_block("globex", 3).key,
    ):
        assert pool.commit_build(pool.begin_build(key), make_kv(key.token_offset))
    root = tmp_path / "snapshots"
    directory = root / "one"
    write_snapshot(pool, directory, max_shard_bytes=1)
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    acme_key, globex_key = _key_of("acme/None")[0], _key_of("globex/None")[0]
    assert snapshots.sealing_key_ids(directory) == {acme_key, globex_key}

    def acme(provenance: CacheProvenance) -> bool:
        return provenance.tenant_id == "acme"

    restarted = _restarted_provider(service, clock)
    try:
        service.failing_status = 503
        with pytest.raises(KeyServiceUnavailable):
            fetch_snapshot_keys(root, restarted.blocking())
        with pytest.raises(KeyServiceUnavailable):
            remove_from_snapshots(root, [acme], restarted.blocking())
        assert {path.name: path.read_bytes() for path in directory.iterdir()} == before

        service.failing_status = None
        clock.now += UNREACHABLE_RETRY_S + 1
        fetch_snapshot_keys(root, restarted.blocking())
        asked = service.requests.copy()
        assert remove_from_snapshots(root, [lambda provenance: False], restarted.blocking()) == [[]]
        assert {path.name: path.read_bytes() for path in directory.iterdir()} == before, (
            "a pass that removed nothing left shards"
        )
        [removals] = remove_from_snapshots(root, [acme], restarted.blocking())
        assert service.requests == asked, "the pass asked the key service for a key fetched ahead"
        assert [(removal.block_hashes, removal.key_ids) for removal in removals] == [
            ((block_hash(2),), frozenset({acme_key}))
        ]
        remaining = readable_blocks(directory, restarted.blocking())
        assert [key.block_hash for key in remaining] == [
            block_hash(0),
            block_hash(1),
            block_hash(3),
        ]
        assert set(path.name for path in directory.iterdir()) == {MANIFEST_NAME} | set(
            snapshots.read_manifest(directory).shards
        )
    finally:
        restarted.close()
        sealing.close()


async def test_a_restarted_node_holds_its_start_inventory_until_the_key_service_answers_for_its_snapshot(
    service: KeyService, tiny_model_dir, tmp_path, kafka_bootstrap
) -> None:
    """A real node (tiny model, real broker) snapshots a tenant's blocks and restarts while its key
    service answers 503: it must not publish a start inventory without the snapshot's sealed blocks
    (the ledger would drop copies still on disk), so it asks again, and once the key service answers
    its inventory lists every snapshot block."""
    node_id = f"snap-{uuid.uuid4().hex[:6]}"
    cache = CacheSettings(
        block_size=16, num_device_blocks=64, num_host_blocks=64, max_disk_blocks=64
    )
    settings = node_settings(
        node_id, tiny_model_dir, tmp_path, kafka_bootstrap, cache, coordinator_url=service.url
    )
    principal = Principal(
        tenant_id="acme", subject_id="alice", scopes=frozenset({"hr"}), policy_versions={"hr": 1}
    )
    messages = (
        ChatMessage(
            "system", "You are a careful assistant for the finance team. " * 4, CacheScope.PUBLIC
        ),
        ChatMessage(
            "user",
            "The handbook says staff rest on day one and day two. " * 6,
            CacheScope.TENANT,
            DocumentRef("handbook", 1, "hr"),
        ),
    )
    engine = AsyncEngine.from_settings(settings)
    await engine.start()
    try:
        async for _ in engine.generate(
            GenerationRequest("fill", messages, SamplingParams(max_tokens=1), principal)
        ):
            pass
        await eventually(
            lambda: engine.pool.key_provider.current_key_id("acme") is not None,
            timeout_s=30,
            what="acme's key fetched",
        )
        written = await engine.write_snapshot()
    finally:
        await engine.stop()
        engine.pool.key_provider.close()
    reader = _provider(service)
    try:
        snapshot = {
            key.block_hash.hex(): key.provenance.scope
            for key in readable_blocks(Path(written["path"]), reader.blocking())
        }
    finally:
        reader.close()
    assert CacheScope.TENANT in snapshot.values() and len(snapshot) == written["num_blocks"], (
        snapshot
    )
    key_id = _key_of("acme/None")[0]

    restarted = AsyncEngine.from_settings(settings)  # a new life: no key in memory
    service.failing_status = 503
    await restarted.start()
    publisher = make_publisher(restarted, settings)
    starting = asyncio.create_task(publisher.start(tmp_path))
    try:
        # Asked once, refused; asked again only after UNREACHABLE_RETRY_S: the start inventory was
        # retried, not sent.
        await eventually(
            lambda: service.requests["get " + key_id] >= 2,
            timeout_s=UNREACHABLE_RETRY_S * 4,
            what="the key asked for again",
        )
        assert not starting.done(), (
            "the start inventory went out while the key service could not answer for the snapshot"
        )
        # An invalidation of another document meanwhile: the snapshot pass cannot decode the sealed
        # records, and must not drop them as unreadable; the command fails (the consumer retries it)
        # and the snapshot stays as it was.
        applier = InvalidationApplier(restarted, SUBJECT_KEY, deferred_wait_s=5.0)
        other_document = schema.DocumentPredicate(tenant="acme", doc_id="policy", below_version=2)
        command = schema.Invalidate(
            command_id=uuid.uuid4(), predicate=other_document, cutoff=datetime.now(UTC)
        )
        shards = {path.name: path.read_bytes() for path in Path(written["path"]).iterdir()}
        with pytest.raises(KeyServiceUnavailable):
            await applier.apply(command)
        assert {path.name: path.read_bytes() for path in Path(written["path"]).iterdir()} == shards
        service.failing_status = None
        await asyncio.wait_for(starting, 30)
        assert await applier.apply(command) == []
        assert {path.name: path.read_bytes() for path in Path(written["path"]).iterdir()} == shards
        records = [
            record
            for record in await read_topic(kafka_bootstrap, KV_EVENTS)
            if record.key == encode_key(node_key(node_id))
        ]
        inventories = [
            envelope.payload
            for envelope in (decode_event(record.value) for record in records)
            if isinstance(envelope.payload, schema.Inventory)
        ]
        assert [inventory.epoch for inventory in inventories] == [publisher.epoch]
        listed = {
            p.block_hash
            for inventory in inventories
            for p in inventory.placements
            if p.tier == "snapshot"
        }
        assert listed == set(snapshot)
    finally:
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await publisher.stop()
        await restarted.stop()
        restarted.pool.key_provider.close()
