"""GPU node settings (pydantic-settings, env prefix ``KVLEDGER_NODE_``, nested with ``__``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class AuthSettings(BaseModel):
    """How bearer tokens are verified. Exactly one of the two keys is expected."""

    jwt_secret: SecretStr | None = None
    jwt_public_key_file: Path | None = None
    audience: str | None = None
    leeway_s: float = 5.0


class CacheSettings(BaseModel):
    block_size: int = Field(16, gt=0)
    num_device_blocks: int = Field(4096, ge=0)
    num_host_blocks: int = Field(8192, ge=0)
    max_disk_blocks: int = Field(65536, ge=0)
    ttl_public_s: float | None = 3600.0
    ttl_tenant_s: float | None = 1800.0
    ttl_user_s: float | None = 600.0
    singleflight_wait_s: float = 30.0
    enabled: bool = True


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


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVLEDGER_NODE_", env_nested_delimiter="__", extra="ignore")

    node_id: str = "node-0"
    model_dir: Path = Path(".kvledger/models/tiny")
    model_name: str | None = None
    data_dir: Path = Path(".kvledger/node-0")
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8100
    warm_from: Path | None = None
    auth: AuthSettings = AuthSettings()
    cache: CacheSettings = CacheSettings()
    identity: IdentitySettings = IdentitySettings()
    # The ledger hooks are optional: without a broker the node runs standalone.
    # The stack-wide variables are honoured because one operator sets them once
    # for every process (see coordinator/settings.py).
    kafka_bootstrap: str | None = Field(
        None, validation_alias=AliasChoices("kafka_bootstrap", "KVLEDGER_NODE_KAFKA_BOOTSTRAP", "KVLEDGER_KAFKA_BOOTSTRAP")
    )
    subject_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("subject_key", "KVLEDGER_NODE_SUBJECT_KEY", "KVLEDGER_SUBJECT_KEY")
    )
    coordinator_url: str | None = Field(
        None,
        validation_alias=AliasChoices("coordinator_url", "KVLEDGER_NODE_COORDINATOR_URL", "KVLEDGER_COORDINATOR_URL"),
    )
    """Where data keys for tenant/user blocks at rest come from (``gpu_node.remote_keys``); unset: a local key file."""
    kafka_partitions: int = Field(4, ge=1)
    publish_interval_s: float = Field(0.05, gt=0)
    heartbeat_interval_s: float = Field(5.0, gt=0)
