"""Coordinator settings (pydantic-settings).

Environment: prefix ``KVLEDGER_COORDINATOR_`` with ``__`` between groups, e.g.
``KVLEDGER_COORDINATOR_DATABASE__URL``, ``KVLEDGER_COORDINATOR_KAFKA__GROUP_ID``,
``KVLEDGER_COORDINATOR_HTTP__PORT``.

The stack-wide variables ``KVLEDGER_DATABASE_URL``, ``KVLEDGER_KAFKA_BOOTSTRAP``,
``KVLEDGER_JWT_SECRET``, ``KVLEDGER_SUBJECT_KEY``, ``KVLEDGER_MASTER_KEY``,
``KVLEDGER_RECEIPT_SIGNING_KEY``, ``KVLEDGER_COMMAND_SIGNING_KEY``, ``KVLEDGER_METRICS_TOKEN`` (or
``_FILE``) and the Kafka security variables (``KVLEDGER_KAFKA_SECURITY_PROTOCOL``,
``KVLEDGER_KAFKA_SASL_USERNAME`` …, see ``events.kafka.settings.KAFKA_SHARED_ENV``) are honoured
too, because one operator sets them once for every process (nodes, coordinator, tests); a
coordinator-specific variable wins over the shared one, an explicit argument over both."""

from __future__ import annotations

import base64

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from events.http_server import HttpServerLimits
from events.kafka.settings import ConsumerGroupTiming, KafkaSecurity, KafkaSettings
from events.topics import ACKS, DOCUMENTS, ERASURES, KV_EVENTS, PERMISSIONS, TOPIC_CONFIGS
from identity.metrics_access import MetricsSettings
from identity.service_settings import METRICS_AND_KAFKA_ENV, ServiceSettings, refuse_shared_issuer
from identity.settings import IssuerSettings
from identity.signing import EnvelopeSigner, load_private_key_pem

DEFAULT_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/kvledger"
_DAY_S = 24 * 3600.0
CONSUMED_TOPICS = (DOCUMENTS, PERMISSIONS, ERASURES, KV_EVENTS, ACKS)
"""The topics whose records the coordinator applies through its inbox."""

# Shared variable → path inside the settings tree.
_SHARED_ENV: dict[str, tuple[str, ...]] = {
    "KVLEDGER_DATABASE_URL": ("database", "url"),
    "KVLEDGER_KAFKA_BOOTSTRAP": ("kafka", "bootstrap"),
    "KVLEDGER_JWT_SECRET": ("auth", "jwt_secret"),
    "KVLEDGER_SUBJECT_KEY": ("ledger", "subject_key"),
    "KVLEDGER_MASTER_KEY": ("keys", "master_key"),
    "KVLEDGER_RECEIPT_SIGNING_KEY": ("ledger", "receipt_signing_key"),
    "KVLEDGER_COMMAND_SIGNING_KEY": ("ledger", "command_signing_key"),
} | METRICS_AND_KAFKA_ENV


class DatabaseSettings(BaseModel):
    """The ledger database. ``url`` is an SQLAlchemy async URL (``postgresql+asyncpg://…``)."""

    url: SecretStr = SecretStr(DEFAULT_DATABASE_URL)
    pool_size: int = Field(10, ge=1)
    max_overflow: int = Field(10, ge=0)
    pool_timeout_s: float = Field(30.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    """The longest a new connection may take: with the server down or paused, a request or
    batch fails (the API answers 503) after this, instead of hanging (docs/operations.md,
    "Degraded modes")."""
    command_timeout_s: float = Field(30.0, gt=0)
    """The longest one statement may wait for its answer (client side): a server that stops
    answering mid-query fails the request or batch instead of holding it."""

    @model_validator(mode="after")
    def _async_driver(self) -> DatabaseSettings:
        url = self.url.get_secret_value()
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            # Operators paste libpq URLs; the engine needs the asyncpg driver named.
            self.url = SecretStr("postgresql+asyncpg://" + url.split("://", 1)[1])
        elif not url.startswith("postgresql+asyncpg://"):
            raise ValueError("database url must be a postgresql:// or postgresql+asyncpg:// URL")
        return self


class CoordinatorKafkaSettings(KafkaSecurity, ConsumerGroupTiming):
    """Kafka options (turned into :class:`events.kafka.settings.KafkaSettings` by
    ``coordinator.consumers``).

    Idempotence is off by default: the embedded Tansu broker rejects it. The security
    fields (SASL, TLS) come from :class:`events.kafka.settings.KafkaSecurity`, the consumer groups'
    session, heartbeat and fetch wait from :class:`events.kafka.settings.ConsumerGroupTiming`.
    """

    bootstrap: str = "127.0.0.1:9092"
    group_id: str = "kvledger-coordinator"
    enable_idempotence: bool = False
    num_partitions: int = Field(4, ge=1)
    replication_factor: int = Field(1, ge=1)
    max_batch_records: int = Field(500, ge=1)
    ingest_fetch_max_wait_ms: int = Field(50, ge=1)
    """How long the broker may hold an empty fetch of the kv-events consumer (the other consumers:
    ``fetch_max_wait_ms``, 5 ms by default, see ``events.kafka.settings.ConsumerGroupTiming``). Node
    reports are bulk and on no user's path; with 5 ms that consumer ran a transaction for every one
    or two reports and took the CPU the decisions need (invalidation bench, 2 cores: last ack p99
    ~250–360 → ~150–200 ms). The ledger shows a node's changes up to this much later."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """The longest one attempt to reach the broker at start may take (a paused broker accepts
    connections and never answers)."""
    reconnect_initial_s: float = Field(0.5, gt=0)
    """While the broker is unreachable at start the consumers retry after this long…"""
    reconnect_max_s: float = Field(30.0, gt=0)
    """…doubling up to this long between attempts; the API answers meanwhile (docs/operations.md,
    "Degraded modes")."""
    stall_after_s: float = Field(60.0, gt=0)
    """A consumer whose fetched records stay uncommitted this long (a batch failing again and again)
    is *stalled*: ``/readyz`` answers 503 naming it and ``kvledger_consumer_stalled{group}`` is 1
    (docs/operations.md, "Stalled consumers")."""

    @model_validator(mode="after")
    def _reconnect_bounds(self) -> CoordinatorKafkaSettings:
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("kafka.reconnect_max_s must be at least kafka.reconnect_initial_s")
        return self


class HttpSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    retry_after_s: int = Field(5, ge=1)
    """``Retry-After`` of a 503 answered while the ledger database is unreachable."""


class LedgerSettings(BaseModel):
    """Ledger behaviour.

    ``subject_key`` is the deployment secret of :func:`events.schema.subject_digest`,
    shared with the nodes: node events carry only the keyed digest of a subject, and
    the ledger API digests a queried subject with the same key to find its blocks.

    ``receipt_signing_key`` is the PEM (unencrypted PKCS#8) Ed25519 key that signs
    erasure receipts and audit tree heads; every coordinator replica should hold the
    same one. Unset, the coordinator generates a key on first use and stores it
    wrapped under the master key, so receipts stay verifiable across restarts.
    ``command_signing_key`` is the PEM (unencrypted PKCS#8) Ed25519 key that signs every
    command (``Invalidate``, ``InventoryRequested``) as it is written to the outbox; the
    nodes pin its public key and apply nothing else. Every replica holds the same one. It
    is required by every part of the coordinator that decides commands (the API and the
    consumers): there is no unsigned mode.
    ``erasure_verify_interval_s`` is how often unverified erasures are re-checked
    (they are also checked right after every ack batch).
    """

    subject_key: SecretStr | None = None
    receipt_signing_key: SecretStr | None = None
    command_signing_key: SecretStr | None = None
    erasure_verify_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0)
    inventory_retry_s: float = Field(60.0, gt=0)
    outbox_poll_s: float = Field(0.5, gt=0)
    outbox_batch_size: int = Field(100, ge=1)
    outbox_lease_s: float = Field(10.0, gt=0)
    """How long the relay leaves a decision's commands to the deciding process, which
    publishes them right after its commit; only if that process died first does the
    relay publish them, this much later."""
    command_resend_after_s: float = Field(10.0, gt=0)
    """A target that has not acked its command this long after the decision gets the command again
    (``coordinator.handlers.resend``); each further re-send waits twice as long as the one
    before…"""
    command_resend_max_s: float = Field(120.0, gt=0)
    """…up to this long between two re-sends to one target."""
    command_resend_poll_s: float = Field(1.0, gt=0)
    """How often the consumers process looks for targets whose re-send is due."""
    deferred_ack_poll_s: float = Field(5.0, gt=0)
    """How often the consumers process looks for deferred acks (``coordinator.handlers.acks``) to
    release without being woken: every kv-events batch wakes it, so this only bounds a wake lost to
    a crash."""
    node_key_cache_s: float = Field(5.0, ge=0)
    """How long a looked-up node key is trusted from memory (``coordinator.keys.node_keys``): the
    longest a revoked node key keeps working at a replica, and the price of one key query per node
    per period."""

    prune_interval_s: float = Field(3600.0, gt=0)
    """How often the consumers process deletes inbox and outbox rows that can no longer matter
    (``coordinator.handlers.pruning``, docs/operations.md "Pruning")."""
    prune_inbox_after_s: float = Field(37 * _DAY_S, gt=0)
    """An inbox row is deleted this long after its event was applied. At least the longest
    retention of a topic the coordinator consumes (30 days) plus a margin for the broker's
    segment roll (Apache Kafka's default ``segment.ms``: 7 days): by then the broker no longer
    holds the record, so no redelivery can meet the missing row."""
    prune_outbox_after_s: float = Field(7 * _DAY_S, gt=0)
    """A sent outbox row is deleted this long after it was published; unsent rows are never deleted."""
    prune_batch_size: int = Field(5000, ge=1)
    """Rows per delete statement (each its own short transaction)."""

    @model_validator(mode="after")
    def _resend_bounds(self) -> LedgerSettings:
        if self.command_resend_max_s < self.command_resend_after_s:
            raise ValueError("command_resend_max_s must be at least command_resend_after_s")
        return self

    @model_validator(mode="after")
    def _inbox_outlives_retention(self) -> LedgerSettings:
        longest_s = (
            max(int(TOPIC_CONFIGS[topic]["retention.ms"]) for topic in CONSUMED_TOPICS) / 1000
        )
        if self.prune_inbox_after_s <= longest_s:
            raise ValueError(
                f"prune_inbox_after_s must exceed the longest retention of a consumed topic ({longest_s:.0f} s):"
                " a redelivered record would otherwise be applied twice"
            )
        return self


class KeySettings(BaseModel):
    """The data key service (``coordinator.keys.data_keys``).

    ``master_key`` (base64 of 32 bytes) wraps every data key stored in the
    ledger. Without it the coordinator serves no keys (HTTP 503): nodes that
    use the coordinator for their data keys then keep tenant/user blocks in
    memory only.
    """

    master_key: SecretStr | None = None

    @model_validator(mode="after")
    def _master_key_length(self) -> KeySettings:
        self.master_key_bytes()
        return self

    def master_key_bytes(self) -> bytes | None:
        """The decoded master key; None when unset. ValueError when it is not base64 of 32 bytes."""
        if self.master_key is None:
            return None
        try:
            key = base64.b64decode(self.master_key.get_secret_value(), validate=True)
        except ValueError:  # binascii.Error
            raise ValueError("the master key (KVLEDGER_MASTER_KEY) must be base64") from None
        if len(key) != 32:
            raise ValueError(
                f"the master key (KVLEDGER_MASTER_KEY) must decode to 32 bytes, got {len(key)}"
            )
        return key


class CoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVLEDGER_COORDINATOR_", env_nested_delimiter="__", extra="ignore"
    )

    database: DatabaseSettings = DatabaseSettings()
    kafka: CoordinatorKafkaSettings = CoordinatorKafkaSettings()
    operator_auth: IssuerSettings = IssuerSettings()
    """The operator issuer: the only tokens the coordinator's API accepts (``identity.roles``).
    Required; it must not share a key with ``auth``."""
    auth: IssuerSettings = IssuerSettings()
    """The end users' issuer, as the nodes verify it. No coordinator endpoint takes end-user
    tokens (the data key endpoints take node credentials only, ``coordinator.api.routes.keys``); the
    coordinator reads it only to refuse an ``operator_auth`` that shares its key."""
    http: HttpSettings = HttpSettings()
    http_limits: HttpServerLimits = HttpServerLimits()
    """What one unauthenticated client may hold of the HTTP server
    (``KVLEDGER_COORDINATOR_HTTP_LIMITS__*``)."""
    ledger: LedgerSettings = LedgerSettings()
    keys: KeySettings = KeySettings()
    metrics: MetricsSettings = MetricsSettings()
    """The bearer token of ``/metrics`` (``KVLEDGER_COORDINATOR_METRICS__TOKEN`` or
    ``KVLEDGER_METRICS_TOKEN``)."""

    SHARED_ENV = _SHARED_ENV

    @model_validator(mode="after")
    def _distinct_issuers(self) -> CoordinatorSettings:
        refuse_shared_issuer(self.operator_auth, self.auth)
        return self

    def command_signer(self) -> EnvelopeSigner:
        """The command signing key as a signer; ValueError when unset or not an Ed25519 PEM key."""
        if self.ledger.command_signing_key is None:
            raise ValueError(
                "set KVLEDGER_COMMAND_SIGNING_KEY (an Ed25519 PEM private key; nodes pin its public key):"
                " the coordinator signs every command it sends"
            )
        try:
            key = load_private_key_pem(self.ledger.command_signing_key.get_secret_value().encode())
        except ValueError as error:
            raise ValueError(f"KVLEDGER_COMMAND_SIGNING_KEY: {error}") from None
        return EnvelopeSigner(key)

    def subject_key_bytes(self) -> bytes:
        """The subject digest key; ValueError when unset, because the ledger cannot match subjects
        without it."""
        if self.ledger.subject_key is None:
            raise ValueError(
                "set KVLEDGER_SUBJECT_KEY (shared with the nodes) to query blocks by subject"
            )
        return self.ledger.subject_key.get_secret_value().encode()


def kafka_settings(settings: CoordinatorSettings) -> KafkaSettings:
    """The shared Kafka helpers' settings for this coordinator: its client id, topics' shape, timing
    and security."""
    return KafkaSettings(
        bootstrap=settings.kafka.bootstrap,
        client_id="kvledger-coordinator",
        enable_idempotence=settings.kafka.enable_idempotence,
        num_partitions=settings.kafka.num_partitions,
        replication_factor=settings.kafka.replication_factor,
        group_id=settings.kafka.group_id,
        **settings.kafka.timing_fields(),
        **settings.kafka.security_fields(),
    )
