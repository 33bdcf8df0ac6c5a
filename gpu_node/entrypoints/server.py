"""``kvledger node``: build one node from settings and serve it with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from pathlib import Path

import uvicorn

from events.http_server import server_config
from events.kafka.settings import KafkaSettings
from events.logs import configure_logging
from gpu_node.cache.kv_memory import KVMemoryError
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app
from gpu_node.governance.applier import InvalidationApplier
from gpu_node.governance.commands import CommandConsumer
from gpu_node.governance.publisher import KV_EVENTS_SUBSCRIBER, NodePublisher
from gpu_node.governance.sync import GovernanceClient
from gpu_node.keys.node_identity import node_signing_key, pinned_command_key
from gpu_node.keys.remote_keys import NODE_CREDENTIAL_TTL_S
from gpu_node.pool import snapshots
from gpu_node.settings import NodeSettings
from identity.node_credentials import issue_node_credential
from identity.signing import EnvelopeSigner
from identity.tokens import TokenVerifier

log = logging.getLogger(__name__)


GIL_SWITCH_INTERVAL_S = 0.001
"""How long the model worker thread may hold the GIL while the event loop waits for it.

A forward pass is mostly Python (module calls, kernel launches), run in the engine's
worker thread; at CPython's default (5 ms) the event loop — HTTP, the command consumer
applying invalidations, the publisher — waited up to 5 ms for every slice of every
forward. On the invalidation benchmark (2 cores, two nodes serving probes) publish →
last ack went from p50 189 / p99 318 ms to 120 / 259 ms (3 runs each)."""


def tune_interpreter() -> None:
    """Once the engine started, before serving: what the process needs of the interpreter.

    The model, its libraries and a warm start leave ~10^5 long-lived objects that every
    full garbage collection would scan again: a pause of hundreds of ms in the middle of
    a request or an invalidation. Frozen, they are skipped; later collections scan what
    came after. And the event loop gets the GIL back within :data:`GIL_SWITCH_INTERVAL_S`.
    """
    gc.freeze()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


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
        updates["auth"] = settings.auth.model_copy(
            update={"jwt_public_key_file": Path(args.jwt_public_key)}
        )
    return settings.model_copy(update=updates)


def kafka_settings(settings: NodeSettings) -> KafkaSettings:
    """The node's Kafka connection: its broker, client id, partitions, security settings and consumer timing."""
    assert settings.kafka_bootstrap is not None, "only a node with a broker talks to Kafka"
    return KafkaSettings(
        bootstrap=settings.kafka_bootstrap,
        client_id=f"kvledger-{settings.node_id}",
        num_partitions=settings.kafka_partitions,
        **settings.kafka.timing_fields(),
        **settings.kafka.security_fields(),
    )


def make_publisher(engine: AsyncEngine, settings: NodeSettings) -> NodePublisher | None:
    """The ledger hook, when a broker is configured; it needs the shared subject-digest key."""
    if settings.kafka_bootstrap is None:
        return None
    if settings.subject_key is None:
        raise ValueError(
            "a node publishing to the ledger needs KVLEDGER_SUBJECT_KEY (shared with the coordinator)"
        )
    publisher = NodePublisher(
        engine,
        kafka_settings(settings),
        settings.node_id,
        settings.subject_key.get_secret_value().encode(),
        publish_interval_s=settings.publish_interval_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        signer=EnvelopeSigner(node_signing_key(settings)),
    )
    engine.manager.subscribe(KV_EVENTS_SUBSCRIBER, publisher.on_pool_events)
    engine.snapshot_sink = publisher.on_snapshot_written
    return publisher


def make_command_consumer(
    engine: AsyncEngine, publisher: NodePublisher, settings: NodeSettings
) -> CommandConsumer:
    """The command side of the ledger hook (its evidence collector subscribes to pool events beside the publisher).

    With ``coordinator_url`` the node takes its governance state from the coordinator at start
    (``gpu_node.governance.sync``); without it, it replays ``kvledger.commands``.
    """
    handler = InvalidationApplier(engine, publisher.subject_key)
    command_key = pinned_command_key(settings)
    governance = None
    if settings.coordinator_url is not None:
        node_key, node_id = node_signing_key(settings), settings.node_id
        governance = GovernanceClient(
            settings.coordinator_url,
            lambda: issue_node_credential(node_key, node_id, NODE_CREDENTIAL_TTL_S),
            node_id,
            command_key,
        )
    return CommandConsumer(
        handler,
        publisher,
        kafka_settings(settings),
        command_key=command_key,
        governance=governance,
        stall_after_s=settings.kafka.stall_after_s,
    )


async def serve(settings: NodeSettings) -> None:
    """engine.start → publisher.start → command replay → ready; HTTP serves meanwhile.

    The HTTP server listens during the replay so ``/healthz`` answers (a long
    replay is not a dead process) while ``/readyz`` and generation answer 503
    until the command consumer has applied everything pending.
    """
    verifier = TokenVerifier(settings.auth)
    operator_verifier = (
        TokenVerifier(settings.operator_auth, secret_env=None)
        if settings.operator_auth.configured
        else None
    )
    engine = AsyncEngine.from_settings(settings)
    publisher = make_publisher(engine, settings)
    commands = make_command_consumer(engine, publisher, settings) if publisher is not None else None
    snapshots.delete_incomplete(engine.snapshot_root)
    await engine.start(ready=commands is None)
    tune_interpreter()
    if publisher is not None:
        await publisher.start(Path(settings.data_dir))
    if commands is not None:
        await commands.start()
    app = create_app(engine, verifier, operator_verifier=operator_verifier)
    server = uvicorn.Server(server_config(app, settings.host, settings.port, settings.http_limits))
    try:
        await server.serve()
    finally:
        if commands is not None:
            await commands.stop()
        if publisher is not None:
            await publisher.stop()
        await engine.stop()


def cli(args: argparse.Namespace) -> int:
    try:
        configure_logging()
    except ValueError as exc:
        print(f"kvledger node: error: {exc}", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    if not (Path(settings.model_dir) / "config.json").is_file():
        raise SystemExit(
            f"no model at {settings.model_dir}; create one with `kvledger model init {settings.model_dir}`"
        )
    try:
        asyncio.run(serve(settings))
    except (
        KVMemoryError
    ) as exc:  # the cache cannot fit this machine: one line naming the numbers, no traceback
        print(f"kvledger node: error: {exc}", file=sys.stderr)
        return 2
    return 0
