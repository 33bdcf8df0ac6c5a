"""``kvledger router``: build one router replica from settings and serve it with uvicorn.

Start order: the model directory is loaded (tokenizer, template, keying digest), the nodes are
asked how they key blocks, both consumer groups join and position themselves, the index is built
from the ledger; the HTTP server listens from the start, and ``/health`` answers 200 once a node
can be routed to. The nodes' keying is asked again every ``routing.keying_refresh_s``, and
their queues are polled every ``routing.queue_poll_interval_s`` (``router.load``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from events.http_server import server_config
from events.kafka.settings import KafkaSettings
from events.logs import configure_logging
from identity.signing import load_public_key_file
from identity.tokens import TokenVerifier
from router.api import Fleet, create_app
from router.feed import CoordinatorClient, Feed
from router.health import Liveness
from router.index import PrefixIndex, TierWeights
from router.keying import Keying
from router.load import QueuePoller
from router.metrics import RouterMetrics
from router.settings import RouterSettings

log = logging.getLogger(__name__)


@dataclass
class Router:
    """One replica's parts: the fleet it routes over, the feed keeping the index exact, its app."""

    settings: RouterSettings
    fleet: Fleet
    feed: Feed
    coordinator: CoordinatorClient
    app: FastAPI

    @classmethod
    def build(cls, settings: RouterSettings) -> Router:
        """ValueError for what the operator must configure."""
        if settings.kafka_bootstrap is None or settings.coordinator_url is None:
            raise ValueError(
                "the router needs the broker (KVLEDGER_KAFKA_BOOTSTRAP) and the coordinator (KVLEDGER_COORDINATOR_URL)"
            )
        if settings.coordinator_public_key_file is None:
            raise ValueError(
                "the router needs the coordinator's command public key (KVLEDGER_ROUTER_COORDINATOR_PUBLIC_KEY_FILE)"
            )
        if not settings.nodes:
            raise ValueError(
                'the router has no nodes (KVLEDGER_ROUTER_NODES=\'[{"node_id": …, "url": …}]\')'
            )
        settings.coordinator_bearer()
        index = PrefixIndex(TierWeights(), max_blocks=settings.routing.max_index_blocks)
        keying = Keying(settings.model_dir, settings.served_model)
        fleet = Fleet(
            endpoints={endpoint.node_id: endpoint for endpoint in settings.nodes},
            index=index,
            keying=keying,
            liveness=Liveness(settings.routing.heartbeat_timeout_s),
            failure_threshold=settings.routing.failure_threshold,
            breaker_open_s=settings.routing.breaker_open_s,
        )
        coordinator = CoordinatorClient(settings.coordinator_url, settings.coordinator_bearer)
        config = KafkaSettings(
            bootstrap=settings.kafka_bootstrap,
            client_id=f"kvledger-{settings.router_id}",
            num_partitions=settings.kafka_partitions,
            **settings.kafka.timing_fields(),
            **settings.kafka.security_fields(),
        )
        feed = Feed(
            index,
            RouterMetrics(index),
            config,
            coordinator,
            load_public_key_file(settings.coordinator_public_key_file),
            group_id=f"kvledger-{settings.router_id}",
            node_keys_cache_s=settings.routing.node_keys_cache_s,
            reread_interval_s=settings.routing.reread_interval_s,
            versions=fleet.versions,
        )
        app = create_app(settings, fleet, feed, TokenVerifier(settings.auth))
        return cls(settings, fleet, feed, coordinator, app)

    async def refresh_keying(self) -> None:
        token = self.settings.metrics.token
        http = self.app.state.router.http
        await self.fleet.keying.refresh(
            http, self.settings.nodes, None if token is None else token.get_secret_value()
        )

    async def _keep_keying(self) -> None:
        while True:
            await asyncio.sleep(self.settings.routing.keying_refresh_s)
            await self.refresh_keying()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Router]:
        """Keying, feed and the keying refresh, for as long as the context lasts."""
        await self.refresh_keying()
        await self.feed.start()
        token = self.settings.metrics.token
        poller = QueuePoller(
            self.app.state.router.http,
            self.settings.nodes,
            None if token is None else token.get_secret_value(),
            self.settings.routing.queue_poll_interval_s,
            self.fleet.reported_queue,
        )
        tasks = [
            asyncio.create_task(self._keep_keying(), name="router keying refresh"),
            asyncio.create_task(poller.run(), name="router queue polls"),
        ]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.feed.stop()
            await self.coordinator.close()


async def serve(settings: RouterSettings) -> None:
    router = Router.build(settings)
    server = uvicorn.Server(
        server_config(router.app, settings.host, settings.port, settings.http_limits)
    )
    serving = asyncio.create_task(server.serve())
    try:
        async with router.running():
            log.info(
                "router serving %d nodes at http://%s:%d",
                len(settings.nodes),
                settings.host,
                settings.port,
            )
            await serving
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)


def cli(args: argparse.Namespace) -> int:
    try:
        configure_logging()
        # httpx logs every request at INFO: each proxied request and each queue poll would be a
        # line.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        settings = RouterSettings()
        updates = {
            name: getattr(args, name)
            for name in ("host", "port", "model_dir")
            if getattr(args, name, None) is not None
        }
        settings = settings.model_copy(update=updates)
        asyncio.run(serve(settings))
    except ValueError as exc:
        print(f"kvledger router: error: {exc}", file=sys.stderr)
        return 2
    return 0
