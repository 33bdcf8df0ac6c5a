"""``/readyz`` means consuming: a coordinator running consumers is ready only once they hold their
partitions.

Before, ``/readyz`` checked the database alone, so ``kvledger up`` reported the stack ready
seconds before the consumer groups were joined, and a document update published right
then was decided only after the join. Real Postgres, the session's broker, the real app
(over ASGI) and the real ``kvledger coordinator --role consumers`` process.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers.fork_server import ForkServer
from helpers.ledger import (
    coordinator_env,
    coordinator_settings,
    eventually,
    fresh_database,
    sign_customer_event,
)
from sqlalchemy import select

from bench.common import start_groups_at_end
from coordinator.api.app import create_app
from coordinator.consumers import consumer_groups, run_consumers
from coordinator.ledger import migrate
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings, kafka_settings
from events import schema
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from kvledger.processes import spawn_cli

DECIDED_WITHIN_S = 3.0
"""An update published once ``/readyz`` said ready is decided this fast (the group join alone took ~5 s)."""


@pytest.fixture
async def settings(
    database_url: str, ledger_template: str, kafka_bootstrap: str
) -> AsyncIterator[CoordinatorSettings]:
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(url, kafka_bootstrap)
        await ensure_topics(kafka_settings(settings))
        await start_groups_at_end(kafka_bootstrap, consumer_groups(settings.kafka.group_id))
        yield settings


async def decided_after(settings: CoordinatorSettings, tenant: str) -> float:
    """Publish a DocumentUpdated now; seconds until the coordinator recorded its decision."""
    event = schema.make_event(
        schema.DocumentUpdated(doc_id="handbook", version=2), tenant_id=tenant
    )
    database = Database(settings.database, pre_ping=False)
    try:
        async with EventProducer(
            KafkaSettings(bootstrap=settings.kafka.bootstrap), sign=sign_customer_event
        ) as producer:
            started = time.monotonic()
            await producer.send(event)

        async def decided() -> bool:
            async with database.session() as session:
                return (
                    await session.scalar(
                        select(Invalidation.command_id).where(
                            Invalidation.source_event_id == event.event_id
                        )
                    )
                    is not None
                )

        await eventually(decided, what="the update's decision")
        return time.monotonic() - started
    finally:
        await database.dispose()


async def test_readyz_is_503_until_the_consumers_consume_then_an_update_is_decided_at_once(
    settings: CoordinatorSettings,
) -> None:
    readiness = ConsumerReadiness()
    app = create_app(settings, consumers=readiness)
    stop = asyncio.Event()
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as client,
    ):
        before = await client.get("/readyz")
        assert before.status_code == 503
        assert before.json() == {"status": "not_ready", "reason": "consumers not started"}

        consumers = asyncio.create_task(run_consumers(settings, stop, readiness=readiness))
        answers: list[tuple[int, dict]] = []
        try:

            async def ready() -> bool:
                assert not consumers.done(), consumers
                response = await client.get("/readyz")
                answers.append((response.status_code, response.json()))
                return response.status_code == 200

            await eventually(ready, timeout_s=60, what="/readyz to say ready")
            assert answers[-1] == (200, {"status": "ready", "revision": migrate.head_revision()})
            group = settings.kafka.group_id
            for status_code, body in answers[:-1]:
                assert status_code == 503 and body["status"] == "not_ready"
                assert body["reason"] == "consumers not started" or body["reason"].startswith(
                    "consumer groups not yet consuming: "
                )
                assert set(
                    body["reason"].removeprefix("consumer groups not yet consuming: ").split(", ")
                ) <= {
                    group,
                    f"{group}-invalidations",
                    f"{group}-acks",
                    "consumers not started",
                }
            assert await decided_after(settings, f"acme-{uuid.uuid4().hex[:6]}") < DECIDED_WITHIN_S
        finally:
            stop.set()
            await asyncio.wait_for(consumers, 60)
        after = await client.get("/readyz")
        assert after.status_code == 503 and after.json()["reason"] == "consumers not started"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_consumers_only_process_serves_readyz_and_is_consuming_when_ready(
    settings: CoordinatorSettings, tmp_path: Path, fork_server: ForkServer
) -> None:
    port = _free_port()
    env = coordinator_env(
        settings.database.url.get_secret_value(), settings.kafka.bootstrap, settings.kafka.group_id
    )
    log_path = tmp_path / "consumers.log"
    process = spawn_cli(
        ["coordinator", "--role", "consumers", "--port", str(port)],
        env,
        log_path,
        launcher=fork_server.launch,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def ready() -> bool:
                assert process.poll() is None, (
                    f"the consumers exited; log: {log_path.read_text()[-2000:]}"
                )
                try:
                    response = await client.get("/readyz")
                except httpx.TransportError:
                    return False
                assert response.status_code in (200, 503), response.text
                return response.status_code == 200

            await eventually(ready, timeout_s=60, what="the consumers process to be ready")
            assert (await client.get("/healthz")).json() == {"status": "ok"}
            assert (await client.get("/v1/nodes")).status_code == 404, (
                "a consumers-only process serves no API"
            )
            assert await decided_after(settings, f"acme-{uuid.uuid4().hex[:6]}") < DECIDED_WITHIN_S
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait)
