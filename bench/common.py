"""What the benchmarks share: database URLs for asyncpg, fresh migrated databases, embedded services,
consumer groups that start at the end of a reused broker's topics, polling, the command's report."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import math
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import make_url, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator.ledger.migrate import upgrade
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from gpu_node.keys.node_identity import NODE_KEY_FILE
from identity.signing import (
    EnvelopeSigner,
    load_or_create_private_key,
    private_key_pem,
    public_key_pem,
)
from identity.tokens import generate_ed25519_key_pair, issue_token
from kvledger.nodes import enroll_node_key
from kvledger.producers import enroll_producer_key
from kvledger.services import EmbeddedKafka, EmbeddedPostgres


def connect_kwargs(database_url: str) -> dict:
    """``asyncpg.connect`` keyword arguments for a SQLAlchemy database URL (TCP host or a ``?host=``
    socket dir)."""
    url = make_url(database_url)
    kwargs = {"user": url.username or "postgres", "database": url.database}
    if url.query.get("host"):
        kwargs["host"] = url.query["host"]
        kwargs["port"] = int(url.query.get("port", 5432))
    else:
        kwargs["host"], kwargs["port"] = url.host, url.port or 5432
    if url.password:
        kwargs["password"] = url.password
    return kwargs


@contextlib.asynccontextmanager
async def fresh_database(server_url: str) -> AsyncIterator[str]:
    """CREATE a uniquely named database on the server and migrate it; DROP it afterwards. Yields its
    URL."""
    name = f"kvl_bench_{uuid.uuid4().hex[:10]}"
    admin = create_async_engine(server_url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    async with admin.connect() as connection:
        await connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    try:
        await asyncio.to_thread(upgrade, url)
        yield url
    finally:
        async with admin.connect() as connection:
            await connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()


@functools.cache
def _operator_key() -> tuple[bytes, str]:
    """The benchmarks' operator issuer: (private key PEM, public key file), made once per process."""
    private_pem, public_pem = generate_ed25519_key_pair()
    handle, path = tempfile.mkstemp(prefix="kvledger-bench-operator-", suffix=".pub.pem")
    with os.fdopen(handle, "wb") as file:
        file.write(public_pem)
    atexit.register(os.unlink, path)
    return private_pem, path


def operator_headers(role: str, tenant: str) -> dict[str, str]:
    """An ``Authorization`` header with an operator token the coordinators of :func:`coordinator_env` accept."""
    token = issue_token(
        tenant=tenant, sub="bench", roles=[role], ttl_s=3600, private_key_pem=_operator_key()[0]
    )
    return {"Authorization": f"Bearer {token}"}


class BenchKeys:
    """A run's command key (the coordinator signs with it, nodes pin it), its nodes' keys and its
    producer key (customer events), enrolled in the ledger — what ``kvledger up`` sets up, so
    benchmarks measure the signed paths."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.command_key = load_or_create_private_key(directory / "command_key.pem")
        self.sign_as_producer = EnvelopeSigner(
            load_or_create_private_key(directory / "producer_key.pem")
        )
        self.command_public_key_file = directory / "command_key.pub"
        self.command_public_key_file.write_bytes(public_key_pem(self.command_key.public_key()))

    def coordinator_env(self) -> dict[str, str]:
        return {"KVLEDGER_COMMAND_SIGNING_KEY": private_key_pem(self.command_key).decode()}

    def node_identity(self) -> dict[str, Path]:
        """``NodeSettings.identity`` of a bench node: the command key pinned."""
        return {"coordinator_public_key_file": self.command_public_key_file}

    async def enroll_producer(self, database_url: str) -> None:
        """Enroll the run's producer key for every tenant, as ``kvledger up`` enrolls the stack's."""
        public_key = self.sign_as_producer.private_key.public_key()
        await enroll_producer_key(database_url, public_key, None, name="kvledger bench producer")

    async def enroll(self, database_url: str, node_id: str, data_dir: Path) -> Ed25519PrivateKey:
        """The node's key (``node_key.pem`` in ``data_dir``, created if missing), enrolled for
        ``node_id``."""
        key = load_or_create_private_key(data_dir / NODE_KEY_FILE)
        await enroll_node_key(database_url, node_id, key.public_key())
        return key


def coordinator_env(
    database_url: str, bootstrap: str, group: str, jwt_secret: str, **extra: str
) -> dict[str, str]:
    """This process's environment plus the settings of a ``kvledger coordinator`` process (``extra``: more variables)."""
    return os.environ | {
        "KVLEDGER_DATABASE_URL": database_url,
        "KVLEDGER_KAFKA_BOOTSTRAP": bootstrap,
        "KVLEDGER_COORDINATOR_KAFKA__GROUP_ID": group,
        "KVLEDGER_JWT_SECRET": jwt_secret,
        "KVLEDGER_COORDINATOR_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE": _operator_key()[1],
        **extra,
    }


async def database_server(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, state_dir: Path
) -> str:
    """``--database-url``, or an embedded Postgres in ``state_dir`` that ``stack`` stops. Returns the server URL."""
    if args.database_url:
        return args.database_url
    postgres = await EmbeddedPostgres(state_dir).start()
    stack.push_async_callback(postgres.stop)
    return postgres.database_url


async def kafka_broker(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, state_dir: Path
) -> str:
    """``--kafka-bootstrap``, or an embedded Tansu in ``state_dir`` that ``stack`` stops. Returns the bootstrap address."""
    if args.kafka_bootstrap:
        return args.kafka_bootstrap
    kafka_service = await EmbeddedKafka(state_dir=state_dir).start()
    stack.push_async_callback(kafka_service.stop)
    return kafka_service.bootstrap


async def start_groups_at_end(bootstrap: str, groups: dict[str, list[str]]) -> None:
    """Commit each group's offsets at the end of its topics: a fresh coordinator group on a reused
    broker must not ingest earlier runs' nodes (they would be targets forever).

    The end is found by reading, not by ``end_offsets`` alone: the embedded Tansu broker
    answers ListOffsets(latest) with the last record *batch's* base offset + 1, so after a
    multi-record batch the reported end lies inside that batch. The caller makes sure that
    nothing else publishes while this runs, so the position after a poll that returns
    nothing is the true end. (Also the integration tests' helper, via ``helpers.ledger``.)
    """
    for group_id, names in groups.items():
        settings = KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench")
        consumer = AIOKafkaConsumer(
            **kafka_client_kwargs(settings), group_id=group_id, enable_auto_commit=False
        )
        await consumer.start()
        try:
            await consumer.topics()
            partitions = [
                TopicPartition(t, p)
                for t in names
                for p in sorted(consumer.partitions_for_topic(t))
            ]
            consumer.assign(partitions)
            await consumer.seek_to_end(*partitions)
            while await consumer.getmany(timeout_ms=300):
                pass
            await consumer.commit({tp: await consumer.position(tp) for tp in partitions})
        finally:
            await consumer.stop()


async def wait(
    probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float, poll_s: float = 0.05
) -> None:
    """Poll ``probe`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(poll_s)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile by rank (nearest below); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else math.nan


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, list]],
    render: Callable[[argparse.Namespace, list], str],
) -> int:
    """Run the benchmark, print its Markdown report and write it to ``--output`` when given."""
    runs = asyncio.run(run(args))
    report = render(args, runs)
    print(report)
    if args.output:
        Path(args.output).write_text(report)
    return 0
