"""GPU node settings (pydantic-settings, env prefix ``KVLEDGER_NODE_``, nested with ``__``).

Stack-wide variables are honoured too, because one operator sets them once for every process:
``KVLEDGER_KAFKA_BOOTSTRAP``, ``KVLEDGER_SUBJECT_KEY``, ``KVLEDGER_COORDINATOR_URL``,
``KVLEDGER_METRICS_TOKEN`` (or ``KVLEDGER_METRICS_TOKEN_FILE``) and the Kafka security variables
``KVLEDGER_KAFKA_SECURITY_PROTOCOL``, ``KVLEDGER_KAFKA_SASL_MECHANISM``,
``KVLEDGER_KAFKA_SASL_USERNAME``, ``KVLEDGER_KAFKA_SASL_PASSWORD``, ``KVLEDGER_KAFKA_SSL_CAFILE``,
``KVLEDGER_KAFKA_SSL_CERTFILE``, ``KVLEDGER_KAFKA_SSL_KEYFILE``,
``KVLEDGER_KAFKA_SSL_CHECK_HOSTNAME``. A node-specific variable (``KVLEDGER_NODE_METRICS__TOKEN``,
``KVLEDGER_NODE_KAFKA__SASL_USERNAME`` …) wins over the shared one."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from events.http_server import HttpServerLimits
from events.kafka.settings import ConsumerGroupTiming, KafkaSecurity
from events.schema import Name
from identity.metrics_access import MetricsSettings
from identity.service_settings import ServiceSettings, refuse_shared_issuer
from identity.settings import IssuerSettings


class CacheSettings(BaseModel):
    """The prefix cache. Tiers are sized in bytes; their block counts follow from the model's KV block
    (``gpu_node.cache.kv_memory``). An explicit ``num_device_blocks`` / ``num_host_blocks`` / ``max_disk_blocks``
    replaces the byte size of its tier (exact sizes for tests and benchmarks)."""

    block_size: int = Field(16, gt=0)
    device_memory_fraction: float | None = Field(None, gt=0, le=0.95)
    """Of the device memory left after the weights (CPU: of ``MemAvailable`` less the host tier);
    unset: 0.8 on CUDA, 0.4 on CPU."""
    host_memory_bytes: int = Field(2 * 1024**3, ge=0)
    """Host tier (CPU RAM; pinned under CUDA)."""
    disk_bytes: int = Field(16 * 1024**3, ge=0)
    """Disk tier (block files under the data directory)."""
    num_device_blocks: int | None = Field(None, ge=1)
    num_host_blocks: int | None = Field(None, ge=0)
    max_disk_blocks: int | None = Field(None, ge=0)
    ttl_public_s: float | None = 3600.0
    ttl_tenant_s: float | None = 1800.0
    ttl_user_s: float | None = 600.0
    singleflight_wait_s: float = 30.0
    enabled: bool = True
    layout_sample_size: int = Field(0, ge=0, le=100_000)
    """Requests whose prompt layout (segment hashes, never text) is kept for ``kvledger advise``; 0:
    none (``gpu_node.cache.layout_sampler``)."""

    @model_validator(mode="after")
    def _one_device_size(self) -> CacheSettings:
        if self.num_device_blocks is not None and self.device_memory_fraction is not None:
            raise ValueError("set num_device_blocks or device_memory_fraction, not both")
        return self


class SchedulerSettings(BaseModel):
    """Continuous batching (``gpu_node.engine.scheduler``): how much one model step may carry.

    ``max_num_batched_tokens`` bounds the tokens of one forward pass (one decode
    token per running request plus prefill chunks), so a long prompt delays
    running decodes by at most one chunk. ``max_num_seqs`` bounds the running
    batch; it may not exceed the token budget, which always fits every decode.
    """

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _decodes_fit(self) -> SchedulerSettings:
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                "max_num_seqs must not exceed max_num_batched_tokens: every running request decodes one token per step"
            )
        return self


class RequestLimits(BaseModel):
    """Bounds on one HTTP request, checked before anything is cached or published (docs/security.md).

    Identifiers and versions inside a request obey the event contract's bounds
    (:mod:`events.schema`), because they end up in kv-events and in the ledger.
    """

    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body, checked while it is read (chunked bodies too), before JSON parsing."""
    max_messages: int = Field(10_000, ge=1)
    """Most messages in one chat request."""
    max_completion_tokens: int = Field(32_768, ge=1)
    """Largest ``max_tokens``/``max_completion_tokens``; the model's context bounds it further."""


class IdentitySettings(BaseModel):
    """Who the node is to the coordinator, and whom it trusts for commands (``docs/security.md``).

    ``key_file``: the node's own Ed25519 private key (PEM); unset, ``node_key.pem`` in the
    data dir, created at first start. Its public key must be enrolled at the coordinator
    (``kvledger nodes enroll``) before the coordinator trusts the node's kv-events, acks
    and key-service credentials. ``coordinator_public_key_file``: the coordinator's command
    public key (PEM), pinned: a node on Kafka applies only commands signed by it and
    refuses to start without it.
    """

    key_file: Path | None = None
    coordinator_public_key_file: Path | None = None


class DataKeySettings(BaseModel):
    """The node's memory of data keys fetched from the coordinator (``gpu_node.keys.remote_keys``).

    The pool reads keys from memory only; they are fetched ahead of a request
    (``prefetch_wait_s``) and in the background. Every cache is bounded, least recently
    used first out: an evicted key is fetched again when next needed.
    """

    timeout_s: float = Field(2.0, gt=0)
    """One request to the key service."""
    prefetch_wait_s: float = Field(0.25, gt=0)
    """How long a request waits for its scopes' keys before it looks blocks up; a key that
    arrives later serves the next request (this one treats that scope's sealed blocks as misses)."""
    max_cached_keys: int = Field(1024, ge=1)
    negative_ttl_s: float = Field(30.0, ge=0)
    """How long an answer "no such key" (404, unknown or refused scope) is remembered before asking
    again."""
    max_negative_entries: int = Field(4096, ge=1)


MAX_PEERS = 256


class PeerSettings(BaseModel):
    """The nodes this node may pull cached blocks from (``gpu_node.cache.peers``, docs/architecture.md "Replicas").

    ``urls`` maps a peer's node id to its base URL. It is trusted configuration (``kvledger up`` writes it for
    its own nodes; ``KVLEDGER_NODE_PEERS__URLS='{"node-1": "http://10.0.0.2:8100"}'``): a pull hint names a node
    id only, so no request can make this node connect anywhere else. Empty: the node never pulls (it still
    serves pulls to enrolled peers of its namespace when it has a coordinator to check them against).
    """

    urls: dict[Name, str] = Field(default_factory=dict, max_length=MAX_PEERS)
    pull_timeout_s: float = Field(10.0, gt=0)
    """One pull (request and every record); past it the node recomputes."""
    max_pull_blocks: int = Field(4096, ge=1, le=65_536)
    """Most blocks one pull asks for (and a holder serves)."""
    key_cache_s: float = Field(5.0, ge=0)
    """How long a holder trusts a peer key the coordinator vouched for: the revocation bound it adds to the
    coordinator's own ``ledger.node_key_cache_s`` (the same default)."""

    @model_validator(mode="after")
    def _http_urls(self) -> PeerSettings:
        for node_id, url in self.urls.items():
            if not url.startswith(("http://", "https://")) or len(url) > 2048:
                raise ValueError(
                    f"peer {node_id!r}: a peer URL is an http(s) URL of at most 2048 characters"
                )
        return self


class NodeKafkaSettings(KafkaSecurity, ConsumerGroupTiming):
    """How the node authenticates to the brokers (:class:`events.kafka.settings.KafkaSecurity`) and how its command
    consumer's group member stays alive and waits on fetches (:class:`events.kafka.settings.ConsumerGroupTiming`)."""

    stall_after_s: float = Field(60.0, gt=0)
    """Commands waiting this long without being handled (one failing again and again) make the command
    consumer *stalled*: ``kvledger_consumer_stalled{group}`` is 1 (docs/operations.md, "Stalled consumers")."""


class NodeSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVLEDGER_NODE_", env_nested_delimiter="__", extra="ignore"
    )

    node_id: Name = "node-0"
    """Travels in every kv-event and ledger row, so it obeys the event contract's identifier bounds."""
    model_dir: Path = Path(".kvledger/models/smollm2-135m-instruct")
    """Where ``kvledger up`` builds the default model (SmolLM2-135M-Instruct, ``kvledger model
    init``)."""
    model_name: str | None = None
    data_dir: Path = Path(".kvledger/node-0")
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8100
    warm_from: Path | None = None
    auth: IssuerSettings = IssuerSettings()
    """End users' tokens (the customer's identity provider; in the dev stack
    ``KVLEDGER_JWT_SECRET``)."""
    operator_auth: IssuerSettings = IssuerSettings()
    """Operators' tokens (``platform-admin`` writes snapshots); unset, no operator endpoint answers."""
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    """``KVLEDGER_NODE_SCHEDULER__MAX_NUM_BATCHED_TOKENS``,
    ``KVLEDGER_NODE_SCHEDULER__MAX_NUM_SEQS``."""
    limits: RequestLimits = RequestLimits()
    http_limits: HttpServerLimits = HttpServerLimits()
    """What one unauthenticated client may hold of the HTTP server
    (``KVLEDGER_NODE_HTTP_LIMITS__*``)."""
    identity: IdentitySettings = IdentitySettings()
    # The ledger hooks are optional: without a broker the node runs standalone.
    # The stack-wide variables are honoured because one operator sets them once
    # for every process (see coordinator/settings.py).
    kafka_bootstrap: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "kafka_bootstrap", "KVLEDGER_NODE_KAFKA_BOOTSTRAP", "KVLEDGER_KAFKA_BOOTSTRAP"
        ),
    )
    subject_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices(
            "subject_key", "KVLEDGER_NODE_SUBJECT_KEY", "KVLEDGER_SUBJECT_KEY"
        ),
    )
    coordinator_url: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "coordinator_url", "KVLEDGER_NODE_COORDINATOR_URL", "KVLEDGER_COORDINATOR_URL"
        ),
    )
    """Where data keys for tenant/user blocks at rest come from (``gpu_node.keys.remote_keys``); unset: a local key file."""
    data_keys: DataKeySettings = DataKeySettings()
    peers: PeerSettings = PeerSettings()
    kafka: NodeKafkaSettings = NodeKafkaSettings()
    """How the node authenticates to the brokers (``KVLEDGER_NODE_KAFKA__*`` or the shared
    ``KVLEDGER_KAFKA_*``) and its command consumer's group timing
    (``KVLEDGER_NODE_KAFKA__SESSION_TIMEOUT_MS``, ``…__FETCH_MAX_WAIT_MS``)."""
    metrics: MetricsSettings = MetricsSettings()
    kafka_partitions: int = Field(4, ge=1)
    publish_interval_s: float = Field(0.05, gt=0)
    heartbeat_interval_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _distinct_issuers(self) -> NodeSettings:
        refuse_shared_issuer(self.operator_auth, self.auth)
        return self
