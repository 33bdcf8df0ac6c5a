"""The router in front of three real tiny-model nodes: affinity, load spread, a paused node routed
around, streaming, isolation, a stale document refused as the node refuses it, authentication,
metrics.

Everything is real and talks over real transports: the coordinator's consumers and API on a fresh
ledger, three nodes as ``gpu_node.entrypoints.server.serve`` runs them
(``helpers.node.RunningNode``), and the router (``router.server.Router``) served by uvicorn, fed by
its own consumer groups. Requests go through the official ``openai`` client. One cluster for the
whole module (each node start costs seconds of CPU); nodes beat every :data:`HEARTBEAT_S` and the
router takes one unheard for :data:`HEARTBEAT_TIMEOUT_S` as gone, so a paused node is noticed within
seconds."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.ledger import (
    GROUP_TIMING,
    JWT_SECRET,
    SigningProducer,
    command_public_key_file,
    enroll_nodes,
    eventually,
    operator_token,
    running_consumers,
    settings_at_topic_ends,
    stored,
)
from helpers.node import RunningNode, Served, node_settings

from coordinator.api.app import create_app as create_coordinator_app
from coordinator.consumers import kafka_settings
from events.schema import BlockStored, DocumentUpdated, NodeStarted, make_event
from gpu_node.settings import CacheSettings
from identity.settings import IssuerSettings
from identity.tokens import Principal, TokenVerifier, issue_token
from router.api import NODE_HEADER, Fleet, create_app
from router.health import Liveness
from router.index import PrefixIndex
from router.keying import Keying, request_messages
from router.server import Router
from router.settings import NodeEndpoint, RouterSettings

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

METRICS_TOKEN = "router-e2e-metrics-token"
HEARTBEAT_S = 0.2
HEARTBEAT_TIMEOUT_S = 4.0
SYSTEM = (
    "You are the assistant of the ACME handbook. Answer briefly, and only from the handbook text you are given below. "
    * 3
)


def token(tenant: str, scopes: tuple[str, ...] = ("hr",)) -> str:
    return issue_token(
        tenant=tenant, sub="alice", scopes=list(scopes), pv=0, ttl_s=600, secret=JWT_SECRET
    )


def messages(question: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "tenant"},
        {"role": "user", "content": question},
    ]


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str):
    return await settings_at_topic_ends(ledger_url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def coordinator_url(settings) -> AsyncIterator[str]:
    async with running_consumers(settings):
        api = await Served(create_coordinator_app(settings)).start()
        try:
            yield api.url
        finally:
            await api.stop()


@pytest.fixture(scope="module")
async def nodes(
    coordinator_url, ledger_url, kafka_bootstrap, tiny_model_dir: Path, tmp_path_factory
) -> AsyncIterator[list[RunningNode]]:
    suffix = uuid.uuid4().hex[:6]
    node_ids = [f"route-{name}-{suffix}" for name in ("a", "b", "c")]
    await enroll_nodes(ledger_url, node_ids)
    root = tmp_path_factory.mktemp("router-nodes")
    started: list[RunningNode] = []
    try:
        for node_id in node_ids:
            cache = CacheSettings(
                block_size=16, num_device_blocks=96, num_host_blocks=0, max_disk_blocks=0
            )
            settings = node_settings(
                node_id,
                tiny_model_dir,
                root / node_id,
                kafka_bootstrap,
                cache,
                metrics={"token": METRICS_TOKEN},
                heartbeat_interval_s=HEARTBEAT_S,
            )
            started.append(await RunningNode(settings).start())
        for node in started:
            await eventually(node.ready, timeout_s=60, what=f"{node.node_id} ready")
        yield started
    finally:
        for node in started:
            await node.stop()


@pytest.fixture(scope="module")
async def router(
    nodes, coordinator_url, kafka_bootstrap, tiny_model_dir
) -> AsyncIterator[tuple[Router, str]]:
    settings = RouterSettings(
        router_id=f"router-e2e-{uuid.uuid4().hex[:6]}",
        nodes=[{"node_id": node.node_id, "url": node.http.url} for node in nodes],
        model_dir=tiny_model_dir,
        auth={"jwt_secret": JWT_SECRET},
        metrics={"token": METRICS_TOKEN},
        kafka_bootstrap=kafka_bootstrap,
        kafka=GROUP_TIMING,
        coordinator_url=coordinator_url,
        coordinator_token=operator_token("router", "platform"),
        coordinator_public_key_file=command_public_key_file(),
        routing={
            "reread_interval_s": 0.2,
            "node_keys_cache_s": 1.0,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "queue_poll_interval_s": 0.2,
        },
    )
    built = Router.build(settings)
    served = await Served(built.app).start()
    try:
        async with built.running():

            async def serving() -> bool:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{served.url}/health")).status_code == 200

            await eventually(serving, timeout_s=60, what="the router ready to route")
            await eventually(
                lambda: len(built.fleet.candidates(time.monotonic())) == len(nodes),
                timeout_s=60,
                what="every node routable",
            )
            yield built, served.url
    finally:
        await served.stop()


def client(url: str, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=token(tenant), max_retries=0, timeout=120
    )


async def ask(url: str, tenant: str, question: str) -> tuple[str, int]:
    """(serving node, cached prompt tokens) of one request through ``url``."""
    async with client(url, tenant) as openai_client:
        raw = await openai_client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages(question), max_tokens=2, temperature=0
        )
    completion = raw.parse()
    return raw.headers.get(NODE_HEADER), completion.usage.prompt_tokens_details.cached_tokens


async def test_the_second_request_of_a_prefix_goes_to_the_node_holding_it_and_hits(router):
    built, url = router
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    first_node, first_cached = await ask(url, tenant, "How many vacation days?")
    assert first_node in built.fleet.endpoints
    assert first_cached == 0
    keys = built.fleet.keying.keys(
        _principal(tenant), request_messages({"messages": messages("How many vacation days?")})
    )
    (hashes,) = keys.values()

    def indexed() -> bool:
        return any(
            match.node_id == first_node and match.num_blocks >= 4
            for match in built.fleet.index.match(hashes)
        )

    await eventually(indexed, timeout_s=30, what="the first request's blocks in the router's index")
    for question in ("How many vacation days?", "Who approves leave?"):
        node, cached = await ask(url, tenant, question)
        assert node == first_node
        assert cached >= 4 * 16  # the shared tenant-scope system prompt


async def test_tenant_b_gets_no_cached_tokens_for_tenant_a_text(router):
    _, url = router
    tenant_a, tenant_b = f"acme-{uuid.uuid4().hex[:6]}", f"globex-{uuid.uuid4().hex[:6]}"
    await ask(url, tenant_a, "What is the leave policy?")
    await ask(url, tenant_a, "What is the leave policy?")
    _, cached = await ask(url, tenant_b, "What is the leave policy?")
    assert cached == 0


async def test_a_stream_through_the_router_is_the_node_stream(router, nodes):
    built, url = router
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    body = {
        "model": "tiny",
        "messages": messages("Stream me the policy."),
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {token(tenant)}"}
    async with httpx.AsyncClient(timeout=120) as http:
        await http.post(
            f"{url}/v1/chat/completions", json={**body, "stream": False}, headers=headers
        )  # warm one node
        through = await http.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={**headers, "X-Request-Id": "router-stream-1"},
        )
        node = next(node for node in nodes if node.node_id == through.headers[NODE_HEADER])
        direct = await http.post(f"{node.http.url}/v1/chat/completions", json=body, headers=headers)
    assert through.status_code == direct.status_code == 200
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert through.headers["x-request-id"] == "router-stream-1"
    assert _normalised(through.content) == _normalised(direct.content)
    assert through.content.endswith(b"data: [DONE]\n\n")


def _normalised(stream: bytes) -> bytes:
    """The stream with its completion id and creation time blanked: they differ between any two
    requests."""
    return re.sub(
        rb'"created": \d+', b'"created": 0', re.sub(rb"chatcmpl-[0-9a-f]+", b"chatcmpl-x", stream)
    )


async def test_the_router_refuses_as_the_node_refuses_before_anything_else(router, nodes):
    _, url = router
    async with httpx.AsyncClient(timeout=60) as http:
        answers = [
            await http.post(f"{base}/v1/chat/completions", content=b"not json")
            for base in (url, nodes[0].http.url)
        ]
        assert [answer.status_code for answer in answers] == [401, 401]
        assert answers[0].json() == answers[1].json()
        assert answers[0].headers["www-authenticate"] == "Bearer"
        wrong_model = await http.post(
            f"{url}/v1/chat/completions",
            json={"model": "gpt-4", "messages": messages("hi")},
            headers={"Authorization": f"Bearer {token('acme')}"},
        )
        assert (wrong_model.status_code, wrong_model.json()["error"]["code"]) == (
            404,
            "model_not_found",
        )
        listed = await http.get(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {token('acme')}"}
        )
        assert [card["id"] for card in listed.json()["data"]] == ["tiny"]


async def test_metrics_count_decisions_and_cached_tokens_behind_the_token(router):
    _, url = router
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/metrics")).status_code == 401
        text = (
            await http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        ).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['kvledger_router_decisions_total{reason="prefix"}'] >= 1
    assert samples["kvledger_router_served_cached_tokens_total"] > 0
    assert samples["kvledger_router_predicted_cached_tokens_total"] > 0
    assert any(
        name.startswith("kvledger_router_index_blocks{") and value > 0
        for name, value in samples.items()
    )


def _principal(tenant: str) -> Principal:
    return TokenVerifier(IssuerSettings(jwt_secret=JWT_SECRET)).verify(token(tenant))


async def test_a_node_failing_before_its_first_byte_is_retried_once_on_the_next_best(
    router, nodes, tiny_model_dir
):
    """A second app over the same index type: a dead node holds the prompt's prefix, so it is tried
    first."""
    built, _ = router
    real = nodes[0]
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    keying = Keying(tiny_model_dir, "tiny")
    keying.nodes = {
        "dead": built.fleet.keying.nodes[real.node_id],
        real.node_id: built.fleet.keying.nodes[real.node_id],
    }
    index = PrefixIndex()
    now = time.monotonic()
    for node_id in ("dead", real.node_id):
        index.apply(NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns"), now)
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    (hashes,) = keying.keys(
        _principal(tenant), request_messages({"messages": messages("Retry me.")})
    ).values()
    blocks = [
        stored(f"retry-{position}", "device").model_copy(update={"block_hash": block.hex()})
        for position, block in enumerate(hashes)
    ]
    index.apply(BlockStored(node_id="dead", epoch=1, seq=1, blocks=blocks), now)
    endpoints = {
        "dead": NodeEndpoint(node_id="dead", url=dead_url),
        real.node_id: NodeEndpoint(node_id=real.node_id, url=real.http.url),
    }
    fleet = Fleet(
        endpoints, index, keying, Liveness(60.0), failure_threshold=3, breaker_open_s=10.0
    )
    app = create_app(
        built.settings, fleet, None, TokenVerifier(IssuerSettings(jwt_secret=JWT_SECRET))
    )
    served = await Served(app).start()
    try:
        node, _ = await ask(served.url, tenant, "Retry me.")
    finally:
        await served.stop()
        dead.close()
    assert node == real.node_id
    assert fleet.breaker("dead").num_failures == 1
    assert app.state.router.metrics.decisions.labels(reason="retry")._value.get() == 1
    assert fleet.in_flight == {"dead": 0, real.node_id: 0}


async def test_a_balanced_workload_is_spread_and_every_repeat_hits(router):
    """Nine tenants' prompts (nine distinct prefixes), three questions each, in a shuffled order: no
    node takes more than 60 % of the requests, and every request after a prefix's first is served
    from cache."""
    built, url = router
    suffix = uuid.uuid4().hex[:6]
    workload = [
        (f"spread-{number}-{suffix}", question)
        for number in range(9)
        for question in ("Who?", "When?", "Where?")
    ]
    random.Random(23).shuffle(workload)
    served: Counter[str] = Counter()
    first_node: dict[str, str] = {}
    for tenant, question in workload:
        node, cached = await ask(url, tenant, question)
        served[node] += 1
        if tenant in first_node:
            assert cached >= 4 * 16, f"a repeat of {tenant}'s prefix missed on {node}"
        else:
            first_node[tenant] = node
            (hashes,) = built.fleet.keying.keys(
                _principal(tenant), request_messages({"messages": messages(question)})
            ).values()

            def indexed(hashes: list[bytes] = hashes, node: str = node) -> bool:
                return any(
                    match.node_id == node and match.num_blocks >= 4
                    for match in built.fleet.index.match(hashes)
                )

            await eventually(indexed, timeout_s=30, what=f"{tenant}'s blocks indexed on {node}")
    assert sum(served.values()) == len(workload)
    assert max(served.values()) <= 0.6 * len(workload), served


@contextlib.asynccontextmanager
async def silenced(node: RunningNode) -> AsyncIterator[None]:
    """The node as a paused process looks to the router: no kv-event and no heartbeat leaves it.

    The test nodes run in the test's own process, so it cannot be stopped with SIGSTOP; its
    publisher's flush and heartbeat loops are stopped instead, and started again on the way out.
    """
    publisher = node.publisher
    for task in publisher._tasks:
        task.cancel()
    await asyncio.gather(*publisher._tasks, return_exceptions=True)
    try:
        yield
    finally:
        publisher._tasks = [
            asyncio.create_task(publisher._flush_loop()),
            asyncio.create_task(publisher._heartbeat_loop()),
        ]


async def test_a_paused_node_is_routed_around_and_taken_back_when_it_beats_again(router, nodes):
    built, url = router
    tenant = f"paused-{uuid.uuid4().hex[:6]}"
    holder, _ = await ask(url, tenant, "Where is the office?")
    (hashes,) = built.fleet.keying.keys(
        _principal(tenant), request_messages({"messages": messages("Where is the office?")})
    ).values()
    await eventually(
        lambda: any(
            match.node_id == holder and match.num_blocks >= 4
            for match in built.fleet.index.match(hashes)
        ),
        timeout_s=30,
        what="the prefix indexed on its node",
    )
    node = next(node for node in nodes if node.node_id == holder)

    def routable() -> set[str]:
        return {candidate.node_id for candidate in built.fleet.candidates(time.monotonic())}

    async with silenced(node):
        await eventually(
            lambda: holder not in routable(),
            timeout_s=HEARTBEAT_TIMEOUT_S + 30,
            what=f"{holder} skipped",
        )
        assert len(routable()) == len(nodes) - 1
        for question in ("Where is the office?", "When does it open?"):
            served_by, _ = await ask(url, tenant, question)
            assert served_by != holder
    await eventually(lambda: holder in routable(), timeout_s=30, what=f"{holder} routable again")


async def test_the_router_learns_every_nodes_own_queue(router, nodes):
    built, _ = router
    await eventually(
        lambda: set(built.fleet.reported_queue) == {node.node_id for node in nodes},
        timeout_s=30,
        what="every node's queue polled",
    )
    assert all(queue >= 0 for queue in built.fleet.reported_queue.values())
    async with httpx.AsyncClient() as http:
        unauthenticated = await http.get(f"{nodes[0].http.url}/v1/kvledger/load")
        answer = await http.get(
            f"{nodes[0].http.url}/v1/kvledger/load",
            headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
        )
    assert unauthenticated.status_code == 401
    assert set(answer.json()) == {"num_requests_running", "num_requests_waiting"}


def document_messages(version: int) -> list[dict]:
    text = " ".join(f"handbook section {number} says staff rest" for number in range(12))
    return [
        {"role": "system", "content": SYSTEM, "cache_scope": "public"},
        {
            "role": "user",
            "content": text,
            "document": {"id": "handbook", "version": version, "auth_scope": "hr"},
        },
        {"role": "user", "content": "How long is the rest?"},
    ]


async def test_a_stale_document_version_is_refused_at_the_router_with_the_nodes_answer(
    router, nodes, settings
):
    built, url = router
    tenant = f"stale-{uuid.uuid4().hex[:6]}"
    headers = {"Authorization": f"Bearer {token(tenant)}"}
    stale_body = {
        "model": "tiny",
        "messages": document_messages(1),
        "max_tokens": 2,
        "temperature": 0,
    }
    async with SigningProducer(
        kafka_settings(settings), settings.database.url.get_secret_value()
    ) as producer:
        await producer.send(
            make_event(DocumentUpdated(doc_id="handbook", version=2), tenant_id=tenant)
        )
    async with httpx.AsyncClient(timeout=120) as http:
        refusals: dict[str, httpx.Response] = {}

        async def refused(name: str, base: str) -> bool:
            refusals[name] = await http.post(
                f"{base}/v1/chat/completions", json=stale_body, headers=headers
            )
            # At the router: refused by the router itself. Until it has consumed the decision it
            # proxies, and a node that already has answers the same 409 with its own header.
            by_router = name != "router" or NODE_HEADER not in refusals[name].headers
            return refusals[name].status_code == 409 and by_router

        await eventually(
            lambda: refused("router", url), timeout_s=60, what="the router refusing version 1"
        )
        await eventually(
            lambda: refused("node", nodes[0].http.url),
            timeout_s=60,
            what="the node refusing version 1",
        )
        at_router, at_node = refusals["router"], refusals["node"]
        assert at_router.json() == at_node.json()
        assert at_router.json()["error"]["code"] == "stale_document_version"
        assert at_router.json()["error"]["param"] == "messages[1].document.version"
        assert NODE_HEADER not in at_router.headers  # refused before any node was asked
        current = await http.post(
            f"{url}/v1/chat/completions",
            json={**stale_body, "messages": document_messages(2)},
            headers=headers,
        )
        assert current.status_code == 200
        assert current.headers[NODE_HEADER] in built.fleet.endpoints
        # A caller without the document's auth scope learns nothing of its versions: the node's 403,
        # as sent straight.
        outsider = {"Authorization": f"Bearer {token(tenant, scopes=('sales',))}"}
        through = await http.post(f"{url}/v1/chat/completions", json=stale_body, headers=outsider)
        direct = await http.post(
            f"{nodes[0].http.url}/v1/chat/completions", json=stale_body, headers=outsider
        )
    assert (through.status_code, through.json()) == (direct.status_code, direct.json())
    assert through.json()["error"]["code"] == "document_scope_forbidden"
