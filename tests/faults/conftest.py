"""The fault-injection suite's system: one :class:`bench.cluster.Cluster` (private PostgreSQL and
broker, a coordinator process, two node processes) shared by every scenario, and the invariant
checker.

Scenarios break the system in their own tenants and leave it running; the next scenario starts by
bringing back any process a failed one left dead. Every test here is marked ``faults`` (and
``integration``, so ``-m "not integration"`` still means "CPU only") and runs in a plain ``./run
test``: on one of its parallel workers, the whole directory as one unit, so the cluster starts once
(``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.fork_server import ForkServer
from helpers.ledger import GROUP_TIMING

from bench.cluster import Cluster, ClusterConfig
from bench.invariants import Invariants

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything here ``faults`` and ``integration`` (``-m faults`` runs just this suite). The
    whole directory takes about 2.5 minutes on 2 cores: the coordinators' and nodes' consumer groups
    use a 2 s session (``ClusterConfig``), so a restart no longer waits out 5 s joins and a killed
    member's 10 s session."""
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
async def fault_cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> AsyncIterator[Cluster]:
    # the tests' fetch wait, not production's: these tests time nothing, and idle consumers cost a
    # tenth of the CPU; every start and restart forked from the session's fork server, without the
    # ML imports
    config = ClusterConfig(
        num_nodes=2,
        consumer_fetch_max_wait_ms=GROUP_TIMING["fetch_max_wait_ms"],
        launcher=fork_server.launch,
    )
    async with Cluster(tmp_path_factory.mktemp("faults"), tiny_model_dir, config) as cluster:
        yield cluster


@pytest.fixture
async def cluster(fault_cluster: Cluster) -> Cluster:
    """The shared cluster with every process running and the broker answering."""
    fault_cluster.resume_broker()
    for child in (fault_cluster.coordinator, *fault_cluster.nodes):
        if not child.running:
            await child.start()
    return fault_cluster


@pytest.fixture
def invariants(cluster: Cluster) -> Invariants:
    return Invariants(cluster)
