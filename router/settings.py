"""Router settings (pydantic-settings, env prefix ``KVLEDGER_ROUTER_``, nested with ``__``).

Stack-wide variables are honoured as by the node: ``KVLEDGER_KAFKA_BOOTSTRAP``,
``KVLEDGER_COORDINATOR_URL``, ``KVLEDGER_METRICS_TOKEN`` (or ``_FILE``), the Kafka security
variables, and ``KVLEDGER_JWT_SECRET`` for end users' tokens (``identity.tokens.TokenVerifier``).
End users' tokens are verified with the same ``auth`` group a node takes, so a router accepts
exactly the tokens its nodes accept.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from events.http_server import HttpServerLimits
from events.kafka.settings import ConsumerGroupTiming, KafkaSecurity
from events.schema import Name
from identity.metrics_access import MetricsSettings
from identity.service_settings import ServiceSettings
from identity.settings import IssuerSettings


class NodeEndpoint(BaseModel):
    """A node the router may send requests to: its id (as in its kv-events) and its base URL."""

    node_id: Name
    url: str = Field(pattern=r"^https?://")


class RoutingSettings(BaseModel):
    """How nodes are picked and when they are skipped (``router.scoring``, ``router.health``)."""

    load_cost_blocks: float = Field(4.0, ge=0)
    """What one request in flight on a node costs, in cached device blocks (``PrefixLoadStrategy``)."""
    heartbeat_timeout_s: float = Field(30.0, gt=0)
    """A node unheard (no kv-event, no heartbeat) for this long is skipped."""
    failure_threshold: int = Field(3, ge=1)
    breaker_open_s: float = Field(10.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)
    """Between two bytes of a node's answer (a long generation streams; a non-streamed one waits for
    its end)."""
    max_index_blocks: int = Field(10_000_000, ge=1)
    reread_interval_s: float = Field(1.0, gt=0)
    """At most one ledger re-read of a node per this interval, however many gaps it shows."""
    node_keys_cache_s: float = Field(5.0, ge=0)
    """How long enrolled node keys fetched from the coordinator are trusted: the router's revocation
    bound."""
    queue_poll_interval_s: float = Field(0.5, gt=0)
    """How often each node's own queue (running + waiting requests, its ``/v1/kvledger/load``) is read (``router.load``)."""
    keying_refresh_s: float = Field(10.0, gt=0)
    """How often the nodes' keying (model, namespace, block size, tokenizer digest) is fetched
    again."""


class RouterLimits(BaseModel):
    """Bounds on one request, checked before it is keyed (the node checks its own again)."""

    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_messages: int = Field(10_000, ge=1)


class RouterKafkaSettings(KafkaSecurity, ConsumerGroupTiming):
    """How the router authenticates to the brokers and how its consumers' group members stay alive."""


class RouterSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVLEDGER_ROUTER_", env_nested_delimiter="__", extra="ignore"
    )

    router_id: Name = "router-0"
    """Names this replica's consumer groups (``kvledger-router-<id>-kv-events``, ``…-commands``): every replica its own."""
    host: str = "127.0.0.1"
    port: int = 8200
    nodes: list[NodeEndpoint] = []
    model_dir: Path = Path(".kvledger/models/smollm2-135m-instruct")
    """The model directory the nodes serve (its tokenizer and chat template key requests)."""
    model_name: str | None = None
    """The model's name as nodes serve it; unset: the directory's name, as a node names it."""
    auth: IssuerSettings = IssuerSettings()
    metrics: MetricsSettings = MetricsSettings()
    limits: RouterLimits = RouterLimits()
    http_limits: HttpServerLimits = HttpServerLimits()
    routing: RoutingSettings = RoutingSettings()
    kafka: RouterKafkaSettings = RouterKafkaSettings()
    kafka_partitions: int = Field(4, ge=1)
    kafka_bootstrap: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "kafka_bootstrap", "KVLEDGER_ROUTER_KAFKA_BOOTSTRAP", "KVLEDGER_KAFKA_BOOTSTRAP"
        ),
    )
    coordinator_url: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "coordinator_url", "KVLEDGER_ROUTER_COORDINATOR_URL", "KVLEDGER_COORDINATOR_URL"
        ),
    )
    coordinator_token: SecretStr | None = None
    """An operator token with the ``router`` role, for the coordinator's ``/v1/router/*``."""
    coordinator_token_file: Path | None = None
    """The same token in a file, read again for every request (so it can be rotated underneath)."""
    coordinator_public_key_file: Path | None = None
    """The coordinator's command key (PEM), pinned as nodes pin it: only decisions it signed drop
    blocks."""

    @model_validator(mode="after")
    def _one_token(self) -> RouterSettings:
        if self.coordinator_token is not None and self.coordinator_token_file is not None:
            raise ValueError("set coordinator_token or coordinator_token_file, not both")
        return self

    @property
    def served_model(self) -> str:
        return self.model_name or Path(self.model_dir).name

    def coordinator_bearer(self) -> str:
        """The operator token for the coordinator; ValueError when none is configured."""
        if self.coordinator_token is not None:
            return self.coordinator_token.get_secret_value()
        if self.coordinator_token_file is not None:
            token = Path(self.coordinator_token_file).read_text().strip()
            if token:
                return token
        raise ValueError(
            "the router needs an operator token with the 'router' role (coordinator_token or coordinator_token_file)"
        )
