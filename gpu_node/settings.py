"""GPU node settings (pydantic-settings, env prefix ``KVLEDGER_NODE_``, nested with ``__``)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from identity.settings import IssuerSettings
from identity.tokens import JWT_SECRET_ENV


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
    auth: IssuerSettings = IssuerSettings()
    """End users' tokens (the customer's identity provider; in the dev stack ``KVLEDGER_JWT_SECRET``)."""
    operator_auth: IssuerSettings = IssuerSettings()
    """Operators' tokens (``platform-admin`` writes snapshots); unset, no operator endpoint answers."""
    cache: CacheSettings = CacheSettings()
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

    @model_validator(mode="after")
    def _distinct_issuers(self) -> NodeSettings:
        if self.operator_auth.configured and self.operator_auth.shares_key_with(
            self.auth, other_secret=os.environ.get(JWT_SECRET_ENV)
        ):
            raise ValueError("operator_auth must not use the end users' key: an end user could then act as an operator")
        return self
