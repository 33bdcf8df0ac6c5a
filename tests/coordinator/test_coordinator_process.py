"""`kvledger coordinator` as a real process: SIGKILL mid-stream loses nothing, SIGTERM exits cleanly.

A killed coordinator has not committed the offsets of its in-flight batch (and its
transaction rolled back), so the restarted one re-reads from the last commit; the
inbox turns any overlap into no-ops. The ledger must end exactly as if nothing happened.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import uuid
from pathlib import Path

import httpx
from helpers.fork_server import ForkServer
from helpers.ledger import SigningProducer, coordinator_env, eventually, stored
from sqlalchemy import func, select

from coordinator.ledger.db import Database
from coordinator.ledger.models import InboxEntry, Node, Placement
from coordinator.settings import CoordinatorSettings
from events.kafka.settings import KafkaSettings
from events.schema import BlockStored, NodeStarted, make_event
from kvledger.processes import Launcher, Process, spawn_cli

NUM_EVENTS = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CoordinatorProcess:
    def __init__(
        self,
        ledger_url: str,
        kafka_bootstrap: str,
        group_id: str,
        log_path: Path,
        launcher: Launcher,
        role: str = "all",
        **extra_env: str,
    ) -> None:
        self.port = _free_port()
        self.role = role
        self.env = coordinator_env(
            ledger_url,
            kafka_bootstrap,
            group_id,
            KVLEDGER_COORDINATOR_KAFKA__MAX_BATCH_RECORDS="20",
            **extra_env,
        )
        self.log_path = log_path
        self.launcher = launcher
        self.process: Process | None = None

    async def start(self) -> None:
        self.process = spawn_cli(
            ["coordinator", "--role", self.role, "--port", str(self.port)],
            self.env,
            self.log_path,
            launcher=self.launcher,
        )

        async def ready() -> bool:
            assert self.process.poll() is None, (
                f"coordinator exited; log: {self.log_path.read_text()[-2000:]}"
            )
            try:
                async with httpx.AsyncClient() as client:
                    return (
                        await client.get(f"http://127.0.0.1:{self.port}/readyz")
                    ).status_code == 200
            except httpx.HTTPError:
                return False

        await eventually(ready, timeout_s=60, what="the coordinator process to be ready")

    async def signal(self, signum: int, timeout_s: float = 60) -> int:
        self.process.send_signal(signum)
        return await asyncio.to_thread(self.process.wait, timeout_s)


async def test_sigkill_mid_stream_then_restart_ends_exact(
    ledger_url: str, kafka_bootstrap: str, tmp_path: Path, fork_server: ForkServer
) -> None:
    group_id = f"process-{uuid.uuid4().hex[:8]}"
    node_id = f"proc-{uuid.uuid4().hex[:8]}"
    blocks = [stored(f"{node_id}/{seq}", "device") for seq in range(1, NUM_EVENTS + 1)]
    envelopes = [make_event(NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-test"))] + [
        make_event(BlockStored(node_id=node_id, epoch=1, seq=seq, blocks=[block]))
        for seq, block in enumerate(blocks, start=1)
    ]
    database = Database(CoordinatorSettings(database={"url": ledger_url}).database)

    async def last_seq() -> int:
        async with database.session() as session:
            node = await session.get(Node, node_id)
            return -1 if node is None else node.last_seq

    coordinator = CoordinatorProcess(
        ledger_url, kafka_bootstrap, group_id, tmp_path / "coordinator.log", fork_server.launch
    )
    try:
        await coordinator.start()
        async with SigningProducer(
            KafkaSettings(bootstrap=kafka_bootstrap), ledger_url
        ) as producer:
            await producer.send_many(envelopes)

        async def some_applied() -> bool:
            return await last_seq() >= 20

        await eventually(some_applied, what="the first batches to be applied")
        assert await coordinator.signal(signal.SIGKILL) == -signal.SIGKILL
        assert await last_seq() < NUM_EVENTS, "the kill came too late to interrupt anything"

        await coordinator.start()

        async def all_applied() -> bool:
            return await last_seq() == NUM_EVENTS

        await eventually(
            all_applied, timeout_s=90, what="the restarted coordinator to apply everything"
        )
        async with database.session() as session:
            live = set(
                await session.scalars(
                    select(Placement.block_hash).where(
                        Placement.node_id == node_id, Placement.state == "live"
                    )
                )
            )
            num_inbox = await session.scalar(
                select(func.count())
                .select_from(InboxEntry)
                .where(InboxEntry.event_id.in_([envelope.event_id for envelope in envelopes]))
            )
            node = await session.get(Node, node_id)
        assert live == {bytes.fromhex(block.block_hash) for block in blocks}
        assert num_inbox == len(envelopes)
        assert node.status == "active"  # redelivery after the kill was not mistaken for a hole

        assert await coordinator.signal(signal.SIGTERM) == 0
    finally:
        if coordinator.process is not None and coordinator.process.poll() is None:
            coordinator.process.kill()
            await asyncio.to_thread(coordinator.process.wait)
        await database.dispose()


async def test_consumers_only_process_serves_health_readiness_and_metrics(
    ledger_url: str, kafka_bootstrap: str, tmp_path: Path, fork_server: ForkServer
) -> None:
    """``--role consumers`` has no ledger API, but is probed and scraped like the API; its logs are
    JSON lines."""
    log_path = tmp_path / "consumers.log"
    metrics_token = "consumers-metrics-token"
    coordinator = CoordinatorProcess(
        ledger_url,
        kafka_bootstrap,
        f"consumers-{uuid.uuid4().hex[:8]}",
        log_path,
        fork_server.launch,
        role="consumers",
        KVLEDGER_METRICS_TOKEN=metrics_token,
        KVLEDGER_LOG_FORMAT="json",
    )
    try:
        await coordinator.start()  # waits for /readyz: the kv-events consumer owns partitions
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{coordinator.port}", timeout=30
        ) as client:
            health = await client.get("/healthz", headers={"X-Request-Id": "probe-1"})
            assert (health.status_code, health.json(), health.headers["x-request-id"]) == (
                200,
                {"status": "ok"},
                "probe-1",
            )
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            refused = await client.get("/metrics")
            assert refused.status_code == 401
            assert refused.json() == {
                "error": {
                    "message": "this route needs the metrics bearer token",
                    "type": "authentication_error",
                    "code": "invalid_metrics_token",
                }
            }
            assert (await client.get("/v1/nodes")).status_code == 404  # no ledger API in this role
            scrape = await client.get(
                "/metrics", headers={"Authorization": f"Bearer {metrics_token}"}
            )
        assert scrape.status_code == 200
        assert 'kvledger_dead_letter_total{topic="kvledger.erasures"} 0.0' in scrape.text
        assert 'kvledger_ledger_nodes{liveness="stale"}' in scrape.text  # refreshed from the ledger
        assert 'kvledger_ledger_ingest_lag_seconds_bucket{le="+Inf"}' in scrape.text
        assert await coordinator.signal(signal.SIGTERM) == 0
    finally:
        if coordinator.process is not None and coordinator.process.poll() is None:
            coordinator.process.kill()
            await asyncio.to_thread(coordinator.process.wait)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    access = [
        line
        for line in lines
        if line["logger"] == "coordinator.access" and line["request_id"] == "probe-1"
    ]
    assert [line["message"].rsplit(" ", 1)[0] for line in access] == ["GET /healthz 200"]
    assert any(
        line["logger"].startswith("uvicorn") for line in lines
    )  # uvicorn logs through the same handler
