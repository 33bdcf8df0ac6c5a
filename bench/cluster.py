"""A whole kvledger system as real processes, with the levers to break it: the fault-injection suite
(``tests/faults``) and ``kvledger bench soak`` both run on it.

:class:`Cluster` starts a private embedded PostgreSQL and Tansu broker, migrates the ledger, and
runs M ``kvledger coordinator --role all`` processes (one by default; more share the consumer
groups, so the broker splits the partitions between them and a survivor takes over a dead one's) and
N ``kvledger node`` processes set up as ``kvledger up`` sets them up (signed commands, enrolled node
keys, data keys in the coordinator). Every process can be killed (``SIGKILL``), paused
(``SIGSTOP``/``SIGCONT``) and restarted — a node with the same data directory — optionally armed
with a fault point (``KVLEDGER_FAULT_POINT``, docs/operations.md "Fault points"). The broker can be
paused and PostgreSQL restarted. :class:`EventTail` reads the node-side topics from the beginning
for the whole run, so the invariant checker (:mod:`bench.invariants`) sees every record any node
ever published.

Everything a process writes goes to ``<work>/logs/<name>.log``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from aiokafka import AIOKafkaConsumer
from aiokafka.partitioner import murmur2
from sqlalchemy import make_url

from bench.common import BenchKeys, coordinator_env, operator_headers, wait
from coordinator.ledger.migrate import upgrade
from events import schema
from events.codec import decode_event, encode_key
from events.fault_points import ENV_VAR as FAULT_POINT_ENV
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.topics import ACKS, COMMANDS, KV_EVENTS, node_key
from identity.signing import EnvelopeSigner
from identity.tokens import issue_token
from kvledger.net import loopback_listener
from kvledger.processes import Launcher, Process, popen_cli, spawn_cli
from kvledger.services import EmbeddedKafka, EmbeddedPostgres
from kvledger.stack import COORDINATOR_ONLY_ENV

READY_TIMEOUT_S = 300.0
"""How long a process may take to answer ready. Generous: several node processes importing torch at
once on a machine shared with other work took over 120 s (4 nodes, 2 cores, load average 16)."""
SUBJECT_KEY = "kvledger-cluster-subject-key"
PLATFORM_ADMIN = ("platform-admin", "platform")
NUM_PARTITIONS = KafkaSettings.model_fields["num_partitions"].default
"""Partitions of every topic the cluster's processes create (the settings' default)."""
COORDINATOR_GROUP = "kvledger-coordinator"
"""The consumer group of every coordinator process's kv-events consumer (decisions and acks: suffixed groups)."""


def free_port() -> int:
    sock = loopback_listener()
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def spread_node_id(index: int, num_partitions: int) -> str:
    """A fresh id for node ``index`` whose kv-events land on partition ``index % num_partitions``: the nodes of a run
    spread over the partitions, so each coordinator process owns some node's events and a takeover moves real traffic."""
    wanted = index % num_partitions
    while True:
        node_id = f"node-{index}-{uuid.uuid4().hex[:6]}"
        if (
            murmur2(encode_key(node_key(node_id))) & 0x7FFFFFFF
        ) % num_partitions == wanted:  # aiokafka's DefaultPartitioner
            return node_id


class Child:
    """One ``python -m kvledger.cli ...`` process: started, probed, killed, paused, restarted."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        url: str,
        ready_timeout_s: float = READY_TIMEOUT_S,
        launcher: Launcher = popen_cli,
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.ready_timeout_s = ready_timeout_s
        self.args = args
        self.env = env
        self.log_path = log_path
        self.url = url
        self.process: Process | None = None
        self.num_starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self, fault_point: str | None = None) -> None:
        assert not self.running, f"{self.name} is already running"
        env = dict(self.env)
        env.pop(FAULT_POINT_ENV, None)
        if fault_point is not None:
            env[FAULT_POINT_ENV] = fault_point
        with open(self.log_path, "ab") as log:
            log.write(
                f"\n=== start {self.num_starts + 1} fault_point={fault_point} at {time.time():.3f}\n".encode()
            )
        self.process = spawn_cli(self.args, env, self.log_path, launcher=self.launcher)
        self.num_starts += 1

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:

            async def ready() -> bool:
                assert self.running, (
                    f"{self.name} exited with {self.process.returncode}; log tail:\n{self.log_tail()}"
                )
                try:
                    return (await client.get(f"{self.url}/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait(ready, f"{self.name} ready at {self.url}", timeout_s, poll_s=0.2)

    async def start(self, fault_point: str | None = None) -> None:
        self.spawn(fault_point)
        await self.wait_ready()

    async def wait_exit(self, timeout_s: float) -> int:
        assert self.process is not None
        return await asyncio.wait_for(asyncio.to_thread(self.process.wait), timeout_s)

    async def kill(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGCONT)  # a paused process dies at once too
            self.process.kill()
        if self.process is not None:
            await self.wait_exit(30)

    async def stop(self, timeout_s: float = 30.0) -> None:
        if not self.running:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            await self.wait_exit(timeout_s)
        except TimeoutError:
            await self.kill()

    def pause(self) -> None:
        assert self.running, f"{self.name} is not running"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def assigned_partitions(self, group_id: str, topic: str) -> set[int] | None:
        """The partitions of ``topic`` that this process's consumer in ``group_id`` was last assigned, from its log
        (``events.kafka.consumer.BatchConsumer`` logs every assignment); None when it logged none."""
        pattern = re.compile(rf"consumer group {re.escape(group_id)}: assigned (.*)$")
        found = None
        for line in self.log_path.read_text(errors="replace").splitlines():
            match = pattern.search(line)
            if match is not None:
                names = match.group(1).split()
                found = {
                    int(name.rsplit("/", 1)[1]) for name in names if name.rsplit("/", 1)[0] == topic
                }
        return found

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def resources(self) -> dict[str, int]:
        """RSS bytes and open file descriptors of the running process (Linux ``/proc``); empty when not running."""
        if not self.running:
            return {}
        pid = self.process.pid
        try:
            with open(f"/proc/{pid}/status") as status:
                rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            return {"rss_bytes": rss_kib * 1024, "open_files": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, StopIteration):
            return {}


@dataclass
class TopicRecord:
    offset: int
    partition: int
    value: bytes
    envelope: schema.Envelope
    timestamp_ms: int
    """When the producer made the record (the broker's ``CreateTime``), on this machine's clock."""


@dataclass
class EventTail:
    """Every record of ``kvledger.kv-events`` and ``kvledger.acks`` since the broker started, read by one consumer
    without a group (it owns every partition and starts at the beginning)."""

    bootstrap: str
    kv_events: list[TopicRecord] = field(default_factory=list)
    acks: list[TopicRecord] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        settings = KafkaSettings(bootstrap=self.bootstrap, client_id="kvledger-cluster-tail")
        consumer = AIOKafkaConsumer(
            KV_EVENTS,
            ACKS,
            **kafka_client_kwargs(settings),
            group_id=None,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
        )
        await consumer.start()
        self._task = asyncio.create_task(self._run(consumer))

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                for tp, records in batch.items():
                    for record in records:
                        try:
                            envelope = decode_event(record.value)
                        except schema.EventValidationError:
                            continue  # not the contract's: the coordinator dead-letters and counts it
                        kept = TopicRecord(
                            record.offset, tp.partition, record.value, envelope, record.timestamp
                        )
                        (self.kv_events if tp.topic == KV_EVENTS else self.acks).append(kept)
        finally:
            await consumer.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def inventory(self, node_id: str, request_id: uuid.UUID) -> list[TopicRecord] | None:
        """The complete set of ``Inventory`` chunks ``node_id`` published for ``request_id``, or None while incomplete."""
        chunks = {}
        for record in self.kv_events:
            payload = record.envelope.payload
            if (
                isinstance(payload, schema.Inventory)
                and payload.node_id == node_id
                and payload.request_id == request_id
            ):
                chunks[payload.chunk] = record
        if not chunks:
            return None
        num_chunks = next(iter(chunks.values())).envelope.payload.chunks
        return [chunks[index] for index in range(num_chunks)] if len(chunks) == num_chunks else None


@dataclass(frozen=True)
class ClusterConfig:
    num_nodes: int = 2
    num_coordinators: int = 1
    """Coordinator processes, all ``--role all`` in the same consumer groups. Nodes and
    :meth:`Cluster.coordinator_api` talk to the first one (the nodes' ``coordinator_url``) while it
    runs; the others consume and serve too."""
    num_device_blocks: int = 48
    num_host_blocks: int = 16
    """Small tiers, so the workload always spills blocks to disk (sealed files), the tier erasures must purge."""
    max_disk_blocks: int = 4096
    command_resend_after_s: float = 2.0
    command_resend_max_s: float = 4.0
    outbox_lease_s: float = 2.0
    heartbeat_interval_s: float = 30.0
    consumer_session_timeout_ms: int = 2000
    consumer_heartbeat_interval_ms: int = 500
    """The coordinators' and nodes' consumer-group timing: the broker holds a group join for half the session
    timeout and waits out a SIGKILLed member's whole session, so the production 10 s would cost most of every restart."""
    consumer_fetch_max_wait_ms: int = 5
    """Every consumer's ``fetch_max_wait_ms``: the production default, which times hops as deployed;
    the fault tests, which time nothing, take 50 ms (a tenth of the idle fetches, see
    ``events.kafka.settings.ConsumerGroupTiming``)."""
    ready_timeout_s: float = READY_TIMEOUT_S
    """How long each start (and restart) of a process may take to answer ready."""
    peers: bool = False
    """Every node lists every other in ``peers.urls`` (``KVLEDGER_NODE_PEERS__URLS``), so it may pull their blocks."""
    node_metrics_token: str | None = None
    """The nodes' metrics token (``/metrics``, ``/v1/cache/stats``); unset, those views are
    disabled."""
    cache_ttl_s: float = 86400.0
    """Every scope's TTL. Longer than any run: a block that expires between the ledger's view and the node's
    inventory is published as removed only after that inventory, which the comparison cannot tell from a loss."""
    launcher: Launcher = popen_cli
    """How each process (and restart) is started: a new interpreter; the tests pass their fork
    server."""


class Cluster:
    """The services and processes of one run (see the module docstring). Use as ``async with
    Cluster(...)``."""

    def __init__(
        self, work_dir: Path, model_dir: Path, config: ClusterConfig | None = None
    ) -> None:
        self.work_dir = Path(work_dir)
        self.model_dir = Path(model_dir)
        self.config = config or ClusterConfig()
        self.jwt_secret = secrets.token_urlsafe(32)
        self.master_key = base64.b64encode(secrets.token_bytes(32)).decode()
        self.postgres: EmbeddedPostgres | None = None
        self.kafka: EmbeddedKafka | None = None
        self.coordinators: list[Child] = []
        self.nodes: list[Child] = []
        self.node_ids: list[str] = []
        self.tail: EventTail | None = None
        self.broker_paused = False
        self.faults: dict[str, int] = {}
        """What was done to the system, by kind — the soak's "faults injected"."""

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.postgres = await EmbeddedPostgres(self.work_dir / "postgres").start()
        self.kafka = await EmbeddedKafka(state_dir=self.work_dir / "kafka").start()
        await asyncio.to_thread(upgrade, self.database_url)
        keys = BenchKeys(self.work_dir / "keys")
        self._command_signer = EnvelopeSigner(keys.command_key)
        self._producer_signer = keys.sign_as_producer
        await keys.enroll_producer(self.database_url)
        ledger = {
            "OUTBOX_POLL_S": "0.1",
            "ERASURE_VERIFY_INTERVAL_S": "0.5",
            "COMMAND_RESEND_AFTER_S": str(self.config.command_resend_after_s),
            "COMMAND_RESEND_MAX_S": str(self.config.command_resend_max_s),
            "COMMAND_RESEND_POLL_S": "0.2",
            "OUTBOX_LEASE_S": str(self.config.outbox_lease_s),
        }
        env = coordinator_env(
            self.database_url,
            self.bootstrap,
            COORDINATOR_GROUP,
            self.jwt_secret,
            KVLEDGER_SUBJECT_KEY=SUBJECT_KEY,
            KVLEDGER_MASTER_KEY=self.master_key,
            **keys.coordinator_env(),
            **{f"KVLEDGER_COORDINATOR_LEDGER__{name}": value for name, value in ledger.items()},
            **{
                f"KVLEDGER_{service}_KAFKA__{name}": str(value)
                for service in ("COORDINATOR", "NODE")
                for name, value in (
                    ("SESSION_TIMEOUT_MS", self.config.consumer_session_timeout_ms),
                    ("HEARTBEAT_INTERVAL_MS", self.config.consumer_heartbeat_interval_ms),
                    ("FETCH_MAX_WAIT_MS", self.config.consumer_fetch_max_wait_ms),
                )
            },
        )
        for index in range(self.config.num_coordinators):
            name, port = "coordinator" if index == 0 else f"coordinator-{index}", free_port()
            args = ["coordinator", "--role", "all", "--port", str(port)]
            self.coordinators.append(
                Child(
                    name,
                    args,
                    env,
                    logs / f"{name}.log",
                    f"http://127.0.0.1:{port}",
                    self.config.ready_timeout_s,
                    self.config.launcher,
                )
            )
        self.tail = EventTail(self.bootstrap)
        await self.tail.start()
        for coordinator in self.coordinators:
            coordinator.spawn()
        for coordinator in self.coordinators:
            await coordinator.wait_ready()
        node_env = {
            name: value for name, value in env.items() if name not in COORDINATOR_ONLY_ENV
        } | {
            "KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE": str(
                keys.command_public_key_file
            ),
            "KVLEDGER_NODE_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE": env[
                "KVLEDGER_COORDINATOR_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE"
            ],
            "KVLEDGER_COORDINATOR_URL": self.coordinator.url,
            "KVLEDGER_NODE_PUBLISH_INTERVAL_S": "0.02",
            "KVLEDGER_NODE_HEARTBEAT_INTERVAL_S": str(self.config.heartbeat_interval_s),
            "KVLEDGER_NODE_CACHE__NUM_DEVICE_BLOCKS": str(self.config.num_device_blocks),
            "KVLEDGER_NODE_CACHE__NUM_HOST_BLOCKS": str(self.config.num_host_blocks),
            "KVLEDGER_NODE_CACHE__MAX_DISK_BLOCKS": str(self.config.max_disk_blocks),
            **{
                f"KVLEDGER_NODE_CACHE__TTL_{scope}_S": str(self.config.cache_ttl_s)
                for scope in ("PUBLIC", "TENANT", "USER")
            },
        }
        node_env = {
            name: value
            for name, value in node_env.items()
            if not name.startswith("KVLEDGER_COORDINATOR_LEDGER__")
        }
        ports = {
            spread_node_id(index, NUM_PARTITIONS): free_port()
            for index in range(self.config.num_nodes)
        }
        if self.config.node_metrics_token is not None:
            node_env["KVLEDGER_NODE_METRICS__TOKEN"] = self.config.node_metrics_token
        if self.config.peers:
            node_env["KVLEDGER_NODE_PEERS__URLS"] = json.dumps(
                {node_id: f"http://127.0.0.1:{port}" for node_id, port in ports.items()}
            )
        for node_id, port in ports.items():
            data_dir = self.work_dir / node_id
            data_dir.mkdir(parents=True)
            await keys.enroll(self.database_url, node_id, data_dir)
            args = [
                "node",
                "--model",
                str(self.model_dir),
                "--port",
                str(port),
                "--node-id",
                node_id,
                "--data-dir",
                str(data_dir),
            ]
            self.nodes.append(
                Child(
                    node_id,
                    args,
                    node_env,
                    logs / f"{node_id}.log",
                    f"http://127.0.0.1:{port}",
                    self.config.ready_timeout_s,
                    self.config.launcher,
                )
            )
            self.node_ids.append(node_id)
        for node in self.nodes:
            node.spawn()
        for node in self.nodes:
            await node.wait_ready()

    async def stop(self) -> None:
        for child in [*self.nodes, *self.coordinators]:
            await child.stop()
        if self.tail is not None:
            await self.tail.stop()
        if self.kafka is not None:
            self.resume_broker()
            await self.kafka.stop()
        if self.postgres is not None:
            await self.postgres.stop()

    @property
    def coordinator(self) -> Child:
        """The first coordinator process: the one the nodes' ``coordinator_url`` names."""
        assert self.coordinators, "the cluster has not started"
        return self.coordinators[0]

    @property
    def children(self) -> list[Child]:
        """Every coordinator and node process, started or not."""
        return [*self.coordinators, *self.nodes]

    @property
    def database_url(self) -> str:
        assert self.postgres is not None
        return self.postgres.database_url

    @property
    def bootstrap(self) -> str:
        assert self.kafka is not None
        return self.kafka.bootstrap

    def connect_kwargs(self) -> dict:
        url = make_url(self.database_url)
        return {
            "host": url.query["host"],
            "port": int(url.query.get("port", 5432)),
            "user": url.username,
            "database": url.database,
        }

    # -- faults --------------------------------------------------------------------------

    def count(self, fault: str) -> None:
        self.faults[fault] = self.faults.get(fault, 0) + 1

    async def restart_coordinator(
        self,
        fault_point: str | None = None,
        *,
        kill: bool = False,
        index: int = 0,
        down_s: float = 0.0,
    ) -> None:
        """Stop coordinator ``index`` (SIGTERM, or SIGKILL with ``kill``), leave it down ``down_s``
        (the others, if any, take its partitions over meanwhile), start it again, optionally armed
        with ``fault_point``."""
        coordinator = self.coordinators[index]
        if kill:
            await coordinator.kill()
            self.count("coordinator_sigkill")
        else:
            await coordinator.stop()
        self.count("coordinator_restart")
        await asyncio.sleep(down_s)
        await coordinator.start(fault_point)

    async def restart_node(
        self, index: int, fault_point: str | None = None, *, kill: bool = False
    ) -> None:
        node = self.nodes[index]
        if kill:
            await node.kill()
            self.count("node_sigkill")
        else:
            await node.stop()
        self.count("node_restart")
        await node.start(fault_point)

    async def died_at_fault_point(self, child: Child, timeout_s: float = 60.0) -> None:
        """Wait until ``child`` killed itself at its armed fault point (exit by SIGKILL)."""
        code = await child.wait_exit(timeout_s)
        assert code == -signal.SIGKILL, (
            f"{child.name} exited with {code}, not by its fault point; log tail:\n{child.log_tail()}"
        )
        self.count("fault_point_sigkill")

    async def start_armed(
        self, child: Child, fault_point: str, timeout_s: float = READY_TIMEOUT_S
    ) -> bool:
        """Start ``child`` armed with ``fault_point``: True once it is ready; False when it already
        died at that point while starting (a node replaying a command an earlier life left unacked
        reaches node points at start)."""
        child.spawn(fault_point)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while child.running:
                try:
                    if (await client.get(f"{child.url}/readyz")).status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, (
                    f"{child.name} not ready after {timeout_s:.0f}s; log tail:\n{child.log_tail()}"
                )
                await asyncio.sleep(0.2)
        await self.died_at_fault_point(child)
        return False

    def pause_broker(self) -> None:
        assert self.kafka is not None and self.kafka._process is not None
        self.kafka._process.send_signal(signal.SIGSTOP)
        self.broker_paused = True
        self.count("broker_pause")

    def resume_broker(self) -> None:
        if self.broker_paused and self.kafka is not None and self.kafka._process is not None:
            self.kafka._process.send_signal(signal.SIGCONT)
        self.broker_paused = False

    async def restart_postgres(self) -> None:
        """Fast shutdown and start of the same data directory (same socket, same URL)."""
        assert self.postgres is not None
        await self.postgres.restart()
        self.count("postgres_restart")

    # -- the outside world -----------------------------------------------------------

    def user_token(self, tenant: str, subject: str, scopes: dict[str, int] | None = None) -> str:
        scopes = scopes or {}
        return issue_token(
            tenant=tenant,
            sub=subject,
            scopes=sorted(scopes),
            pv=scopes,
            ttl_s=3600,
            secret=self.jwt_secret,
        )

    def openai_client(self, index: int, token: str) -> openai.AsyncOpenAI:
        """No retries: a refusal or a failure must surface as it is."""
        return openai.AsyncOpenAI(
            base_url=f"{self.nodes[index].url}/v1", api_key=token, max_retries=0, timeout=120
        )

    async def chat(self, index: int, token: str, messages: list[dict]):
        async with self.openai_client(index, token) as client:
            return await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=1, temperature=0
            )

    async def publish(self, payload: schema.EventPayload, tenant: str) -> schema.Envelope:
        """A customer event, signed with the run's producer key (enrolled for every tenant)."""
        event = self._producer_signer(schema.make_event(payload, tenant_id=tenant))
        async with EventProducer(
            KafkaSettings(bootstrap=self.bootstrap, client_id="kvledger-cluster-customer")
        ) as producer:
            await producer.send(event)
        return event

    async def request_inventory(self, node_id: str) -> uuid.UUID:
        """Publish a signed ``InventoryRequested`` for ``node_id`` (as the coordinator would); returns its request id."""
        request_id = uuid.uuid4()
        command = self._command_signer(
            schema.make_event(schema.InventoryRequested(node_id=node_id, request_id=request_id))
        )
        async with EventProducer(
            KafkaSettings(bootstrap=self.bootstrap, client_id="kvledger-cluster-inventory")
        ) as producer:
            await producer.send(command, topic=COMMANDS)
        return request_id

    async def coordinator_api(
        self, method: str, path: str, role: tuple[str, str] = PLATFORM_ADMIN, **kwargs
    ) -> httpx.Response:
        """To the first running coordinator process (the first one while it runs)."""
        running = [child for child in self.coordinators if child.running] or self.coordinators
        async with httpx.AsyncClient(
            base_url=running[0].url, headers=operator_headers(*role), timeout=30
        ) as client:
            return await client.request(method, path, **kwargs)

    async def request_erasure(self, tenant: str, subject: str) -> str:
        response = await self.coordinator_api(
            "POST",
            "/v1/erasures",
            role=("privacy-officer", tenant),
            json={"tenant_id": tenant, "subject_id": subject, "reason": "fault-injection erasure"},
        )
        assert response.status_code == 202, response.text
        return response.json()["id"]

    async def snapshot(self, index: int) -> httpx.Response:
        async with httpx.AsyncClient(
            base_url=self.nodes[index].url, headers=operator_headers(*PLATFORM_ADMIN), timeout=60
        ) as client:
            return await client.post("/v1/cache/snapshots")


SYSTEM_PROMPT = (
    "You are the assistant of the people team. Answer briefly and kindly, and cite the handbook."
)
READER_SCOPES = {"hr": 1}
"""The auth scope (and policy version) of document readers in the workloads."""


def private_chat(subject: str, turns: int = 6) -> list[dict]:
    """A user's private chat: a public system prompt, then user-scope text (every block after it is the user's)."""
    text = " ".join(
        f"{subject} wrote note {i}: my sick leave started on day {i}" for i in range(turns)
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT, "cache_scope": "public"},
        {"role": "user", "content": text},
    ]


def document_chat(doc_id: str, version: int, auth_scope: str = "hr") -> list[dict]:
    """A question about version ``version`` of a tenant document (tenant-scope blocks tagged
    ``doc_id@version``)."""
    text = " ".join(
        f"{doc_id} section {i} version {version} says staff rest on day {i}" for i in range(6)
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT, "cache_scope": "public"},
        {
            "role": "user",
            "content": text,
            "document": {"id": doc_id, "version": version, "auth_scope": auth_scope},
        },
        {"role": "user", "content": "What is the leave policy?"},
    ]
