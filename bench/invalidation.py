"""``kvledger bench invalidation``: how fast a user event stops reuse and deletes the blocks it covers.

Per run: a freshly migrated ledger, the coordinator's consumers in their own
process (as in production), and two nodes in this process, each holding
``--blocks-per-node`` tenant-scope blocks spread over many documents. The blocks
are made through the pool itself with synthetic KV (generating 10,000 blocks with
the model would measure the model, not invalidation) and reach the ledger through
the node's real publisher. Then ``DocumentUpdated`` events, each for another
document, are published with a plain aiokafka producer at ``--rate``:
``--warmup-s`` worth of warm-up events, then ``--events`` measured ones in the same
stream. Only the measured events enter the statistics: the first batches after
start pay for cold caches (prepared statements, query plans, database buffers),
which is start-up cost, not invalidation latency.

Per event it measures, from the moment before the send:

* **first refused request** — a real HTTP request carrying the old version, sent
  by one prober per node: a full cache hit until the node refuses it with 409
  ``stale_document_version`` (or, were the blocks gone first, serves no cached
  tokens). Each prober follows the newest event, so a sample starts
  within one probe of the publish; events it never reached are not sampled.
  A prober keeps one request in flight and starts one at most every
  ``--probe-interval-ms``: that bounds the request load it adds to the nodes,
  and is the resolution of this measurement (a refusal is seen up to one
  interval after it took effect);
* **decision** — the coordinator's invalidation row (``created_at``, database clock);
* **command reached the last node** — the node started applying the batch holding it,
  and **applied on the last node** — the node's ``InvalidationApplier.apply_batch``
  yielded it, complete (timed by a subclass, see :class:`TimedHandler`);
* **last node's ack** — this process received the later of the two ``CommandAck``s;
* **complete** — the ledger marked the invalidation complete (``completed_at``).

All clocks are this machine's wall clock (the database runs here too). The phases
between them show where the time goes when the target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import asyncpg
import httpx
import torch
import uvicorn
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.common import (
    BenchKeys,
    connect_kwargs,
    coordinator_env,
    database_server,
    fresh_database,
    kafka_broker,
    percentile,
    run_and_report,
    start_groups_at_end,
    wait,
)
from coordinator.consumers import consumer_groups
from events import schema, topics
from events.codec import encode_event
from events.kafka.admin import ensure_topics
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.entrypoints.server import kafka_settings, make_publisher, tune_interpreter
from gpu_node.governance.applier import InvalidationApplier
from gpu_node.governance.commands import CommandConsumer
from gpu_node.keys.node_identity import pinned_command_key
from gpu_node.settings import CacheSettings, NodeSettings
from identity.signing import EnvelopeSigner
from identity.tokens import TokenVerifier, issue_token
from kvledger.model_init import build_tiny_model
from kvledger.net import loopback_listener
from prefix_keys.blocks import CacheScope, DocumentRef, Principal, compute_block_keys
from prefix_keys.prompt import ChatMessage, render_prompt

NUM_NODES = 2
AUTH_SCOPE = "kb"
SECTIONS_PER_DOCUMENT = 6
"""About 10 blocks of 16 tokens per document with the tiny model's tokenizer."""
JWT_SECRET = "bench-invalidation-secret-of-32-bytes-or-more"
SUBJECT_KEY = "bench-invalidation-subject-key"
IDLE_POLL_S = 0.002
TIMEOUT_S = 300.0
FILL_CHUNK_BLOCKS = 500
"""Blocks committed between two publisher flushes while filling. The publisher turns all
pending stores into one ``BlockStored`` record (about 440 bytes a block); past roughly
2,400 blocks that record exceeds the producer's 1 MB request limit and is never sent."""
TARGET_P99_MS = 250.0


# --------------------------------------------------------------------------- nodes


class TimedHandler(InvalidationApplier):
    """The node's handler, noting when each command's batch started and when the command was
    complete."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.applied: dict[uuid.UUID, tuple[float, float]] = {}

    async def apply_batch(self, commands):
        started = time.time()
        async for command, evidence in super().apply_batch(commands):
            self.applied[command.command_id] = (started, time.time())
            yield command, evidence


class BenchNode:
    """Engine, publisher, command consumer and HTTP app, assembled as
    ``gpu_node.entrypoints.server.serve`` does."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.engine = AsyncEngine.from_settings(settings)
        self.publisher = make_publisher(self.engine, settings)
        self.handler = TimedHandler(self.engine, self.publisher.subject_key)
        self.commands = CommandConsumer(
            self.handler,
            self.publisher,
            kafka_settings(settings),
            command_key=pinned_command_key(settings),
        )
        self.server: uvicorn.Server | None = None
        self.url = ""

    async def start(self) -> None:
        await self.engine.start(ready=False)
        await self.publisher.start(Path(self.settings.data_dir))
        await self.commands.start()
        await asyncio.wait_for(self.commands.replayed.wait(), TIMEOUT_S)
        sock = loopback_listener()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = create_app(self.engine, TokenVerifier(self.settings.auth))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            await self._serving
        await self.commands.stop()
        await self.publisher.stop()
        await self.engine.stop()

    def fill(self, keys: list, kv: torch.Tensor) -> None:
        """Commit every key as a READY block with synthetic KV; the pool's events go to the
        publisher."""
        pool = self.engine.pool
        for key in keys:
            entry = pool.begin_build(key)
            if entry is not None:
                assert pool.commit_build(entry, kv), (
                    "the device tier must hold every benchmark block"
                )
        self.engine.manager.drain_events()


def document_message(doc_id: str, version: int) -> dict:
    text = " ".join(
        f"{doc_id} section {i} says the on-call rota rotates weekly"
        for i in range(SECTIONS_PER_DOCUMENT)
    )
    return {
        "role": "user",
        "content": text,
        "document": {"id": doc_id, "version": version, "auth_scope": AUTH_SCOPE},
    }


def document_keys(engine: AsyncEngine, principal: Principal, doc_id: str) -> list:
    """The block keys a request for ``doc_id`` v1 computes: the same rendering and hashing as the
    engine."""
    message = document_message(doc_id, 1)
    ref = DocumentRef(doc_id, 1, AUTH_SCOPE)
    prompt = render_prompt(
        engine.runner.tokenizer, [ChatMessage("user", message["content"], CacheScope.TENANT, ref)]
    )
    return compute_block_keys(
        engine.namespace.namespace, prompt.token_ids, prompt.segments, principal, engine.block_size
    )


# --------------------------------------------------------------------------- one run


@dataclass
class Published:
    event_id: str
    doc_id: str
    old_version: int
    at: float
    measured: bool
    """False for the warm-up events, which no statistic includes."""


@dataclass
class InvalidationRun:
    num_events: int
    blocks_per_node: int
    blocks_per_event: float
    refused_ms: list[float]
    decided_ms: list[float]
    reached_ms: list[float]
    applied_ms: list[float]
    acked_ms: list[float]
    complete_ms: list[float]
    apply_duration_ms: list[float]
    node_commands_per_s: float
    num_refused_by_409: int
    num_refused_by_miss: int
    num_late_reissues: int
    elapsed_s: float


@dataclass
class _Probes:
    refused: dict[tuple[int, str], float] = field(default_factory=dict)
    by_409: int = 0
    by_miss: int = 0


async def _probe(
    node: BenchNode,
    token: str,
    published: list[Published],
    probes: _Probes,
    done: asyncio.Event,
    full_tokens: int,
    index: int,
    interval_s: float,
) -> None:
    """Follow the newest event on ``node``: send its old version until the node stops serving it, then the next newest.

    Never an event older than the last one probed: its refusal would time how long
    it waited to be picked, not the invalidation.
    """
    num_seen = 0
    loop = asyncio.get_running_loop()
    next_send = loop.time()
    async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
        while not done.is_set():
            # Only the cached version hits; probing a later one would build (stale) blocks itself.
            newest = published[-1] if len(published) > num_seen else None
            num_seen = len(published)
            if newest is None or newest.old_version != 1:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            event = newest
            body = {
                "model": node.engine.model_name,
                "messages": [document_message(event.doc_id, event.old_version)],
                "max_tokens": 1,
            }
            while not done.is_set():
                await asyncio.sleep(max(0.0, next_send - loop.time()))
                next_send = loop.time() + interval_s
                response = await client.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
                )
                now = time.time()
                if response.status_code == 409:
                    by_409 = True
                    break
                if response.status_code != 200:
                    raise RuntimeError(f"probe answered {response.status_code}: {response.text}")
                if response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < full_tokens:
                    by_409 = False
                    break
            else:
                return
            if event.measured:
                probes.refused[(index, event.event_id)] = (now - event.at) * 1000
                probes.by_409 += by_409
                probes.by_miss += not by_409


async def _collect_acks(
    bootstrap: str, acks: dict[str, dict[str, float]], ready: asyncio.Event
) -> None:
    """Receipt time of every CommandAck published from now on, by command id and node.

    ``fetch_max_wait_ms`` is small because Tansu does not answer a long-polling fetch
    when data arrives, only when the wait expires: at aiokafka's default (500 ms)
    this clock would add up to half a second to every ack it times.
    """
    consumer = AIOKafkaConsumer(
        **kafka_client_kwargs(KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench")),
        group_id=None,
        enable_auto_commit=False,
        fetch_max_wait_ms=5,
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topics.ACKS, p)
            for p in sorted(consumer.partitions_for_topic(topics.ACKS))
        ]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)
        ready.set()
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.time()
            for records in batch.values():
                for record in records:
                    payload = json.loads(record.value)["payload"]
                    acks.setdefault(payload["command_id"], {})[payload["node_id"]] = now
    finally:
        await consumer.stop()


def _bench_nodes(
    args, run_id: str, model_dir: Path, work: Path, bootstrap: str, keys: BenchKeys
) -> list[BenchNode]:
    """The run's nodes, each with room for ``blocks_per_node`` device blocks and no other tier."""
    cache = CacheSettings(
        num_device_blocks=args.blocks_per_node + 64, num_host_blocks=0, max_disk_blocks=0
    )
    return [
        BenchNode(
            NodeSettings(
                node_id=f"bench-{run_id}-{i}",
                model_dir=model_dir,
                data_dir=work / run_id / str(i),
                kafka_bootstrap=bootstrap,
                subject_key=SUBJECT_KEY,
                auth={"jwt_secret": JWT_SECRET},
                cache=cache,
                identity=keys.node_identity(),
            )
        )
        for i in range(NUM_NODES)
    ]


async def _fill_nodes(
    nodes: list[BenchNode], principal: Principal, blocks_per_node: int, connection
) -> tuple[list, list[str]]:
    """Fill every node with documents of about 10 blocks each until it holds ``blocks_per_node``,
    and wait until the ledger holds each of them live; returns the block keys and the documents."""
    node_ids = [node.settings.node_id for node in nodes]
    engine = nodes[0].engine
    kv = torch.randn(engine.pool.spec.block_shape, dtype=engine.pool.spec.dtype)
    keys, documents = [], []
    while len(keys) < blocks_per_node:
        doc_id = f"doc-{len(documents):05d}"
        documents.append(doc_id)
        keys += document_keys(engine, principal, doc_id)
    for node in nodes:
        for start in range(0, len(keys), FILL_CHUNK_BLOCKS):
            await asyncio.to_thread(node.fill, keys[start : start + FILL_CHUNK_BLOCKS], kv)
            await node.publisher.flush()

    async def in_ledger() -> bool:
        rows = await connection.fetch(
            "SELECT node_id, count(*) AS n FROM placements WHERE state = 'live' AND node_id = ANY($1::text[]) GROUP BY node_id",
            node_ids,
        )
        return len(rows) == len(node_ids) and all(row["n"] == len(keys) for row in rows)

    await wait(in_ledger, "every block in the ledger", TIMEOUT_S)
    return keys, documents


async def _publish_document_updates(
    bootstrap: str,
    tenant: str,
    documents: list[str],
    args,
    published: list[Published],
    sign: EnvelopeSigner,
) -> None:
    """Publish warm-up and measured DocumentUpdated events (signed with the run's producer key) at
    ``args.rate`` per second, round robin over the documents, recording each one's publish time in
    ``published``."""
    versions = dict.fromkeys(documents, 1)
    producer = AIOKafkaProducer(
        **kafka_client_kwargs(KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench")),
        acks="all",
        linger_ms=0,
    )
    await producer.start()
    num_warmup = round(args.rate * args.warmup_s)
    try:
        sends = []
        loop_started = time.perf_counter()
        for i in range(num_warmup + args.events):
            delay = loop_started + i / args.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            doc_id = documents[i % len(documents)]
            versions[doc_id] += 1
            event = sign(
                schema.make_event(
                    schema.DocumentUpdated(doc_id=doc_id, version=versions[doc_id]),
                    tenant_id=tenant,
                )
            )
            event_id = str(event.event_id)
            at = time.time()
            key = topics.document_key(tenant, doc_id).encode()
            sends.append(await producer.send(topics.DOCUMENTS, encode_event(event), key=key))
            published.append(
                Published(event_id, doc_id, versions[doc_id] - 1, at, measured=i >= num_warmup)
            )
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


def _summarize(
    args,
    rows: list,
    measured: dict[str, float],
    acks: dict[str, dict[str, float]],
    nodes: list[BenchNode],
    probes: _Probes,
    *,
    blocks_per_node: int,
    blocks_per_document: float,
    late: int,
    elapsed_s: float,
) -> InvalidationRun:
    """Each measured command's stages as milliseconds after its event was published."""
    decided, reached, applied, acked, complete, durations = [], [], [], [], [], []
    for row in rows:
        command_id, published_at = row["command_id"], measured[str(row["source_event_id"])]
        decided.append((row["created_at"].timestamp() - published_at) * 1000)
        complete.append((row["completed_at"].timestamp() - published_at) * 1000)
        acked.append((max(acks[str(command_id)].values()) - published_at) * 1000)
        spans = [node.handler.applied[command_id] for node in nodes]
        reached.append((max(begin for begin, _ in spans) - published_at) * 1000)
        applied.append((max(end for _, end in spans) - published_at) * 1000)
        durations += [(end - begin) * 1000 for begin, end in spans]
    # Sustained rate of one node: its commands over the span from its first apply to its last.
    throughputs = []
    for node in nodes:
        spans = [node.handler.applied[row["command_id"]] for row in rows]
        throughputs.append(
            len(spans) / (max(end for _, end in spans) - min(begin for begin, _ in spans))
        )
    return InvalidationRun(
        num_events=args.events,
        blocks_per_node=blocks_per_node,
        blocks_per_event=blocks_per_document,
        refused_ms=list(probes.refused.values()),
        decided_ms=decided,
        reached_ms=reached,
        applied_ms=applied,
        acked_ms=acked,
        complete_ms=complete,
        apply_duration_ms=durations,
        node_commands_per_s=min(throughputs),
        num_refused_by_409=probes.by_409,
        num_refused_by_miss=probes.by_miss,
        num_late_reissues=late,
        elapsed_s=elapsed_s,
    )


async def _wait_registered(
    connection: asyncpg.Connection, node_ids: list[str], consumers: subprocess.Popen, log: IO[bytes]
) -> None:
    """Until the ledger knows every node; a consumer process that exits meanwhile fails the run with
    its log's tail."""

    async def registered() -> bool:
        count = await connection.fetchval(
            "SELECT count(*) FROM nodes WHERE node_id = ANY($1::text[])", node_ids
        )
        if consumers.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"coordinator consumers exited:\n{log.read().decode()[-4000:]}")
        return count == len(node_ids)

    await wait(registered, "both nodes registered", TIMEOUT_S)


async def _wait_invalidated(
    connection: asyncpg.Connection,
    published: list[Published],
    acks: dict[str, dict[str, float]],
    collector: asyncio.Task,
) -> tuple[list, dict[str, float], int, float]:
    """Until every published update's invalidation is complete and acked by every node.

    Returns the measured updates' invalidation rows, their publish times by event id, the number
    of late-block re-issues and the seconds from the first measured publish to completion.
    """

    async def all_complete() -> bool:
        complete = await connection.fetchval(
            "SELECT count(*) FROM invalidations WHERE status = 'complete' AND trigger = 'event'"
        )
        return complete == len(published)

    await wait(all_complete, "every invalidation complete", TIMEOUT_S)
    measured = {p.event_id: p.at for p in published if p.measured}
    elapsed_s = time.time() - min(measured.values())
    rows = [
        row
        for row in await connection.fetch(
            "SELECT command_id, source_event_id, created_at, completed_at FROM invalidations WHERE trigger = 'event'"
        )
        if str(row["source_event_id"]) in measured
    ]
    late = await connection.fetchval(
        "SELECT count(*) FROM invalidations WHERE trigger = 'late_block'"
    )

    async def all_acked() -> bool:
        if (
            collector.done()
        ):  # it never returns: an exception, surfaced here rather than as a timeout
            collector.result()
        return all(len(acks.get(str(row["command_id"]), {})) == NUM_NODES for row in rows)

    await wait(all_acked, "both acks of every command seen", 30)
    return rows, measured, late, elapsed_s


async def _run_once(
    args, database_url: str, bootstrap: str, model_dir: Path, work: Path
) -> InvalidationRun:
    run_id = uuid.uuid4().hex[:8]
    tenant = f"bench-{run_id}"
    group = f"bench-invalidation-{run_id}"
    await start_groups_at_end(bootstrap, consumer_groups(group))
    keys = BenchKeys(work / run_id / "keys")
    env = coordinator_env(
        database_url,
        bootstrap,
        group,
        JWT_SECRET,
        KVLEDGER_SUBJECT_KEY=SUBJECT_KEY,
        **keys.coordinator_env(),
    )
    nodes = _bench_nodes(args, run_id, model_dir, work, bootstrap, keys)
    for node in nodes:
        await keys.enroll(database_url, node.settings.node_id, Path(node.settings.data_dir))
    await keys.enroll_producer(database_url)
    principal = Principal(tenant, "reader", frozenset({AUTH_SCOPE}), {AUTH_SCOPE: 1})
    token = issue_token(
        tenant=tenant,
        sub="reader",
        scopes=[AUTH_SCOPE],
        pv={AUTH_SCOPE: 1},
        ttl_s=3600,
        secret=JWT_SECRET,
    )
    with tempfile.TemporaryFile() as log:
        consumers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvledger.cli",
                "coordinator",
                "--role",
                "consumers",
                "--port",
                "0",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        connection = await asyncpg.connect(**connect_kwargs(database_url))
        collector: list[asyncio.Task] = []
        probers: list[asyncio.Task] = []
        probes, done = _Probes(), asyncio.Event()
        try:
            for node in nodes:
                await node.start()
            tune_interpreter()  # as gpu_node.entrypoints.server.serve does once its engine started
            await _wait_registered(
                connection, [node.settings.node_id for node in nodes], consumers, log
            )

            keys, documents = await _fill_nodes(nodes, principal, args.blocks_per_node, connection)
            blocks_per_document = len(keys) / len(documents)
            full_tokens = (
                len(document_keys(nodes[0].engine, principal, documents[0]))
                * nodes[0].engine.block_size
            )

            acks: dict[str, dict[str, float]] = {}
            listening = asyncio.Event()
            collector.append(asyncio.create_task(_collect_acks(bootstrap, acks, listening)))
            await asyncio.wait_for(listening.wait(), 60)
            published: list[Published] = []
            for index, node in enumerate(nodes):
                probers.append(
                    asyncio.create_task(
                        _probe(
                            node,
                            token,
                            published,
                            probes,
                            done,
                            full_tokens,
                            index,
                            args.probe_interval_ms / 1000,
                        )
                    )
                )

            await _publish_document_updates(
                bootstrap, tenant, documents, args, published, keys.sign_as_producer
            )
            rows, measured, late, elapsed_s = await _wait_invalidated(
                connection, published, acks, collector[0]
            )
        finally:
            # Probers finish their request in flight (a cancelled one would be a client disconnect),
            # the collector is cancelled.
            done.set()
            if probers:
                await asyncio.wait(probers, timeout=30)
            for task in probers + collector:
                task.cancel()
            results = await asyncio.gather(*probers, *collector, return_exceptions=True)
            try:
                await connection.close()
                for node in nodes:
                    await node.stop()
            finally:
                consumers.terminate()
                consumers.wait(timeout=60)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    return _summarize(
        args,
        rows,
        measured,
        acks,
        nodes,
        probes,
        blocks_per_node=len(keys),
        blocks_per_document=blocks_per_document,
        late=late,
        elapsed_s=elapsed_s,
    )


# --------------------------------------------------------------------------- report


async def _run(args) -> list[InvalidationRun]:
    # The nodes' model runs share the machine with the database, the broker and the coordinator: a
    # second intra-op thread only waits for a core (a full-hit probe: 12.2 → 11.1 ms even when
    # idle).
    torch.set_num_threads(1)
    model_dir = build_tiny_model(Path(args.model_dir))
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server_url = await database_server(stack, args, work / "postgres")
        runs = []
        for index in range(args.runs):
            async with contextlib.AsyncExitStack() as per_run:
                # A fresh broker per run (unless given one): nodes replay the whole command log at
                # start, and earlier runs' commands would only add replay time.
                bootstrap = await kafka_broker(per_run, args, work / f"kafka-{index}")
                await ensure_topics(KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench"))
                database_url = await per_run.enter_async_context(fresh_database(server_url))
                runs.append(await _run_once(args, database_url, bootstrap, model_dir, work))
            run = runs[-1]
            print(
                f"run {index + 1}/{args.runs}: refused p50/p99 {percentile(run.refused_ms, 0.5):.0f}/{percentile(run.refused_ms, 0.99):.0f} ms "
                f"({len(run.refused_ms)} samples), last ack p50/p99 {percentile(run.acked_ms, 0.5):.0f}/{percentile(run.acked_ms, 0.99):.0f} ms, "
                f"apply p50 {percentile(run.apply_duration_ms, 0.5):.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        return runs


def render_markdown(args, runs: list[InvalidationRun]) -> str:
    median = statistics.median

    def row(label: str, values_of, target: str = "") -> str:
        p50 = median(percentile(values_of(r), 0.5) for r in runs)
        p99 = median(percentile(values_of(r), 0.99) for r in runs)
        return f"| {label} | {p50:,.1f} | {p99:,.1f} | {target} |"

    first = runs[0]
    return "\n".join(
        [
            "## Invalidation latency (`kvledger bench invalidation`)",
            "",
            f"Command: `kvledger bench invalidation --runs {args.runs} --rate {args.rate:g} --blocks-per-node {args.blocks_per_node} "
            f"--events {args.events} --warmup-s {args.warmup_s:g} --probe-interval-ms {args.probe_interval_ms:g}` on {platform.machine()}, {os.cpu_count()} cores, embedded Postgres + Tansu on the same machine, "
            f"coordinator consumers in their own process, {NUM_NODES} nodes (tiny model, one torch thread) in the benchmark process. "
            f"Each node holds {first.blocks_per_node:,} tenant-scope blocks over {first.blocks_per_node / first.blocks_per_event:,.0f} documents "
            f"({first.blocks_per_event:.1f} blocks each); every `DocumentUpdated` (plain aiokafka, raw JSON) supersedes one document. "
            f"The measured events follow {args.warmup_s:g} s of warm-up events at the same rate (same stream, not in any statistic: "
            f"the first batches after start pay for cold plan and buffer caches). "
            f"Times from the moment before the send; median over {len(runs)} runs of each run's percentile.",
            "",
            "| publish → | p50 ms | p99 ms | target |",
            "|---|---:|---:|---|",
            row(
                "first refused request (409 over HTTP)",
                lambda r: r.refused_ms,
                f"p99 ≤ {TARGET_P99_MS:.0f}",
            ),
            row("coordinator decision (invalidation row)", lambda r: r.decided_ms),
            row("command reached the last node (apply starts)", lambda r: r.reached_ms),
            row("applied on the last node", lambda r: r.applied_ms),
            row("last node's ack received", lambda r: r.acked_ms, f"p99 ≤ {TARGET_P99_MS:.0f}"),
            row("invalidation complete in the ledger", lambda r: r.complete_ms),
            "",
            "| per run (median) | value |",
            "|---|---:|",
            f"| node apply duration p50 / p99 (batch start → command complete, one node) | {median(percentile(r.apply_duration_ms, 0.5) for r in runs):.1f} / "
            f"{median(percentile(r.apply_duration_ms, 0.99) for r in runs):.1f} ms |",
            f"| slower node's sustained rate (commands / span of its applies) | {median(r.node_commands_per_s for r in runs):,.0f} /s |",
            f"| refusal samples per run (probed events) | {median(len(r.refused_ms) for r in runs):,.0f} |",
            f"| refusals by 409 / by a miss | {median(r.num_refused_by_409 for r in runs):,.0f} / {median(r.num_refused_by_miss for r in runs):,.0f} |",
            f"| late-block re-issues | {median(r.num_late_reissues for r in runs):,.0f} |",
            f"| first measured publish → last invalidation complete | {median(r.elapsed_s for r in runs):.1f} s for {first.num_events:,} events |",
            "",
        ]
    )


def cli(args: argparse.Namespace) -> int:
    return run_and_report(args, _run, render_markdown)
