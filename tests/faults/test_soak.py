"""The CI variant of ``kvledger bench soak``: two minutes of mixed workload with two node restarts
(each after a snapshot) and a coordinator restart on the fault suite's cluster (one of its own in a
parallel run, see tests/conftest.py); no invariant violated, and every kind of work actually
happened."""

from __future__ import annotations

from bench.cluster import Cluster
from bench.soak import SoakOptions, process_lives, render_markdown, run_soak

SOAK_S = 120.0
"""Two minutes: room for two node restarts and a coordinator SIGKILL (each 10-30 s on a loaded CI
machine) with requests and governance actions flowing around them. The restarts (at 40 s and 80 s)
and the coordinator's (at 60 s) overlap on a slow machine: a node then takes its start inventory
while the key service is down, the case that once reported a node's snapshot placements missing from
the ledger (docs/benchmarks.md, "Soak")."""


async def test_a_short_soak_keeps_every_invariant(cluster: Cluster) -> None:
    options = SoakOptions(
        duration_s=SOAK_S,
        tenants=2,
        concurrency=3,
        action_interval_s=3.0,
        check_interval_s=20.0,
        node_restarts=2,
        rss_sample_interval_s=5.0,
    )
    report = await run_soak(cluster, options)
    print(
        render_markdown(report, f"tests/faults/test_soak.py: {options}")
    )  # the counts, for ``pytest -rP``
    assert report.violations == [], "\n".join(report.violations)
    for count in (
        "requests_ok",
        "kv_events",
        "commands",
        "document_updates",
        "erasures_verified",
        "probes",
        "checks",
    ):
        assert report.counts[count] > 0, f"the soak did no {count}: {report.counts}"
    assert report.counts.get("snapshots") == 2, report.counts
    assert (
        report.faults.get("node_restart") == 2 and report.faults.get("coordinator_sigkill") == 1
    ), report.faults
    assert set(report.resources_end) == set(report.resources_start)
    # Every process is sampled throughout, and each restart starts a new life: 2 nodes + 2 restarts,
    # 1 coordinator + 1.
    lives = process_lives(report.rss_samples)
    assert {life.name for life in lives} == {child.name for child in cluster.children}
    assert len(lives) == len(cluster.children) + 2 + 1, [(life.name, life.pid) for life in lives]
