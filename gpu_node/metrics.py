"""Prometheus metrics of a node.

Each engine owns its own registry so several nodes can live in one process
(tests, benchmarks) without colliding. Only aggregates are exposed: no block
hashes, tenants or subjects appear in label values. Aggregates still mix every
tenant's traffic, so they are served to the operator's scraper only
(``identity.metrics_access``, docs/security.md).
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# An engine step's work outside the model forward: ~0.1 ms is a small model's whole step on a GPU, 1
# ms the target at 16 running.
_STEP_OVERHEAD_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
)
_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class MissReason(StrEnum):
    """Why a request did not get (more of) its prefix from the cache.

    Reasons only ever compare a request with entries its caller could have been
    served (public ones, its tenant's, its own): see ``KVCacheManager``.
    """

    NO_ENTRY = "NO_ENTRY"
    TOKENIZER_MISMATCH = "TOKENIZER_MISMATCH"
    MODEL_VERSION_MISMATCH = "MODEL_VERSION_MISMATCH"
    AUTH_SCOPE_MISMATCH = "AUTH_SCOPE_MISMATCH"
    PREFIX_TOO_SHORT = "PREFIX_TOO_SHORT"
    ENTRY_EXPIRED = "ENTRY_EXPIRED"
    EVICTED = "EVICTED"
    KV_RESTORE_FAILED = "KV_RESTORE_FAILED"
    OOM = "OOM"


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvledger_requests", "Generation requests", registry=r)
        self.full_misses = Counter(
            "kvledger_full_misses", "Requests served with no cached prompt token", registry=r
        )
        self.prefix_hits = Counter(
            "kvledger_prefix_hits", "Requests with at least one cached prompt token", registry=r
        )
        self.hit_tokens = Counter(
            "kvledger_hit_tokens", "Prompt tokens served from cache", registry=r
        )
        self.prompt_tokens = Counter(
            "kvledger_prompt_tokens", "Prompt tokens requested", registry=r
        )
        self.hit_ratio_tokens = Gauge(
            "kvledger_hit_ratio_tokens", "hit tokens / prompt tokens since start", registry=r
        )
        self.hit_ratio_requests = Gauge(
            "kvledger_hit_ratio_requests", "requests with a hit / requests since start", registry=r
        )
        self.misses = Counter(
            "kvledger_cache_misses", "Cache misses by reason", ["reason"], registry=r
        )
        for reason in MissReason:
            self.misses.labels(reason.value)
        self.tier_bytes = Gauge(
            "kvledger_tier_bytes", "Bytes of READY blocks per tier", ["tier"], registry=r
        )
        self.tier_entries = Gauge(
            "kvledger_tier_entries", "READY blocks per tier", ["tier"], registry=r
        )
        self.evictions = Counter(
            "kvledger_evictions", "Blocks evicted or demoted out of a tier", ["tier"], registry=r
        )
        self.expirations = Counter("kvledger_expirations", "Blocks deleted by TTL", registry=r)
        self.builds = Counter(
            "kvledger_prefix_builds",
            "Requests that built (led) at least one missing block",
            registry=r,
        )
        self.blocks_built = Counter(
            "kvledger_blocks_built", "Blocks computed and committed READY", registry=r
        )
        self.peer_pulls = Counter(
            "kvledger_peer_pulls",
            "Pulls of a prefix's missing blocks from a peer (gpu_node.cache.peers) by outcome: pulled, or why the request recomputed",
            ["outcome"],
            registry=r,
        )
        self.peer_pulled_blocks = Counter(
            "kvledger_peer_pulled_blocks", "Blocks pulled from peers and served as hits", registry=r
        )
        self.peer_pull_seconds = Histogram(
            "kvledger_peer_pull_seconds",
            "Time one pull took, failed ones included",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.peer_serves = Counter(
            "kvledger_peer_serves",
            "Pull requests this node answered as a holder, by outcome (served or the refusal's code)",
            ["outcome"],
            registry=r,
        )
        self.build_wait = Histogram(
            "kvledger_build_wait_seconds",
            "Time waiting for another request's build",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.singleflight_waiters = Gauge(
            "kvledger_singleflight_waiters", "Requests currently waiting on a build", registry=r
        )
        self.pool_event_subscriber_failures = Counter(
            "kvledger_pool_event_subscriber_failures",
            "Pool-event batches a subscriber raised on, by subscriber",
            ["subscriber"],
            registry=r,
        )
        self.restore_latency = Histogram(
            "kvledger_restore_seconds",
            "Promoting host and disk hits into device blocks",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.prefill_latency = Histogram(
            "kvledger_prefill_seconds",
            "Prefill of the uncached suffix",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.ttft = Histogram(
            "kvledger_ttft_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS_S
        )
        self.generated_tokens = Counter(
            "kvledger_generated_tokens", "Completion tokens generated", registry=r
        )
        self.decode_tokens_per_s = Gauge(
            "kvledger_decode_tokens_per_second",
            "Decode throughput of the last finished request",
            registry=r,
        )
        # Continuous batching, named and shaped like vLLM's (gpu_node.engine.scheduler,
        # gpu_node.engine.paged_kv).
        self.requests_running = Gauge(
            "kvledger_num_requests_running", "Requests in the running batch", registry=r
        )
        self.requests_waiting = Gauge(
            "kvledger_num_requests_waiting",
            "Requests waiting to join the running batch",
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "kvledger_kv_device_blocks_used",
            "Device-tier blocks in use (cached entries and running requests' own)",
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            "kvledger_kv_device_blocks_total", "Device-tier blocks in total", registry=r
        )
        self.kv_usage = Gauge(
            "kvledger_kv_cache_usage_perc", "Fraction of device-tier blocks in use", registry=r
        )
        self.preemptions = Counter(
            "kvledger_num_preemptions",
            "Running requests preempted for lack of device blocks (recomputed later)",
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "kvledger_iteration_tokens",
            "Tokens computed per engine step",
            registry=r,
            buckets=_ITERATION_TOKEN_BUCKETS,
        )
        self.step_overhead = Histogram(
            "kvledger_engine_step_overhead_seconds",
            "Wall time of an engine step on the model worker outside the model forward"
            " (scheduling, step tensors, sampling, detokenizing, hand-off to the streams)",
            registry=r,
            buckets=_STEP_OVERHEAD_BUCKETS_S,
        )
        self.inter_token_latency = Histogram(
            "kvledger_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.e2e_latency = Histogram(
            "kvledger_e2e_request_latency_seconds",
            "Time from arrival to the last token of a request",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.prefix_cache_queries = Counter(
            "kvledger_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "kvledger_prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.dead_letters = Counter(
            "kvledger_node_dead_letters",
            "kv-events records the publisher could not build or send (invalid, too_large, refused)",
            ["type", "cause"],
            registry=r,
        )
        self.unverified_commands = Counter(
            "kvledger_unverified_commands",
            "Records on kvledger.commands dead-lettered because they are not signed by the pinned coordinator key, by reason",
            ["reason"],
            registry=r,
        )
        self.misrouted_commands = Counter(
            "kvledger_misrouted_commands",
            "Records on kvledger.commands dead-lettered because their event type is not one the topic carries, by reason",
            ["reason"],
            registry=r,
        )
        self.http_request_seconds = Histogram(
            "kvledger_http_request_seconds",
            "HTTP requests by method, route template and status: time to the end of the handler",
            ["method", "route", "status"],
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.consumer_stalled = Gauge(
            "kvledger_consumer_stalled",
            "1 while the command consumer has commands waiting and has not handled them for longer than"
            " kafka.stall_after_s (a command that keeps failing), else 0",
            ["group"],
            registry=r,
        )
        self.commands_reacked = Counter(
            "kvledger_commands_reacked",
            "Re-sent commands this node had already applied in this run and answered with their ack again",
            registry=r,
        )
        self.governance_failures = Counter(
            "kvledger_governance_sync_failures",
            "Start-up fetches of the governance state that failed (node stays not ready and retries), by reason",
            ["reason"],
            registry=r,
        )
        self._num_requests = 0
        self._num_hit_requests = 0
        self._num_prompt_tokens = 0
        self._num_hit_tokens = 0

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_request_seconds.labels(method, route, str(status)).observe(seconds)

    def observe_request(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.hit_tokens.inc(num_cached_tokens)
        self._num_requests += 1
        self._num_prompt_tokens += num_prompt_tokens
        self._num_hit_tokens += num_cached_tokens
        if num_cached_tokens:
            self.prefix_hits.inc()
            self._num_hit_requests += 1
        else:
            self.full_misses.inc()
        self.hit_ratio_requests.set(self._num_hit_requests / self._num_requests)
        self.hit_ratio_tokens.set(self._num_hit_tokens / max(self._num_prompt_tokens, 1))
