"""Replicas: a node pulls a prefix from the peer holding it (``gpu_node.cache.peers``), governed like any copy.

Everything is real: the coordinator (consumers, key service and node registry) in its own
thread on a fresh ledger, a holder and a puller node as ``serve`` assembles them, keeping
their data keys in the coordinator, the session's broker and Postgres. Between the puller and
the holder sits :class:`PeerLink`, a real TCP hop the puller's ``peers.urls`` points at, which
passes, corrupts, cuts or holds what the holder sends: that is how a failing peer, a record
that does not open and the races with an erasure are produced. Each test uses its own tenant.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    GROUP_TIMING,
    JWT_SECRET,
    command_public_key_file,
    coordinator_settings,
    enroll_nodes,
    eventually,
    fresh_database,
    node_key,
    operator_headers,
    operator_token,
)
from helpers.node import CoordinatorThread, RunningNode, Served, node_settings

from bench.common import start_groups_at_end
from coordinator.consumers import consumer_groups
from coordinator.settings import kafka_settings
from events.kafka.admin import ensure_topics
from gpu_node.cache.peers import PULL_PATH, read_frames
from gpu_node.pool.block_records import FLAG_SEALED, HEADER
from gpu_node.pool.vocabulary import BlockState
from gpu_node.settings import CacheSettings
from identity.node_credentials import issue_peer_credential
from identity.settings import IssuerSettings
from identity.tokens import TokenVerifier, issue_token
from kvledger.nodes import revoke_node_keys
from router.api import NODE_HEADER
from router.keying import request_messages
from router.server import Router
from router.settings import RouterSettings

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

BLOCK_SIZE = 16
METRICS_TOKEN = "replicas-metrics-token"
TIMEOUT_S = 30.0
MASTER_KEY = base64.b64encode(os.urandom(32)).decode()
HANDBOOK = (
    "You are the assistant of the ACME handbook. Answer briefly, and only from the handbook text you are given below. "
    * 3
)


class PeerLink:
    """A real TCP hop between puller and holder: forwards each pull and answers with the holder's
    response, as set by ``mode``.

    ``pass`` as it is; ``corrupt`` one byte flipped inside the first record (its ciphertext);
    ``die`` the headers and half the body, then the connection closes; ``hold`` waits for
    :attr:`release` before answering (the holder has served by then).
    """

    def __init__(self) -> None:
        self.target = ""
        self.mode = "pass"
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.bodies: list[bytes] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ")
            headers = {
                name.lower(): value
                for name, _, value in (line.partition(": ") for line in head[1:] if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            forwarded = {
                name: headers[name] for name in ("authorization", "content-type") if name in headers
            }
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                response = await client.request(
                    method, self.target + path, content=body, headers=forwarded
                )
            payload = bytearray(response.content)
            self.bodies.append(bytes(payload))
            if self.mode == "hold":
                self.holding.set()
                await self.release.wait()
            if self.mode == "corrupt" and len(payload) > 200:
                payload[200] ^= 0x01
            sent = payload[: len(payload) // 2] if self.mode == "die" else payload
            writer.write(
                f"HTTP/1.1 {response.status_code} X\r\nContent-Length: {len(payload)}\r\n"
                f"Content-Type: {response.headers.get('content-type', 'application/octet-stream')}\r\nConnection: close\r\n\r\n".encode()
                + bytes(sent)
            )
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture(scope="module")
async def stack(
    database_url: str,
    ledger_template: str,
    kafka_bootstrap: str,
    tiny_model_dir: Path,
    tmp_path_factory,
) -> AsyncIterator[dict]:
    """The coordinator (own thread), a holder, and a puller whose peer list names the holder behind a :class:`PeerLink`."""
    async with fresh_database(database_url, ledger_template) as url:
        group = f"replicas-{uuid.uuid4().hex[:8]}"
        settings = coordinator_settings(
            url,
            kafka_bootstrap,
            kafka={"group_id": group},
            ledger={"erasure_verify_interval_s": 0.5},
            keys={"master_key": MASTER_KEY},
        )
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(kafka_bootstrap, consumer_groups(group))
        coordinator = await CoordinatorThread(settings).start()
        suffix = uuid.uuid4().hex[:6]
        holder_id, puller_id, stranger_id = (
            f"replica-{name}-{suffix}" for name in ("holder", "puller", "stranger")
        )
        await enroll_nodes(url, [holder_id, puller_id, stranger_id])
        root = tmp_path_factory.mktemp("replica-nodes")
        link = PeerLink()
        link_url = await link.start()
        nodes: list[RunningNode] = []
        try:
            for node_id, peers in ((holder_id, {}), (puller_id, {holder_id: link_url})):
                cache = CacheSettings(
                    block_size=BLOCK_SIZE,
                    num_device_blocks=128,
                    num_host_blocks=0,
                    max_disk_blocks=0,
                )
                node = RunningNode(
                    node_settings(
                        node_id,
                        tiny_model_dir,
                        root / node_id,
                        kafka_bootstrap,
                        cache,
                        coordinator_url=coordinator.url,
                        peers={"urls": peers, "key_cache_s": 1.0},
                        # For the router of the routed test: it asks how a node keys, and takes
                        # a node whose beat it has not heard as gone.
                        metrics={"token": METRICS_TOKEN},
                        heartbeat_interval_s=0.5,
                    )
                )
                nodes.append(await node.start())
                await node.replayed()
            link.target = nodes[0].http.url
            yield {
                "url": coordinator.url,
                "database_url": url,
                "holder": nodes[0],
                "puller": nodes[1],
                "link": link,
                "stranger": stranger_id,
            }
        finally:
            for node in nodes:
                await node.stop()
                node.engine.pool.key_provider.close()
            await link.stop()
            await coordinator.stop()


@pytest.fixture(autouse=True)
def link_passes(stack) -> None:
    link: PeerLink = stack["link"]
    link.mode = "pass"
    link.holding.clear()
    link.release.clear()
    link.bodies.clear()


def tenant_token(tenant: str, subject: str = "alice") -> str:
    return issue_token(
        tenant=tenant, sub=subject, scopes=["hr"], pv=0, ttl_s=600, secret=JWT_SECRET
    )


def user_token(tenant: str, subject: str) -> str:
    return issue_token(tenant=tenant, sub=subject, scopes=[], ttl_s=600, secret=JWT_SECRET)


def handbook(question: str) -> list[dict]:
    return [
        {"role": "system", "content": HANDBOOK, "cache_scope": "tenant"},
        {"role": "user", "content": question},
    ]


def private_chat(subject: str) -> list[dict]:
    """Every block after the public system prompt is the subject's (user scope)."""
    text = " ".join(
        f"{subject} wrote note {i}: my sick leave started on day {i}" for i in range(10)
    )
    return [
        {
            "role": "system",
            "content": "You are the assistant of the people team.",
            "cache_scope": "public",
        },
        {"role": "user", "content": text},
    ]


async def ask(
    node: RunningNode, token: str, messages: list[dict], hint: tuple[str, int] | None = None
) -> tuple[str, int]:
    """(completion text, cached prompt tokens) of a greedy request, with a pull hint when given."""
    headers = {"Authorization": f"Bearer {token}"}
    if hint is not None:
        headers |= {"X-KVLedger-Pull-From": hint[0], "X-KVLedger-Pull-Blocks": str(hint[1])}
    async with httpx.AsyncClient(base_url=node.http.url, timeout=120) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": node.engine.model_name,
                "messages": messages,
                "max_tokens": 8,
                "temperature": 0,
            },
            headers=headers,
        )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def pulls(node: RunningNode, outcome: str) -> float:
    return (
        node.engine.metrics.registry.get_sample_value(
            "kvledger_peer_pulls_total", {"outcome": outcome}
        )
        or 0.0
    )


def full_blocks(node: RunningNode, messages: list[dict]) -> int:
    return node.prefix_tokens(messages)[0] // BLOCK_SIZE


async def test_a_pulled_prefix_serves_the_same_greedy_output_as_recomputing_it_and_travels_sealed(
    stack,
) -> None:
    holder, puller, link = stack["holder"], stack["puller"], stack["link"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("How many vacation days do I get?")
    computed, cached = await ask(holder, tenant_token(tenant), messages)
    assert cached == 0
    num_blocks = full_blocks(holder, messages)
    before = pulls(puller, "pulled")

    pulled, cached = await ask(puller, tenant_token(tenant), messages, (holder.node_id, num_blocks))

    assert pulled == computed, "greedy output over pulled KV equals the output over computed KV"
    assert cached == num_blocks * BLOCK_SIZE
    assert pulls(puller, "pulled") == before + 1
    records = read_frames(io.BytesIO(link.bodies[-1]), num_blocks, 1 << 30)
    assert len(records) == num_blocks
    # Tenant blocks cross the wire sealed, exactly as at rest: the clear header says so and holds no
    # provenance.
    assert all(record[5] == FLAG_SEALED for record in records[1:])
    assert all(
        tenant.encode() not in record and b"provenance" not in record[HEADER.size :]
        for record in records[1:]
    )
    # The replica is a hit like any other block now.
    assert (await ask(puller, tenant_token(tenant), messages))[1] == num_blocks * BLOCK_SIZE


async def test_concurrent_requests_for_one_prefix_pull_it_once(stack) -> None:
    holder, puller, link = stack["holder"], stack["puller"], stack["link"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("What is the dress code?")
    computed, _ = await ask(holder, tenant_token(tenant), messages)
    num_blocks = full_blocks(holder, messages)
    before = pulls(puller, "pulled")
    link.mode = "hold"

    first = asyncio.create_task(
        ask(puller, tenant_token(tenant), messages, (holder.node_id, num_blocks))
    )
    await asyncio.wait_for(link.holding.wait(), TIMEOUT_S)
    # The second request finds the first's claims and waits on them, as on a build: it sends no pull
    # of its own.
    second = asyncio.create_task(
        ask(puller, tenant_token(tenant), messages, (holder.node_id, num_blocks))
    )
    await eventually(
        lambda: (
            (puller.engine.metrics.registry.get_sample_value("kvledger_singleflight_waiters") or 0)
            >= 1
        ),
        timeout_s=TIMEOUT_S,
        what="a waiter",
    )
    link.release.set()

    assert await first == (computed, num_blocks * BLOCK_SIZE)
    assert await second == (computed, num_blocks * BLOCK_SIZE)
    assert len(link.bodies) == 1 and pulls(puller, "pulled") == before + 1


async def test_a_pull_brings_only_blocks_of_the_callers_own_scope(stack) -> None:
    holder, puller = stack["holder"], stack["puller"]
    owner, other = f"acme-{uuid.uuid4().hex[:6]}", f"globex-{uuid.uuid4().hex[:6]}"
    messages = handbook("Who approves my expenses?")
    computed, _ = await ask(holder, tenant_token(owner), messages)
    num_blocks = full_blocks(holder, messages)
    before = pulls(puller, "not_held")

    # Another tenant's request has other block keys: the holder holds none of them, nothing crosses.
    text, cached = await ask(puller, tenant_token(other), messages, (holder.node_id, num_blocks))

    assert (text, cached) == (computed, 0)
    assert pulls(puller, "not_held") == before + 1
    assert not [
        entry for entry in puller.engine.pool.ready_entries() if entry.provenance.tenant_id == owner
    ]


async def test_a_record_that_does_not_open_falls_back_to_recompute(stack) -> None:
    holder, puller, link = stack["holder"], stack["puller"], stack["link"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("Where is the office?")
    computed, _ = await ask(holder, tenant_token(tenant), messages)
    before = pulls(puller, "decrypt_failed")
    link.mode = "corrupt"

    text, cached = await ask(
        puller, tenant_token(tenant), messages, (holder.node_id, full_blocks(holder, messages))
    )

    assert (text, cached) == (computed, 0)
    assert pulls(puller, "decrypt_failed") == before + 1


async def test_a_peer_dying_mid_transfer_falls_back_to_recompute(stack) -> None:
    holder, puller, link = stack["holder"], stack["puller"], stack["link"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("When is payday?")
    computed, _ = await ask(holder, tenant_token(tenant), messages)
    before = pulls(puller, "unavailable")
    link.mode = "die"

    text, cached = await ask(
        puller, tenant_token(tenant), messages, (holder.node_id, full_blocks(holder, messages))
    )

    assert (text, cached) == (computed, 0)
    assert pulls(puller, "unavailable") == before + 1
    # The claims the pull held were released: the blocks are the request's own now, and hit next
    # time.
    assert (await ask(puller, tenant_token(tenant), messages))[1] == full_blocks(
        holder, messages
    ) * BLOCK_SIZE


async def test_a_hint_names_a_node_id_never_a_place_to_connect_to(stack) -> None:
    puller = stack["puller"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("Can I work remotely?")
    before = pulls(puller, "unknown_peer")

    _, cached = await ask(
        puller, tenant_token(tenant), messages, ("http://169.254.169.254/latest", 4)
    )
    assert cached == 0 and pulls(puller, "unknown_peer") == before + 1
    async with httpx.AsyncClient(base_url=puller.http.url, timeout=60) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": puller.engine.model_name, "messages": messages, "max_tokens": 1},
            headers={
                "Authorization": f"Bearer {tenant_token(tenant)}",
                "X-KVLedger-Pull-From": "holder",
                "X-KVLedger-Pull-Blocks": "lots",
            },
        )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_pull_hint"


async def pull_directly(
    holder: RunningNode,
    signer: str,
    body: dict,
    *,
    audience: str | None = None,
    digest: str | None = None,
) -> httpx.Response:
    """A pull request to the holder signed with ``signer``'s test key (for ``audience``'s node, over
    ``digest``)."""
    content = json.dumps(body).encode()
    credential = issue_peer_credential(
        node_key(signer),
        signer,
        audience or holder.node_id,
        digest or hashlib.sha256(content).hexdigest(),
    )
    async with httpx.AsyncClient(base_url=holder.http.url, timeout=30) as client:
        return await client.post(
            PULL_PATH, content=content, headers={"Authorization": f"Bearer {credential}"}
        )


def refusal(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


async def test_the_holder_serves_only_signed_same_namespace_requests_of_enrolled_unrevoked_nodes(
    stack,
) -> None:
    holder, puller, stranger = stack["holder"], stack["puller"], stack["stranger"]
    namespace = holder.engine.namespace.namespace
    body = {"namespace": namespace, "block_hashes": ["00" * 32]}

    assert (await pull_directly(holder, puller.node_id, body)).status_code == 200
    async with httpx.AsyncClient(base_url=holder.http.url) as client:
        assert refusal(await client.post(PULL_PATH, json=body)) == (401, "missing_token")
    assert (
        refusal(await pull_directly(holder, puller.node_id, body, audience="another-holder"))[0]
        == 401
    )
    assert refusal(await pull_directly(holder, puller.node_id, body, digest="ab" * 32))[0] == 401
    assert refusal(
        await pull_directly(holder, puller.node_id, {**body, "namespace": "another-model"})
    ) == (403, "namespace_mismatch")
    assert (
        refusal(await pull_directly(holder, puller.node_id, {**body, "block_hashes": ["zz"]}))[0]
        == 400
    )
    assert refusal(await pull_directly(holder, "never-enrolled", body)) == (401, "unknown_node_key")
    # An enrolled node the ledger has never seen serve this namespace is not a peer of it.
    assert refusal(await pull_directly(holder, stranger, body)) == (403, "namespace_mismatch")

    await revoke_node_keys(stack["database_url"], stranger, None)

    async def refused_as_revoked() -> bool:
        return refusal(await pull_directly(holder, stranger, body)) == (401, "unknown_node_key")

    # Within the coordinator's key cache plus the holder's (1 s each here).
    await eventually(refused_as_revoked, timeout_s=10, what="the revoked node's pulls refused")


async def request_erasure(stack: dict, tenant: str, subject: str) -> str:
    async with httpx.AsyncClient(base_url=stack["url"], timeout=30) as client:
        response = await client.post(
            "/v1/erasures",
            json={"tenant_id": tenant, "subject_id": subject, "reason": "GDPR art. 17 request"},
            headers=operator_headers("privacy-officer", tenant),
        )
    assert response.status_code == 202, response.text
    return response.json()["id"]


async def erasure_verified(stack: dict, erasure_id: str) -> dict:
    seen: dict = {}

    async def verified() -> bool:
        async with httpx.AsyncClient(
            base_url=stack["url"], headers=operator_headers("platform-admin", "platform")
        ) as client:
            seen.update((await client.get(f"/v1/erasures/{erasure_id}")).json())
        return seen.get("status") == "verified"

    await eventually(
        verified, timeout_s=60, what=f"erasure {erasure_id} verified (last: {seen.get('status')})"
    )
    return seen


def held_by(node: RunningNode, tenant: str) -> set[str]:
    """Block hashes of ``tenant``'s user blocks the node holds READY."""
    return {
        entry.block_hash.hex()
        for entry in node.engine.pool.ready_entries()
        if entry.provenance.tenant_id == tenant and entry.provenance.subject_id is not None
    }


async def test_an_erasure_during_a_pull_leaves_no_live_copy_of_the_subjects_blocks(stack) -> None:
    holder, puller, link = stack["holder"], stack["puller"], stack["link"]
    tenant, subject = f"acme-{uuid.uuid4().hex[:6]}", f"alice-{uuid.uuid4().hex[:6]}"
    chat = private_chat(subject)
    computed, _ = await ask(holder, user_token(tenant, subject), chat)
    assert held_by(holder, tenant)
    before = pulls(puller, "discarded")
    link.mode = "hold"

    asking = asyncio.create_task(
        ask(puller, user_token(tenant, subject), chat, (holder.node_id, full_blocks(holder, chat)))
    )
    await asyncio.wait_for(
        link.holding.wait(), TIMEOUT_S
    )  # the holder has served; the bytes are in flight
    erasure_id = await request_erasure(stack, tenant, subject)

    def claims_tombstoned() -> bool:
        entries = puller.engine.pool.state.entries.values()
        claims = [
            entry
            for entry in entries
            if entry.state is BlockState.BUILDING and entry.provenance.subject_id is not None
        ]
        return bool(claims) and all(entry.tombstoned for entry in claims)

    await eventually(
        claims_tombstoned,
        timeout_s=TIMEOUT_S,
        what="the erasure reached the pull's claims on the puller",
    )
    link.release.set()
    text, cached = await asking

    assert text == computed and cached < full_blocks(holder, chat) * BLOCK_SIZE
    assert pulls(puller, "discarded") == before + 1
    await erasure_verified(stack, erasure_id)
    assert held_by(puller, tenant) == set() and held_by(holder, tenant) == set()


async def test_a_pull_after_the_holder_erased_brings_nothing(stack) -> None:
    holder, puller = stack["holder"], stack["puller"]
    tenant, subject = f"acme-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    chat = private_chat(subject)
    await ask(holder, user_token(tenant, subject), chat)
    await erasure_verified(stack, await request_erasure(stack, tenant, subject))
    assert held_by(holder, tenant) == set()
    before = pulls(puller, "not_held")

    _, cached = await ask(
        puller, user_token(tenant, subject), chat, (holder.node_id, full_blocks(holder, chat))
    )

    assert pulls(puller, "not_held") == before + 1
    assert cached < full_blocks(holder, chat) * BLOCK_SIZE


async def test_an_erasure_after_a_pull_removes_both_copies_and_its_receipt_lists_both_nodes(
    stack,
) -> None:
    holder, puller = stack["holder"], stack["puller"]
    tenant, subject = f"acme-{uuid.uuid4().hex[:6]}", f"carol-{uuid.uuid4().hex[:6]}"
    chat = private_chat(subject)
    await ask(holder, user_token(tenant, subject), chat)
    before = pulls(puller, "pulled")
    await ask(
        puller, user_token(tenant, subject), chat, (holder.node_id, full_blocks(holder, chat))
    )
    assert pulls(puller, "pulled") == before + 1
    replicated = held_by(holder, tenant)
    assert replicated and held_by(puller, tenant) == replicated
    for node in (holder, puller):
        await node.publisher.flush()

    async def ledgered() -> dict[tuple[str, str], dict | None]:
        async with httpx.AsyncClient(
            base_url=stack["url"], headers=operator_headers("privacy-officer", tenant)
        ) as client:
            page = (
                await client.get(
                    "/v1/ledger/blocks",
                    params={"tenant": tenant, "subject": subject, "limit": 1000},
                )
            ).json()
        return {
            (block["block_hash"], placement["node_id"]): placement["replica_of"]
            for block in page["blocks"]
            for placement in block["placements"]
        }

    async def both_copies_ledgered() -> bool:
        return set(await ledgered()) == {
            (block, node.node_id) for block in replicated for node in (holder, puller)
        }

    await eventually(
        both_copies_ledgered, timeout_s=TIMEOUT_S, what="the ledger lists the copies on both nodes"
    )
    # The pulled copies name their source; the holder's were computed there.
    for (_, node_id), replica_of in (await ledgered()).items():
        if node_id == holder.node_id:
            assert replica_of is None
        else:
            assert (
                replica_of is not None
                and replica_of["source_node_id"] == holder.node_id
                and replica_of["pulled_at"]
            )

    erasure_id = await request_erasure(stack, tenant, subject)
    done = await erasure_verified(stack, erasure_id)

    assert {row["node_id"] for row in done["nodes"]} == {holder.node_id, puller.node_id}
    assert held_by(puller, tenant) == set() and held_by(holder, tenant) == set()
    async with httpx.AsyncClient(
        base_url=stack["url"], headers=operator_headers("privacy-officer", tenant)
    ) as client:
        receipt = (await client.get(f"/v1/erasures/{erasure_id}/receipt")).json()["receipt"]
    assert {(tier["node_id"], tier["tier"]) for tier in receipt["tiers"]} == {
        (holder.node_id, "device"),
        (puller.node_id, "device"),
    }


@pytest.fixture(scope="module")
async def routed(stack, kafka_bootstrap: str, tiny_model_dir: Path) -> AsyncIterator[dict]:
    """A router over the holder and the puller; it reaches the holder through a :class:`PeerLink`
    of its own (``front``), whose ``hold`` keeps one of the holder's answers in flight."""
    holder, puller = stack["holder"], stack["puller"]
    front = PeerLink()
    front.target = holder.http.url
    front_url = await front.start()
    settings = RouterSettings(
        router_id=f"router-replicas-{uuid.uuid4().hex[:6]}",
        nodes=[
            {"node_id": holder.node_id, "url": front_url},
            {"node_id": puller.node_id, "url": puller.http.url},
        ],
        model_dir=tiny_model_dir,
        auth={"jwt_secret": JWT_SECRET},
        metrics={"token": METRICS_TOKEN},
        kafka_bootstrap=kafka_bootstrap,
        kafka=GROUP_TIMING,
        coordinator_url=stack["url"],
        coordinator_token=operator_token("router", "platform"),
        coordinator_public_key_file=command_public_key_file(),
        # One request in flight outweighs any prefix: the holder, once busy, is passed over.
        routing={"load_cost_blocks": 1000.0, "reread_interval_s": 0.2},
    )
    built = Router.build(settings)
    served = await Served(built.app).start()
    try:
        async with built.running():
            await eventually(
                lambda: len(built.fleet.candidates(time.monotonic())) == 2,
                timeout_s=60,
                what="both nodes routable",
            )
            yield {"router": built, "url": served.url, "front": front}
    finally:
        front.release.set()
        await served.stop()
        await front.stop()


async def ask_router(url: str, token: str, messages: list[dict]) -> tuple[str, int]:
    """(serving node, cached prompt tokens) of a greedy request through the router."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0},
            headers={"Authorization": f"Bearer {token}"},
        )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return response.headers[NODE_HEADER], usage["prompt_tokens_details"]["cached_tokens"]


async def test_the_router_sends_a_request_past_its_busy_holder_with_a_hint_and_the_node_pulls(
    stack, routed
) -> None:
    holder, puller, built = stack["holder"], stack["puller"], routed["router"]
    front: PeerLink = routed["front"]
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    messages = handbook("Who approves leave?")
    num_blocks = full_blocks(holder, messages)
    await ask(holder, tenant_token(tenant), messages)
    principal = TokenVerifier(IssuerSettings(jwt_secret=JWT_SECRET)).verify(tenant_token(tenant))
    (hashes,) = built.fleet.keying.keys(
        principal, request_messages({"messages": messages})
    ).values()

    def indexed() -> bool:
        return any(
            match.node_id == holder.node_id and match.num_blocks >= num_blocks
            for match in built.fleet.index.match(hashes)
        )

    await eventually(indexed, timeout_s=30, what="the holder's blocks in the router's index")
    # The same prefix goes to its holder, whose answer the front link then holds: one in flight.
    front.mode = "hold"
    busy = asyncio.create_task(ask_router(routed["url"], tenant_token(tenant), messages))
    await asyncio.wait_for(front.holding.wait(), TIMEOUT_S)
    before = pulls(puller, "pulled")

    node, cached = await ask_router(routed["url"], tenant_token(tenant), messages)

    assert node == puller.node_id
    assert cached == num_blocks * BLOCK_SIZE
    assert pulls(puller, "pulled") == before + 1
    front.release.set()
    assert await asyncio.wait_for(busy, TIMEOUT_S) == (holder.node_id, num_blocks * BLOCK_SIZE)
