"""``kvledger status``: the stack at a glance — nodes and their liveness, outbox backlog, dead letters, ingest lag,
stalled consumer groups.

Nodes come from ``GET /v1/nodes`` (a ``platform-admin`` token, see :mod:`kvledger.api`);
the backlog figures from the coordinator's ``/metrics`` with the metrics token
(``--metrics-token`` or ``metrics_token`` of the stack file). Without a token, or when
the coordinator serves no metrics, the node table is still shown and the figures say why
they are missing: a partial picture beats none when something is wrong.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import httpx

from events.logs import escape_control
from identity.roles import PLATFORM_ADMIN
from kvledger.api import REQUEST_TIMEOUT_S, Coordinator
from kvledger.tokens import load_stack

TIERS = ("device", "host", "disk", "snapshot")
_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    """A label value as exposed (``\\\\``, ``\\"`` and ``\\n`` escaped) back to its text."""
    return re.sub(r"\\(.)", lambda escape: "\n" if escape[1] == "n" else escape[1], value)


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition; comments and bad lines
    skipped."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = {
            label["key"]: _unescape(label["value"])
            for label in _LABEL.finditer(match["labels"] or "")
        }
        samples.append((match["name"], labels, value))
    return samples


def backlog(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    """Outbox records not yet published, dead-lettered records by source topic, the mean ingest lag and the
    consumer groups that are stalled (``kvledger_consumer_stalled``: records waiting, not committed past).

    The coordinator exports ingest lag as a histogram; its ``_sum``/``_count`` give the mean over
    the events this process committed since it started (None before the first one).
    """
    dead_letters = {
        labels.get("topic", ""): int(value)
        for name, labels, value in samples
        if name == "kvledger_ledger_dead_letter_records"
    }
    pending = [value for name, _, value in samples if name == "kvledger_outbox_pending"]
    lag_sum = sum(
        value for name, _, value in samples if name == "kvledger_ledger_ingest_lag_seconds_sum"
    )
    lag_count = sum(
        value for name, _, value in samples if name == "kvledger_ledger_ingest_lag_seconds_count"
    )
    stalled = sorted(
        {
            labels.get("group", "")
            for name, labels, value in samples
            if name == "kvledger_consumer_stalled" and value > 0
        }
    )
    return {
        "stalled_groups": stalled,
        "outbox_pending": int(pending[0]) if pending else None,
        "dead_letters": dead_letters,
        "ingest_lag_s": lag_sum / lag_count if lag_count else None,
    }


def _metrics(url: str, token: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The backlog figures, or None and why they are missing."""
    if not token:
        return None, "no metrics token (pass --metrics-token or run `kvledger up` here)"
    response = httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=REQUEST_TIMEOUT_S
    )
    if not response.is_success:
        return None, f"/metrics answered HTTP {response.status_code}"
    return backlog(parse_samples(response.text)), None


def cli(args: argparse.Namespace) -> int:
    coordinator = Coordinator(args, role=PLATFORM_ADMIN, tenant="platform")
    nodes = coordinator.json("GET", "/v1/nodes")["nodes"]
    figures, missing = _metrics(
        coordinator.url, args.metrics_token or load_stack(args.stack).get("metrics_token")
    )
    if args.json:
        print(
            json.dumps(
                {
                    "coordinator_url": coordinator.url,
                    "nodes": nodes,
                    "metrics": figures,
                    "metrics_missing": missing,
                },
                indent=2,
            )
        )
        return 0
    print(f"coordinator  {coordinator.url}")
    print(
        f"{'node':<16} {'alive':<5} {'status':<10} {'last seen':>10}  "
        + " ".join(f"{tier:>8}" for tier in TIERS)
    )
    for node in nodes:
        placements = node["num_live_placements"]
        row = f"{node['node_id']:<16} {'yes' if node['alive'] else 'NO':<5} {node['status']:<10} {node['last_seen_age_s']:>9.1f}s  "
        print(escape_control(row + " ".join(f"{placements.get(tier, 0):>8}" for tier in TIERS)))
    if not nodes:
        print("(no node has reported yet)")
    if figures is None:
        print(f"backlog      unknown: {missing}")
        return 0
    dead = figures["dead_letters"]
    print(
        f"outbox       {figures['outbox_pending'] if figures['outbox_pending'] is not None else '-'} pending"
    )
    by_topic = (
        f" ({', '.join(f'{topic}: {n}' for topic, n in sorted(dead.items()) if n)})"
        if any(dead.values())
        else ""
    )
    print(escape_control(f"dead letters {sum(dead.values())}{by_topic}"))
    print(
        f"ingest lag   {'-' if figures['ingest_lag_s'] is None else format(figures['ingest_lag_s'], '.3f') + ' s (mean)'}"
    )
    stalled = figures["stalled_groups"]
    print(
        escape_control(
            f"consumers    {'STALLED: ' + ', '.join(stalled) if stalled else 'none stalled'}"
        )
    )
    return 0
