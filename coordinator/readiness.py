"""Whether this process's consumers are consuming: what ``/readyz`` reports for them.

Its own module because both sides need it and neither may import the other: the consumers tell
it about themselves (``coordinator.consumers``), the API's probes ask it (``coordinator/api/``).
"""

from __future__ import annotations

from events.kafka.consumer import BatchConsumer


class ConsumerReadiness:
    """Whether this process's consumers are consuming: what the coordinator's ``/readyz`` reports for them.

    Consuming means every consumer (kv-events, decisions, acks) joined its group and knows
    the position it resumes from on each partition it was assigned
    (:attr:`events.kafka.consumer.BatchConsumer.consuming`), so an event published from then on is
    taken by the next poll. Before that — at start, while the group join runs (seconds on
    some brokers), or during a rebalance — a document update would wait for the join, and
    a process that answered ready would let a client act on a version it has not applied.

    A consumer that is stalled (:class:`events.kafka.consumer.StallClock`: records waiting, its
    batch failing for longer than ``kafka.stall_after_s``) is a problem too: every later
    decision of its partitions waits behind the failing batch.
    """

    def __init__(self) -> None:
        self._consumers: list[BatchConsumer] = []
        self._waiting: str | None = None

    def watch(self, consumers: list[BatchConsumer]) -> None:
        self._consumers = list(consumers)
        self._waiting = None

    def wait_for(self, reason: str) -> None:
        """The consumers are not started because of ``reason`` (e.g. the broker is unreachable)."""
        self._consumers = []
        self._waiting = reason

    def problem(self) -> str | None:
        """Why the consumers are not consuming yet (None when they are)."""
        if not self._consumers:
            return self._waiting or "consumers not started"
        waiting = [consumer.group_id for consumer in self._consumers if not consumer.consuming]
        if waiting:
            return "consumer groups not yet consuming: " + ", ".join(waiting)
        stalled = [
            f"{each.group_id} ({each.stall.stalled_for_s:.0f}s)"
            for each in self._consumers
            if each.stall.stalled
        ]
        if stalled:
            return "consumer groups stalled (records waiting, not committed past): " + ", ".join(
                stalled
            )
        return None
