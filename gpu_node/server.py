"""``kvledger node``: build one node from settings and serve it with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import uvicorn

from gpu_node.api import create_app
from gpu_node.auth import TokenVerifier
from events.kafka import KafkaSettings
from gpu_node.engine import AsyncEngine
from gpu_node.publisher import NodePublisher
from gpu_node.settings import NodeSettings

log = logging.getLogger(__name__)


def settings_from_args(args: argparse.Namespace) -> NodeSettings:
    """Environment first (KVLEDGER_NODE_*), command-line flags override it."""
    settings = NodeSettings()
    overrides = {
        "model_dir": args.model_dir,
        "host": args.host,
        "port": args.port,
        "node_id": args.node_id,
        "data_dir": args.data_dir,
        "warm_from": args.warm_from,
    }
    updates = {name: value for name, value in overrides.items() if value is not None}
    if args.jwt_public_key:
        updates["auth"] = settings.auth.model_copy(update={"jwt_public_key_file": Path(args.jwt_public_key)})
    return settings.model_copy(update=updates)


def make_publisher(engine: AsyncEngine, settings: NodeSettings) -> NodePublisher | None:
    """The ledger hook, when a broker is configured; it needs the shared subject-digest key."""
    if settings.kafka_bootstrap is None:
        return None
    if settings.subject_key is None:
        raise ValueError("a node publishing to the ledger needs KVLEDGER_SUBJECT_KEY (shared with the coordinator)")
    kafka = KafkaSettings(bootstrap=settings.kafka_bootstrap, client_id=f"kvledger-{settings.node_id}", num_partitions=settings.kafka_partitions)
    publisher = NodePublisher(
        engine,
        kafka,
        settings.node_id,
        settings.subject_key.get_secret_value().encode(),
        publish_interval_s=settings.publish_interval_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
    )
    engine.manager.event_sink = publisher.on_pool_events
    engine.snapshot_sink = publisher.on_snapshot_written
    return publisher


async def serve(settings: NodeSettings) -> None:
    verifier = TokenVerifier(settings.auth)
    engine = AsyncEngine.from_settings(settings)
    publisher = make_publisher(engine, settings)
    await engine.start()
    if publisher is not None:
        await publisher.start(Path(settings.data_dir))
    app = create_app(engine, verifier)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False))
    try:
        await server.serve()
    finally:
        if publisher is not None:
            await publisher.stop()
        await engine.stop()


def cli(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if not (Path(settings.model_dir) / "config.json").is_file():
        raise SystemExit(f"no model at {settings.model_dir}; create one with `kvledger model init {settings.model_dir}`")
    asyncio.run(serve(settings))
    return 0
