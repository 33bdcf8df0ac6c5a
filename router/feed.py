"""What keeps the router's index exact: kv-events, the coordinator's decisions, and the ledger.

* kv-events: a consumer group of this replica's own (``kvledger-router-<id>-kv-events``, offsets
  committed only after the batch is applied) reads ``kvledger.kv-events``; every record is verified
  as the coordinator verifies it (``identity.signing.record_problem`` over the node keys enrolled at
  the coordinator, fetched from ``GET /v1/router/nodes`` and trusted for
  ``routing.node_keys_cache_s``) and applied (``router.index.PrefixIndex.apply``). A record that
  fails is skipped and counted (``kvledger_router_unverified_records_total``): the coordinator's own
  consumer dead-letters the same record, once for the operator.
* decisions: a second group reads ``kvledger.commands``; an ``Invalidate`` signed by the pinned
  command key drops its matches from the index at once, before any node acks it, and moves the
  router's version registry (``prefix_keys.versions``), so a request naming a version it made stale
  is refused at the router as the node would refuse it.
* the ledger: at start — once both groups are consuming, so nothing falls between the read and the
  topics — the decisions a version registry holds (``GET /v1/router/versions``, what a starting node
  gets from ``/v1/governance``), and for every node the index marks (a seq gap, a new epoch without
  ``NodeStarted``), the node's live placements are read (``GET /v1/router/placements``) and replace
  what the index holds for it; at most once per node per ``routing.reread_interval_s``.

Both groups start, when new, at the topics' ends: what came before is in the ledger.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import TypeAdapter

from events.kafka.admin import ensure_topics
from events.kafka.consumer import BatchConsumer, ConsumedEvent
from events.kafka.settings import KafkaSettings
from events.schema import Invalidate, NodeEvent, NodeHeartbeat, Predicate
from events.tiers import Tier
from events.topics import COMMANDS, KV_EVENTS
from identity.signing import EnrolledKey, public_key_from_raw, record_problem, signature_problem
from prefix_keys.versions import VersionRegistry
from router.index import BlockTags, Placement, PrefixIndex
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MIN_REFETCH_S = 1.0
"""The shortest interval between two fetches of the node keys for unknown key ids."""
MAX_PLACEMENT_PAGES = 100_000
"""A bound on one node's read (5000 placements a page): a coordinator that never ends its pages is
refused."""
MAX_VERSION_PAGES = 10_000
"""A bound on the version read (1000 decisions a page), for the same reason."""
_PREDICATE: TypeAdapter[Predicate] = TypeAdapter(Predicate)
_DECIDED_AT = TypeAdapter(datetime)


class CoordinatorClient:
    """The coordinator's ``/v1/router/*`` routes, with the router's operator token."""

    def __init__(self, base_url: str, bearer: Callable[[], str], timeout_s: float = 30.0) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self._bearer = bearer

    async def close(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self._http.get(
            path, params=params, headers={"Authorization": f"Bearer {self._bearer()}"}
        )
        response.raise_for_status()
        data = response.json()
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the coordinator answered no JSON object")
        return data

    async def nodes(self) -> tuple[list[dict[str, Any]], dict[str, EnrolledKey]]:
        """Every node's epoch, last seq and liveness, and the enrolled node keys by key id."""
        data = await self._get("/v1/router/nodes")
        keys = {}
        for entry in data["node_keys"]:
            raw = base64.urlsafe_b64decode(
                entry["public_key"] + "=" * (-len(entry["public_key"]) % 4)
            )
            keys[entry["key_id"]] = EnrolledKey(
                entry["key_id"], entry["node_id"], public_key_from_raw(raw)
            )
        return list(data["nodes"]), keys

    async def versions(self) -> list[tuple[Predicate, datetime]]:
        """Every decision a version registry holds (predicate, decided at), every page."""
        decisions: list[tuple[Predicate, datetime]] = []
        params: dict[str, Any] = {}
        for _ in range(MAX_VERSION_PAGES):
            page = await self._get("/v1/router/versions", params)
            for entry in page["decisions"]:
                decisions.append(
                    (
                        _PREDICATE.validate_python(entry["predicate"]),
                        _DECIDED_AT.validate_python(entry["decided_at"]),
                    )
                )
            if page["next_cursor"] is None:
                return decisions
            params = {"cursor": str(page["next_cursor"])}
        raise ValueError(f"the coordinator's versions did not end within {MAX_VERSION_PAGES} pages")

    async def placements(self, node_id: str) -> tuple[int, int, list[Placement]]:
        """``(epoch, last_seq, live copies)`` of ``node_id``, every page; the first page's epoch and
        seq."""
        placements: list[Placement] = []
        after, first = 0, None
        for _ in range(MAX_PLACEMENT_PAGES):
            page = await self._get(
                "/v1/router/placements", {"node": node_id, "after": after, "limit": 5000}
            )
            first = first or (int(page["epoch"]), int(page["last_seq"]))
            for entry in page["placements"]:
                tags = BlockTags(
                    namespace=entry["namespace"],
                    tenant_id=entry["tenant_id"],
                    subject_id=entry["subject_id"],
                    documents=tuple(
                        (doc_id, int(version)) for doc_id, version in entry["documents"]
                    ),
                    auth_scopes=tuple(
                        (scope, int(version)) for scope, version in entry["auth_scopes"]
                    ),
                    created_at=float(entry["created_at"]),
                )
                placements.append(
                    Placement(
                        bytes.fromhex(entry["block_hash"]),
                        Tier(entry["tier"]),
                        tags,
                        tuple(entry["creators"]),
                    )
                )
            if page["next_cursor"] is None:
                return first[0], first[1], placements
            after = int(page["next_cursor"])
        raise ValueError(
            f"the coordinator's placements of {node_id} did not end within {MAX_PLACEMENT_PAGES} pages"
        )


class NodeKeys:
    """Enrolled node keys from the coordinator, trusted for ``cache_s`` (the router's revocation
    bound).

    A batch naming a key id not held refetches them, at most once per :data:`MIN_REFETCH_S`
    (waiting out the rest of it), so a node enrolled a moment ago is verified, and made-up key
    ids cannot flood the coordinator.
    """

    def __init__(self, coordinator: CoordinatorClient, cache_s: float) -> None:
        self._coordinator = coordinator
        self._cache_s = cache_s
        self._keys: dict[str, EnrolledKey] = {}
        self._fetched_at: float | None = None
        self.nodes: list[dict[str, Any]] = []

    async def refresh(self) -> None:
        self.nodes, self._keys = await self._coordinator.nodes()
        self._fetched_at = time.monotonic()

    async def lookup(self, key_ids: set[str]) -> dict[str, EnrolledKey]:
        age_s = None if self._fetched_at is None else time.monotonic() - self._fetched_at
        if age_s is not None and age_s < self._cache_s and key_ids - self._keys.keys():
            await asyncio.sleep(max(0.0, MIN_REFETCH_S - age_s))
            age_s = None
        if age_s is None or age_s >= self._cache_s:
            await self.refresh()
        return self._keys


class Feed:
    """The two consumer groups and the ledger reads of one router replica (see the module
    docstring)."""

    def __init__(
        self,
        index: PrefixIndex,
        metrics: RouterMetrics,
        config: KafkaSettings,
        coordinator: CoordinatorClient,
        command_key: Ed25519PublicKey,
        *,
        group_id: str,
        node_keys_cache_s: float,
        reread_interval_s: float,
        versions: VersionRegistry | None = None,
    ) -> None:
        self.index = index
        self.versions = versions or VersionRegistry()
        self._config = config
        self.metrics = metrics
        self.coordinator = coordinator
        self.command_key = command_key
        self.node_keys = NodeKeys(coordinator, node_keys_cache_s)
        self.reread_interval_s = reread_interval_s
        self._reread = asyncio.Event()
        self._last_read: dict[str, float] = {}
        self.built = asyncio.Event()
        """Set once the index was built from the ledger (the router then serves)."""
        self.kv_events = BatchConsumer(
            config,
            [KV_EVENTS],
            self._on_kv_events,
            group_id=f"{group_id}-kv-events",
            auto_offset_reset="latest",
        )
        self.commands = BatchConsumer(
            config,
            [COMMANDS],
            self._on_commands,
            group_id=f"{group_id}-commands",
            auto_offset_reset="latest",
        )
        self._tasks: list[asyncio.Task] = []

    @property
    def consuming(self) -> bool:
        return self.kv_events.consuming and self.commands.consuming

    async def start(self, timeout_s: float = 60.0) -> None:
        """Join both groups, wait until they know their positions, then build the index from the
        ledger."""
        await ensure_topics(self._config)
        await self.kv_events.start()
        await self.commands.start()
        self._tasks = [
            asyncio.create_task(self.kv_events.run(), name="router kv-events"),
            asyncio.create_task(self.commands.run(), name="router commands"),
        ]
        deadline = time.monotonic() + timeout_s
        while not self.consuming:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the router's consumer groups were not consuming within {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.05)
        await self.rebuild()
        self.built.set()
        self._tasks.append(asyncio.create_task(self._reread_loop(), name="router ledger re-reads"))

    async def stop(self) -> None:
        for task in self._tasks[2:]:
            task.cancel()
        await asyncio.gather(self.kv_events.stop(), self.commands.stop(), return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def rebuild(self) -> None:
        """The ledger's current versions and every node it knows, read again (at start)."""
        for predicate, decided_at in await self.coordinator.versions():
            self.versions.apply(predicate, decided_at)
        await self.node_keys.refresh()
        now = time.monotonic()
        for node in self.node_keys.nodes:
            await self._read(node["node_id"], now - float(node["last_seen_age_s"]))

    async def _read(self, node_id: str, last_seen: float | None = None) -> None:
        self._last_read[node_id] = time.monotonic()
        epoch, last_seq, placements = await self.coordinator.placements(node_id)
        reason = self.index.replace_node(node_id, epoch, last_seq, placements, now=last_seen)
        self.metrics.rereads.inc()
        behind = f"; still behind: {reason}" if reason else ""
        log.info(
            "router: %s read from the ledger (%d copies, epoch %d seq %d)%s",
            node_id,
            len(placements),
            epoch,
            last_seq,
            behind,
        )

    async def _reread_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._reread.wait(), self.reread_interval_s)
            except TimeoutError:
                pass
            self._reread.clear()
            now = time.monotonic()
            for node in self.index.nodes:
                if (
                    node.reread_reason is None
                    or now - self._last_read.get(node.node_id, 0.0) < self.reread_interval_s
                ):
                    continue
                log.info(
                    "router: re-reading %s from the ledger: %s", node.node_id, node.reread_reason
                )
                try:
                    await self._read(node.node_id)
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    log.warning(
                        "router: ledger read of %s failed (%s); retrying",
                        node.node_id,
                        type(error).__name__,
                    )

    async def _on_kv_events(self, events: list[ConsumedEvent]) -> None:
        kids = {
            event.envelope.signature.kid for event in events if event.envelope.signature is not None
        }
        enrolled = await self.node_keys.lookup(kids)
        now = time.monotonic()
        for event in events:
            problem = record_problem(event.envelope, enrolled)
            if problem is not None:
                self.metrics.unverified.labels(topic=event.topic, reason=problem).inc()
                continue
            payload = event.envelope.payload
            if not isinstance(payload, NodeEvent | NodeHeartbeat):
                continue
            outcome = self.index.apply(payload, now)
            self.metrics.kv_events.labels(outcome=outcome).inc()
            self.metrics.event_lag.set(max(0.0, time.time() - event.timestamp_ms / 1000))
        if any(node.reread_reason is not None for node in self.index.nodes):
            self._reread.set()

    async def _on_commands(self, events: list[ConsumedEvent]) -> None:
        for event in events:
            payload = event.envelope.payload
            if not isinstance(payload, Invalidate):
                continue
            problem = signature_problem(event.envelope, self.command_key)
            if problem is not None:
                self.metrics.unverified.labels(topic=event.topic, reason=problem).inc()
                continue
            self.versions.apply(payload.predicate, payload.cutoff)
            dropped = self.index.invalidate(payload.predicate, payload.cutoff.timestamp())
            self.metrics.invalidated_blocks.inc(dropped)
