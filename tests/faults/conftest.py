"""The fault-injection suite's system: one :class:`bench.cluster.Cluster` (private PostgreSQL and broker, a
coordinator process, two node processes) shared by every scenario, and the invariant checker.

Scenarios break the system in their own tenants and leave it running; the next scenario starts by
bringing back any process a failed one left dead. Every test here is marked ``faults`` (and
``integration``, so ``-m "not integration"`` still means "CPU only"); see
:func:`pytest_collection_modifyitems` for which of them a plain run includes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.cluster import Cluster, ClusterConfig
from bench.invariants import Invariants

_HERE = Path(__file__).parent


SCENARIOS_ENV = "KVLEDGER_TEST_FAULTS"
"""Set to 1 to run the fault scenarios in a plain run (CI with time to spare); ``-m faults`` selects them too."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything here ``faults`` and ``integration``. The scenarios restart processes a dozen times (each
    coordinator start waits for three consumer-group joins of about 5 s each on the embedded broker): the
    directory took 12 minutes on the shared 2-core build machine, far over its ~3-minute budget, so a plain
    run skips them unless asked; the short soak (``test_soak.py``, about 3 minutes) always runs."""
    markexpr = config.getoption("markexpr") or ""
    asked = os.environ.get(SCENARIOS_ENV) == "1" or ("faults" in markexpr and "not faults" not in markexpr)
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.integration)
            if not asked and item.path.name != "test_soak.py":
                item.add_marker(
                    pytest.mark.skip(reason=f"fault scenarios run with -m faults or {SCENARIOS_ENV}=1 (about 12 min on 2 cores)")
                )


@pytest.fixture(scope="session")
async def fault_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path_factory.mktemp("faults"), tiny_model_dir, ClusterConfig(num_nodes=2)) as cluster:
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
