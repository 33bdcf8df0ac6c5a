"""The queue each node reports, polled from its ``/metrics`` (behind the metrics token the router holds).

A node's scheduler sets ``kvledger_num_requests_running`` and ``kvledger_num_requests_waiting``
after every step; their sum is every request the node holds, whoever sent it — this router,
another replica, a client going straight to the node. The router's own in-flight count
(``Fleet.in_flight``) is exact at once but blind to the others; the reported queue sees them
all but is up to one poll old. A node's load is therefore the larger of the two
(:func:`node_load`): the reported queue already counts this router's requests, so adding them
would count them twice, and the in-flight count covers the requests sent since the last poll.

A node whose scrape fails (unreachable, an error, no such samples) has no reported queue until
the next good one: its load is then the router's in-flight count alone, as before any poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

from router.settings import NodeEndpoint

log = logging.getLogger(__name__)

QUEUE_GAUGES = frozenset({"kvledger_num_requests_running", "kvledger_num_requests_waiting"})
_QUEUE_PREFIXES = tuple(QUEUE_GAUGES)
MAX_SCRAPE_BYTES = 4 << 20
"""A node's metrics page larger than this is not parsed (a node's is a few tens of KiB)."""


def reported_queue(metrics_text: str) -> int | None:
    """Running plus waiting requests in a node's metrics page (Prometheus text); None when it has neither sample.

    A line scan for the two gauges rather than a full parse: the page is scraped every poll, and
    its histograms are most of it.
    """
    found = False
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(_QUEUE_PREFIXES):
            continue
        name, _, rest = line.partition(" ")
        if name.partition("{")[0] not in QUEUE_GAUGES:
            continue
        try:
            value = float(rest.split(" ", 1)[0])
        except ValueError:
            continue
        if value >= 0:
            found = True
            total += value
    return round(total) if found else None


def node_load(in_flight: int, reported: int | None) -> float:
    """What one node's load counts as in scoring (the module docstring says why the larger)."""
    return float(in_flight if reported is None else max(in_flight, reported))


class QueuePoller:
    """Polls every node's queue every ``interval_s`` into ``reported`` (node id → its latest queue; absent: unknown)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        endpoints: Iterable[NodeEndpoint],
        metrics_token: str | None,
        interval_s: float,
        reported: dict[str, int],
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._http = http
        self._endpoints = list(endpoints)
        self._headers = {} if metrics_token is None else {"Authorization": f"Bearer {metrics_token}"}
        self.interval_s = interval_s
        self.reported = reported

    async def poll(self) -> None:
        """One scrape of every node, concurrently."""
        await asyncio.gather(*(self._poll_one(endpoint) for endpoint in self._endpoints))

    async def _poll_one(self, endpoint: NodeEndpoint) -> None:
        queue = None
        try:
            response = await self._http.get(f"{endpoint.url}/metrics", headers=self._headers, timeout=max(1.0, self.interval_s))
            if response.status_code == 200 and len(response.content) <= MAX_SCRAPE_BYTES:
                queue = reported_queue(response.text)
        except (httpx.HTTPError, ValueError) as error:
            log.debug("router: queue of %s not read (%s)", endpoint.node_id, type(error).__name__)
        if queue is None:
            self.reported.pop(endpoint.node_id, None)
        else:
            self.reported[endpoint.node_id] = queue

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)
