"""Routing strategies and node health, with exact expectations."""

from __future__ import annotations

from router.health import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, Liveness
from router.index import PrefixMatch
from router.scoring import (
    FALLBACK,
    LOAD,
    PREFIX,
    Candidate,
    LeastLoadedStrategy,
    PrefixLoadStrategy,
    RoundRobinStrategy,
)


def test_the_longest_weighted_prefix_wins():
    strategy = PrefixLoadStrategy(load_cost_blocks=4.0)
    candidates = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    decision = strategy.rank(candidates, [PrefixMatch("a", 3, 3.0), PrefixMatch("b", 8, 6.5)])
    assert decision.ranked[:2] == ("b", "a")
    assert decision.reason == PREFIX
    assert decision.predicted_blocks == {"b": 8, "a": 3, "c": 0}


def test_load_outweighs_a_prefix_once_it_costs_more_than_the_prefix_saves():
    strategy = PrefixLoadStrategy(load_cost_blocks=4.0)
    matches = [PrefixMatch("a", 10, 10.0)]
    assert (
        strategy.rank([Candidate("a", 2), Candidate("b", 0)], matches).ranked[0] == "a"
    )  # 10 - 8 > 0
    decision = strategy.rank([Candidate("a", 3), Candidate("b", 0)], matches)  # 10 - 12 < 0
    assert (decision.ranked, decision.reason) == (("b", "a"), LOAD)


def test_without_any_match_the_least_loaded_wins_and_ties_take_turns():
    strategy = PrefixLoadStrategy()
    assert strategy.rank([Candidate("a", 2), Candidate("b", 1)], []).ranked[0] == "b"
    firsts = [strategy.rank([Candidate("a", 0), Candidate("b", 0)], []) for _ in range(4)]
    assert {decision.reason for decision in firsts} == {FALLBACK}
    assert sorted(decision.ranked[0] for decision in firsts) == ["a", "a", "b", "b"]


def test_round_robin_and_least_loaded_ignore_the_index():
    round_robin = RoundRobinStrategy()
    candidates = [Candidate("a", 5), Candidate("b", 0), Candidate("c", 1)]
    assert [round_robin.rank(candidates, []).ranked[0] for _ in range(4)] == ["a", "b", "c", "a"]
    decision = LeastLoadedStrategy().rank(candidates, [PrefixMatch("a", 4, 4.0)])
    assert decision.ranked == ("b", "c", "a")
    assert decision.reason == FALLBACK
    assert decision.predicted_blocks["a"] == 4


def test_a_breaker_opens_after_consecutive_failures_and_lets_one_trial_through():
    breaker = CircuitBreaker(failure_threshold=2, open_s=10.0)
    breaker.failed(now=0.0)
    assert breaker.state(1.0) == CLOSED
    breaker.succeeded()
    breaker.failed(now=1.0)
    breaker.failed(now=2.0)
    assert (breaker.state(3.0), breaker.allows(3.0)) == (OPEN, False)
    assert (breaker.state(12.0), breaker.allows(12.0)) == (HALF_OPEN, True)
    breaker.sent(12.0)
    assert breaker.allows(12.5) is False  # one trial at a time
    breaker.failed(now=13.0)
    assert breaker.state(14.0) == OPEN  # a failed trial opens it again at once
    breaker.sent(23.5)
    breaker.succeeded()
    assert (breaker.state(23.6), breaker.allows(23.6)) == (CLOSED, True)


def test_a_node_unheard_for_longer_than_the_timeout_is_not_alive():
    liveness = Liveness(heartbeat_timeout_s=15.0)
    assert liveness.alive(100.0, now=114.9)
    assert not liveness.alive(100.0, now=115.0)
    assert not liveness.alive(None, now=0.0)
