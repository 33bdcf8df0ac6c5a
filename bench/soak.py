"""``kvledger bench soak``: a mixed workload with faults for a set duration, checking the invariants
throughout.

On a :class:`bench.cluster.Cluster` (private embedded PostgreSQL and broker, ``--coordinators``
coordinator processes sharing the consumer groups, ``--nodes`` node processes), for ``--duration``:

* **requests** — ``--concurrency`` workers send chat requests over real HTTP with the ``openai``
  client, from ``--tenants`` tenants and several users each: private chats and questions about each
  tenant's document at its current version;
* **governance** — every ``--action-interval-s`` one of: a document update, a permission revocation
  (readers move to the new policy version), an erasure of one of the users. Once its invalidation
  completed (or the erasure verified) it is probed on every running node: the replaced document
  version is refused (409), the revoked policy's token is refused (401), the erased user hits no
  more than a stranger would (:class:`bench.invariants.Invariants`);
* **faults** — node restarts (SIGKILL and SIGTERM in turn, each after the node wrote a snapshot, so
  every restart starts with sealed snapshot copies to inventory) spread over the run, and
  coordinator SIGKILLs (one at half time by default), each restarted after ``--coordinator-down-s``.
  With ``--coordinators 2`` or more the kills take turns, the second process first: while one is
  dead the others own its partitions and must apply what is published to them meanwhile, before it
  comes back (partition takeover, :meth:`bench.invariants.Invariants.taken_over`);
* **checks** — every ``--check-interval-s`` the cheap invariants (one content per seq and no seq
  hole, no live copy of a verified erasure's subject, probe results); at the end, with the workload
  stopped, all of them (:meth:`Invariants.check`, which also waits for everything to finish and
  compares the ledger with every node's inventory).

Reports counts (requests, kv-events, commands, erasures verified, faults injected, violations),
resource growth between the end of the warm-up and the end of the run (RSS and open files of each
process, sizes of the ledger's tables) and, since a restarted process is a new life, each process
life's RSS from its first to its last sample (every ``rss_sample_interval_s``), as Markdown, or JSON
with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai

from bench.cluster import COORDINATOR_GROUP, Cluster, ClusterConfig, document_chat, private_chat
from bench.invariants import Invariants
from events import schema
from events.topics import KV_EVENTS
from kvledger.model_init import build_tiny_model, is_complete

TABLES = (
    "blocks",
    "placements",
    "inbox",
    "outbox",
    "invalidations",
    "invalidation_targets",
    "erasures",
    "receipts",
    "audit_log",
)
"""Ledger tables whose growth the report shows."""
NUM_USERS_PER_TENANT = 6
SOAK_READY_TIMEOUT_S = 900.0
"""A long run on a shared machine rides out a slow restart rather than abort: a node restarted while
its coordinator's key service answered slowly (load 22 on 2 cores) was still re-indexing its disk
tier after 300 s."""


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``2m``, ``1h`` → seconds; ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"duration {text!r}: expected a positive number with an optional unit s, m or h (e.g. 2m)"
        )
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


@dataclass
class SoakOptions:
    duration_s: float
    tenants: int = 3
    concurrency: int = 4
    action_interval_s: float = 4.0
    check_interval_s: float = 20.0
    node_restarts: int = 2
    coordinator_restarts: int = 1
    coordinator_down_s: float = 0.0
    """How long a SIGKILLed coordinator stays dead before its restart: with more than one coordinator process,
    the time the survivors own its partitions (each such window is checked, :meth:`Invariants.taken_over`)."""
    seed: int = 0
    rss_sample_interval_s: float = 30.0
    """How often each running process's RSS is sampled for :attr:`SoakReport.rss_samples`."""


@dataclass(frozen=True)
class RssSample:
    """One process's resident memory at ``at_s`` seconds into the run; ``pid`` tells its lives
    apart."""

    at_s: float
    name: str
    pid: int
    rss_bytes: int


@dataclass(frozen=True)
class ProcessLife:
    """The RSS samples of one life of one process (between two restarts): what growth means."""

    name: str
    pid: int
    first: RssSample
    last: RssSample
    num_samples: int

    @property
    def mib_per_10_min(self) -> float | None:
        """RSS growth rate over the life; None for a life sampled less than a minute apart."""
        span_s = self.last.at_s - self.first.at_s
        if span_s < 60:
            return None
        return (self.last.rss_bytes - self.first.rss_bytes) / 2**20 * 600 / span_s


def process_lives(samples: list[RssSample]) -> list[ProcessLife]:
    """Samples grouped by (process, pid), in the order each life was first sampled."""
    lives: dict[tuple[str, int], list[RssSample]] = {}
    for sample in samples:
        lives.setdefault((sample.name, sample.pid), []).append(sample)
    return [
        ProcessLife(name, pid, life[0], life[-1], len(life)) for (name, pid), life in lives.items()
    ]


@dataclass
class SoakReport:
    duration_s: float
    counts: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    resources_start: dict[str, dict[str, int]] = field(default_factory=dict)
    resources_end: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_samples: list[RssSample] = field(default_factory=list)
    """Every running process's RSS every :attr:`SoakOptions.rss_sample_interval_s`: ``resources_*``
    compare whichever processes hold the names at the start and the end, different lives after a
    restart."""

    @property
    def num_violations(self) -> int:
        return len(self.violations)

    def to_json(self) -> dict:
        return asdict(self) | {"num_violations": self.num_violations}


@dataclass
class _Tenant:
    name: str
    doc: str = "handbook"
    doc_version: int = 1
    policy_version: int = 1
    users: list[str] = field(default_factory=list)

    @property
    def scopes(self) -> dict[str, int]:
        return {"hr": self.policy_version}


class Soak:
    def __init__(self, cluster: Cluster, options: SoakOptions) -> None:
        self.cluster = cluster
        self.options = options
        self.invariants = Invariants(cluster)
        self.random = random.Random(options.seed)
        self.tenants = [
            _Tenant(
                f"soak-{index}-{uuid.uuid4().hex[:4]}",
                users=[f"user-{index}-{u}" for u in range(NUM_USERS_PER_TENANT)],
            )
            for index in range(options.tenants)
        ]
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "requests_ok",
                "requests_unavailable",
                "document_updates",
                "revocations",
                "erasures_requested",
                "probes",
                "checks",
            ),
            0,
        )
        self.violations: list[str] = []
        self._stop = asyncio.Event()
        self._erasing: set[tuple[str, str]] = set()
        """(tenant, user) with an erasure in progress: nobody uses them until it verified and was probed."""
        self._restarting: set[int] = set()

    # -- the workload ------------------------------------------------------------------

    def _running_nodes(self) -> list[int]:
        return [
            index
            for index, node in enumerate(self.cluster.nodes)
            if node.running and index not in self._restarting
        ]

    async def _chat_worker(self) -> None:
        while not self._stop.is_set():
            nodes = self._running_nodes()
            tenant = self.random.choice(self.tenants)
            users = [user for user in tenant.users if (tenant.name, user) not in self._erasing]
            if not nodes or not users:
                await asyncio.sleep(0.1)
                continue
            index, user = self.random.choice(nodes), self.random.choice(users)
            if self.random.random() < 0.5:
                token, messages = (
                    self.cluster.user_token(tenant.name, user),
                    private_chat(user, turns=self.random.randint(2, 6)),
                )
            else:
                token, messages = (
                    self.cluster.user_token(tenant.name, user, tenant.scopes),
                    document_chat(tenant.doc, tenant.doc_version),
                )
            try:
                await self.cluster.chat(index, token, messages)
                self.counts["requests_ok"] += 1
            except (openai.APIConnectionError, openai.InternalServerError):
                self.counts["requests_unavailable"] += (
                    1  # the node is being restarted (503 while it replays)
                )
            except openai.APIStatusError as error:
                if error.status_code in (401, 409) and index in self._running_nodes():
                    # A governance action moved past what this worker read a moment ago; refused,
                    # never served.
                    self.counts["requests_refused_stale"] = (
                        self.counts.get("requests_refused_stale", 0) + 1
                    )
                else:
                    self.violations.append(
                        f"request to {self.cluster.node_ids[index]} failed with {error.status_code}"
                    )

    async def _governance(self) -> None:
        """One action every ``action_interval_s``; each waits for its own completion and probes in its own task."""
        running: set[asyncio.Task] = set()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.options.action_interval_s)
                if self._stop.is_set():
                    break
                action = getattr(
                    self, f"_{self.random.choice(('document', 'revocation', 'erasure'))}"
                )
                task = asyncio.create_task(self._act(action, self.random.choice(self.tenants)))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in running:
                task.cancel()
            results = await asyncio.gather(*running, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                raise result

    async def _act(self, action, tenant: _Tenant) -> None:
        try:
            await action(tenant)
        except (OSError, httpx.HTTPError, asyncpg.PostgresError, TimeoutError):
            # The coordinator or the database is being restarted: a later action tries again, this
            # probe is skipped.
            self.counts["actions_deferred"] = self.counts.get("actions_deferred", 0) + 1

    async def _document(self, tenant: _Tenant) -> None:
        stale = tenant.doc_version
        tenant.doc_version += (
            1  # before the send: a concurrent action must not publish the same version
        )
        event = await self.cluster.publish(
            schema.DocumentUpdated(doc_id=tenant.doc, version=tenant.doc_version), tenant.name
        )
        self.counts["document_updates"] += 1
        if await self._completed("source_event_id = $1", event.event_id):
            for index in self._running_nodes():
                await self._probe(
                    self.invariants.probe_stale_document(
                        index, tenant.name, document_chat(tenant.doc, stale), tenant.scopes
                    )
                )

    async def _revocation(self, tenant: _Tenant) -> None:
        stale = tenant.scopes
        tenant.policy_version += 1
        event = await self.cluster.publish(
            schema.PermissionRevoked(auth_scope="hr", policy_version=tenant.policy_version),
            tenant.name,
        )
        self.counts["revocations"] += 1
        if await self._completed("source_event_id = $1", event.event_id):
            for index in self._running_nodes():
                await self._probe(
                    self.invariants.probe_stale_policy(
                        index, tenant.name, document_chat(tenant.doc, tenant.doc_version), stale
                    )
                )

    async def _erasure(self, tenant: _Tenant) -> None:
        candidates = [u for u in tenant.users if (tenant.name, u) not in self._erasing]
        if not candidates:
            return
        user = self.random.choice(candidates)
        self._erasing.add((tenant.name, user))
        try:
            response = await self.cluster.coordinator_api(
                "POST",
                "/v1/erasures",
                role=("privacy-officer", tenant.name),
                json={"tenant_id": tenant.name, "subject_id": user, "reason": "soak erasure"},
            )
            if (
                response.status_code != 202
            ):  # 503 while the coordinator restarts: tried again by a later action
                self.counts["actions_deferred"] = self.counts.get("actions_deferred", 0) + 1
                return
            erasure_id = response.json()["id"]
            self.counts["erasures_requested"] += 1
            if await self._verified(erasure_id):
                for index in self._running_nodes():
                    await self._probe(
                        self.invariants.probe_erased(index, tenant.name, user, private_chat(user))
                    )
        finally:
            self._erasing.discard((tenant.name, user))

    async def _probe(self, probe: Coroutine[Any, Any, None]) -> None:
        """Run one probe; a node restarted under it (no answer, or 503 while it replays) skips it,
        counted."""
        try:
            await probe
        except (openai.APIConnectionError, openai.InternalServerError):
            self.counts["probes_skipped"] = self.counts.get("probes_skipped", 0) + 1

    async def _completed(self, where: str, *args, timeout_s: float = 60.0) -> bool:
        """Whether the invalidation matching ``where`` completed in time (a restart may delay it: then no probe)."""
        deadline = time.monotonic() + timeout_s
        connection = await asyncpg.connect(**self.cluster.connect_kwargs(), timeout=10)
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                if await connection.fetchval(
                    f"SELECT status = 'complete' FROM invalidations WHERE {where}", *args
                ):
                    return bool(self._running_nodes())
                await asyncio.sleep(0.2)
        finally:
            await connection.close()
        return False

    async def _verified(self, erasure_id: str, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            response = await self.cluster.coordinator_api("GET", f"/v1/erasures/{erasure_id}")
            if response.status_code == 200 and response.json()["status"] == "verified":
                return True
            await asyncio.sleep(0.2)
        return False

    async def _faults(self, started: float) -> None:
        """Node restarts spread over the run, coordinator SIGKILLs in the middles of equal slices (one: at half time);
        each on its own schedule, so a slow restart delays no other fault. One that started always finishes, even
        past the end of the run."""
        duration, num_kills = self.options.duration_s, self.options.coordinator_restarts
        plan = [
            (duration * (i + 1) / (self.options.node_restarts + 1), self._restart_node, i)
            for i in range(self.options.node_restarts)
        ]
        plan += [
            (duration * (2 * i + 1) / (2 * num_kills), self._restart_coordinator, i)
            for i in range(num_kills)
        ]
        await asyncio.gather(
            *(self._at(started + at_s, fault, number) for at_s, fault, number in plan)
        )

    async def _at(self, when: float, fault, number: int) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), max(0.0, when - time.monotonic()))
        if not self._stop.is_set():
            await fault(number)

    async def _restart_coordinator(self, number: int) -> None:
        """SIGKILL coordinator ``number + 1`` (modulo their count: the second first, the API's last), restart it after
        ``coordinator_down_s``; with others alive, check that they took its kv-events partitions over meanwhile."""
        cluster = self.cluster
        index = (number + 1) % len(cluster.coordinators)
        held = cluster.coordinators[index].assigned_partitions(COORDINATOR_GROUP, KV_EVENTS)
        killed_ms = int(time.time() * 1000)
        await cluster.coordinators[index].kill()
        cluster.count("coordinator_sigkill")
        # The whole time even past the end of the run: a window cut short by the stop gave the
        # survivor too little time to notice the death and rejoin on a loaded machine, and the
        # takeover check failed on the timing.
        await asyncio.sleep(self.options.coordinator_down_s)
        restarted_ms = int(time.time() * 1000)
        await cluster.restart_coordinator(index=index)
        if len(cluster.coordinators) > 1 and held:
            num_records, found = await self.invariants.taken_over(held, killed_ms, restarted_ms)
            self.counts["takeovers"] = self.counts.get("takeovers", 0) + 1
            self.counts["kv_events_taken_over"] = (
                self.counts.get("kv_events_taken_over", 0) + num_records
            )
            self.violations.extend(found)

    async def _restart_node(self, number: int) -> None:
        """Snapshot, then restart: the new life must report the snapshot's sealed copies in its start inventory even
        when its coordinator's key service is down or slow then (a coordinator SIGKILL may overlap the restart)."""
        index = number % len(self.cluster.nodes)
        self._restarting.add(index)
        try:
            try:
                written = (await self.cluster.snapshot(index)).status_code == 201
            except httpx.HTTPError:
                written = False
            name = "snapshots" if written else "snapshots_failed"
            self.counts[name] = self.counts.get(name, 0) + 1
            await self.cluster.restart_node(index, kill=number % 2 == 0)
        finally:
            self._restarting.discard(index)

    async def _continuous_checks(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.options.check_interval_s)
            with contextlib.suppress(OSError, asyncpg.PostgresError, TimeoutError):
                found = (
                    self.invariants.kv_events_exact()
                    + await self.invariants.erased_copies_in_ledger()
                )
                self.counts["checks"] += 1
                self.violations.extend(v for v in found if v not in self.violations)

    def _sample_rss_once(self, started: float, samples: list[RssSample]) -> None:
        at_s = round(time.monotonic() - started, 1)
        for child in self.cluster.children:
            rss_bytes = child.resources().get("rss_bytes")
            if rss_bytes is not None:
                samples.append(RssSample(at_s, child.name, child.process.pid, rss_bytes))

    async def _sample_rss(self, started: float, samples: list[RssSample]) -> None:
        while not self._stop.is_set():
            self._sample_rss_once(started, samples)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.options.rss_sample_interval_s)

    # -- the run -----------------------------------------------------------------------

    async def _ledger_totals(self) -> dict[str, int]:
        """Commands decided, re-sends and verified erasures in the ledger so far (the report shows the run's share)."""
        connection = await asyncpg.connect(**self.cluster.connect_kwargs(), timeout=10)
        try:
            return {
                "commands": await connection.fetchval("SELECT count(*) FROM invalidations"),
                "commands_late_block": await connection.fetchval(
                    "SELECT count(*) FROM invalidations WHERE trigger = 'late_block'"
                ),
                "erasure_late_block_reissues": await connection.fetchval(
                    "SELECT count(*) FROM invalidations WHERE trigger = 'late_block' AND kind = 'subject'"
                ),
                "command_resends": await connection.fetchval(
                    "SELECT coalesce(sum(resend_count), 0) FROM invalidation_targets"
                ),
                "erasures_verified": await connection.fetchval(
                    "SELECT count(*) FROM erasures WHERE status = 'verified'"
                ),
            }
        finally:
            await connection.close()

    async def resources(self) -> dict[str, dict[str, int]]:
        found = {child.name: child.resources() for child in self.cluster.children}
        connection = await asyncpg.connect(**self.cluster.connect_kwargs(), timeout=10)
        try:
            found["tables (bytes)"] = {
                table: await connection.fetchval(
                    "SELECT pg_total_relation_size($1::regclass)", table
                )
                for table in TABLES
            }
        finally:
            await connection.close()
        return found

    async def run(self) -> SoakReport:
        report = SoakReport(duration_s=self.options.duration_s)
        faults_before = dict(self.cluster.faults)
        num_kv_events_before = len(self.cluster.tail.kv_events)
        report.resources_start = await self.resources()
        totals_before = await self._ledger_totals()
        started = time.monotonic()
        tasks = [asyncio.create_task(self._chat_worker()) for _ in range(self.options.concurrency)]
        tasks += [
            asyncio.create_task(self._governance()),
            asyncio.create_task(self._faults(started)),
            asyncio.create_task(self._continuous_checks()),
            asyncio.create_task(self._sample_rss(started, report.rss_samples)),
        ]
        try:
            done, _ = await asyncio.wait(
                tasks, timeout=self.options.duration_s, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                task.result()
        finally:
            self._stop.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            raise failures[0]
        for child in self.cluster.children:
            if not child.running:
                await child.start()
        self.violations.extend(await self.invariants.check())
        self._sample_rss_once(
            started, report.rss_samples
        )  # the last lives' end, however short they were
        report.resources_end = await self.resources()
        totals = await self._ledger_totals()
        report.counts = (
            self.counts
            | {
                "probes": self.invariants.num_probes,
                "checks": self.counts["checks"] + self.invariants.num_checks,
                "replicas_live": self.invariants.num_replicas,
                "kv_events": len(self.cluster.tail.kv_events) - num_kv_events_before,
            }
            | {name: totals[name] - totals_before[name] for name in totals}
        )
        report.faults = {
            kind: count - faults_before.get(kind, 0)
            for kind, count in self.cluster.faults.items()
            if count > faults_before.get(kind, 0)
        }
        report.violations = list(dict.fromkeys(self.violations))
        return report


async def run_soak(cluster: Cluster, options: SoakOptions) -> SoakReport:
    return await Soak(cluster, options).run()


def render_markdown(report: SoakReport, command: str) -> str:
    lines = [
        f"Soak of {report.duration_s:.0f} s (`{command}`)",
        "",
        "| count | value |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {value} |" for name, value in sorted(report.counts.items())]
    lines += [f"| faults: {name} | {value} |" for name, value in sorted(report.faults.items())]
    lines += [f"| **violations** | **{report.num_violations}** |", ""]
    lines += [
        "| process / table | measure | after warm-up | at the end | growth |",
        "|---|---|---:|---:|---:|",
    ]
    for name, start in report.resources_start.items():
        end = report.resources_end.get(name, {})
        for measure, before in start.items():
            after = end.get(measure)
            growth = "" if after is None else f"{after - before:+d}"
            lines.append(
                f"| {name} | {measure} | {before} | {'' if after is None else after} | {growth} |"
            )
    lives = process_lives(report.rss_samples)
    if lives:
        lines += [
            "",
            "| process | life (pid) | sampled from – to (s) | samples | RSS first → last (MiB) | per 10 min (MiB) |",
        ]
        lines += ["|---|---|---|---:|---:|---:|"]
        for life in lives:
            rate = life.mib_per_10_min
            lines.append(
                f"| {life.name} | {life.pid} | {life.first.at_s:.0f} – {life.last.at_s:.0f} | {life.num_samples} "
                f"| {life.first.rss_bytes / 2**20:.1f} → {life.last.rss_bytes / 2**20:.1f} | {'' if rate is None else f'{rate:+.1f}'} |"
            )
    if report.violations:
        lines += ["", "Violations:", *[f"- {violation}" for violation in report.violations]]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> SoakReport:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvledger-soak-"))
    model_dir = Path(args.model_dir)
    if not is_complete(model_dir):
        await asyncio.to_thread(build_tiny_model, model_dir)
    options = SoakOptions(
        duration_s=parse_duration(args.duration),
        tenants=args.tenants,
        concurrency=args.concurrency,
        action_interval_s=args.action_interval_s,
        check_interval_s=args.check_interval_s,
        node_restarts=args.node_restarts,
        coordinator_restarts=args.coordinator_restarts,
        coordinator_down_s=args.coordinator_down_s,
        seed=args.seed,
    )
    async with Cluster(
        work,
        model_dir,
        ClusterConfig(
            num_nodes=args.nodes,
            num_coordinators=args.coordinators,
            ready_timeout_s=SOAK_READY_TIMEOUT_S,
        ),
    ) as cluster:
        return await run_soak(cluster, options)


def cli(args: argparse.Namespace) -> int:
    """0 when no invariant was violated, 1 otherwise; the report on stdout (and ``--output``)."""
    try:
        parse_duration(args.duration)
    except ValueError as error:
        print(f"kvledger bench soak: error: {error}", file=sys.stderr)
        return 2
    report = asyncio.run(_main(args))
    command = (
        f"kvledger bench soak --duration {args.duration} --nodes {args.nodes} --coordinators {args.coordinators}"
        f" --coordinator-restarts {args.coordinator_restarts} --coordinator-down-s {args.coordinator_down_s:g}"
        f" --node-restarts {args.node_restarts} --tenants {args.tenants} --concurrency {args.concurrency}"
    )
    text = json.dumps(report.to_json(), indent=2) if args.json else render_markdown(report, command)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if report.num_violations == 0 else 1
