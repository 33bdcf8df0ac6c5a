"""Helpers shared by the integration, security and e2e tests: a fresh database per module, coordinator
settings (:func:`coordinator_settings`), the coordinator's consumers in the test's event loop, waiting
(:func:`eventually`), event builders and a fake node (:class:`FakeNode`), consumer groups that start at the
end of the shared broker's topics, and the keys every party signs with (the coordinator's command key, one
key per test node, enrolled on first use)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import make_url, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from bench.common import connect_kwargs, start_groups_at_end
from coordinator.consumers import consumer_groups, run_consumers
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.codec import DeadLetter, encode_event
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.schema import (
    BlockStored,
    Envelope,
    EventPayload,
    EventValidationError,
    NodeStarted,
    StoredBlock,
    make_event,
    parse_event,
)
from events.topics import COMMANDS, CUSTOMER_TOPICS, DEAD_LETTER, route
from gpu_node.keys.node_identity import NODE_KEY_FILE
from identity.signing import EnvelopeSigner, private_key_pem, public_key_pem, sign_envelope
from identity.tokens import issue_token
from kvledger.nodes import enroll_node_key
from kvledger.producers import enroll_producer_key

JWT_SECRET = "integration-test-secret-of-at-least-32-bytes"
"""The end users' HS256 secret (the nodes' ``auth``); the coordinator accepts no token signed with
it."""
SUBJECT_KEY = "integration-test-subject-key"

_OPERATOR_KEY = Ed25519PrivateKey.from_private_bytes(
    hashlib.sha256(b"kvledger test operator issuer").digest()
)
OPERATOR_PRIVATE_KEY_PEM = _OPERATOR_KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
)
OPERATOR_PUBLIC_KEY_PEM = _OPERATOR_KEY.public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
)


def _public_key_file() -> str:
    """The test operator issuer's public key as a file (settings name a file); same content for every process."""
    path = os.path.join(tempfile.gettempdir(), f"kvledger-test-operator-{os.getuid()}.pub.pem")
    staged = f"{path}.{os.getpid()}"
    with open(staged, "wb") as file:
        file.write(OPERATOR_PUBLIC_KEY_PEM)
    os.replace(staged, path)
    return path


OPERATOR_PUBLIC_KEY_FILE = _public_key_file()
OPERATOR_AUTH = {"jwt_public_key_file": OPERATOR_PUBLIC_KEY_FILE}
"""``CoordinatorSettings.operator_auth`` / ``NodeSettings.operator_auth`` of the tests."""


def operator_token(
    role: str,
    tenant: str = "acme",
    *,
    sub: str = "operator-1",
    ttl_s: int = 3600,
    now: float | None = None,
) -> str:
    """A token of the tests' operator issuer: ``role`` acting for ``tenant``."""
    return issue_token(
        tenant=tenant,
        sub=sub,
        roles=[role],
        ttl_s=ttl_s,
        private_key_pem=OPERATOR_PRIVATE_KEY_PEM,
        now=now,
    )


def operator_headers(role: str, tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {operator_token(role, tenant)}"}


COMMAND_KEY = Ed25519PrivateKey.generate()
"""The test session's coordinator command key: coordinator settings sign with it, test nodes pin it."""
COMMAND_SIGNING_KEY = private_key_pem(COMMAND_KEY).decode()
sign_command = EnvelopeSigner(COMMAND_KEY)


@functools.cache
def command_public_key_file() -> Path:
    """The command public key as a PEM file, for
    ``NodeSettings.identity.coordinator_public_key_file``."""
    path = Path(tempfile.mkdtemp(prefix="kvledger-command-key-")) / "command_key.pub"
    path.write_bytes(public_key_pem(COMMAND_KEY.public_key()))
    return path


def node_key(node_id: str) -> Ed25519PrivateKey:
    """The test key of ``node_id``: derived from the id, so fake nodes, real nodes and enrollment agree on it."""
    return Ed25519PrivateKey.from_private_bytes(
        hashlib.sha256(f"kvledger-test-node:{node_id}".encode()).digest()
    )


def install_node_key(data_dir: Path, node_id: str) -> None:
    """Put ``node_id``'s test key where a node keeps its own (``node_key.pem`` in its data dir)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / NODE_KEY_FILE
    if not path.exists():
        path.touch(mode=0o600)
        path.write_bytes(private_key_pem(node_key(node_id)))


async def enroll_nodes(database_url: str, node_ids: Iterable[str]) -> None:
    """Enroll the test keys of ``node_ids`` in the ledger at ``database_url``."""
    for node_id in node_ids:
        await enroll_node_key(database_url, node_id, node_key(node_id).public_key())


PRODUCER_KEY = Ed25519PrivateKey.from_private_bytes(
    hashlib.sha256(b"kvledger test producer").digest()
)
"""The tests' customer-event producer key, enrolled for every tenant in every test ledger
(:func:`enroll_producer`)."""
sign_customer_event = EnvelopeSigner(PRODUCER_KEY)


async def enroll_producer(database_url: str) -> None:
    """Enroll :data:`PRODUCER_KEY` for all tenants in the ledger at ``database_url`` (idempotent)."""
    await enroll_producer_key(database_url, PRODUCER_KEY.public_key(), None, name="kvledger tests")


def signed_customer_value(value: bytes) -> bytes:
    """A hand-written customer event's JSON, signed with :data:`PRODUCER_KEY` as a real producer would send it."""
    return encode_event(sign_customer_event(parse_event(value)))


class SigningProducer(EventProducer):
    """The tests' producer: signs what the real party would — commands with :data:`COMMAND_KEY`,
    kv-events and acks with their node's :func:`node_key` (enrolled in ``database_url`` on first
    use), customer events with :data:`PRODUCER_KEY`. Tests of unsigned or forged records use a plain
    :class:`EventProducer`."""

    def __init__(self, settings: KafkaSettings, database_url: str | None = None) -> None:
        super().__init__(settings)
        self._database_url = database_url
        self._enrolled: set[str] = set()

    async def signed(self, envelope: Envelope) -> Envelope:
        topic, _ = route(envelope)
        if topic == COMMANDS:
            return sign_command(envelope)
        if topic in CUSTOMER_TOPICS:
            return sign_customer_event(envelope)
        node_id = envelope.payload.node_id
        if self._database_url is not None and node_id not in self._enrolled:
            await enroll_nodes(self._database_url, [node_id])
            self._enrolled.add(node_id)
        return sign_envelope(envelope, node_key(node_id))

    async def send(self, envelope: Envelope, *, topic: str | None = None, key: str | None = None):
        return await super().send(await self.signed(envelope), topic=topic, key=key)

    async def send_many(self, envelopes: Iterable[Envelope]):
        return await super().send_many([await self.signed(envelope) for envelope in envelopes])


GROUP_TIMING: dict[str, int] = {
    "session_timeout_ms": 2_000,
    "heartbeat_interval_ms": 500,
    "fetch_max_wait_ms": 50,
}
"""Consumer timing (:class:`~events.kafka.settings.ConsumerGroupTiming`) of every test coordinator,
node and :class:`~events.kafka.consumer.BatchConsumer`. The embedded broker holds each group join
for half the session timeout: production's 10 s cost 5 s per group, 15 s per coordinator start
(three groups), 5 s per node start. 2 s still survives a loaded machine's event-loop stalls between
heartbeats. The embedded broker answers a waiting fetch only when its wait expires, so every idle
consumer fetches once per wait: at the default 5 ms an idle coordinator and the broker burnt about a
third of a core between them, most of the suite's time on 2 cores; 50 ms costs a tenth of that and
adds at most 50 ms per hop to what a test waits for."""


NODE_KEY_CACHE_S = 1.0
"""``ledger.node_key_cache_s`` of every test coordinator: a revoked node key is refused within a
second, not production's 5 s, so the tests that revoke one wait that much less."""


GROUP_TIMING_ENV: dict[str, str] = {
    f"KVLEDGER_{service}_KAFKA__{name.upper()}": str(value)
    for service in ("COORDINATOR", "NODE")
    for name, value in GROUP_TIMING.items()
}
""":data:`GROUP_TIMING` as the environment of coordinator and node processes (``kvledger coordinator``, ``kvledger node``,
``kvledger up``)."""


def _merged(defaults: Mapping[str, object], overrides: Mapping[str, object]) -> dict[str, object]:
    """``defaults`` with ``overrides`` applied; a group given as a dict on both sides is merged key by key."""
    merged = dict(defaults)
    for name, value in overrides.items():
        base = merged.get(name)
        merged[name] = (
            {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
        )
    return merged


def coordinator_settings(
    database_url: str | None = None, bootstrap: str | None = None, **overrides
) -> CoordinatorSettings:
    """The tests' coordinator: ``database_url``'s ledger, the broker at ``bootstrap`` with a consumer group of its
    own and :data:`GROUP_TIMING`, the tests' end-user secret, operator issuer, command key and subject key, a
    fast outbox relay and the short node-key cache of :data:`NODE_KEY_CACHE_S`. ``overrides`` are CoordinatorSettings arguments; a group given as a dict (``ledger={...}``)
    is merged into the defaults key by key, so a test names only what it is about."""
    defaults: dict[str, object] = {
        "auth": {"jwt_secret": JWT_SECRET},
        "operator_auth": OPERATOR_AUTH,
        "ledger": {
            "command_signing_key": COMMAND_SIGNING_KEY,
            "subject_key": SUBJECT_KEY,
            "outbox_poll_s": 0.1,
            "node_key_cache_s": NODE_KEY_CACHE_S,
        },
        "kafka": {"group_id": f"coordinator-{uuid.uuid4().hex[:8]}", **GROUP_TIMING},
    }
    if database_url is not None:
        defaults["database"] = {"url": database_url}
    if bootstrap is not None:
        defaults["kafka"]["bootstrap"] = bootstrap
    return CoordinatorSettings(**_merged(defaults, overrides))


def coordinator_env(
    database_url: str, bootstrap: str, group_id: str, **extra: str
) -> dict[str, str]:
    """The environment of a ``kvledger coordinator`` process configured as :func:`coordinator_settings` configures
    one in-process (``extra``: more variables, e.g. ``KVLEDGER_METRICS_TOKEN``)."""
    return {
        **os.environ,
        "KVLEDGER_DATABASE_URL": database_url,
        "KVLEDGER_KAFKA_BOOTSTRAP": bootstrap,
        "KVLEDGER_JWT_SECRET": JWT_SECRET,
        "KVLEDGER_COORDINATOR_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE": OPERATOR_PUBLIC_KEY_FILE,
        "KVLEDGER_COMMAND_SIGNING_KEY": COMMAND_SIGNING_KEY,
        "KVLEDGER_COORDINATOR_KAFKA__GROUP_ID": group_id,
        "KVLEDGER_COORDINATOR_LEDGER__NODE_KEY_CACHE_S": str(NODE_KEY_CACHE_S),
        **GROUP_TIMING_ENV,
        **extra,
    }


def kafka_client_settings(bootstrap: str, **fields) -> KafkaSettings:
    """Kafka settings of a test client of ``bootstrap`` (its own consumers join groups with
    :data:`GROUP_TIMING`)."""
    return KafkaSettings(
        **{"bootstrap": bootstrap, "client_id": "kvledger-test", **GROUP_TIMING, **fields}
    )


class RunningConsumers:
    """The coordinator's consumers (``run_consumers``) as a task of the calling event loop; stoppable, restartable.

    :meth:`launch` starts them without waiting, so several replicas can join their
    groups at once; :meth:`wait_assigned` raises their start-up error, if any.
    """

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self._stop: asyncio.Event | None = None
        self._assigned: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    def launch(self) -> None:
        self._stop, self._assigned = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(run_consumers(self.settings, self._stop, self._assigned))

    async def wait_assigned(self, timeout_s: float = 60.0) -> None:
        assert self.task is not None and self._assigned is not None, "launch() first"
        waiter = asyncio.create_task(self._assigned.wait())
        await asyncio.wait(
            {self.task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        if self.task.done():
            self.task.result()
        assert self._assigned.is_set(), "the coordinator's consumers never got partitions"

    async def start(self) -> RunningConsumers:
        self.launch()
        await self.wait_assigned()
        return self

    async def stop(self) -> None:
        assert self.task is not None and self._stop is not None, "launch() first"
        self._stop.set()
        await asyncio.wait_for(self.task, 60)


class FakeNode:
    """One GPU node as the ledger sees it: its kv-events with a running ``seq``, through a (signing)
    producer.

    ``seq`` is the last one used; each epoch begins with ``NodeStarted`` at seq 0 (:meth:`start`),
    and every further event takes the next seq unless the test names one (a gap, a replay)."""

    def __init__(
        self, producer: EventProducer, node_id: str, *, epoch: int = 0, namespace: str = "ns-test"
    ) -> None:
        self.producer, self.node_id, self.namespace = producer, node_id, namespace
        self.epoch, self.seq = epoch, -1

    def event(
        self, payload_type: type[EventPayload], *, seq: int | None = None, **fields
    ) -> Envelope:
        self.seq = self.seq + 1 if seq is None else seq
        return make_event(
            payload_type(node_id=self.node_id, epoch=self.epoch, seq=self.seq, **fields)
        )

    async def publish(self, payload_type: type[EventPayload], **fields) -> Envelope:
        envelope = self.event(payload_type, **fields)
        await self.producer.send(envelope)
        return envelope

    async def start(self, epoch: int | None = None, namespace: str | None = None) -> Envelope:
        """A new epoch (the next one unless ``epoch`` is given) announced by ``NodeStarted`` at seq
        0."""
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.seq = -1
        self.namespace = namespace or self.namespace
        return await self.publish(NodeStarted, namespace=self.namespace)

    async def store(self, *blocks: StoredBlock) -> Envelope:
        return await self.publish(BlockStored, blocks=list(blocks))


@contextlib.asynccontextmanager
async def fresh_database(server_url: str, template: str | None = None) -> AsyncIterator[str]:
    """CREATE a uniquely named database on the test server — empty, or a copy of the database named
    ``template`` (the ``ledger_template`` fixture: migrated once per session, copied in milliseconds
    where migrating takes seconds); DROP it afterwards. Yields its URL."""
    name = f"kvl_{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(server_url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    copy = "" if template is None else f' TEMPLATE "{template}"'
    try:
        async with admin.connect() as connection:
            await connection.execute(text(f'CREATE DATABASE "{name}"{copy}'))
        try:
            yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
        finally:
            async with admin.connect() as connection:
                await connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


async def connect(database_url: str) -> asyncpg.Connection:
    """A plain asyncpg connection to a test database (a TCP URL, or the embedded server's ``?host=``
    socket dir)."""
    return await asyncpg.connect(**connect_kwargs(database_url))


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 30.0,
    what: str = "condition",
    poll_s: float = 0.05,
) -> None:
    """Poll ``condition`` (plain or async) until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)


def block_hash(label: str) -> str:
    """A deterministic, test-unique 32-byte hex hash."""
    return uuid.uuid5(uuid.NAMESPACE_URL, label).hex * 2


def stored(
    label: str,
    tier: str,
    *,
    namespace: str = "ns-test",
    tenant_id: str | None = None,
    scope: str = "public",
    subject_id: str | None = None,
    auth_scopes: list[tuple[str, int]] | None = None,
    documents: list[str] | None = None,
    token_offset: int = 0,
    parent: str | None = None,
) -> StoredBlock:
    return StoredBlock(
        block_hash=block_hash(label),
        parent_hash=block_hash(parent) if parent else None,
        namespace=namespace,
        tenant_id=tenant_id,
        scope=scope,
        auth_scopes=auth_scopes or [],
        subject_id=subject_id,
        documents=documents or [],
        token_offset=token_offset,
        created_at=datetime(2026, 11, 29, 12, 0, tzinfo=UTC),
        tier=tier,
    )


async def scan_topic(
    bootstrap: str, topic: str, visit: Callable[[ConsumerRecord], bool], timeout_s: float = 30.0
) -> None:
    """Read every partition of ``topic`` from the beginning, handing records to ``visit`` until it
    returns True.

    No consumer group (``group_id=None`` takes all partitions locally), so there is no group join to
    wait for."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    for record in records:
                        try:
                            if visit(record):
                                return
                        except EventValidationError:
                            continue  # shared topics hold malformed records other tests put there on purpose
    finally:
        await consumer.stop()


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[ConsumerRecord]:
    """Every record of ``topic`` that the broker acknowledged before the call, from every partition.

    Reads until each partition's position reaches the end the broker reported at the start, then
    drains what that last fetch brought (the embedded broker reports the end of a multi-record batch
    as the batch's base offset + 1; the rest of the batch comes in the same fetch). No consumer
    group, so no join to wait for."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[ConsumerRecord] = []
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.topics()
            partitions = [
                TopicPartition(topic, partition)
                for partition in sorted(consumer.partitions_for_topic(topic) or ())
            ]
            assert partitions, f"topic {topic} does not exist"
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
            ends = await consumer.end_offsets(partitions)
            while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    records.extend(batch)
            for batch in (await consumer.getmany(timeout_ms=0)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def dead_letters(
    bootstrap: str, group_id: str, event_ids: set[uuid.UUID], topic: str = DEAD_LETTER
) -> dict[uuid.UUID, str]:
    """The dead-letter error of each of ``event_ids`` that ``group_id`` dead-lettered on ``topic``
    (waits for all of them).

    Nodes dead-letter on their own topic (``kvledger.node-dead-letter``), the coordinator on
    ``kvledger.dead-letter``."""
    found: dict[uuid.UUID, str] = {}

    def visit(record) -> bool:
        letter = DeadLetter.model_validate_json(record.value)
        if letter.group_id == group_id:
            # Consumers replay whole shared topics: other tests' garbage is dead-lettered too.
            try:
                event_id = uuid.UUID(json.loads(letter.raw_value() or b"null")["event_id"])
            except (ValueError, TypeError, KeyError):
                return False
            if event_id in event_ids:
                found[event_id] = letter.error
        return set(found) == event_ids

    await scan_topic(bootstrap, topic, visit)
    return found


@contextlib.asynccontextmanager
async def own_broker(
    shared_bootstrap: str, service_mode: str, state_dir: Path
) -> AsyncIterator[str]:
    """A Kafka-protocol broker for one module (embedded mode; other modes keep the shared one).

    For modules that publish tens of megabytes (100,000-block erasures, acks near the record limit):
    on the session's shared broker every later module's coordinator would read them again from the
    start of ``kvledger.kv-events`` and ``kvledger.acks``.
    """
    if service_mode != "embedded":
        yield shared_bootstrap
        return
    from kvledger.services import EmbeddedKafka

    kafka = EmbeddedKafka(state_dir=state_dir)
    await kafka.start()
    try:
        yield kafka.bootstrap
    finally:
        await kafka.stop()


async def settings_at_topic_ends(
    ledger_url: str, kafka_bootstrap: str, **overrides
) -> CoordinatorSettings:
    """A module's coordinator settings, its consumer groups positioned at the end of every topic.

    The worker's broker is shared by the modules it runs: what earlier modules published is not
    this module's to consume (and some of it is garbage on purpose).
    """
    settings = coordinator_settings(ledger_url, kafka_bootstrap, **overrides)
    await ensure_topics(kafka_settings(settings))
    await start_groups_at_end(kafka_bootstrap, consumer_groups(settings.kafka.group_id))
    return settings


@contextlib.asynccontextmanager
async def running_consumers(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    """The coordinator's consumers of ``settings``, started and, on leaving, stopped."""
    running = await RunningConsumers(settings).start()
    try:
        yield running
    finally:
        await running.stop()
