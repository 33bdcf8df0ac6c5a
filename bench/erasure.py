"""``kvledger bench erasure``: time from an erasure request to its verified, signed receipt.

Setup (once): embedded Postgres and Tansu (or ``--database-url`` /
``--kafka-bootstrap``), a freshly migrated ledger, the coordinator as its own
process (``kvledger coordinator --role all``: HTTP API, consumers, erasure
verifier), and two nodes in this process whose data keys live in that
coordinator (``CoordinatorKeyProvider``).

Per run: a new subject gets ``--blocks`` user-scope blocks, half on each node,
committed through the pool with synthetic KV (making 10,000 blocks with the model
would measure the model, not erasure). The tiers are sized so a third of each
node's blocks stays on the device, a third is demoted to the host and the rest
to disk (sealed under the subject's key, resolved from the coordinator); then
each node writes a snapshot of all of them. Everything reaches the ledger through
the nodes' real publishers, and the run starts only once the ledger shows every
placement. The clock runs from just before ``POST /v1/erasures`` until
``GET /v1/erasures/{id}/receipt`` returns the signed receipt: the coordinator
decides and destroys the keys, both nodes delete every tier, rewrite their
snapshots and crypto-erase, ack, the ledger applies the evidence and the
receipt is signed and appended to the audit log.

``--sweep 1000,10000,100000`` repeats that for each size, in ascending order, with
fresh nodes sized for it (one coordinator throughout): the time per size, how it
grows (the target: no worse than linear, so 10x the blocks in at most 10x the
time), and the peak resident memory (``VmHWM``) of the coordinator process and of
this process (both nodes) once the size's runs are done. Past about 6,000 blocks
per node a node's ack no longer fits one record and goes out in parts
(``events.ack_parts``), which the coordinator assembles before it counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import platform
import secrets
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import torch

from bench.common import (
    BenchKeys,
    connect_kwargs,
    coordinator_env,
    database_server,
    fresh_database,
    kafka_broker,
    operator_headers,
    run_and_report,
    start_groups_at_end,
    wait,
)
from coordinator.consumers import consumer_groups
from events.kafka.admin import ensure_topics
from events.kafka.settings import KafkaSettings
from events.schema import subject_digest
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.server import make_command_consumer, make_publisher
from gpu_node.settings import CacheSettings, NodeSettings
from kvledger.model_init import build_tiny_model
from kvledger.processes import popen_cli
from prefix_keys.blocks import HASH_BYTES, BlockKey, CacheProvenance, CacheScope

JWT_SECRET = "bench-erasure-secret-" + "x" * 32
SUBJECT_KEY = "bench-erasure-subject-key"
NUM_NODES = 2
TARGET_S = 5.0
TIMEOUT_S = 300.0
POLL_S = 0.02


@dataclass
class ErasureRun:
    num_blocks: int
    num_placements: int
    seconds: float
    coordinator_peak_rss_bytes: int = 0
    nodes_peak_rss_bytes: int = 0


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (``VmHWM``); 0 where /proc does not say."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class BenchNode:
    """Engine, publisher and command consumer, assembled as ``gpu_node.entrypoints.server.serve``
    does."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.engine = AsyncEngine.from_settings(settings)
        self.publisher = make_publisher(self.engine, settings)
        self.commands = make_command_consumer(self.engine, self.publisher, settings)

    async def start(self) -> None:
        await self.engine.start(ready=False)
        await self.publisher.start(Path(self.settings.data_dir))
        await self.commands.start()
        await asyncio.wait_for(self.commands.replayed.wait(), TIMEOUT_S)

    async def stop(self) -> None:
        await self.commands.stop()
        await self.publisher.stop()
        await self.engine.stop()
        self.engine.pool.key_provider.close()

    def fill(self, tenant: str, subject: str, num_blocks: int, kv: torch.Tensor) -> None:
        """Commit ``num_blocks`` READY user blocks of ``subject`` (worker thread); the pool demotes as tiers fill."""
        pool = self.engine.pool
        provenance = CacheProvenance(
            self.engine.namespace.namespace, tenant, CacheScope.USER, (), subject, (), time.time()
        )
        parent = secrets.token_bytes(HASH_BYTES)
        for index in range(num_blocks):
            block_hash = secrets.token_bytes(HASH_BYTES)
            entry = pool.begin_build(
                BlockKey(block_hash, parent, index, pool.spec.block_size, provenance)
            )
            assert entry is not None and pool.commit_build(entry, kv), (
                "the pool must hold every benchmark block"
            )
            parent = block_hash


class Coordinator:
    """``kvledger coordinator --role all`` in its own process, on a free loopback port."""

    def __init__(self, database_url: str, bootstrap: str, group: str, log, keys: BenchKeys) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.database_url = database_url
        env = coordinator_env(
            database_url,
            bootstrap,
            group,
            JWT_SECRET,
            KVLEDGER_SUBJECT_KEY=SUBJECT_KEY,
            KVLEDGER_MASTER_KEY=base64.b64encode(os.urandom(32)).decode(),
            **keys.coordinator_env(),
        )
        command = ["coordinator", "--role", "all", "--host", "127.0.0.1", "--port", str(port)]
        self._log = log
        self.process = popen_cli(command, env, log, None, new_session=False, dies_with_parent=False)

    def check(self) -> None:
        if self.process.poll() is not None:
            self._log.seek(0)
            raise RuntimeError(f"the coordinator exited:\n{self._log.read().decode()[-4000:]}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


async def _live_placements(connection: asyncpg.Connection, tenant: str, subject_hash: bytes) -> int:
    return await connection.fetchval(
        "SELECT count(*) FROM placements p JOIN blocks b ON b.block_hash = p.block_hash"
        " WHERE b.tenant_id = $1 AND b.subject_hash = $2 AND p.state = 'live'",
        tenant,
        subject_hash,
    )


async def _run_once(
    nodes: list[BenchNode],
    coordinator: Coordinator,
    connection: asyncpg.Connection,
    num_blocks: int,
) -> ErasureRun:
    tenant, subject = f"bench-{uuid.uuid4().hex[:8]}", f"subject-{uuid.uuid4().hex}"
    digest = subject_digest(SUBJECT_KEY.encode(), tenant, subject)
    spec = nodes[0].engine.pool.spec
    kv = torch.randn(spec.block_shape, dtype=spec.dtype)
    per_node = [
        num_blocks // NUM_NODES + (1 if i < num_blocks % NUM_NODES else 0) for i in range(NUM_NODES)
    ]
    for node, count in zip(nodes, per_node, strict=True):
        await asyncio.to_thread(node.fill, tenant, subject, count, kv)
        node.engine.manager.drain_events()
        await node.engine.write_snapshot()
        stats = node.engine.pool.stats().num_entries
        assert all(stats[tier] > 0 for tier in stats), f"blocks must sit in every tier, got {stats}"
        await node.publisher.flush()
    expected = 2 * num_blocks  # one pool tier per block, plus the snapshot

    async def in_ledger() -> bool:
        coordinator.check()
        return await _live_placements(connection, tenant, bytes.fromhex(digest)) == expected

    await wait(in_ledger, f"{expected} placements in the ledger", TIMEOUT_S, POLL_S)
    officer = operator_headers("privacy-officer", tenant)
    async with httpx.AsyncClient(base_url=coordinator.url, headers=officer, timeout=30) as client:
        started = time.perf_counter()
        response = await client.post(
            "/v1/erasures", json={"tenant_id": tenant, "subject_id": subject, "reason": "benchmark"}
        )
        assert response.status_code == 202, response.text
        erasure_id = response.json()["id"]

        async def receipt() -> bool:
            coordinator.check()
            return (await client.get(f"/v1/erasures/{erasure_id}/receipt")).status_code == 200

        await wait(receipt, "the verified receipt", TIMEOUT_S, POLL_S)
        seconds = time.perf_counter() - started
        body = (await client.get(f"/v1/erasures/{erasure_id}/receipt")).json()["receipt"]
    assert body["block_commitment"]["count"] == num_blocks, body["block_commitment"]
    assert await _live_placements(connection, tenant, bytes.fromhex(digest)) == 0
    return ErasureRun(num_blocks, expected, seconds)


async def _run(args) -> list[ErasureRun]:
    async with contextlib.AsyncExitStack() as stack:
        work = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-erasure-"))
        )
        server_url = await database_server(stack, args, work / "postgres")
        bootstrap = await kafka_broker(stack, args, work / "kafka")
        await ensure_topics(KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench"))
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").is_file():
            model_dir = build_tiny_model(work / "model", seed=0)
        keys = BenchKeys(work / "keys")
        runs = []
        for num_blocks in args.sweep or [args.blocks]:
            # Every size gets a ledger, a coordinator and nodes of its own: every registered node is
            # a target of every command, and a coordinator's peak memory is then the size's own.
            async with contextlib.AsyncExitStack() as size_stack:
                database_url = await size_stack.enter_async_context(fresh_database(server_url))
                coordinator = await _start_coordinator(size_stack, database_url, bootstrap, keys)
                connection = await asyncpg.connect(**connect_kwargs(database_url))
                size_stack.push_async_callback(connection.close)
                nodes = await _start_nodes(
                    size_stack,
                    num_blocks,
                    keys,
                    work,
                    model_dir,
                    bootstrap,
                    coordinator,
                    connection,
                )
                for _ in range(args.runs):
                    run = await _run_once(nodes, coordinator, connection, num_blocks)
                    run.coordinator_peak_rss_bytes = peak_rss_bytes(coordinator.process.pid)
                    run.nodes_peak_rss_bytes = peak_rss_bytes(os.getpid())
                    runs.append(run)
                    print(run, file=sys.stderr, flush=True)
        return runs


async def _start_coordinator(
    stack: contextlib.AsyncExitStack, database_url: str, bootstrap: str, keys: BenchKeys
) -> Coordinator:
    """``kvledger coordinator --role all`` on ``database_url``, its consumer groups starting at the
    topics' end, serving."""
    group = f"bench-erasure-{uuid.uuid4().hex[:8]}"
    await start_groups_at_end(bootstrap, consumer_groups(group))
    log = stack.enter_context(tempfile.TemporaryFile())
    coordinator = Coordinator(database_url, bootstrap, group, log, keys)
    stack.callback(coordinator.stop)
    async with httpx.AsyncClient(base_url=coordinator.url, timeout=5) as client:

        async def serving() -> bool:
            coordinator.check()
            with contextlib.suppress(httpx.HTTPError):
                return (await client.get("/healthz")).status_code == 200
            return False

        await wait(serving, "the coordinator's HTTP API", TIMEOUT_S, POLL_S)
    return coordinator


async def _start_nodes(
    stack: contextlib.AsyncExitStack,
    num_blocks: int,
    keys: BenchKeys,
    work: Path,
    model_dir: Path,
    bootstrap: str,
    coordinator: Coordinator,
    connection: asyncpg.Connection,
) -> list[BenchNode]:
    """Two fresh nodes (new ids and data directories) whose tiers are sized for ``num_blocks``,
    registered in the ledger."""
    per_node = -(-num_blocks // NUM_NODES)
    cache = CacheSettings(
        num_device_blocks=per_node // 3, num_host_blocks=per_node // 3, max_disk_blocks=per_node
    )
    nodes = []
    for i in range(NUM_NODES):
        node_id = f"bench-erasure-{uuid.uuid4().hex[:8]}-{i}"
        data_dir = work / node_id
        await keys.enroll(coordinator.database_url, node_id, data_dir)
        node = BenchNode(
            NodeSettings(
                node_id=node_id,
                model_dir=model_dir,
                data_dir=data_dir,
                kafka_bootstrap=bootstrap,
                subject_key=SUBJECT_KEY,
                coordinator_url=coordinator.url,
                auth={"jwt_secret": JWT_SECRET},
                cache=cache,
                publish_interval_s=0.02,
                identity=keys.node_identity(),
            )
        )
        await node.start()
        stack.push_async_callback(node.stop)
        nodes.append(node)
    node_ids = [node.settings.node_id for node in nodes]

    async def registered() -> bool:
        coordinator.check()
        return await connection.fetchval(
            "SELECT count(*) FROM nodes WHERE node_id = ANY($1::text[])", node_ids
        ) == len(node_ids)

    await wait(registered, "both nodes registered", TIMEOUT_S, POLL_S)
    return nodes


def render_single(args, runs: list[ErasureRun]) -> str:
    seconds = sorted(run.seconds for run in runs)
    p50 = statistics.median(seconds)
    return "\n".join(
        [
            "## Erasure to verified receipt (`kvledger bench erasure`)",
            "",
            f"Command: `kvledger bench erasure --runs {args.runs} --blocks {args.blocks}` on {platform.machine()}, "
            f"{os.cpu_count()} cores, embedded Postgres + Tansu on the same machine, the coordinator (`--role all`) in its "
            f"own process, two nodes (tiny model, CPU) in the benchmark process. Per run one subject's {args.blocks} "
            f"user-scope blocks, half per node, a third of each node's on device, host and disk, plus a snapshot of all "
            f"of them ({runs[0].num_placements} ledger placements). Timed from `POST /v1/erasures` to the signed receipt "
            f"being served.",
            "",
            "| metric | value | target |",
            "|---|---:|---|",
            f"| request → verified receipt, p50 of {len(runs)} runs | {p50:.2f} s | ≤ {TARGET_S:.0f} s |",
            f"| min / max | {seconds[0]:.2f} / {seconds[-1]:.2f} s | |",
            "",
        ]
    )


def render_sweep(args, runs: list[ErasureRun]) -> str:
    """One row per size: p50 time, its growth over the size before, and peak memory."""
    rows = []
    previous: tuple[int, float] | None = None
    medians: dict[int, float] = {}
    for num_blocks in args.sweep:
        mine = [run for run in runs if run.num_blocks == num_blocks]
        seconds = sorted(run.seconds for run in mine)
        p50 = medians[num_blocks] = statistics.median(seconds)
        growth = (
            ""
            if previous is None
            else f"{p50 / previous[1]:.1f}x for {num_blocks / previous[0]:.0f}x the blocks"
        )
        coordinator_mib = max(run.coordinator_peak_rss_bytes for run in mine) / 2**20
        nodes_mib = max(run.nodes_peak_rss_bytes for run in mine) / 2**20
        rows.append(
            f"| {num_blocks} | {mine[0].num_placements} | {p50:.2f} s | {seconds[0]:.2f} / {seconds[-1]:.2f} s | {growth} "
            f"| {coordinator_mib:.0f} MiB | {nodes_mib:.0f} MiB |"
        )
        previous = (num_blocks, p50)
    sizes = ",".join(str(size) for size in args.sweep)
    return "\n".join(
        [
            "## Erasure size sweep (`kvledger bench erasure --sweep`)",
            "",
            f"Command: `kvledger bench erasure --sweep {sizes} --runs {args.runs}` on {platform.machine()}, {os.cpu_count()} cores, "
            "embedded Postgres + Tansu on the same machine; per size a fresh ledger, coordinator (`--role all`, own process) "
            "and two nodes (tiny model, CPU, in the benchmark process) sized so a third of each node's blocks sits on device, "
            "host and disk, plus a snapshot of all of them. Timed from `POST /v1/erasures` to the signed receipt being served. "
            "Peak RSS is `VmHWM` after the size's runs: the coordinator process, and the benchmark process holding both nodes.",
            "",
            "| blocks | ledger placements | request → receipt, p50 | min / max | growth | coordinator peak RSS | nodes peak RSS |",
            "|---:|---:|---:|---:|---|---:|---:|",
            *rows,
            "",
        ]
    )


def render_markdown(args, runs: list[ErasureRun]) -> str:
    return render_sweep(args, runs) if args.sweep else render_single(args, runs)


def cli(args: argparse.Namespace) -> int:
    if args.runs < 1 or min([args.blocks, *(args.sweep or [])]) < 3 * NUM_NODES:
        raise SystemExit(
            f"--runs must be >= 1 and every size >= {3 * NUM_NODES} (every node needs blocks in every tier)"
        )
    if args.sweep and args.sweep != sorted(set(args.sweep)):
        raise SystemExit("--sweep sizes must be distinct and ascending")
    return run_and_report(args, _run, render_markdown)
