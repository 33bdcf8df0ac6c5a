"""``kvledger bench ledger``: block events per second from publish to committed
ledger rows, and per-record consumer lag, against a raw asyncpg COPY (the
headline ratio) and a raw asyncpg bulk INSERT of the same rows into the same
database server, in the same run.

The coordinator's consumers run as a separate process (as in production), so the
producer, broker, consumer and Postgres share this machine's cores the way a
one-box deployment would. Each run uses a freshly migrated database.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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
)
from coordinator.consumers import consumer_groups
from coordinator.handlers.ingest import LedgerIngest
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorKafkaSettings, DatabaseSettings
from events import schema
from events.codec import decode_event, encode_event
from events.kafka.admin import ensure_topics
from events.kafka.consumer import ConsumedEvent
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.topics import KV_EVENTS
from identity.signing import EnvelopeSigner, sign_envelope, signature_problem

NUM_NODES = 4
NAMESPACE = "bench-namespace"
RECORDS_PER_SEND = 20
CONSUMER_BATCH_RECORDS = CoordinatorKafkaSettings.model_fields["max_batch_records"].default
"""The largest batch the coordinator's kv-events consumer hands over (its default
``kafka.max_batch_records``)."""
POLL_INTERVAL_S = 0.01
TIMEOUT_S = 600.0


def _block(index: int, node: int, run_id: str) -> schema.StoredBlock:
    digest = uuid.uuid5(uuid.NAMESPACE_URL, f"{run_id}/{node}/{index}").hex
    return schema.StoredBlock(
        block_hash=digest * 2,
        parent_hash=None,
        namespace=NAMESPACE,
        tenant_id=None,
        scope="public",
        auth_scopes=[],
        subject_id=None,
        documents=[],
        token_offset=index * 16,
        created_at=datetime.now(UTC),
        tier="device",
    )


def _workload(
    num_events: int, blocks_per_record: int, run_id: str
) -> dict[str, list[schema.BlockStored]]:
    """Per node: BlockStored records of ``blocks_per_record`` blocks, seq 1, 2, …"""
    per_node = num_events // NUM_NODES
    records: dict[str, list[schema.BlockStored]] = {}
    for node in range(NUM_NODES):
        node_id = f"bench-{run_id}-{node}"
        records[node_id] = [
            schema.BlockStored(
                node_id=node_id,
                epoch=1,
                seq=seq,
                blocks=[
                    _block(i, node, run_id)
                    for i in range(start, min(start + blocks_per_record, per_node))
                ],
            )
            for seq, start in enumerate(range(0, per_node, blocks_per_record), start=1)
        ]
    return records


async def _live_counts(connection: asyncpg.Connection) -> dict[str, int]:
    rows = await connection.fetch(
        "SELECT node_id, count(*) AS n FROM placements WHERE state = 'live' GROUP BY node_id"
    )
    return {row["node_id"]: row["n"] for row in rows}


@dataclass
class LedgerRun:
    num_events: int
    end_to_end_events_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    raw_insert_rows_per_s: float
    raw_copy_rows_per_s: float
    apply_events_per_s: float
    decode_ms_per_record: float
    verify_ms_per_record: float
    sign_ms_per_record: float
    parse_ms_per_record: float
    """The same records decoded by the contract's pydantic ``schema.parse_event`` (the consumer's
    ``decode_event`` reads kv-events with the compiled decoder, ``events.kv_decoder``)."""


def _cpu_per_record(num_events: int, blocks_per_record: int) -> tuple[float, float, float, float]:
    """Process CPU ms per record of the workload's records for the consumer's decode and signature
    check, the node's signing, and pydantic's decode of the same records: CPU time, so other
    processes on the machine barely move it."""
    records = [
        record
        for group in _workload(num_events, blocks_per_record, uuid.uuid4().hex[:8]).values()
        for record in group
    ]
    key = Ed25519PrivateKey.generate()
    started = time.process_time()
    signed = [sign_envelope(schema.make_event(record), key) for record in records]
    sign_s = time.process_time() - started
    values = [encode_event(envelope) for envelope in signed]
    # Each decoder is timed with only its own results alive: the collector's work grows with live
    # objects.
    started = time.process_time()
    parsed = [schema.parse_event(value) for value in values]
    parse_s = time.process_time() - started
    assert parsed == [decode_event(value) for value in values], (
        "the compiled decoder must decode the bench's records as the contract does"
    )
    del parsed
    started = time.process_time()
    decoded = [decode_event(value) for value in values]
    decode_s = time.process_time() - started
    started = time.process_time()
    problems = [signature_problem(envelope, key.public_key()) for envelope in decoded]
    verify_s = time.process_time() - started
    assert problems == [None] * len(records), "the bench's own signatures must verify"
    ms_per_s_record = 1000 / len(records)
    return (
        decode_s * ms_per_s_record,
        verify_s * ms_per_s_record,
        sign_s * ms_per_s_record,
        parse_s * ms_per_s_record,
    )


async def _end_to_end(
    database_url: str, kafka: KafkaSettings, num_events: int, blocks_per_record: int
) -> tuple[float, list[float], int]:
    run_id = uuid.uuid4().hex[:8]
    workload = _workload(num_events, blocks_per_record, run_id)
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-keys-") as keys_dir:
        keys = BenchKeys(Path(keys_dir))
        # Each bench node signs its records with its own enrolled key, as a real node does.
        node_keys = {
            node_id: await keys.enroll(database_url, node_id, Path(keys_dir) / node_id)
            for node_id in workload
        }

    def sign_as_node(envelope: schema.Envelope) -> schema.Envelope:
        return sign_envelope(envelope, node_keys[envelope.payload.node_id])

    group = f"bench-{run_id}"
    # A fresh group would start at the beginning of the shared topic and re-read (and dead-letter:
    # their nodes are not enrolled here) every earlier run's records while this run is measured.
    await start_groups_at_end(kafka.bootstrap, consumer_groups(group))
    env = coordinator_env(
        database_url,
        kafka.bootstrap,
        group,
        os.environ.get("KVLEDGER_JWT_SECRET", "bench-secret-" + "x" * 32),
        **keys.coordinator_env(),
    )
    with tempfile.TemporaryFile() as log:
        consumers = subprocess.Popen(
            [sys.executable, "-m", "kvledger.cli", "coordinator", "--role", "consumers"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        connection = await asyncpg.connect(**connect_kwargs(database_url))
        try:
            async with EventProducer(kafka, sign=sign_as_node) as producer:
                await producer.send_many(
                    schema.make_event(
                        schema.NodeStarted(node_id=node_id, epoch=1, seq=0, namespace=NAMESPACE)
                    )
                    for node_id in workload
                )
                # the consumer is up and has applied the starts: every node row exists
                await _wait(lambda: _count_nodes(connection, list(workload)), len(workload))
                interleaved = [
                    record for group in zip(*workload.values(), strict=False) for record in group
                ]
                targets: list[tuple[str, int, float]] = []  # node, seq of the record, publish time
                started = time.perf_counter()
                for offset in range(0, len(interleaved), RECORDS_PER_SEND):
                    chunk = interleaved[offset : offset + RECORDS_PER_SEND]
                    await producer.send_many(schema.make_event(record) for record in chunk)
                    published = time.perf_counter()
                    targets.extend((record.node_id, record.seq, published) for record in chunk)
            lags, pending = [], list(targets)
            deadline = time.perf_counter() + TIMEOUT_S
            while pending:
                # A record's rows are committed with its node's last_seq (one transaction): watching
                # 4 rows keeps the probe off the database the ingest is measured on (counting live
                # placements every 10 ms took a large share of a core from it).
                applied = await _applied_seqs(connection, list(workload))
                now = time.perf_counter()
                lags.extend(
                    (now - at) * 1000 for node, seq, at in pending if applied.get(node, -1) >= seq
                )
                pending = [
                    (node, seq, at) for node, seq, at in pending if applied.get(node, -1) < seq
                ]
                if now > deadline:
                    raise TimeoutError(f"ledger did not catch up within {TIMEOUT_S}s")
                if pending:
                    await asyncio.sleep(POLL_INTERVAL_S)
            elapsed_s = time.perf_counter() - started
            total = sum(len(record.blocks) for record in interleaved)
            live = await _live_counts(connection)
            expected = {
                node_id: sum(len(record.blocks) for record in records)
                for node_id, records in workload.items()
            }
            assert live == expected, f"live placements {live} after ingest, expected {expected}"
        finally:
            await connection.close()
            consumers.terminate()
            consumers.wait(timeout=60)
    return total / elapsed_s, lags, total


async def _applied_seqs(connection: asyncpg.Connection, node_ids: list[str]) -> dict[str, int]:
    rows = await connection.fetch(
        "SELECT node_id, last_seq FROM nodes WHERE node_id = ANY($1::text[])", node_ids
    )
    return {row["node_id"]: row["last_seq"] for row in rows}


async def _count_nodes(connection: asyncpg.Connection, node_ids: list[str]) -> int:
    return await connection.fetchval(
        "SELECT count(*) FROM nodes WHERE node_id = ANY($1::text[])", node_ids
    )


async def _wait(probe, expected: int) -> None:
    deadline = time.perf_counter() + 120
    while await probe() < expected:
        if time.perf_counter() > deadline:
            raise TimeoutError("coordinator consumers did not start")
        await asyncio.sleep(0.05)


async def _apply_only(database_url: str, num_events: int, blocks_per_record: int) -> float:
    """The coordinator's batch handler alone on already decoded, verified records (no broker, no
    consumer process), in batches of the consumer's default size: the database side of ingest."""
    run_id = uuid.uuid4().hex[:8]
    workload = _workload(num_events, blocks_per_record, run_id)
    database = Database(DatabaseSettings(url=database_url), pre_ping=False)
    try:
        ingest = LedgerIngest(
            database,
            inventory_retry_s=60.0,
            command_signer=EnvelopeSigner(Ed25519PrivateKey.generate()),
        )
        starts = [
            schema.make_event(
                schema.NodeStarted(node_id=node_id, epoch=1, seq=0, namespace=NAMESPACE)
            )
            for node_id in workload
        ]
        records = [
            schema.make_event(record)
            for group in zip(*workload.values(), strict=False)
            for record in group
        ]
        events = [
            ConsumedEvent(
                topic=KV_EVENTS,
                partition=0,
                offset=offset,
                key=envelope.payload.node_id,
                timestamp_ms=0,
                envelope=envelope,
            )
            for offset, envelope in enumerate([*starts, *records])
        ]
        await ingest(events[: len(starts)])
        started = time.perf_counter()
        for offset in range(len(starts), len(events), CONSUMER_BATCH_RECORDS):
            await ingest(events[offset : offset + CONSUMER_BATCH_RECORDS])
        return sum(len(record.payload.blocks) for record in records) / (
            time.perf_counter() - started
        )
    finally:
        await database.dispose()


async def _raw_baseline(
    database_url: str, num_events: int, blocks_per_record: int, use_copy: bool
) -> float:
    """The same block + placement rows written straight through asyncpg (no broker, no consumer)."""
    run_id = uuid.uuid4().hex[:8]
    workload = _workload(num_events, blocks_per_record, run_id)
    connection = await asyncpg.connect(**connect_kwargs(database_url))
    try:
        await connection.execute(
            "INSERT INTO namespaces (namespace) VALUES ($1) ON CONFLICT DO NOTHING", NAMESPACE
        )
        await connection.executemany(
            "INSERT INTO nodes (node_id, epoch, last_seq) VALUES ($1, 1, 0)",
            [(node_id,) for node_id in workload],
        )
        blocks, placements = [], []
        for node_id, records in workload.items():
            for record in records:
                for block in record.blocks:
                    block_hash = bytes.fromhex(block.block_hash)
                    blocks.append(
                        (
                            block_hash,
                            None,
                            NAMESPACE,
                            None,
                            "public",
                            None,
                            block.token_offset,
                            block.created_at,
                        )
                    )
                    placements.append((block_hash, node_id, "device", None, "live", 1, None))
        started = time.perf_counter()
        for offset in range(0, len(blocks), blocks_per_record * 500):
            end = offset + blocks_per_record * 500
            async with connection.transaction():
                if use_copy:
                    await connection.copy_records_to_table(
                        "blocks",
                        records=blocks[offset:end],
                        columns=[
                            "block_hash",
                            "parent_hash",
                            "namespace",
                            "tenant_id",
                            "scope",
                            "subject_hash",
                            "token_offset",
                            "created_at",
                        ],
                    )
                    await connection.copy_records_to_table(
                        "placements",
                        records=placements[offset:end],
                        columns=[
                            "block_hash",
                            "node_id",
                            "tier",
                            "snapshot_id",
                            "state",
                            "epoch",
                            "reason",
                        ],
                    )
                else:
                    await connection.executemany(
                        "INSERT INTO blocks (block_hash, parent_hash, namespace, tenant_id, scope, subject_hash, token_offset, created_at)"
                        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
                        blocks[offset:end],
                    )
                    await connection.executemany(
                        "INSERT INTO placements (block_hash, node_id, tier, snapshot_id, state, epoch, reason)"
                        " VALUES ($1, $2, $3, $4, $5, $6, $7)",
                        placements[offset:end],
                    )
        return len(blocks) / (time.perf_counter() - started)
    finally:
        await connection.close()


async def _run(args) -> list[LedgerRun]:
    async with contextlib.AsyncExitStack() as stack:
        work = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-ledger-"))
        )
        server_url = await database_server(stack, args, work / "postgres")
        bootstrap = await kafka_broker(stack, args, work / "kafka")
        kafka = KafkaSettings(bootstrap=bootstrap, client_id="kvledger-bench")
        await ensure_topics(kafka)
        runs = []
        for _ in range(args.runs):
            async with fresh_database(server_url) as url:
                events_per_s, lags, total = await _end_to_end(
                    url, kafka, args.events, args.blocks_per_record
                )
            async with fresh_database(server_url) as url:
                insert_rows_per_s = await _raw_baseline(
                    url, args.events, args.blocks_per_record, use_copy=False
                )
            async with fresh_database(server_url) as url:
                copy_rows_per_s = await _raw_baseline(
                    url, args.events, args.blocks_per_record, use_copy=True
                )
            async with fresh_database(server_url) as url:
                apply_events_per_s = await _apply_only(url, args.events, args.blocks_per_record)
            runs.append(
                LedgerRun(
                    total,
                    events_per_s,
                    percentile(lags, 0.5),
                    percentile(lags, 0.99),
                    insert_rows_per_s,
                    copy_rows_per_s,
                    apply_events_per_s,
                    *_cpu_per_record(args.events, args.blocks_per_record),
                )
            )
            print(runs[-1], file=sys.stderr, flush=True)
        return runs


def _git_revision() -> str:
    """The checkout's short commit (``+dirty`` with uncommitted changes); ``unknown`` outside a git
    checkout."""
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + ("+dirty" if dirty.strip() else "")


def render_markdown(args, runs: list[LedgerRun]) -> str:
    median = statistics.median
    e2e = median(r.end_to_end_events_per_s for r in runs)
    insert = median(r.raw_insert_rows_per_s for r in runs)
    copy = median(r.raw_copy_rows_per_s for r in runs)
    ratios_copy = [r.end_to_end_events_per_s / r.raw_copy_rows_per_s for r in runs]
    ratio_insert = median(r.end_to_end_events_per_s / r.raw_insert_rows_per_s for r in runs)
    load_1m, load_5m, load_15m = os.getloadavg()
    return "\n".join(
        [
            "## Ledger ingest (`kvledger bench ledger`)",
            "",
            f"Command: `kvledger bench ledger --runs {args.runs} --events {args.events} --blocks-per-record {args.blocks_per_record}` "
            f"on {platform.machine()}, {os.cpu_count()} cores, embedded Postgres + Tansu on the same machine, coordinator consumers "
            f"in their own process; git {_git_revision()}, load average at the end {load_1m:.2f} / {load_5m:.2f} / {load_15m:.2f} "
            f"(1 / 5 / 15 min). {runs[0].num_events} block events per run over {NUM_NODES} nodes; median of {len(runs)} runs; "
            "each ratio is taken within one run.",
            "",
            "| metric | value | target |",
            "|---|---:|---|",
            f"| **end to end / raw COPY of the same rows** (per run: {', '.join(f'{r * 100:.0f} %' for r in ratios_copy)}) "
            f"| **{median(ratios_copy) * 100:.0f} %** | ≥ 70 % |",
            f"| end to end (publish → committed ledger rows) | {e2e:,.0f} block events/s | |",
            f"| consumer lag p50 / p99 (per record, publish → visible) | {median(r.lag_p50_ms for r in runs):,.0f} / "
            f"{median(r.lag_p99_ms for r in runs):,.0f} ms | |",
            f"| raw asyncpg COPY of the same rows (upper bound) | {copy:,.0f} rows/s | |",
            f"| raw asyncpg bulk INSERT (executemany) of the same rows | {insert:,.0f} rows/s | |",
            f"| end to end / raw INSERT | {ratio_insert * 100:.0f} % | |",
            f"| ledger apply alone (the batch handler on decoded records, no broker) / raw COPY | "
            f"{median(r.apply_events_per_s / r.raw_copy_rows_per_s for r in runs) * 100:.0f} % "
            f"({median(r.apply_events_per_s for r in runs):,.0f} block events/s) | |",
            f"| CPU per {args.blocks_per_record}-block record: consumer decode / signature check, node signing | "
            f"{median(r.decode_ms_per_record for r in runs):.2f} / {median(r.verify_ms_per_record for r in runs):.2f} ms, "
            f"{median(r.sign_ms_per_record for r in runs):.2f} ms | |",
            f"| consumer decode: compiled (`events.kv_decoder`) / pydantic (`schema.parse_event`) | "
            f"{1000 / median(r.decode_ms_per_record for r in runs):,.0f} / {1000 / median(r.parse_ms_per_record for r in runs):,.0f} "
            "records/s | |",
            "",
        ]
    )


def cli(args: argparse.Namespace) -> int:
    return run_and_report(args, _run, render_markdown)
