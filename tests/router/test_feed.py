"""kv-events → the router's index → a routing decision, on real PostgreSQL, a real broker and the
coordinator's HTTP API.

The nodes are :class:`helpers.ledger.FakeNode`s publishing signed kv-events; the coordinator's
consumers ingest them into the ledger while the router's own consumer groups feed its index.
Covered: routing from kv-events, an unsigned record skipped, the index rebuilt from the ledger
by a restarted router routing as before, a seq gap repaired by a ledger re-read, and a decision
dropping a block from the index before any node acks it (and a re-read not bringing it back).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from helpers.ledger import (
    COMMAND_KEY,
    FakeNode,
    SigningProducer,
    block_hash,
    eventually,
    kafka_client_settings,
    operator_token,
    running_consumers,
    settings_at_topic_ends,
    stored,
)
from helpers.node import Served

from coordinator.api.app import create_app as create_coordinator_app
from coordinator.settings import kafka_settings
from events.kafka.producer import EventProducer
from events.schema import BlockStored, DocumentUpdated, make_event
from events.tiers import Tier
from router.feed import CoordinatorClient, Feed
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.scoring import PREFIX, Candidate, PrefixLoadStrategy

pytestmark = pytest.mark.integration


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
async def producer(settings) -> AsyncIterator[SigningProducer]:
    async with SigningProducer(
        kafka_settings(settings), settings.database.url.get_secret_value()
    ) as producer:
        yield producer


class Replica:
    """One router replica's index and feed; restartable with the same consumer groups."""

    def __init__(self, kafka_bootstrap: str, coordinator_url: str, group_id: str) -> None:
        self.kafka_bootstrap, self.coordinator_url, self.group_id = (
            kafka_bootstrap,
            coordinator_url,
            group_id,
        )

    async def start(self) -> Replica:
        self.index = PrefixIndex()
        self.metrics = RouterMetrics(self.index)
        self.coordinator = CoordinatorClient(
            self.coordinator_url, lambda: operator_token("router", "platform")
        )
        self.feed = Feed(
            self.index,
            self.metrics,
            kafka_client_settings(self.kafka_bootstrap),
            self.coordinator,
            COMMAND_KEY.public_key(),
            group_id=self.group_id,
            node_keys_cache_s=1.0,
            reread_interval_s=0.2,
        )
        await self.feed.start()
        return self

    async def stop(self) -> None:
        await self.feed.stop()
        await self.coordinator.close()

    def route(self, labels: list[str], node_ids: list[str]) -> tuple[tuple[str, ...], str]:
        decision = PrefixLoadStrategy().rank(
            [Candidate(node_id, 0) for node_id in node_ids],
            self.index.match([key(x) for x in labels]),
        )
        return decision.ranked, decision.reason


def key(label: str) -> bytes:
    return bytes.fromhex(block_hash(label))


@pytest.fixture(scope="module")
async def replica(kafka_bootstrap, coordinator_url) -> AsyncIterator[Replica]:
    running = await Replica(
        kafka_bootstrap, coordinator_url, f"router-test-{uuid.uuid4().hex[:8]}"
    ).start()
    try:
        yield running
    finally:
        await running.stop()


async def test_kv_events_route_to_the_node_holding_the_prefix_and_a_restart_routes_the_same(
    replica, producer, kafka_bootstrap, coordinator_url
):
    tag = uuid.uuid4().hex[:8]
    a, b = FakeNode(producer, f"ra-{tag}"), FakeNode(producer, f"rb-{tag}")
    labels = [f"{tag}-p{position}" for position in range(3)]
    for node in (a, b):
        await node.start()
    await a.store(*(stored(label, "device") for label in labels))
    await b.store(stored(labels[0], "host"))
    nodes = [b.node_id, a.node_id]

    async def routed_to_a() -> bool:
        return replica.route(labels, nodes) == ((a.node_id, b.node_id), PREFIX)

    await eventually(routed_to_a, timeout_s=30, what="the router's index fed by kv-events")
    assert replica.index.holders(key(labels[0])) == {a.node_id: Tier.DEVICE, b.node_id: Tier.HOST}

    # The ledger has it all too; a restarted replica (same groups, resuming past these records)
    # builds from it.
    await replica.stop()
    restarted = await Replica(kafka_bootstrap, coordinator_url, replica.group_id).start()
    try:

        async def rebuilt() -> bool:
            await restarted.feed.rebuild()
            return restarted.route(labels, nodes) == ((a.node_id, b.node_id), PREFIX)

        await eventually(
            rebuilt, timeout_s=30, what="the restarted router's index read from the ledger"
        )
        assert restarted.index.holders(key(labels[0])) == {
            a.node_id: Tier.DEVICE,
            b.node_id: Tier.HOST,
        }
        assert [restarted.index.holders(key(label)) for label in labels[1:]] == [
            {a.node_id: Tier.DEVICE}
        ] * 2
    finally:
        await restarted.stop()
        await replica.start()  # for the module's later tests


async def test_an_unsigned_record_is_skipped(replica, settings):
    tag = uuid.uuid4().hex[:8]
    async with EventProducer(kafka_settings(settings)) as plain:
        forged = make_event(
            BlockStored(
                node_id=f"rf-{tag}", epoch=1, seq=1, blocks=[stored(f"{tag}-forged", "device")]
            )
        )
        await plain.send(forged)

    async def counted() -> bool:
        return (
            replica.metrics.unverified.labels(
                topic="kvledger.kv-events", reason="unsigned"
            )._value.get()
        ) >= 1

    await eventually(counted, timeout_s=30, what="the unsigned record counted")
    assert replica.index.holders(key(f"{tag}-forged")) == {}


async def test_a_seq_gap_is_repaired_from_the_ledger(replica, producer):
    tag = uuid.uuid4().hex[:8]
    node = FakeNode(producer, f"rg-{tag}")
    await node.start()
    await node.store(stored(f"{tag}-first", "device"))
    await node.publish(BlockStored, seq=node.seq + 2, blocks=[stored(f"{tag}-after-gap", "device")])

    async def repaired() -> bool:
        state = replica.index.node(node.node_id)
        return (
            state is not None
            and state.reread_reason is None
            and state.last_seq == node.seq
            and replica.metrics.rereads._value.get() > 0
        )

    await eventually(repaired, timeout_s=30, what="the node re-read from the ledger after its gap")
    assert replica.index.holders(key(f"{tag}-after-gap")) == {node.node_id: Tier.DEVICE}


async def test_a_decision_stops_a_block_attracting_traffic_before_any_ack(replica, producer):
    tag = uuid.uuid4().hex[:8]
    tenant = f"t-{tag}"
    node = FakeNode(producer, f"ri-{tag}")
    await node.start()
    v1 = stored(
        f"{tag}-v1",
        "device",
        tenant_id=tenant,
        scope="tenant",
        documents=["handbook@1"],
        auth_scopes=[("hr", 0)],
    )
    v2 = stored(
        f"{tag}-v2",
        "device",
        tenant_id=tenant,
        scope="tenant",
        documents=["handbook@2"],
        auth_scopes=[("hr", 0)],
    )
    await node.store(v1, v2)
    await eventually(lambda: _held(replica, f"{tag}-v1"), timeout_s=30, what="both blocks indexed")
    await producer.send(make_event(DocumentUpdated(doc_id="handbook", version=2), tenant_id=tenant))

    async def dropped() -> bool:
        return not replica.index.holders(key(f"{tag}-v1"))

    await eventually(dropped, timeout_s=30, what="the decided block dropped from the index")
    assert replica.index.holders(key(f"{tag}-v2")) == {node.node_id: Tier.DEVICE}
    assert replica.route([f"{tag}-v1"], [node.node_id])[1] != PREFIX
    # The fake node never acks: the ledger still lists the copy live, pending its deletion; a
    # re-read leaves it out.
    await replica.feed.rebuild()
    assert replica.index.holders(key(f"{tag}-v1")) == {}
    assert replica.index.holders(key(f"{tag}-v2")) == {node.node_id: Tier.DEVICE}


async def _held(replica: Replica, label: str) -> bool:
    return bool(replica.index.holders(key(label)))


async def test_the_router_routes_of_the_coordinator_take_the_router_role_only(coordinator_url):
    async with httpx.AsyncClient(base_url=coordinator_url) as http:

        def as_role(role: str, tenant: str = "platform") -> dict[str, str]:
            return {"Authorization": f"Bearer {operator_token(role, tenant)}"}

        assert (await http.get("/v1/router/nodes", headers=as_role("router"))).status_code == 200
        assert (
            await http.get("/v1/router/nodes", headers=as_role("platform-admin"))
        ).status_code == 200
        refused = await http.get("/v1/router/nodes", headers=as_role("tenant-admin", "acme"))
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "insufficient_role")
        ledger = await http.get("/v1/ledger/blocks", headers=as_role("router"))
        assert (ledger.status_code, ledger.json()["error"]["code"]) == (403, "insufficient_role")
        unknown = await http.get(
            "/v1/router/placements", params={"node": "no-such-node"}, headers=as_role("router")
        )
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "unknown_node")
        assert (await http.get("/v1/router/nodes")).status_code == 401


async def test_a_starting_router_knows_the_versions_the_ledger_made_current(
    producer, kafka_bootstrap, coordinator_url
):
    """Decided before the replica started (so never on its commands group): read from
    ``/v1/router/versions``."""
    tenant = f"versions-{uuid.uuid4().hex[:8]}"
    for doc_id, version in (("handbook", 3), ("policies", 2)):
        await producer.send(
            make_event(DocumentUpdated(doc_id=doc_id, version=version), tenant_id=tenant)
        )
    headers = {"Authorization": f"Bearer {operator_token('router', 'platform')}"}
    async with httpx.AsyncClient(base_url=coordinator_url) as http:

        async def decided() -> bool:
            page = (await http.get("/v1/router/versions", headers=headers)).json()
            return (
                sum(entry["predicate"].get("tenant") == tenant for entry in page["decisions"]) == 2
            )

        await eventually(decided, timeout_s=30, what="the coordinator's decision listed")
        first = await http.get("/v1/router/versions", params={"limit": 1}, headers=headers)
        assert (
            first.status_code == 200
            and len(first.json()["decisions"]) == 1
            and first.json()["next_cursor"] is not None
        )
        bad = await http.get(
            "/v1/router/versions", params={"cursor": "not-a-cursor"}, headers=headers
        )
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_parameter")
        refused = await http.get(
            "/v1/router/versions",
            headers={"Authorization": f"Bearer {operator_token('tenant-admin', tenant)}"},
        )
        assert refused.status_code == 403
    replica = await Replica(
        kafka_bootstrap, coordinator_url, f"router-versions-{uuid.uuid4().hex[:8]}"
    ).start()
    try:
        assert replica.feed.versions.document_version(tenant, "handbook") == 3
        assert replica.feed.versions.document_version(tenant, "policies") == 2
    finally:
        await replica.stop()
