"""The queue a node reports, read from its real metrics page, and what it does to a routing decision, exactly."""

from __future__ import annotations

from prometheus_client import generate_latest

from gpu_node.metrics import NodeMetrics
from router.index import PrefixMatch
from router.load import node_load, reported_queue
from router.scoring import LOAD, PREFIX, Candidate, PrefixLoadStrategy


def node_page(num_running: int, num_waiting: int) -> str:
    """A node's ``/metrics`` page as it serves it, with its scheduler's two gauges set."""
    metrics = NodeMetrics()
    metrics.requests_running.set(num_running)
    metrics.requests_waiting.set(num_waiting)
    return generate_latest(metrics.registry).decode()


def test_the_queue_is_running_plus_waiting_on_the_node_page():
    assert reported_queue(node_page(3, 2)) == 5
    assert reported_queue(node_page(0, 0)) == 0


def test_a_page_without_the_gauges_or_with_bad_values_reports_nothing():
    assert reported_queue("# HELP other x\nother_metric 4.0\n") is None
    assert reported_queue("kvledger_num_requests_running_total 9\nkvledger_num_requests_waiting nan-ish\n") is None
    assert reported_queue("kvledger_num_requests_running -1\nkvledger_num_requests_waiting 2.0\n") == 2


def test_load_is_the_larger_of_the_routers_in_flight_and_the_nodes_queue():
    assert node_load(2, None) == 2.0
    assert node_load(2, 5) == 5.0  # other replicas' and direct clients' requests too
    assert node_load(4, 1) == 4.0  # sent since the last poll: the node's page does not show them yet


def test_a_hot_prefix_moves_off_a_node_whose_own_queue_is_long():
    """Node a holds 10 device blocks of the prefix; the router has nothing in flight anywhere, but a reports 3 queued."""
    strategy = PrefixLoadStrategy(load_cost_blocks=4.0)
    matches = [PrefixMatch("a", 10, 10.0)]
    quiet = strategy.rank([Candidate("a", node_load(0, 2)), Candidate("b", node_load(0, 0))], matches)
    assert (quiet.ranked, quiet.reason) == (("a", "b"), PREFIX)  # 10 - 8 > 0
    busy = strategy.rank([Candidate("a", node_load(0, 3)), Candidate("b", node_load(0, 0))], matches)
    assert (busy.ranked, busy.reason) == (("b", "a"), LOAD)  # 10 - 12 < 0
    assert busy.predicted_blocks == {"b": 0, "a": 10}
