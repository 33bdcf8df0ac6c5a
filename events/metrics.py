"""Prometheus metrics of the shared Kafka helpers (registered once, on the default registry)."""

from __future__ import annotations

from prometheus_client import Counter

DEAD_LETTER_TOTAL = Counter(
    "kvledger_dead_letter_total",
    "Records that failed contract validation and were sent to kvledger.dead-letter, by source topic.",
    ["topic"],
)

HANDLER_FAILURES_TOTAL = Counter(
    "kvledger_consumer_handler_failures_total",
    "Batches that failed (handler, dead-letter publish or offset commit); they are redelivered after a backoff, never skipped.",
    ["group"],
)
