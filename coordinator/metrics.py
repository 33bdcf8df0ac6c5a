"""Prometheus metrics of the coordinator (registered once, on the default registry).

Counters and histograms are per process (the consumers' own work). Gauges named
``*_ledger_*`` that describe shared state (dead-letter totals, outbox backlog,
node liveness) are refreshed from the database on each scrape, so every replica
reports the same cluster-wide numbers.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_TOTAL = Counter(
    "kvledger_ledger_events_total",
    "kv-events seen by the ledger, by type and outcome "
    "(applied; duplicate = inbox hit; replayed = seq already applied; stale = older epoch).",
    ["type", "outcome"],
)
BATCHES_TOTAL = Counter("kvledger_ledger_batches_total", "Polled kv-event batches committed to the ledger.")
BATCH_SIZE = Histogram(
    "kvledger_ledger_batch_size",
    "Events per committed kv-event batch.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
BATCH_SECONDS = Histogram("kvledger_ledger_batch_seconds", "Time to apply and commit one kv-event batch.")
INGEST_LAG_SECONDS = Gauge(
    "kvledger_ledger_ingest_lag_seconds",
    "Age (commit time minus occurred_at) of the newest event in the last committed batch.",
)
PLACEMENT_CHANGES_TOTAL = Counter(
    "kvledger_ledger_placement_changes_total",
    "Placement rows written, by resulting state and cause (event, restart, reconcile, snapshot).",
    ["state", "cause"],
)
SEQ_GAPS_TOTAL = Counter(
    "kvledger_ledger_seq_gaps_total",
    "Detected holes in a node's event stream (missed seq, missed NodeStarted, unknown block, unseen node).",
    ["kind"],
)
INVENTORY_REQUESTS_TOTAL = Counter("kvledger_ledger_inventory_requests_total", "InventoryRequested commands queued.")
INVENTORIES_TOTAL = Counter("kvledger_ledger_inventories_total", "Complete inventories reconciled.")
OUTBOX_PUBLISHED_TOTAL = Counter("kvledger_outbox_published_total", "Outbox records published to Kafka.", ["topic"])

DEAD_LETTER_RECORDS = Gauge(
    "kvledger_ledger_dead_letter_records",
    "Records dead-lettered by all coordinator consumers, by source topic (from the ledger).",
    ["topic"],
)
OUTBOX_PENDING = Gauge("kvledger_outbox_pending", "Outbox records not yet published (from the ledger).")
NODES = Gauge("kvledger_ledger_nodes", "Known nodes by liveness (from heartbeat age).", ["liveness"])

INVALIDATION_EVENTS_TOTAL = Counter(
    "kvledger_invalidation_events_total",
    "Document, permission and ack events seen by the invalidation consumer, by type and outcome "
    "(applied; duplicate = inbox hit or repeated ack; superseded = version not above the recorded one; "
    "unexpected = ack for no known target; unverified = ack whose post-check failed).",
    ["type", "outcome"],
)
INVALIDATIONS_TOTAL = Counter(
    "kvledger_invalidations_total",
    "Invalidate commands decided, by predicate kind and trigger (event, api, late_block).",
    ["kind", "trigger"],
)
COMMAND_RESENDS_TOTAL = Counter(
    "kvledger_command_resends_total",
    "Invalidate commands re-sent because some expected node had not acked in time, by predicate kind.",
    ["kind"],
)
INVALIDATION_SECONDS = Histogram(
    "kvledger_invalidation_seconds",
    "Decision to last expected ack, per completed invalidation.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
INVALIDATION_BATCH_SECONDS = Histogram(
    "kvledger_invalidation_batch_seconds", "Time to apply and commit one documents/permissions/acks batch."
)

RECEIPTS_TOTAL = Counter("kvledger_erasure_receipts_total", "Erasures verified and given a signed receipt.")
ERASURE_SECONDS = Histogram(
    "kvledger_erasure_seconds",
    "Time from an erasure's request to its verified receipt.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
)
