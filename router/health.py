"""Which nodes may be sent a request: fresh heartbeats and closed circuit breakers.

Pure (the caller passes ``now``, monotonic seconds). A node is skipped while its last kv-event
or heartbeat is older than ``heartbeat_timeout_s``, or while its breaker is open: after
``failure_threshold`` consecutive failures (a connection refused, a timeout, a 5xx before the
first byte) it opens for ``open_s``; then one request may try it (half-open), whose success
closes the breaker and whose failure opens it again.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    """One node's breaker (see the module docstring)."""

    def __init__(self, failure_threshold: int = 3, open_s: float = 10.0) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError("failure_threshold must be at least 1 and open_s positive")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.num_failures = 0
        self.opened_at: float | None = None
        self._trial = False

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return CLOSED
        return OPEN if now - self.opened_at < self.open_s else HALF_OPEN

    def allows(self, now: float) -> bool:
        """Whether a request may go to the node now; a half-open breaker lets one through at a time."""
        state = self.state(now)
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._trial:
            return True
        return False

    def sent(self, now: float) -> None:
        if self.state(now) == HALF_OPEN:
            self._trial = True

    def succeeded(self) -> None:
        self.num_failures, self.opened_at, self._trial = 0, None, False

    def failed(self, now: float) -> None:
        self.num_failures += 1
        self._trial = False
        if self.opened_at is not None or self.num_failures >= self.failure_threshold:
            self.opened_at = now


@dataclass(frozen=True, slots=True)
class Liveness:
    """How old a node's last sign of life may be before it is skipped."""

    heartbeat_timeout_s: float = 30.0

    def alive(self, last_seen: float | None, now: float) -> bool:
        return last_seen is not None and now - last_seen < self.heartbeat_timeout_s
