"""``kvledger bench routing``: what the router's index costs per core.

* **lookups/s**: ``PrefixIndex.match`` over a prompt's block keys (``--blocks``, 30 by default)
  against an index of ``--nodes`` nodes (8) holding groups of prompts that share long prefixes
  (every prompt's first two thirds are its group's), each prompt cached on two nodes up to a random
  depth in a random tier: the runs of every node that holds the prompt's first block. Keys are
  chained as ``prefix_keys`` chains them (each block's ``BlockStored`` names its parent), so the
  index looks them up along its recorded chains.
* **decisions/s**: the lookup and ``PrefixLoadStrategy.rank`` over all nodes (what a request costs
  before it is proxied).
* **events/s**: ``PrefixIndex.apply`` of verified ``BlockStored`` records of 50 blocks (block events
  per second; signature checks and decoding are the consumer's, measured by ``bench ledger``).

CPU time of this process (``time.process_time``), so a busy machine's other work is not counted;
one core. A reference row times a bare ``dict.get`` over the same keys, the floor of any exact
Python index on this machine.

``--fleet``: instead, a real ``kvledger up --nodes N --tiny`` (bounded device tiers, no host or disk
tier) and an llm-d-like workload: ``--groups`` groups of ``--users`` users, each group sharing a
long prefix (its tenant-scope system prompt), each user asking ``--questions`` questions of its own
(user scope), in a random order arriving as a Poisson process of ``--rate`` requests/s, streamed.
The same workload runs four times, one strategy after another, each with tenants of its own (so
none reuses another's blocks): round-robin over the nodes, least-loaded (fewest of this client's
requests in flight), a fixed node per group (client affinity, the reference) and the router.
Reported per strategy: the share of prompt tokens served from cache, TTFT p50/p90, requests and
output tokens per second, requests per node; then the router's own cost: a warm hit through the
router against the same request straight to the node that served it, alternately, p50/p99.
The stack's nodes list each other as peers, so a request the router sends past an overloaded
holder carries a pull hint and the node pulls the prefix (prefix-aware load balancing with
transfer): each strategy's row counts the fleet's pulls, the blocks they brought, and the pulls that
fell back to computing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.common import run_and_report
from events.schema import BlockStored, NodeStarted, StoredBlock
from kvledger.processes import Process, spawn_cli
from router.index import PrefixIndex
from router.scoring import Candidate, PrefixLoadStrategy

CREATED_AT = datetime(2026, 1, 1, tzinfo=UTC)
NUM_PROMPTS = 2000
NUM_GROUPS = 50
NUM_QUERIES = 1000
NAMESPACE_ROOT = hashlib.sha256(b"bench-namespace").hexdigest()
"""The parent of every prompt's first block (a real chain starts at its namespace's root)."""


def _hash(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def _block(block_hash: str, parent_hash: str, tier: str) -> StoredBlock:
    return StoredBlock(
        block_hash=block_hash,
        parent_hash=parent_hash,
        namespace="ns",
        tenant_id=None,
        scope="public",
        auth_scopes=[],
        subject_id=None,
        documents=[],
        token_offset=0,
        created_at=CREATED_AT,
        tier=tier,
    )


def _fill(
    args: argparse.Namespace, rng: random.Random
) -> tuple[PrefixIndex, list[list[bytes]], float]:
    """The index, the queries, and the block events/s of filling it."""
    index = PrefixIndex()
    shared = args.blocks * 2 // 3
    prompts = []
    for p in range(NUM_PROMPTS):
        keys = [NAMESPACE_ROOT]  # chained as prefix_keys chains them: each key names its parent
        for i in range(args.blocks):
            keys.append(
                _hash(keys[-1], "g", p % NUM_GROUPS, i)
                if i < shared
                else _hash(keys[-1], "p", p, i)
            )
        prompts.append(keys)
    for node in range(args.nodes):
        index.apply(NodeStarted(node_id=f"node-{node}", epoch=1, seq=0, namespace="ns"), 0.0)
    seqs = [0] * args.nodes
    records = []
    for keys in prompts:
        for node in rng.sample(range(args.nodes), 2):
            tier = rng.choice(["device", "device", "host", "disk"])
            depth = rng.randint(1, args.blocks)
            blocks = [_block(keys[i + 1], keys[i], tier) for i in range(depth)]
            for start in range(0, len(blocks), 50):
                seqs[node] += 1
                records.append(
                    BlockStored(
                        node_id=f"node-{node}",
                        epoch=1,
                        seq=seqs[node],
                        blocks=blocks[start : start + 50],
                    )
                )
    started = time.process_time()
    for record in records:
        index.apply(record, 0.0)
    events_per_s = sum(len(record.blocks) for record in records) / (time.process_time() - started)
    queries = [
        [bytes.fromhex(block_hash) for block_hash in rng.choice(prompts)[1:]]
        for _ in range(NUM_QUERIES)
    ]
    return index, queries, events_per_s


def _per_s(call, queries: list[list[bytes]], num_calls: int) -> float:
    started = time.process_time()
    for position in range(num_calls):
        call(queries[position % NUM_QUERIES])
    return num_calls / (time.process_time() - started)


async def _run(args: argparse.Namespace) -> list[dict[str, float]]:
    rng = random.Random(0)
    index, queries, _ = _fill(args, rng)
    candidates = [Candidate(f"node-{node}", 0.0) for node in range(args.nodes)]
    strategy = PrefixLoadStrategy()
    blocks = index._blocks  # the reference: a bare dict lookup of every key
    runs = []
    for _ in range(args.runs):
        _, _, events_per_s = _fill(args, random.Random(1))
        runs.append(
            {
                "lookups_per_s": _per_s(index.match, queries, args.lookups),
                "decisions_per_s": _per_s(
                    lambda keys: strategy.rank(candidates, index.match(keys)),
                    queries,
                    args.lookups // 4,
                ),
                "dict_gets_per_s": _per_s(
                    lambda keys: list(map(blocks.get, keys)), queries, args.lookups
                ),
                "events_per_s": events_per_s,
                "nodes_matched": statistics.fmean(len(index.match(keys)) for keys in queries),
            }
        )
    return runs


def _render(args: argparse.Namespace, runs: list[dict[str, float]]) -> str:
    def cell(name: str) -> str:
        values = [run[name] for run in runs]
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"

    lines = [
        f"Router index, {args.blocks} blocks per prompt over {args.nodes} nodes ({runs[0]['nodes_matched']:.1f} nodes matched per lookup), "
        f"one core of {platform.processor() or platform.machine()}, Python {platform.python_version()}; median (min–max) of {len(runs)} runs",
        "",
        "| measure | per second |",
        "|---|---|",
        f"| index lookups (`PrefixIndex.match`) | {cell('lookups_per_s')} |",
        f"| routing decisions (lookup + `PrefixLoadStrategy.rank`) | {cell('decisions_per_s')} |",
        f"| reference: bare `dict.get` of every key | {cell('dict_gets_per_s')} |",
        f"| block events applied (`BlockStored`, 50 blocks each) | {cell('events_per_s')} |",
    ]
    return "\n".join(lines) + "\n"


QUESTIONS = (
    "How many vacation days do I get?",
    "Who approves my leave?",
    "Can I carry days over?",
    "What about sick days?",
)
STRATEGIES = ("round-robin", "least-loaded", "affinity", "router")
NUM_LATENCY_PAIRS = 40
NUM_WARMUP_TRIES = 20


def _shared_prompt(group: int) -> str:
    """A group's long shared prefix (a system prompt with its handbook): about 500 tokens of the tiny model."""
    clause = f"Section {group}: employees of unit {group} accrue leave monthly, approved by their manager, carried over up to five days. "
    return clause * 24


def _free_port() -> int:
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if 1200 < port < 65_000 and all(_port_free(port + offset) for offset in (-100, 1, 2, 100)):
            return port
    raise RuntimeError("no free ports for the stack")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _stack(state_dir: Path, num_nodes: int, device_blocks: int) -> tuple[Process, dict]:
    env = {
        name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")
    } | {
        "KVLEDGER_NODE_CACHE__NUM_DEVICE_BLOCKS": str(device_blocks),
        "KVLEDGER_NODE_CACHE__HOST_MEMORY_BYTES": "0",
        "KVLEDGER_NODE_CACHE__DISK_BYTES": "0",
    }
    args = ["up", "--tiny", "--nodes", str(num_nodes), "--state-dir", str(state_dir)]
    args += ["--model", str(state_dir / "model"), "--port", str(_free_port())]
    process = spawn_cli(args, env, None, new_session=True, dies_with_parent=False)
    deadline = time.monotonic() + 600
    while not (state_dir / "stack.json").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvledger up did not start (see {state_dir / 'logs'})")
        time.sleep(0.5)
    return process, json.loads((state_dir / "stack.json").read_text())


def _token(stack: dict, tenant: str, subject: str) -> str:
    from identity.tokens import issue_token

    return issue_token(
        tenant=tenant, sub=subject, scopes=["hr"], pv=0, ttl_s=3600, secret=stack["jwt_secret"]
    )


def _body(stack: dict, group: int, user: int, question: int, stream: bool) -> dict:
    """A user's request: the group's shared prefix (tenant scope), then the user's own question (user scope)."""
    return {
        "model": Path(stack["model_dir"]).name,
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        "messages": [
            {"role": "system", "content": _shared_prompt(group), "cache_scope": "tenant"},
            {
                "role": "user",
                "content": f"I am user {user}. {QUESTIONS[question]}",
                "cache_scope": "user",
            },
        ],
    }


def _workload(args: argparse.Namespace) -> list[tuple[float, int, int, int]]:
    """(arrival s, group, user, question): every user of every group asks ``--questions`` questions, in a random
    order, arriving as a Poisson process of ``--rate`` requests per second (the same for every strategy)."""
    rng = random.Random(0)
    requests = [
        (group, user, question % len(QUESTIONS))
        for group in range(args.groups)
        for user in range(args.users)
        for question in range(args.questions)
    ]
    rng.shuffle(requests)
    arrivals, now = [], 0.0
    for group, user, question in requests:
        arrivals.append((now, group, user, question))
        now += rng.expovariate(args.rate)
    return arrivals


async def _strategy_run(
    stack: dict, name: str, workload: list[tuple[float, int, int, int]], run_id: str
) -> dict[str, object]:
    """One strategy over the workload; each group is a tenant of this run alone, so no strategy reuses another's blocks."""
    node_urls, router_url = stack["node_urls"], stack["router_url"]
    in_flight = [0] * len(node_urls)
    turn = 0
    results: list[
        tuple[float, int, int, int, str]
    ] = []  # ttft s, cached, prompt, output tokens, node

    def pick(group: int) -> tuple[str, int | None]:
        nonlocal turn
        if name == "round-robin":
            turn += 1
            return node_urls[(turn - 1) % len(node_urls)], (turn - 1) % len(node_urls)
        if name == "least-loaded":
            position = min(
                range(len(node_urls)),
                key=lambda index: (in_flight[index], (index - turn) % len(node_urls)),
            )
            turn += 1
            return node_urls[position], position
        if name == "affinity":
            return node_urls[group % len(node_urls)], group % len(node_urls)
        return router_url, None

    async def one(
        http: httpx.AsyncClient, at: float, group: int, user: int, question: int, started: float
    ) -> None:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        url, position = pick(group)
        if position is not None:
            in_flight[position] += 1
        headers = {
            "Authorization": f"Bearer {_token(stack, f'{run_id}-{name}-g{group}', f'user-{user}')}"
        }
        sent = time.perf_counter()
        ttft, usage = None, None
        try:
            async with http.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json=_body(stack, group, user, question, True),
                headers=headers,
            ) as answer:
                answer.raise_for_status()
                node = answer.headers.get("x-kvledger-node") or f"node-{position}"
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if ttft is None and chunk.get("choices"):
                        ttft = time.perf_counter() - sent
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        finally:
            if position is not None:
                in_flight[position] -= 1
        assert ttft is not None and usage is not None, "a stream without content or usage"
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        results.append((ttft, cached, usage["prompt_tokens"], usage["completion_tokens"], node))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        pulls_before = await _pull_counts(http, stack)
        started = time.perf_counter()
        await asyncio.gather(*(one(http, *request, started) for request in workload))
        elapsed_s = time.perf_counter() - started
        pulls_after = await _pull_counts(http, stack)
    ttfts = sorted(result[0] for result in results)
    per_node: dict[str, int] = {}
    for result in results:
        per_node[result[4]] = per_node.get(result[4], 0) + 1
    return {
        "client": name,
        "hit_ratio": sum(result[1] for result in results) / sum(result[2] for result in results),
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p90_s": _quantile(ttfts, 0.9),
        "requests_per_s": len(results) / elapsed_s,
        "output_tokens_per_s": sum(result[3] for result in results) / elapsed_s,
        "requests_per_node": dict(sorted(per_node.items())),
        "pulls": {name: pulls_after[name] - pulls_before[name] for name in pulls_after},
    }


PULL_SAMPLES = {
    "pulled": 'kvledger_peer_pulls_total{outcome="pulled"}',
    "blocks": "kvledger_peer_pulled_blocks_total",
}


async def _pull_counts(http: httpx.AsyncClient, stack: dict) -> dict[str, float]:
    """Every node's successful pulls and pulled blocks, and its pulls that fell back to computing
    (any other outcome), summed over the fleet (the nodes' ``/metrics``)."""
    counts = {"pulled": 0.0, "blocks": 0.0, "fell_back": 0.0}
    headers = {"Authorization": f"Bearer {stack['metrics_token']}"}
    for url in stack["node_urls"]:
        answer = await http.get(f"{url}/metrics", headers=headers)
        answer.raise_for_status()
        for line in answer.text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == PULL_SAMPLES["pulled"]:
                counts["pulled"] += float(value)
            elif name == PULL_SAMPLES["blocks"]:
                counts["blocks"] += float(value)
            elif name.startswith("kvledger_peer_pulls_total{"):
                counts["fell_back"] += float(value)
    return counts


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _added_latency(stack: dict, run_id: str) -> dict[str, object]:
    """A warm hit through the router against the same request straight to the node that served it,
    alternately."""
    headers = {"Authorization": f"Bearer {_token(stack, f'{run_id}-router-g0', 'user-0')}"}
    body = _body(stack, 0, 0, 0, False) | {"max_tokens": 1}
    through, direct = [], []
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(
            NUM_WARMUP_TRIES
        ):  # until the router's index has the first answer's blocks and routes to them
            warm = await http.post(
                f"{stack['router_url']}/v1/chat/completions", json=body, headers=headers
            )
            warm.raise_for_status()
            if warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"no warm hit through the router after {NUM_WARMUP_TRIES} tries")
        node = warm.headers["x-kvledger-node"]
        node_url = stack["node_urls"][int(node.rsplit("-", 1)[1])]
        for _ in range(NUM_LATENCY_PAIRS):
            for url, samples in ((stack["router_url"], through), (node_url, direct)):
                sent = time.perf_counter()
                answer = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                samples.append(time.perf_counter() - sent)
                answer.raise_for_status()
                assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (
                    "the latency pair must be a warm hit"
                )
    through.sort()
    direct.sort()
    return {
        "client": "added latency",
        "router_p50_s": _quantile(through, 0.5),
        "router_p99_s": _quantile(through, 0.99),
        "direct_p50_s": _quantile(direct, 0.5),
        "direct_p99_s": _quantile(direct, 0.99),
    }


async def _run_fleet(args: argparse.Namespace) -> list[dict[str, object]]:
    workload = _workload(args)
    run_id = f"bench-{uuid_suffix()}"
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-routing-") as scratch:
        process, stack = _stack(Path(scratch), args.fleet_nodes, args.device_blocks)
        try:
            runs = [await _strategy_run(stack, name, workload, run_id) for name in STRATEGIES]
            return [*runs, await _added_latency(stack, run_id)]
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)


def uuid_suffix() -> str:
    return os.urandom(3).hex()


def _render_fleet(args: argparse.Namespace, runs: list[dict[str, object]]) -> str:
    *strategies, latency = runs
    num_requests = args.groups * args.users * args.questions
    lines = [
        f"Routing on `kvledger up --nodes {args.fleet_nodes} --tiny` ({args.device_blocks} device blocks per node, no host or disk tier): "
        f"{args.groups} groups × {args.users} users sharing a group prefix of about 500 tokens, {args.questions} questions each "
        f"({num_requests} requests), Poisson arrivals at {args.rate:g} requests/s, streamed, 8 output tokens",
        "",
        "| client | prompt tokens cached | TTFT p50 | TTFT p90 | requests/s | output tokens/s | requests per node | pulls (blocks) / fell back |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in strategies:
        spread = ", ".join(f"{node} {count}" for node, count in run["requests_per_node"].items())  # type: ignore[union-attr]
        pulls = run["pulls"]
        lines.append(
            f"| {run['client']} | {run['hit_ratio']:.0%} | {run['ttft_p50_s'] * 1000:.0f} ms | {run['ttft_p90_s'] * 1000:.0f} ms | "
            f"{run['requests_per_s']:.2f} | {run['output_tokens_per_s']:.1f} | {spread} | "
            f"{pulls['pulled']:.0f} ({pulls['blocks']:.0f}) / {pulls['fell_back']:.0f} |"  # type: ignore[index]
        )
    lines += [
        "",
        f"Warm hit, {NUM_LATENCY_PAIRS} requests each way, alternately (1 output token, not streamed):",
        "",
        "| path | p50 | p99 |",
        "|---|---|---|",
        f"| through the router | {latency['router_p50_s'] * 1000:.1f} ms | {latency['router_p99_s'] * 1000:.1f} ms |",  # type: ignore[operator]
        f"| straight to the node | {latency['direct_p50_s'] * 1000:.1f} ms | {latency['direct_p99_s'] * 1000:.1f} ms |",  # type: ignore[operator]
    ]
    return "\n".join(lines) + "\n"


def cli(args: argparse.Namespace) -> int:
    if args.fleet:
        return run_and_report(args, _run_fleet, _render_fleet)
    return run_and_report(args, _run, _render)
