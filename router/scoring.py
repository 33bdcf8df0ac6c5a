"""Which node serves a request: strategies over the index's prefix matches and the nodes' load.

A strategy ranks the nodes that may serve (healthy, keyed for the model) best first and says why
the first one won (:class:`Decision`). The router's own is :class:`PrefixLoadStrategy`; the
benchmarks compare it with :class:`RoundRobinStrategy` and :class:`LeastLoadedStrategy`
(``kvledger bench routing``). Pure: tested with exact expectations (tests/router/test_scoring.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol

from events.pull_hint import MAX_HINT_BLOCKS
from router.index import PrefixMatch

PREFIX = "prefix"
"""The node with the best cached prefix won."""
LOAD = "load"
"""A node with a cached prefix was passed over for a less loaded one."""
FALLBACK = "fallback"
"""No node holds any of the request's blocks: the least loaded one."""
RETRY = "retry"
"""The next-best node, after the first failed before its first byte."""
DECISION_REASONS = (PREFIX, LOAD, FALLBACK, RETRY)

_NODE_ID = itemgetter(3)
_NODE_AND_BLOCKS = itemgetter(3, 4)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that may serve: its load (the larger of the requests this router has in flight there and the queue
    the node reports, ``router.load.node_load``)."""

    node_id: str
    load: float


@dataclass(frozen=True, slots=True)
class Decision:
    """Nodes best first, why the first won, and the cached blocks predicted on each (0 when none)."""

    ranked: tuple[str, ...]
    reason: str
    predicted_blocks: Mapping[str, int]


def pull_hint(decision: Decision, node_id: str) -> tuple[str, int] | None:
    """``(holder, blocks)`` when ``node_id`` is sent a request whose prefix another node holds more of, else None.

    The node holding the most predicted blocks (the better ranked on a tie): ``node_id`` may pull the
    blocks it misses from it instead of computing them (docs/architecture.md "Replicas") — prefix-aware
    load balancing with transfer, when the strategy passed an overloaded holder over. The hint names a
    node id only; the node resolves it in its own peer list.
    """
    predicted = decision.predicted_blocks
    holder = max(decision.ranked, key=lambda candidate: predicted.get(candidate, 0))
    num_blocks = predicted.get(holder, 0)
    if holder == node_id or num_blocks <= predicted.get(node_id, 0):
        return None
    return holder, min(num_blocks, MAX_HINT_BLOCKS)


class Strategy(Protocol):
    def rank(self, candidates: Sequence[Candidate], matches: Sequence[PrefixMatch]) -> Decision: ...


class PrefixLoadStrategy:
    """Score = weighted cached blocks − ``load_cost_blocks`` × load; ties go to the less loaded, then in turn.

    ``load_cost_blocks`` is what one request ahead in a node's queue costs, in device blocks of
    prefill saved: with 4, a node holding 30 cached blocks of a hot prefix takes that prefix's
    requests until it has about 7 more in flight than an empty node, so one hot prefix spreads
    instead of piling onto one node.
    """

    def __init__(self, load_cost_blocks: float = 4.0) -> None:
        if load_cost_blocks < 0:
            raise ValueError("load_cost_blocks must not be negative")
        self.load_cost_blocks = load_cost_blocks
        self._turn = itertools.count()

    def rank(self, candidates: Sequence[Candidate], matches: Sequence[PrefixMatch]) -> Decision:
        assert candidates, "a decision needs at least one candidate"
        by_node = {match.node_id: match for match in matches}
        turn = next(self._turn)
        count = len(candidates)
        cost = self.load_cost_blocks
        # One sort key per candidate, built in one pass (a key function is a call per candidate):
        # the best score, then the less loaded, then in turn; positions differ, so no tie reaches
        # the node id and the cached blocks that follow.
        get = by_node.get
        keyed = [
            (
                -(match.weighted_blocks - cost * candidate.load)
                if (match := get(candidate.node_id)) is not None
                else -(0.0 - cost * candidate.load),
                candidate.load,
                (position - turn) % count,
                candidate.node_id,
                0 if match is None else match.num_blocks,
            )
            for position, candidate in enumerate(candidates)
        ]
        keyed.sort()
        ranked = tuple(map(_NODE_ID, keyed))
        predicted = dict(map(_NODE_AND_BLOCKS, keyed))
        best_cached = max(predicted.values())
        if best_cached == 0:
            reason = FALLBACK
        elif keyed[0][4] == best_cached:
            reason = PREFIX
        else:
            reason = LOAD
        return Decision(ranked, reason, predicted)


class RoundRobinStrategy:
    """Each request to the next node in turn, whatever it holds (what a plain load balancer does)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, candidates: Sequence[Candidate], matches: Sequence[PrefixMatch]) -> Decision:
        assert candidates, "a decision needs at least one candidate"
        start = next(self._turn) % len(candidates)
        ordered = [*candidates[start:], *candidates[:start]]
        return _unaware(ordered, matches)


class LeastLoadedStrategy:
    """The node with the fewest requests in flight, whatever it holds."""

    def rank(self, candidates: Sequence[Candidate], matches: Sequence[PrefixMatch]) -> Decision:
        assert candidates, "a decision needs at least one candidate"
        return _unaware(sorted(candidates, key=lambda candidate: candidate.load), matches)


def _unaware(ordered: Sequence[Candidate], matches: Sequence[PrefixMatch]) -> Decision:
    by_node = {match.node_id: match.num_blocks for match in matches}
    predicted = {candidate.node_id: by_node.get(candidate.node_id, 0) for candidate in ordered}
    reason = PREFIX if predicted[ordered[0].node_id] > 0 else FALLBACK
    return Decision(tuple(candidate.node_id for candidate in ordered), reason, predicted)
