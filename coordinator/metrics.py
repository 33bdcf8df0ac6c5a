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
