"""Partition takeover under load: two coordinator processes in the same consumer groups, two nodes.

The broker splits every coordinator topic's partitions between the two processes (the nodes' ids are
spread over the kv-events partitions, so each process ingests one node's events). The recorded run
with four nodes is ``kvledger bench soak --coordinators 2 --nodes 4`` (docs/benchmarks.md); here two
nodes keep the start short. A soak runs chats on every node, document updates, revocations and
erasures; half-way the second coordinator is SIGKILLed, stays dead for :data:`DOWN_S` — longer than
the consumer session, so the broker expires it and the survivor takes its partitions over — then is
restarted and rejoins (a second rebalance).

Nothing may be lost or doubled: the survivor applies kv-events of the dead process's partitions
while it is down (:meth:`Invariants.taken_over`), every kv-event on the topic is in the ledger's
inbox with one content per seq and no hole, every command completes, every erasure verifies, and the
ledger equals each node's inventory (:meth:`Invariants.check`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.fork_server import ForkServer
from helpers.ledger import GROUP_TIMING

from bench.cluster import COORDINATOR_GROUP, NUM_PARTITIONS, Cluster, ClusterConfig
from bench.soak import SoakOptions, run_soak
from events.topics import KV_EVENTS

DOWN_S = 15.0
"""Seven consumer sessions (``ClusterConfig.consumer_session_timeout_ms``): the survivor owns the dead one's
partitions for most of it."""
SOAK_S = 40.0
NUM_NODES = 2


@pytest.fixture(scope="module")
async def two_coordinators(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> AsyncIterator[Cluster]:
    config = ClusterConfig(
        num_nodes=NUM_NODES,
        num_coordinators=2,
        consumer_fetch_max_wait_ms=GROUP_TIMING["fetch_max_wait_ms"],
        launcher=fork_server.launch,
    )
    async with Cluster(tmp_path_factory.mktemp("takeover"), tiny_model_dir, config) as cluster:
        yield cluster


async def test_a_killed_coordinators_partitions_are_taken_over_without_loss(
    two_coordinators: Cluster,
) -> None:
    cluster = two_coordinators
    first, second = cluster.coordinators
    split = [child.assigned_partitions(COORDINATOR_GROUP, KV_EVENTS) for child in (first, second)]
    assert (
        split[0]
        and split[1]
        and split[0] | split[1] == set(range(NUM_PARTITIONS))
        and not split[0] & split[1]
    ), f"the two coordinators do not split the kv-events partitions: {split}"
    nodes_partitions = {
        index % NUM_PARTITIONS for index in range(NUM_NODES)
    }  # bench.cluster.spread_node_id
    assert split[0] & nodes_partitions and split[1] & nodes_partitions, (
        f"a coordinator owns no node's partition: {split}"
    )

    options = SoakOptions(
        duration_s=SOAK_S,
        tenants=2,
        concurrency=4,
        action_interval_s=2.0,
        check_interval_s=10.0,
        node_restarts=0,
        coordinator_restarts=1,
        coordinator_down_s=DOWN_S,
    )
    report = await run_soak(cluster, options)

    assert report.violations == [], "\n".join(report.violations)
    assert report.faults == {"coordinator_sigkill": 1, "coordinator_restart": 1}, report.faults
    assert report.counts["takeovers"] == 1, report.counts
    assert report.counts["kv_events_taken_over"] > 0, (
        f"no kv-event reached the dead coordinator's partitions: {report.counts}"
    )
    for count in ("requests_ok", "kv_events", "commands", "erasures_verified", "probes"):
        assert report.counts[count] > 0, f"the run did no {count}: {report.counts}"
    rejoined = [
        child.assigned_partitions(COORDINATOR_GROUP, KV_EVENTS) for child in (first, second)
    ]
    assert rejoined[1], (
        f"the restarted coordinator was given no kv-events partition back: {rejoined}"
    )
