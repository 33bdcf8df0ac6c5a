"""How every Kafka client of the project connects: one settings model and one place that builds client arguments.

Nodes, coordinator, router and CLI all construct aiokafka clients through
:func:`kafka_client_kwargs`, so TLS and SASL cannot be configured for one client and forgotten
for another (a unit test fails on any client built without it).
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

log = logging.getLogger(__name__)


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaSecurity(BaseModel):
    """How a client proves who it is to the brokers and protects the connection.

    One set of fields for every service's Kafka settings (this module's
    :class:`KafkaSettings`, the coordinator's and the node's groups), so each carries
    the same options under the same names; :func:`kafka_client_kwargs` turns them
    into aiokafka arguments. The brokers' ACLs then decide what each principal may
    produce and consume (docs/security.md, "Kafka authentication and ACLs").

    ``SSL``/``SASL_SSL`` verify the brokers against ``ssl_cafile`` (the system CAs
    when unset); ``ssl_certfile`` + ``ssl_keyfile`` add a client certificate (mTLS).
    SCRAM and PLAIN both take ``sasl_username``/``sasl_password``.
    """

    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        """Refuse combinations that would silently connect with less protection than configured."""
        uses_sasl = self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")
        uses_ssl = self.security_protocol in ("SSL", "SASL_SSL")
        has_sasl = (
            self.sasl_mechanism is not None
            or self.sasl_username is not None
            or self.sasl_password is not None
        )
        if uses_sasl:
            if self.sasl_mechanism is None:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs a sasl_mechanism"
                )
            if (
                not self.sasl_username
                or self.sasl_password is None
                or not self.sasl_password.get_secret_value()
            ):
                raise ValueError(
                    f"sasl_mechanism {self.sasl_mechanism} needs sasl_username and sasl_password"
                )
        elif has_sasl:
            raise ValueError(
                f"SASL settings need security_protocol SASL_PLAINTEXT or SASL_SSL, not {self.security_protocol}"
            )
        files = {
            "ssl_cafile": self.ssl_cafile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
        }
        if not uses_ssl and any(path is not None for path in files.values()):
            raise ValueError(
                f"ssl_* files need security_protocol SSL or SASL_SSL, not {self.security_protocol}"
            )
        for name, path in files.items():
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {path} does not exist")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("a client certificate (mTLS) needs both ssl_certfile and ssl_keyfile")
        return self

    def security_fields(self) -> dict[str, Any]:
        """These fields and their values, to build another service's settings from this one's."""
        return {name: getattr(self, name) for name in KafkaSecurity.model_fields}


KAFKA_SHARED_ENV: dict[str, str] = {
    f"KVLEDGER_KAFKA_{name.upper()}": name for name in KafkaSecurity.model_fields
}
"""Stack-wide variable → :class:`KafkaSecurity` field, honoured by every service and the CLI (e.g.
``KVLEDGER_KAFKA_SASL_PASSWORD``): one operator sets them once for every process."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ConsumerGroupTiming(BaseModel):
    """How group members stay alive and how long their fetches wait: the settings of every service
    whose consumers join a group."""

    session_timeout_ms: int = Field(default=10_000, ge=1)
    """How long the group coordinator waits for a :class:`BatchConsumer`'s heartbeat before it
    drops the member and hands its partitions to the others. It also paces every group join on
    the embedded Tansu broker, which holds a JoinGroup for half of it waiting for more members:
    each consumer start or rebalance there costs ``session_timeout_ms / 2``. Apache Kafka
    accepts values between its ``group.min.session.timeout.ms`` (6 s by default) and
    ``group.max.session.timeout.ms``. The default is aiokafka's; the tests pass a small value."""
    heartbeat_interval_ms: int = Field(default=3_000, ge=1)
    """How often a member heartbeats; below ``session_timeout_ms`` (a third of it is usual)."""
    fetch_max_wait_ms: int = Field(default=5, ge=1)
    """How long the broker may hold a fetch waiting for data. Brokers that answer a waiting
    fetch only when the wait expires (Tansu does) add up to this much to every consumer hop
    (aiokafka's default: 500 ms), and an invalidation crosses three hops before its last ack.
    An idle consumer costs the broker one empty fetch per wait in exchange (at 5 ms about a
    sixth of a core between client and broker, per idle consumer). Apache Kafka answers a
    waiting fetch as soon as data arrives, so there a long wait costs no latency."""

    @model_validator(mode="after")
    def _heartbeat_within_session(self) -> ConsumerGroupTiming:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below session_timeout_ms ({self.session_timeout_ms})"
            )
        return self

    def timing_fields(self) -> dict[str, int]:
        """These fields and their values: another service's settings, or an ``AIOKafkaConsumer``'s
        keyword arguments of the same names."""
        return {name: getattr(self, name) for name in ConsumerGroupTiming.model_fields}


MIN_REQUEST_BYTES = 65_536
"""What a by-reference dead letter (bounded prefixes and error, see ``events.codec``) always fits in:
far below the producers' :data:`~events.record_size.MAX_REQUEST_BYTES`, so one can always be sent."""


class KafkaSettings(KafkaSecurity, ConsumerGroupTiming):
    """Connection and topic defaults.

    ``enable_idempotence`` defaults to off because the embedded Tansu broker answers the
    idempotent producer's InitProducerId with an error; turn it on against Apache Kafka.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap: str = Field(min_length=1)
    client_id: str = Field(default="kvledger", min_length=1)
    enable_idempotence: bool = False
    num_partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    group_id: str | None = None
    top_up_ms: int = Field(default=10, ge=0)
    """How long :func:`get_fresh_batch` waits for the records that reached the broker while the
    previous batch was handled (0: never tops up). About one fetch round trip plus the broker's
    wait; it is spent only when a poll found its records already buffered."""

    @model_validator(mode="after")
    def _warn_cleartext_credentials(self) -> KafkaSettings:
        if self.security_protocol == "SASL_PLAINTEXT":
            remote = sorted(
                {hostport.rsplit(":", 1)[0] for hostport in self.bootstrap.split(",")} - {""}
            )
            remote = [host for host in remote if not _is_loopback(host)]
            if remote:
                log.warning(
                    "Kafka SASL_PLAINTEXT to %s: credentials and records cross the network unencrypted; use SASL_SSL",
                    ", ".join(remote),
                )
        return self


def kafka_ssl_context(security: KafkaSecurity) -> ssl.SSLContext:
    """A client TLS context: verifies the brokers (``ssl_cafile`` or the system CAs), presents a client certificate for mTLS."""
    context = ssl.create_default_context(
        cafile=str(security.ssl_cafile) if security.ssl_cafile is not None else None
    )
    context.check_hostname = security.ssl_check_hostname
    if security.ssl_certfile is not None:
        context.load_cert_chain(
            certfile=str(security.ssl_certfile), keyfile=str(security.ssl_keyfile)
        )
    return context


def kafka_client_kwargs(settings: KafkaSettings) -> dict[str, Any]:
    """Connection and authentication arguments for every aiokafka producer, consumer and admin client.

    The one place settings become client arguments, so no client of the code base
    connects with less than what is configured (a test checks every construction
    site goes through here).
    """
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap,
        "client_id": settings.client_id,
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = kafka_ssl_context(settings)
    if settings.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        kwargs["sasl_mechanism"] = settings.sasl_mechanism
        kwargs["sasl_plain_username"] = settings.sasl_username
        assert settings.sasl_password is not None, "KafkaSettings refuses SASL without a password"
        kwargs["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    return kwargs
