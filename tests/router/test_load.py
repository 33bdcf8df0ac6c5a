"""The queue a node reports (its ``/v1/kvledger/load`` answer) and what it does to a routing decision, exactly."""

from __future__ import annotations

from router.index import PrefixMatch
from router.load import MAX_QUEUE, node_load, reported_queue
from router.scoring import LOAD, PREFIX, Candidate, PrefixLoadStrategy


def test_the_queue_is_running_plus_waiting():
    assert reported_queue({"num_requests_running": 3, "num_requests_waiting": 2}) == 5
    assert reported_queue({"num_requests_running": 0, "num_requests_waiting": 0}) == 0


def test_an_answer_that_is_not_a_load_reports_nothing():
    for answer in (
        [],
        {"num_requests_running": 3},
        {"num_requests_running": 3, "num_requests_waiting": -1},
        {"num_requests_running": 3.0, "num_requests_waiting": 1},
        {"num_requests_running": True, "num_requests_waiting": 1},
        {"num_requests_running": MAX_QUEUE + 1, "num_requests_waiting": 0},
    ):
        assert reported_queue(answer) is None, answer


def test_load_is_the_larger_of_the_routers_in_flight_and_the_nodes_queue():
    assert node_load(2, None) == 2.0
    assert node_load(2, 5) == 5.0  # other replicas' and direct clients' requests too
    assert (
        node_load(4, 1) == 4.0
    )  # sent since the last poll: the node's answer does not show them yet


def test_a_hot_prefix_moves_off_a_node_whose_own_queue_is_long():
    """Node a holds 10 device blocks of the prefix; the router has nothing in flight anywhere, but a
    reports a queue."""
    strategy = PrefixLoadStrategy(load_cost_blocks=4.0)
    matches = [PrefixMatch("a", 10, 10.0)]
    quiet = strategy.rank(
        [Candidate("a", node_load(0, 2)), Candidate("b", node_load(0, 0))], matches
    )
    assert (quiet.ranked, quiet.reason) == (("a", "b"), PREFIX)  # 10 - 8 > 0
    busy = strategy.rank(
        [Candidate("a", node_load(0, 3)), Candidate("b", node_load(0, 0))], matches
    )
    assert (busy.ranked, busy.reason) == (("b", "a"), LOAD)  # 10 - 12 < 0
    assert busy.predicted_blocks == {"b": 0, "a": 10}
