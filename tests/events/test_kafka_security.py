"""Kafka authentication and TLS settings: validation, the aiokafka arguments they become, and that
every client uses them.

The embedded Tansu broker cannot serve SASL or TLS to these tests (``--cert`` does not
turn TLS on, and ``--authentication`` needs SCRAM users that only an authenticated
client can create), so the end-to-end TLS check runs through a TLS-terminating proxy in
tests/security/test_kafka_tls.py; here the settings themselves are checked.
"""

from __future__ import annotations

import ast
import datetime
import logging
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pydantic import ValidationError

from coordinator.consumers import kafka_settings as coordinator_kafka_settings
from coordinator.settings import CoordinatorSettings
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from gpu_node.entrypoints.server import kafka_settings as node_kafka_settings
from gpu_node.settings import NodeSettings

ROOT = Path(__file__).resolve().parents[2]
CLIENT_CLASSES = {"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"}


def _pem_pair(
    directory: Path, name: str, issuer_key=None, issuer_name=None, is_ca: bool = False
) -> tuple[Path, Path, object, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    certificate = builder.sign(issuer_key or key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path, key, subject


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca_cert, _, ca_key, ca_name = _pem_pair(tmp_path, "ca", is_ca=True)
    client_cert, client_key, _, _ = _pem_pair(tmp_path, "client", ca_key, ca_name)
    return {"ca": ca_cert, "client_cert": client_cert, "client_key": client_key}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVLEDGER_"):
            monkeypatch.delenv(name)


def test_plaintext_is_the_default_and_carries_no_credentials():
    assert kafka_client_kwargs(KafkaSettings(bootstrap="127.0.0.1:9092", client_id="c")) == {
        "bootstrap_servers": "127.0.0.1:9092",
        "client_id": "c",
        "security_protocol": "PLAINTEXT",
    }


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_gives_credentials_and_a_verifying_context(pki, mechanism):
    settings = KafkaSettings(
        bootstrap="kafka.example:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism=mechanism,
        sasl_username="coordinator",
        sasl_password="s3cret",
        ssl_cafile=pki["ca"],
    )
    kwargs = kafka_client_kwargs(settings)
    context = kwargs.pop("ssl_context")
    assert kwargs == {
        "bootstrap_servers": "kafka.example:9093",
        "client_id": "kvledger",
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": mechanism,
        "sasl_plain_username": "coordinator",
        "sasl_plain_password": "s3cret",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname is True
    # Exactly the given CA is trusted, not the system bundle.
    assert [cert["subject"] for cert in context.get_ca_certs()] == [((("commonName", "ca"),),)]
    assert "s3cret" not in repr(settings)


def test_mtls_context_loads_the_client_certificate(pki):
    settings = KafkaSettings(
        bootstrap="kafka.example:9093",
        security_protocol="SSL",
        ssl_cafile=pki["ca"],
        ssl_certfile=pki["client_cert"],
        ssl_keyfile=pki["client_key"],
        ssl_check_hostname=False,
    )
    context = kafka_client_kwargs(settings)["ssl_context"]
    assert context.check_hostname is False and context.verify_mode == ssl.CERT_REQUIRED
    # A key that does not belong to the certificate is refused when the context is built.
    other_cert, other_key, _, _ = _pem_pair(pki["ca"].parent, "other")
    mismatched = settings.model_copy(update={"ssl_keyfile": other_key})
    with pytest.raises(ssl.SSLError):
        kafka_client_kwargs(mismatched)
    assert other_cert.is_file()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"security_protocol": "SASL_SSL", "sasl_username": "u", "sasl_password": "p"},
            "needs a sasl_mechanism",
        ),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
            },
            "needs sasl_username and sasl_password",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_password": "p",
            },
            "needs sasl_username and sasl_password",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "",
            },
            "needs sasl_username and sasl_password",
        ),
        (
            {"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"},
            "SASL settings need security_protocol",
        ),
        (
            {"security_protocol": "SSL", "ssl_cafile": "/nonexistent/ca.pem"},
            "ssl_cafile /nonexistent/ca.pem does not exist",
        ),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "p",
                "ssl_cafile": "CA",
            },
            "ssl_\\* files need security_protocol SSL",
        ),
        (
            {"security_protocol": "SSL", "ssl_certfile": "CERT"},
            "needs both ssl_certfile and ssl_keyfile",
        ),
        (
            {"security_protocol": "TLS"},
            "Input should be 'PLAINTEXT', 'SSL', 'SASL_PLAINTEXT' or 'SASL_SSL'",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "GSSAPI",
                "sasl_username": "u",
                "sasl_password": "p",
            },
            "Input should be 'PLAIN'",
        ),
    ],
)
def test_inconsistent_settings_are_refused(pki, fields, message):
    files = {"CA": str(pki["ca"]), "CERT": str(pki["client_cert"])}
    fields = {
        name: files.get(value, value) if isinstance(value, str) else value
        for name, value in fields.items()
    }
    with pytest.raises(ValueError, match=message):
        KafkaSettings(bootstrap="127.0.0.1:9092", **fields)


def test_sasl_plaintext_to_a_remote_broker_is_warned_about(caplog):
    sasl = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_username": "u",
        "sasl_password": "p",
    }
    with caplog.at_level(logging.WARNING, logger="events.kafka"):
        KafkaSettings(bootstrap="127.0.0.1:9092,localhost:9093,[::1]:9094", **sasl)
        assert caplog.records == []
        KafkaSettings(bootstrap="127.0.0.1:9092,kafka-1.internal:9092", **sasl)
    assert [record.getMessage() for record in caplog.records] == [
        "Kafka SASL_PLAINTEXT to kafka-1.internal: credentials and records cross the network unencrypted; use SASL_SSL"
    ]


def test_node_and_coordinator_take_the_shared_and_their_own_variables(monkeypatch, pki):
    monkeypatch.setenv("KVLEDGER_KAFKA_BOOTSTRAP", "kafka.example:9093")
    monkeypatch.setenv("KVLEDGER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KVLEDGER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("KVLEDGER_KAFKA_SASL_USERNAME", "shared-user")
    monkeypatch.setenv("KVLEDGER_KAFKA_SASL_PASSWORD", "shared-password")
    monkeypatch.setenv("KVLEDGER_KAFKA_SSL_CAFILE", str(pki["ca"]))
    monkeypatch.setenv("KVLEDGER_NODE_KAFKA__SASL_USERNAME", "node-7")
    monkeypatch.setenv("KVLEDGER_NODE_KAFKA__SASL_PASSWORD", "node-password")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_KAFKA__SASL_USERNAME", "coordinator")
    node = node_kafka_settings(NodeSettings(node_id="node-7"))
    coordinator = coordinator_kafka_settings(CoordinatorSettings())
    assert (node.security_protocol, node.sasl_mechanism, node.ssl_cafile) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        pki["ca"],
    )
    assert (node.sasl_username, node.sasl_password.get_secret_value()) == (
        "node-7",
        "node-password",
    )
    assert (coordinator.security_protocol, coordinator.sasl_mechanism) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
    )
    assert (coordinator.sasl_username, coordinator.sasl_password.get_secret_value()) == (
        "coordinator",
        "shared-password",
    )
    assert kafka_client_kwargs(node)["sasl_plain_username"] == "node-7"


def test_the_nodes_consumer_timing_reaches_its_kafka_settings(monkeypatch):
    """The node's command consumer joins a group of its own: the coordinator's timing settings, its own variables."""
    defaults = node_kafka_settings(NodeSettings(kafka_bootstrap="127.0.0.1:9092"))
    assert (
        defaults.session_timeout_ms,
        defaults.heartbeat_interval_ms,
        defaults.fetch_max_wait_ms,
    ) == (10_000, 3_000, 5)
    monkeypatch.setenv("KVLEDGER_NODE_KAFKA__SESSION_TIMEOUT_MS", "2000")
    monkeypatch.setenv("KVLEDGER_NODE_KAFKA__HEARTBEAT_INTERVAL_MS", "500")
    monkeypatch.setenv("KVLEDGER_NODE_KAFKA__FETCH_MAX_WAIT_MS", "50")
    config = node_kafka_settings(NodeSettings(kafka_bootstrap="127.0.0.1:9092"))
    assert (config.session_timeout_ms, config.heartbeat_interval_ms, config.fetch_max_wait_ms) == (
        2000,
        500,
        50,
    )


def test_invalid_environment_fails_at_startup(monkeypatch):
    monkeypatch.setenv("KVLEDGER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    with pytest.raises(ValidationError, match="needs a sasl_mechanism"):
        NodeSettings()
    with pytest.raises(ValidationError, match="needs a sasl_mechanism"):
        CoordinatorSettings()


def _client_constructions(path: Path) -> list[tuple[int, str, bool]]:
    """(line, class, passes **kafka_client_kwargs(...)) for every aiokafka client constructed in
    ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = (
                node.func.id
                if isinstance(node.func, ast.Name)
                else getattr(node.func, "attr", None)
            )
            if name in CLIENT_CLASSES:
                uses_kwargs = any(
                    keyword.arg is None
                    and isinstance(keyword.value, ast.Call)
                    and getattr(keyword.value.func, "id", None) == "kafka_client_kwargs"
                    for keyword in node.keywords
                )
                plain = {keyword.arg for keyword in node.keywords} & {
                    "bootstrap_servers",
                    "security_protocol",
                    "ssl_context",
                    "sasl_mechanism",
                }
                found.append((node.lineno, name, uses_kwargs and not plain))
    return found


def test_every_kafka_client_is_built_with_the_security_kwargs():
    """No producer, consumer or admin client of the code base connects around the configured
    SASL/TLS."""
    sources = [
        path
        for package in ("events", "gpu_node", "coordinator", "kvledger", "bench")
        for path in (ROOT / package).rglob("*.py")
    ]
    constructions = {
        path.relative_to(ROOT).as_posix(): _client_constructions(path) for path in sources
    }
    constructions = {path: found for path, found in constructions.items() if found}
    bypassing = {
        path: [(line, name) for line, name, ok in found if not ok]
        for path, found in constructions.items()
    }
    assert {path: found for path, found in bypassing.items() if found} == {}
    # The check sees the clients it is meant to see.
    assert {
        "events/kafka/producer.py",
        "events/kafka/consumer.py",
        "events/kafka/admin.py",
        "gpu_node/governance/commands.py",
        "kvledger/services.py",
        "bench/common.py",
        "bench/invalidation.py",
    } <= set(constructions)
