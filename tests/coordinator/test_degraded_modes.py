"""Degraded modes: the coordinator answers while Kafka or Postgres is down and recovers by itself.

The real ``kvledger coordinator --role all`` process, a real Tansu broker and a real
PostgreSQL server — private ones where the test stops or has not yet started them
(the session's shared services are never stopped). See docs/operations.md, "Degraded modes".
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from helpers.fork_server import ForkServer
from helpers.ledger import (
    SUBJECT_KEY,
    coordinator_env,
    enroll_producer,
    eventually,
    fresh_database,
    operator_headers,
    sign_customer_event,
)
from sqlalchemy import select

from coordinator.ledger import migrate
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation
from coordinator.settings import DatabaseSettings
from events import schema
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from kvledger.processes import Launcher, spawn_cli
from kvledger.services import EmbeddedKafka, EmbeddedPostgres

BOUNDED_S = 5.0
"""No request to a coordinator whose database is down may take longer than this."""
RETRY_AFTER_S = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def coordinator(
    database_url: str, bootstrap: str, log_path: Path, launcher: Launcher
) -> AsyncIterator[httpx.AsyncClient]:
    """``kvledger coordinator --role all`` as a child process (started by ``launcher``: the session's
    fork server); a client of its HTTP port. SIGTERM at exit."""
    port = _free_port()
    env = coordinator_env(
        database_url,
        bootstrap,
        f"degraded-{uuid.uuid4().hex[:8]}",
        KVLEDGER_SUBJECT_KEY=SUBJECT_KEY,
        KVLEDGER_COORDINATOR_KAFKA__RECONNECT_INITIAL_S="0.2",
        KVLEDGER_COORDINATOR_KAFKA__RECONNECT_MAX_S="1",
        KVLEDGER_COORDINATOR_HTTP__RETRY_AFTER_S=str(RETRY_AFTER_S),
    )
    process = spawn_cli(
        ["coordinator", "--role", "all", "--port", str(port)], env, log_path, launcher=launcher
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            async def answers() -> bool:
                assert process.poll() is None, (
                    f"the coordinator exited: {log_path.read_text()[-3000:]}"
                )
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(answers, timeout_s=60, what="the coordinator's /healthz")
            yield client
    finally:
        if process.poll() is None:
            process.terminate()
            await asyncio.to_thread(process.wait, 60)


async def timed(request) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await request
    return response, time.monotonic() - started


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 90) -> None:
    async def ready() -> bool:
        return (await client.get("/readyz")).status_code == 200

    await eventually(ready, timeout_s=timeout_s, what="/readyz to say ready")


async def update_is_decided(database_url: str, bootstrap: str) -> None:
    """Publish a DocumentUpdated; wait until the coordinator recorded its decision."""
    event = schema.make_event(
        schema.DocumentUpdated(doc_id="handbook", version=2),
        tenant_id=f"acme-{uuid.uuid4().hex[:6]}",
    )
    async with EventProducer(
        KafkaSettings(bootstrap=bootstrap), sign=sign_customer_event
    ) as producer:
        await producer.send(event)
    database = Database(DatabaseSettings(url=database_url))
    try:

        async def decided() -> bool:
            async with database.session() as session:
                statement = select(Invalidation.command_id).where(
                    Invalidation.source_event_id == event.event_id
                )
                return await session.scalar(statement) is not None

        await eventually(decided, timeout_s=60, what="the update's decision")
    finally:
        await database.dispose()


async def test_the_api_answers_while_the_broker_is_down_and_consumes_once_it_starts(
    database_url: str, ledger_template: str, tmp_path: Path, fork_server: ForkServer
) -> None:
    port = _free_port()
    broker = EmbeddedKafka(port=port, state_dir=tmp_path / "kafka")  # not started yet
    async with fresh_database(database_url, ledger_template) as url:
        async with coordinator(
            url, f"127.0.0.1:{port}", tmp_path / "coordinator.log", fork_server.launch
        ) as client:
            readyz = await client.get("/readyz")
            assert readyz.status_code == 503
            assert readyz.json()["status"] == "not_ready"
            assert readyz.json()["reason"].startswith("kafka unreachable (")
            nodes, seconds = await timed(
                client.get("/v1/nodes", headers=operator_headers("platform-admin"))
            )
            assert (nodes.status_code, nodes.json()) == (200, {"nodes": []})
            assert seconds < BOUNDED_S
            # A write needs only the database: the outbox holds its commands until the broker is
            # back.
            erasure = await client.post(
                "/v1/erasures",
                json={"tenant_id": "acme", "subject_id": "alice", "reason": "GDPR art. 17 request"},
                headers=operator_headers("privacy-officer", "acme"),
            )
            assert erasure.status_code == 202, erasure.text

            await broker.start()
            try:
                await wait_ready(client)
                await update_is_decided(url, broker.bootstrap)
            finally:
                await broker.stop()


async def test_the_api_answers_503_while_postgres_is_down_and_recovers_when_it_returns(
    kafka_bootstrap: str, tmp_path: Path, fork_server: ForkServer
) -> None:
    postgres = EmbeddedPostgres(tmp_path / "pg" / "data")
    await postgres.start()
    try:
        url = postgres.database_url
        await asyncio.to_thread(
            migrate.upgrade, url
        )  # a server of its own (the test stops it): the session's template is not there
        await enroll_producer(url)
        async with coordinator(
            url, kafka_bootstrap, tmp_path / "coordinator.log", fork_server.launch
        ) as client:
            await wait_ready(client)
            await postgres.stop()

            health, seconds = await timed(client.get("/healthz"))
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            readyz, seconds = await timed(client.get("/readyz"))
            assert readyz.status_code == 503 and seconds < BOUNDED_S
            assert readyz.json() == {"status": "not_ready", "reason": "database unreachable"}
            unavailable = {
                "error": {
                    "message": "the ledger database is unavailable; retry later",
                    "type": "server_error",
                    "code": "database_unavailable",
                }
            }
            for request in (
                client.get("/v1/nodes", headers=operator_headers("platform-admin")),
                client.get("/v1/ledger/blocks", headers=operator_headers("platform-admin")),
                client.post(
                    "/v1/erasures",
                    json={
                        "tenant_id": "acme",
                        "subject_id": "alice",
                        "reason": "GDPR art. 17 request",
                    },
                    headers=operator_headers("privacy-officer", "acme"),
                ),
            ):
                response, seconds = await timed(request)
                assert (response.status_code, response.json()) == (503, unavailable)
                assert response.headers["retry-after"] == str(RETRY_AFTER_S)
                assert seconds < BOUNDED_S

            await postgres.start()
            await wait_ready(client)
            nodes = await client.get("/v1/nodes", headers=operator_headers("platform-admin"))
            assert (nodes.status_code, nodes.json()) == (200, {"nodes": []})
            await update_is_decided(url, kafka_bootstrap)
    finally:
        await postgres.stop()
