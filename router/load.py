"""The queue each node reports, polled from its ``GET /v1/kvledger/load`` (behind the metrics token the router holds).

A node's scheduler sets ``kvledger_num_requests_running`` and ``kvledger_num_requests_waiting``
after every step, and ``/v1/kvledger/load`` answers the two (a few bytes, where ``/metrics`` would
render every series on the node's event loop several times a second). Their sum is every request
the node holds, whoever sent it — this router, another replica, a client going straight to the
node. The router's own in-flight count (``Fleet.in_flight``) is exact at once but blind to the
others; the reported queue sees them all but is up to one poll old. A node's load is therefore the
larger of the two (:func:`node_load`): the reported queue already counts this router's requests,
so adding them would count them twice, and the in-flight count covers the requests sent since the
last poll.

A node whose poll fails (unreachable, an error, a malformed answer) has no reported queue until
the next good one: its load is then the router's in-flight count alone, as before any poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import httpx

from router.settings import NodeEndpoint

log = logging.getLogger(__name__)

LOAD_PATH = "/v1/kvledger/load"
MAX_QUEUE = 1_000_000
"""A reported queue above this is not believed (a node holds at most a few thousand requests)."""


def reported_queue(answer: Any) -> int | None:
    """Running plus waiting requests of a node's ``/v1/kvledger/load`` answer; None when it is not
    one."""
    if not isinstance(answer, dict):
        return None
    counts = [answer.get("num_requests_running"), answer.get("num_requests_waiting")]
    if not all(type(count) is int and 0 <= count <= MAX_QUEUE for count in counts):
        return None
    return sum(counts)  # type: ignore[arg-type]


def node_load(in_flight: int, reported: int | None) -> float:
    """What one node's load counts as in scoring (the module docstring says why the larger)."""
    return float(in_flight if reported is None else max(in_flight, reported))


class QueuePoller:
    """Polls every node's queue every ``interval_s`` into ``reported`` (node id → its latest queue;
    absent: unknown)."""

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
        self._headers = (
            {} if metrics_token is None else {"Authorization": f"Bearer {metrics_token}"}
        )
        self.interval_s = interval_s
        self.reported = reported

    async def poll(self) -> None:
        """One scrape of every node, concurrently."""
        await asyncio.gather(*(self._poll_one(endpoint) for endpoint in self._endpoints))

    async def _poll_one(self, endpoint: NodeEndpoint) -> None:
        queue = None
        try:
            response = await self._http.get(
                f"{endpoint.url}{LOAD_PATH}",
                headers=self._headers,
                timeout=max(1.0, self.interval_s),
            )
            if response.status_code == 200:
                queue = reported_queue(response.json())
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
