"""Prometheus metrics of the shared Kafka helpers (registered once, on the default registry)."""

from __future__ import annotations

from prometheus_client import Counter

DEAD_LETTER_TOTAL = Counter(
    "kvledger_dead_letter_total",
    "Records sent to kvledger.dead-letter (contract violations and records the database refused as data), by source topic.",
    ["topic"],
)

HANDLER_FAILURES_TOTAL = Counter(
    "kvledger_consumer_handler_failures_total",
    "Batches that failed transiently (handler, dead-letter publish or offset commit); redelivered after a backoff, never skipped.",
    ["group"],
)
