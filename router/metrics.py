"""The router's Prometheus metrics (its own registry, served at ``/metrics`` behind the metrics token).

Cross-tenant aggregates only: no label names a tenant, a subject, a document or a block.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.index import SERVING_TIERS, PrefixIndex


class RouterMetrics:
    def __init__(self, index: PrefixIndex) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvledger_router_decisions_total",
            "Routing decisions by reason (prefix, load, fallback, retry)",
            ["reason"],
            registry=self.registry,
        )
        self.predicted_cached_tokens = Counter(
            "kvledger_router_predicted_cached_tokens_total",
            "Cached prompt tokens the index predicted on the serving node",
            registry=self.registry,
        )
        self.served_cached_tokens = Counter(
            "kvledger_router_served_cached_tokens_total",
            "Cached prompt tokens the serving node reported (its usage)",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvledger_router_prompt_tokens_total",
            "Prompt tokens the serving nodes reported",
            registry=self.registry,
        )
        self.routing_latency = Histogram(
            "kvledger_router_routing_seconds",
            "Keying and choosing a node for one request (before it is sent)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.node_errors = Counter(
            "kvledger_router_node_failures_total",
            "Requests a node failed before its first byte",
            ["node"],
            registry=self.registry,
        )
        self.kv_events = Counter(
            "kvledger_router_kv_events_total",
            "kv-events taken, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.unverified = Counter(
            "kvledger_router_unverified_records_total",
            "Records skipped for their signature, by topic and reason",
            ["topic", "reason"],
            registry=self.registry,
        )
        self.rereads = Counter(
            "kvledger_router_ledger_rereads_total",
            "Nodes read again from the ledger",
            registry=self.registry,
        )
        self.invalidated_blocks = Counter(
            "kvledger_router_invalidated_blocks_total",
            "Blocks dropped from the index by coordinator decisions",
            registry=self.registry,
        )
        self.event_lag = Gauge(
            "kvledger_router_event_lag_seconds",
            "Age of the last kv-event applied, when it was applied",
            registry=self.registry,
        )
        blocks = Gauge(
            "kvledger_router_index_blocks",
            "Copies in the index per node and tier",
            ["node", "tier"],
            registry=self.registry,
        )
        self._blocks = blocks
        self._index = index

    def collect_index(self) -> None:
        """Refresh the per-node, per-tier gauge (called before each scrape)."""
        for node_id, tiers in self._index.num_blocks().items():
            for tier in SERVING_TIERS:
                self._blocks.labels(node=node_id, tier=tier.value).set(tiers[tier])
