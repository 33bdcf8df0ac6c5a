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
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import statistics
import time
from datetime import UTC, datetime

from bench.common import run_and_report
from events.schema import BlockStored, NodeStarted, StoredBlock
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


def cli(args: argparse.Namespace) -> int:
    return run_and_report(args, _run, _render)
