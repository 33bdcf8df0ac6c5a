"""``kvledger bench replicas``: a prefix pulled from the peer holding it vs recomputed vs a local hit.

Two node processes of one :class:`bench.cluster.Cluster` (real coordinator, key service and node
registry, embedded PostgreSQL and broker) that list each other as peers. Per prompt size and run,
with a tenant of its own (so nothing is cached anywhere before):

1. node 0 computes the prompt (**recompute**, a full miss);
2. node 0 again (**local hit**);
3. node 1 with the pull hint naming node 0 (**pulled**: node 1 pulls the blocks, then computes the rest).

Each time is the whole response of a ``max_tokens=1`` request (prefill plus one token: the time to
first token as a client sees it). The pull's own time and blocks come from node 1's
``kvledger_peer_pull_seconds`` and ``kvledger_peer_pulled_blocks_total``; its throughput is those
blocks' KV bytes over that time, next to a raw loopback TCP transfer of the same bytes in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.cluster import Cluster, ClusterConfig
from bench.common import run_and_report
from events.pull_hint import PULL_BLOCKS_HEADER, PULL_FROM_HEADER
from kvledger.model_init import build_tiny_model, is_complete

METRICS_TOKEN = secrets.token_urlsafe(24)


@dataclass(frozen=True)
class ReplicaRun:
    prompt_tokens: int
    recompute_s: float
    local_hit_s: float
    pulled_s: float
    cached_after_pull: int
    pull_s: float
    pulled_bytes: int
    loopback_s: float


def _prompt(num_words: int) -> list[dict]:
    text = " ".join(
        f"clause {i} of the handbook says item {i % 97} applies" for i in range(num_words // 8 + 1)
    )
    return [
        {"role": "system", "content": text, "cache_scope": "tenant"},
        {"role": "user", "content": "Summarise."},
    ]


async def _ask(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    token: str,
    messages: list[dict],
    headers: dict | None = None,
) -> tuple[float, dict]:
    started = time.perf_counter()
    response = await client.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 1, "temperature": 0},
        headers={"Authorization": f"Bearer {token}"} | (headers or {}),
    )
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()["usage"]


async def _metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    text = (
        await client.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    ).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _loopback_s(num_bytes: int) -> float:
    """Seconds to send ``num_bytes`` over a loopback TCP connection and have the receiver read them
    all into memory.

    Blocking sockets on two threads, the receiver reading into one preallocated buffer: what the
    kernel's loopback moves, the reference a pull is held against (an asyncio stream reader,
    which buffers and copies, made a fifth of this rate here).
    """
    payload = secrets.token_bytes(num_bytes)
    received = bytearray(num_bytes)
    received_bytes: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def receive() -> None:
            connection, _ = server.accept()
            with connection:
                view, num_read = memoryview(received), 0
                while num_read < num_bytes:
                    got = connection.recv_into(view[num_read:])
                    if not got:
                        break
                    num_read += got
            received_bytes.append(num_read)

        receiver = threading.Thread(target=receive)
        receiver.start()
        started = time.perf_counter()
        with socket.create_connection(server.getsockname()) as sender:
            sender.sendall(payload)
            receiver.join()
        elapsed = time.perf_counter() - started
    if received_bytes != [num_bytes]:
        raise ConnectionError(f"the loopback receiver read {received_bytes} of {num_bytes} bytes")
    return elapsed


async def _run(args: argparse.Namespace) -> list[ReplicaRun]:
    model_dir = Path(args.model_dir)
    if not is_complete(model_dir):
        await asyncio.to_thread(build_tiny_model, model_dir)
    runs: list[ReplicaRun] = []
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-replicas-") as work:
        config = ClusterConfig(
            num_nodes=2,
            peers=True,
            node_metrics_token=METRICS_TOKEN,
            num_device_blocks=args.device_blocks,
            num_host_blocks=0,
        )
        async with (
            Cluster(Path(work), model_dir, config) as cluster,
            httpx.AsyncClient(timeout=600) as client,
        ):
            holder, puller = cluster.nodes[0].url, cluster.nodes[1].url
            model = (
                await client.get(
                    f"{holder}/v1/models",
                    headers={"Authorization": f"Bearer {cluster.user_token('t', 'u')}"},
                )
            ).json()["data"][0]["id"]
            stats = (
                await client.get(
                    f"{holder}/v1/cache/stats", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
                )
            ).json()
            block_size, block_bytes = stats["block_size"], stats["block_bytes"]
            for num_words in args.sizes:
                messages = _prompt(num_words)
                for _ in range(args.runs):
                    token = cluster.user_token(f"bench-{uuid.uuid4().hex[:8]}", "reader")
                    recompute_s, usage = await _ask(client, holder, model, token, messages)
                    local_hit_s, _ = await _ask(client, holder, model, token, messages)
                    num_blocks = usage["prompt_tokens"] // block_size
                    pull_before = await _metric(client, puller, "kvledger_peer_pull_seconds_sum")
                    blocks_before = await _metric(
                        client, puller, "kvledger_peer_pulled_blocks_total"
                    )
                    hint = {
                        PULL_FROM_HEADER: cluster.node_ids[0],
                        PULL_BLOCKS_HEADER: str(num_blocks),
                    }
                    pulled_s, pulled_usage = await _ask(
                        client, puller, model, token, messages, hint
                    )
                    pull_s = (
                        await _metric(client, puller, "kvledger_peer_pull_seconds_sum")
                        - pull_before
                    )
                    pulled_blocks = int(
                        await _metric(client, puller, "kvledger_peer_pulled_blocks_total")
                        - blocks_before
                    )
                    runs.append(
                        ReplicaRun(
                            usage["prompt_tokens"],
                            recompute_s,
                            local_hit_s,
                            pulled_s,
                            pulled_usage["prompt_tokens_details"]["cached_tokens"],
                            pull_s,
                            pulled_blocks * block_bytes,
                            await asyncio.to_thread(
                                _loopback_s, max(pulled_blocks * block_bytes, 1)
                            ),
                        )
                    )
    return runs


def render_markdown(args: argparse.Namespace, runs: list[ReplicaRun]) -> str:
    lines = [
        f"`kvledger bench replicas --model {args.model_dir} --sizes {','.join(map(str, args.sizes))} --runs {args.runs}`"
        " (medians over the runs)",
        "",
        "| prompt tokens | recompute | local hit | pulled | cached after pull | pull | pulled KV | pull throughput | raw loopback | pull / loopback |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sorted({run.prompt_tokens for run in runs}):
        of_size = [run for run in runs if run.prompt_tokens == size]

        def median(field: str, of_size: list[ReplicaRun] = of_size) -> float:
            return statistics.median(getattr(run, field) for run in of_size)

        pull_rate = median("pulled_bytes") / median("pull_s") if median("pull_s") > 0 else 0.0
        loop_rate = median("pulled_bytes") / median("loopback_s")
        lines.append(
            f"| {size} | {median('recompute_s') * 1e3:.1f} ms | {median('local_hit_s') * 1e3:.1f} ms | {median('pulled_s') * 1e3:.1f} ms"
            f" | {median('cached_after_pull'):.0f} | {median('pull_s') * 1e3:.1f} ms | {median('pulled_bytes') / 1e6:.2f} MB"
            f" | {pull_rate / 1e6:.0f} MB/s | {loop_rate / 1e6:.0f} MB/s | {pull_rate / loop_rate:.0%} |"
        )
    return "\n".join(lines) + "\n"


def cli(args: argparse.Namespace) -> int:
    if args.runs < 1 or not args.sizes or min(args.sizes) < 16:
        raise SystemExit("--runs must be >= 1 and every size >= 16 words")
    return run_and_report(args, _run, render_markdown)
