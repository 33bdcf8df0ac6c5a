"""The router's pull hint (``router.scoring.pull_hint``): who holds more of a request's prefix than the chosen node."""

from __future__ import annotations

from router.index import PrefixMatch
from router.scoring import Candidate, Decision, PrefixLoadStrategy, pull_hint


def test_a_request_sent_past_an_overloaded_holder_names_the_holder_and_its_blocks():
    decision = PrefixLoadStrategy(load_cost_blocks=4.0).rank(
        [Candidate("a", 3), Candidate("b", 0)],
        [PrefixMatch("a", 10, 10.0), PrefixMatch("b", 2, 2.0)],
    )
    assert decision.ranked[0] == "b"
    assert pull_hint(decision, "b") == ("a", 10)


def test_no_hint_for_the_best_holder_or_a_node_holding_as_much():
    decision = Decision(("a", "b", "c"), "prefix", {"a": 6, "b": 6, "c": 0})
    assert pull_hint(decision, "a") is None
    assert pull_hint(decision, "b") is None
    assert pull_hint(decision, "c") == ("a", 6), "a tie goes to the better ranked holder"
    assert pull_hint(Decision(("a", "b"), "fallback", {"a": 0, "b": 0}), "b") is None
