"""``kvledger bench routing``: what the router's index costs per core.

* **lookups/s**: ``PrefixIndex.match`` over a prompt's block keys (``--blocks``, 30 by default)
  against an index of ``--nodes`` nodes (8) holding groups of prompts that share long prefixes
  (every prompt's first two thirds are its group's), each prompt cached on two nodes up to a
  random depth in a random tier: the runs of every node that holds the prompt's first block.
* **decisions/s**: the lookup and ``PrefixLoadStrategy.rank`` over all nodes (what a request costs
  before it is proxied).
* **events/s**: ``PrefixIndex.apply`` of verified ``BlockStored`` records of 50 blocks (block
  events per second; signature checks and decoding are the consumer's, measured by ``bench ledger``).

CPU time of this process (``time.process_time``), so a busy machine's other work is not counted;
one core. A reference row times a bare ``dict.get`` over the same keys, the floor of any exact
Python index on this machine.

``--fleet``: instead, a real ``kvledger up --nodes N --tiny`` (bounded device tiers, no host or disk
tier) and the workload of the router's issue — ``--documents`` tenant documents, four questions
each, in random order, twice — sent by three clients in turn, each as its own tenant (so no client
reuses another's blocks): round-robin over the nodes, a fixed node per document (client affinity,
the reference) and the router. Reported: the share of prompt tokens served from cache over both
passes and on the second, and requests per node.
"""

from __future__ import annotations

import argparse
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


def _hash(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def _block(block_hash: str, tier: str) -> StoredBlock:
    return StoredBlock(
        block_hash=block_hash,
        parent_hash=None,
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


def _fill(args: argparse.Namespace, rng: random.Random) -> tuple[PrefixIndex, list[list[bytes]], float]:
    """The index, the queries, and the block events/s of filling it."""
    index = PrefixIndex()
    shared = args.blocks * 2 // 3
    prompts = [[_hash("g", p % NUM_GROUPS, i) if i < shared else _hash("p", p, i) for i in range(args.blocks)] for p in range(NUM_PROMPTS)]
    for node in range(args.nodes):
        index.apply(NodeStarted(node_id=f"node-{node}", epoch=1, seq=0, namespace="ns"), 0.0)
    seqs = [0] * args.nodes
    records = []
    for keys in prompts:
        for node in rng.sample(range(args.nodes), 2):
            tier = rng.choice(["device", "device", "host", "disk"])
            blocks = [_block(block_hash, tier) for block_hash in keys[: rng.randint(1, args.blocks)]]
            for start in range(0, len(blocks), 50):
                seqs[node] += 1
                records.append(BlockStored(node_id=f"node-{node}", epoch=1, seq=seqs[node], blocks=blocks[start : start + 50]))
    started = time.process_time()
    for record in records:
        index.apply(record, 0.0)
    events_per_s = sum(len(record.blocks) for record in records) / (time.process_time() - started)
    queries = [[bytes.fromhex(block_hash) for block_hash in rng.choice(prompts)] for _ in range(NUM_QUERIES)]
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
                "decisions_per_s": _per_s(lambda keys: strategy.rank(candidates, index.match(keys)), queries, args.lookups // 4),
                "dict_gets_per_s": _per_s(lambda keys: list(map(blocks.get, keys)), queries, args.lookups),
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


QUESTIONS = ("How many vacation days do I get?", "Who approves my leave?", "Can I carry days over?", "What about sick days?")


def _document(number: int) -> str:
    clause = f"Section {number}: employees of unit {number} accrue leave monthly, approved by their manager, carried over up to five days. "
    return clause * 12


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
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")} | {
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


def _token(stack: dict, tenant: str) -> str:
    from identity.tokens import issue_token

    return issue_token(tenant=tenant, sub="bench", scopes=["hr"], pv=0, ttl_s=3600, secret=stack["jwt_secret"])


def _client_run(stack: dict, name: str, order: list[tuple[int, int]], num_documents: int) -> dict[str, object]:
    tenant = f"bench-{name}-{uuid_suffix()}"
    headers = {"Authorization": f"Bearer {_token(stack, tenant)}"}
    node_urls, router_url = stack["node_urls"], stack["router_url"]
    per_pass = [[0, 0], [0, 0]]
    per_node: dict[str, int] = {}
    with httpx.Client(timeout=300) as http:
        for position, (document, question) in enumerate(order):
            if name == "round-robin":
                url = node_urls[position % len(node_urls)]
            elif name == "affinity":
                url = node_urls[document % len(node_urls)]
            else:
                url = router_url
            body = {
                "model": Path(stack["model_dir"]).name,
                "max_tokens": 1,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": "Answer from the handbook only.", "cache_scope": "public"},
                    {
                        "role": "user",
                        "content": _document(document),
                        "document": {"id": f"doc-{document}", "version": 1, "auth_scope": "hr"},
                    },
                    {"role": "user", "content": QUESTIONS[question]},
                ],
            }
            answer = http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            answer.raise_for_status()
            usage = answer.json()["usage"]
            counts = per_pass[position // (len(order) // 2)]
            counts[0] += usage["prompt_tokens_details"]["cached_tokens"]
            counts[1] += usage["prompt_tokens"]
            node = answer.headers.get("x-kvledger-node") or f"node-{node_urls.index(url)}"
            per_node[node] = per_node.get(node, 0) + 1
    total_cached, total_prompt = per_pass[0][0] + per_pass[1][0], per_pass[0][1] + per_pass[1][1]
    return {
        "client": name,
        "hit_ratio": total_cached / total_prompt,
        "second_pass_hit_ratio": per_pass[1][0] / per_pass[1][1],
        "requests_per_node": dict(sorted(per_node.items())),
    }


def uuid_suffix() -> str:
    return os.urandom(3).hex()


async def _run_fleet(args: argparse.Namespace) -> list[dict[str, object]]:
    rng = random.Random(0)
    one_pass = [(document, question) for document in range(args.documents) for question in range(len(QUESTIONS))]
    order = rng.sample(one_pass, len(one_pass)) + rng.sample(one_pass, len(one_pass))
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-routing-") as scratch:
        process, stack = _stack(Path(scratch), args.fleet_nodes, args.device_blocks)
        try:
            return [_client_run(stack, name, order, args.documents) for name in ("round-robin", "affinity", "router")]
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)


def _render_fleet(args: argparse.Namespace, runs: list[dict[str, object]]) -> str:
    lines = [
        f"Routing on `kvledger up --nodes {args.fleet_nodes} --tiny` ({args.device_blocks} device blocks per node, no host or disk tier): "
        f"{args.documents} tenant documents × {len(QUESTIONS)} questions, random order, twice",
        "",
        "| client | prompt tokens cached (both passes) | second pass | requests per node |",
        "|---|---|---|---|",
    ]
    for run in runs:
        spread = ", ".join(f"{node} {count}" for node, count in run["requests_per_node"].items())  # type: ignore[union-attr]
        lines.append(f"| {run['client']} | {run['hit_ratio']:.0%} | {run['second_pass_hit_ratio']:.0%} | {spread} |")
    return "\n".join(lines) + "\n"


def cli(args: argparse.Namespace) -> int:
    if args.fleet:
        return run_and_report(args, _run_fleet, _render_fleet)
    return run_and_report(args, _run, _render)
