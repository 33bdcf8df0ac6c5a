"""Coordinator settings: nested KVLEDGER_COORDINATOR_* groups, the shared KVLEDGER_* variables and
their precedence."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings

SHARED = {
    "KVLEDGER_DATABASE_URL": "postgresql://shared@db/kvledger",
    "KVLEDGER_KAFKA_BOOTSTRAP": "kafka-shared:9092",
    "KVLEDGER_JWT_SECRET": "a-shared-secret-that-is-long-enough-32b",
    "KVLEDGER_SUBJECT_KEY": "shared-subject-key",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVLEDGER_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    settings = CoordinatorSettings()
    assert settings.database.url.get_secret_value().startswith("postgresql+asyncpg://")
    assert settings.kafka.enable_idempotence is False
    assert (settings.http.host, settings.http.port) == ("127.0.0.1", 8000)
    assert settings.auth.jwt_secret is None and settings.ledger.subject_key is None


def test_shared_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SHARED.items():
        monkeypatch.setenv(name, value)
    settings = CoordinatorSettings()
    # A libpq URL gets the asyncpg driver; secrets stay SecretStr (never printed by repr).
    assert settings.database.url.get_secret_value() == "postgresql+asyncpg://shared@db/kvledger"
    assert settings.kafka.bootstrap == "kafka-shared:9092"
    assert settings.auth.jwt_secret.get_secret_value() == SHARED["KVLEDGER_JWT_SECRET"]
    assert settings.ledger.subject_key.get_secret_value() == "shared-subject-key"
    assert "shared-subject-key" not in repr(settings) and "shared@db" not in repr(settings)


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    """explicit argument > KVLEDGER_COORDINATOR_* > shared KVLEDGER_* > default; groups merge, not
    replace."""
    for name, value in SHARED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__BOOTSTRAP", "kafka-coordinator:9092")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__GROUP_ID", "ledger-a")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_DATABASE__POOL_SIZE", "3")
    settings = CoordinatorSettings(database={"url": "postgresql+asyncpg://explicit/db"})
    assert settings.kafka.bootstrap == "kafka-coordinator:9092"
    assert settings.kafka.group_id == "ledger-a"
    assert settings.database.url.get_secret_value() == "postgresql+asyncpg://explicit/db"
    assert settings.database.pool_size == 3


def test_rejects_non_postgres_url() -> None:
    with pytest.raises(ValueError, match="postgresql"):
        CoordinatorSettings(database={"url": "mysql://x/y"})


def test_command_signer_is_required_and_must_be_an_ed25519_pem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from identity.signing import key_id, private_key_pem

    with pytest.raises(ValueError, match="KVLEDGER_COMMAND_SIGNING_KEY"):
        CoordinatorSettings().command_signer()
    key = Ed25519PrivateKey.generate()
    monkeypatch.setenv("KVLEDGER_COMMAND_SIGNING_KEY", private_key_pem(key).decode())
    assert CoordinatorSettings().command_signer().key_id == key_id(key.public_key())
    monkeypatch.setenv("KVLEDGER_COMMAND_SIGNING_KEY", "not a key")
    with pytest.raises(
        ValueError, match="KVLEDGER_COMMAND_SIGNING_KEY: not an unencrypted PEM private key"
    ):
        CoordinatorSettings().command_signer()


def test_consumer_group_timing_reaches_every_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Production keeps aiokafka's 10 s session; a deployment (or a test) sets its own, and the
    consumers get it."""
    from coordinator.consumers import kafka_settings

    defaults = kafka_settings(CoordinatorSettings())
    assert (
        defaults.session_timeout_ms,
        defaults.heartbeat_interval_ms,
        defaults.fetch_max_wait_ms,
    ) == (10_000, 3_000, 5)
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__SESSION_TIMEOUT_MS", "2000")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__HEARTBEAT_INTERVAL_MS", "500")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__FETCH_MAX_WAIT_MS", "50")
    config = kafka_settings(CoordinatorSettings())
    assert (config.session_timeout_ms, config.heartbeat_interval_ms, config.fetch_max_wait_ms) == (
        2000,
        500,
        50,
    )
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__HEARTBEAT_INTERVAL_MS", "2000")
    with pytest.raises(ValueError, match="must be below session_timeout_ms"):
        CoordinatorSettings()


def test_the_node_key_revocation_bound_is_five_seconds_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert CoordinatorSettings().ledger.node_key_cache_s == 5.0
    monkeypatch.setenv("KVLEDGER_COORDINATOR_LEDGER__NODE_KEY_CACHE_S", "0.5")
    assert CoordinatorSettings().ledger.node_key_cache_s == 0.5
    monkeypatch.setenv("KVLEDGER_COORDINATOR_LEDGER__NODE_KEY_CACHE_S", "-1")
    with pytest.raises(ValueError, match="node_key_cache_s"):
        CoordinatorSettings()
