"""Prometheus metrics of the coordinator (registered once, on the default registry).

Counters and histograms are per process (the consumers' own work): quantiles come from
histograms, rates from counters (docs/operations.md lists every series). Gauges that
describe shared state (dead-letter totals, outbox backlog, node liveness, open
invalidations and erasures) are refreshed from the database on each scrape by
:func:`refresh_ledger_gauges`, so every replica reports the same cluster-wide numbers.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.ledger.models import (
    DeadLetterCount,
    DeferredAck,
    Erasure,
    Invalidation,
    Node,
    OutboxEntry,
)
from coordinator.ledger.states import ErasureStatus, InvalidationStatus

log = logging.getLogger(__name__)

EVENTS_TOTAL = Counter(
    "kvledger_ledger_events_total",
    "kv-events seen by the ledger, by type and outcome "
    "(applied; duplicate = inbox hit; replayed = seq already applied; stale = older epoch).",
    ["type", "outcome"],
)
BATCHES_TOTAL = Counter(
    "kvledger_ledger_batches_total", "Polled kv-event batches committed to the ledger."
)
BATCH_SIZE = Histogram(
    "kvledger_ledger_batch_size",
    "Events per committed kv-event batch.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
BATCH_SECONDS = Histogram(
    "kvledger_ledger_batch_seconds", "Time to apply and commit one kv-event batch."
)
INGEST_LAG_SECONDS = Histogram(
    "kvledger_ledger_ingest_lag_seconds",
    "Per kv-event in a committed batch: commit time of the batch minus the event's occurred_at.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
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
INVENTORY_REQUESTS_TOTAL = Counter(
    "kvledger_ledger_inventory_requests_total", "InventoryRequested commands queued."
)
INVENTORIES_TOTAL = Counter("kvledger_ledger_inventories_total", "Complete inventories reconciled.")
OUTBOX_PUBLISHED_TOTAL = Counter(
    "kvledger_outbox_published_total", "Outbox records published to Kafka.", ["topic"]
)
PRUNED_ROWS_TOTAL = Counter(
    "kvledger_pruned_rows_total",
    "Inbox and outbox rows deleted once they can no longer matter, by table.",
    ["table"],
)

DEAD_LETTER_RECORDS = Gauge(
    "kvledger_ledger_dead_letter_records",
    "Records dead-lettered by all coordinator consumers, by source topic (from the ledger).",
    ["topic"],
)
OUTBOX_PENDING = Gauge(
    "kvledger_outbox_pending", "Outbox records not yet published (from the ledger)."
)
NODES = Gauge(
    "kvledger_ledger_nodes", "Known nodes by liveness (from heartbeat age).", ["liveness"]
)
INVALIDATIONS_OPEN = Gauge(
    "kvledger_ledger_invalidations_open",
    "Invalidations not complete, by status (pending: acks outstanding; failed: a post-check did not verify) (from the ledger).",
    ["status"],
)
OLDEST_OPEN_INVALIDATION_AGE = Gauge(
    "kvledger_ledger_oldest_open_invalidation_age_seconds",
    "Age of the oldest invalidation that is not complete; 0 when none (from the ledger).",
)
OLDEST_DEFERRED_ACK_AGE = Gauge(
    "kvledger_ledger_oldest_deferred_ack_age_seconds",
    "Age of the oldest ack waiting for its node's kv-events to reach its fence; 0 when none (from the ledger).",
)
ERASURE_AGE_BUCKETS: tuple[tuple[str, timedelta], ...] = (
    ("lt_5m", timedelta(minutes=5)),
    ("lt_1h", timedelta(hours=1)),
    ("lt_24h", timedelta(hours=24)),
)
"""Age classes of unverified erasures: the first whose bound is above the age, else ``ge_24h``."""
ERASURES_UNVERIFIED = Gauge(
    "kvledger_ledger_erasures_unverified",
    "Erasures without a receipt, by status (pending, partial, failed) and age class (lt_5m, lt_1h, lt_24h, ge_24h) (from the ledger).",
    ["status", "age"],
)
OLDEST_UNVERIFIED_ERASURE_AGE = Gauge(
    "kvledger_ledger_oldest_unverified_erasure_age_seconds",
    "Age of the oldest erasure without a receipt; 0 when none (from the ledger).",
)

INVALIDATION_EVENTS_TOTAL = Counter(
    "kvledger_invalidation_events_total",
    "Document, permission and ack events seen by the invalidation consumer, by type and outcome "
    "(applied; duplicate = inbox hit or repeated ack; superseded = version not above the recorded one; "
    "unexpected = ack for no known target; unverified = ack whose post-check failed; part_staged = ack part held "
    "for the rest of its ack; deferred = ack held until its node's kv-events reach its fence; released = a deferred "
    "ack applied once they did).",
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
    "kvledger_invalidation_batch_seconds",
    "Time to apply and commit one documents/permissions/acks batch.",
)

HTTP_REQUEST_SECONDS = Histogram(
    "kvledger_http_request_seconds",
    "HTTP requests by method, route template and status: time to the end of the handler.",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def observe_http(method: str, route: str, status: int, seconds: float) -> None:
    HTTP_REQUEST_SECONDS.labels(method, route, str(status)).observe(seconds)


RECEIPTS_TOTAL = Counter(
    "kvledger_erasure_receipts_total", "Erasures verified and given a signed receipt."
)
ERASURE_SECONDS = Histogram(
    "kvledger_erasure_seconds",
    "Time from an erasure's request to its verified receipt.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
)


async def exposition(session: AsyncSession, heartbeat_timeout_s: float) -> bytes:
    """The ``/metrics`` body: the ledger gauges refreshed when the ledger answers, then every
    series."""
    try:
        await refresh_ledger_gauges(session, heartbeat_timeout_s)
    except Exception as exc:  # noqa: BLE001 - process metrics are still worth serving without the ledger
        log.warning("metrics: ledger gauges not refreshed (%s)", type(exc).__name__)
    return generate_latest()


async def refresh_ledger_gauges(session: AsyncSession, heartbeat_timeout_s: float) -> None:
    """Set the cluster-wide gauges from the ledger (called by every ``/metrics`` scrape)."""
    for topic, count in await session.execute(
        select(DeadLetterCount.topic, DeadLetterCount.num_records)
    ):
        DEAD_LETTER_RECORDS.labels(topic=topic).set(count)
    OUTBOX_PENDING.set(
        await session.scalar(
            select(func.count()).select_from(OutboxEntry).where(OutboxEntry.sent_at.is_(None))
        )
    )
    alive = (
        func.extract("epoch", func.now() - func.greatest(Node.last_heartbeat, Node.last_event_at))
        < heartbeat_timeout_s
    )
    num_alive, num_total = (
        await session.execute(select(func.count().filter(alive), func.count()).select_from(Node))
    ).one()
    NODES.labels(liveness="alive").set(num_alive)
    NODES.labels(liveness="stale").set(num_total - num_alive)

    open_statuses = (InvalidationStatus.PENDING, InvalidationStatus.FAILED)
    counts = dict(
        (
            await session.execute(
                select(Invalidation.status, func.count())
                .where(Invalidation.status.in_(open_statuses))
                .group_by(Invalidation.status)
            )
        ).all()
    )
    for status in open_statuses:
        INVALIDATIONS_OPEN.labels(status=status).set(counts.get(status, 0))
    OLDEST_OPEN_INVALIDATION_AGE.set(
        await session.scalar(
            select(
                func.coalesce(
                    func.extract("epoch", func.now() - func.min(Invalidation.requested_at)), 0
                )
            ).where(Invalidation.status.in_(open_statuses))
        )
    )

    OLDEST_DEFERRED_ACK_AGE.set(
        await session.scalar(
            select(
                func.coalesce(
                    func.extract("epoch", func.now() - func.min(DeferredAck.deferred_at)), 0
                )
            )
        )
    )

    unverified_statuses = (ErasureStatus.PENDING, ErasureStatus.PARTIAL, ErasureStatus.FAILED)
    age = func.now() - Erasure.requested_at
    age_class = case(
        *((age < bound, label) for label, bound in ERASURE_AGE_BUCKETS), else_="ge_24h"
    )
    counts = {
        (status, age_label): count
        for status, age_label, count in await session.execute(
            select(Erasure.status, age_class, func.count())
            .where(Erasure.status.in_(unverified_statuses))
            .group_by(Erasure.status, age_class)
        )
    }
    for status in unverified_statuses:
        for age_label in [label for label, _ in ERASURE_AGE_BUCKETS] + ["ge_24h"]:
            ERASURES_UNVERIFIED.labels(status=status, age=age_label).set(
                counts.get((status, age_label), 0)
            )
    OLDEST_UNVERIFIED_ERASURE_AGE.set(
        await session.scalar(
            select(
                func.coalesce(func.extract("epoch", func.now() - func.min(Erasure.requested_at)), 0)
            ).where(Erasure.status.in_(unverified_statuses))
        )
    )
