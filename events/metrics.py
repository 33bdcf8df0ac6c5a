"""Prometheus metrics of the shared Kafka helpers (registered once, on the default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from events.topics import ALERT_TOPICS

DEAD_LETTER_TOTAL = Counter(
    "kvledger_dead_letter_total",
    "Records sent to kvledger.dead-letter (contract violations and records the database refused as data), by source topic.",
    ["topic"],
)
for _topic in sorted(ALERT_TOPICS):
    # Exported at 0 from the start, so the first dead letter on these topics is an increase an alert
    # sees.
    DEAD_LETTER_TOTAL.labels(_topic)

DEAD_LETTER_BY_REFERENCE_TOTAL = Counter(
    "kvledger_dead_letter_by_reference_total",
    "Dead letters that refer to their record (coordinates, size, SHA-256, a prefix) instead of carrying it,"
    " because the letter would not fit one producer request; such letters cannot be replayed. By source topic.",
    ["topic"],
)

CONSUMER_STALLED = Gauge(
    "kvledger_consumer_stalled",
    "1 while the consumer group's member in this process has records waiting and has not committed past them"
    " for longer than its stall threshold (a batch that keeps failing), else 0.",
    ["group"],
)

HANDLER_FAILURES_TOTAL = Counter(
    "kvledger_consumer_handler_failures_total",
    "Batches that failed transiently (handler, dead-letter publish or offset commit); redelivered after a backoff, never skipped.",
    ["group"],
)

UNVERIFIED_RECORDS_TOTAL = Counter(
    "kvledger_unverified_records_total",
    "kv-events, acks and customer events dead-lettered because their signature is missing or invalid, or by a key"
    " not enrolled (or revoked) for the record's node, or not bound to the record's tenant, by source topic and reason.",
    ["topic", "reason"],
)

MISROUTED_RECORDS_TOTAL = Counter(
    "kvledger_misrouted_records_total",
    "Records dead-lettered because their event type is not one their topic carries (wrong_topic) or a customer"
    " event's record key is not its envelope's tenant key (key_tenant_mismatch), by source topic and reason.",
    ["topic", "reason"],
)
