"""``kvledger up``: the whole system on one machine.

Starts PostgreSQL and the Kafka-protocol broker (embedded unless external URLs
are given), applies migrations, then runs the coordinator and N nodes as child
processes and one fleet router in front of the nodes (``kvledger router``, ``router_url`` in
``stack.json``), waits until each answers ``/readyz``, writes ``stack.json`` and stays
in the foreground until Ctrl-C or SIGTERM, when everything is stopped in reverse
order. Each step prints its elapsed time as it completes (``[  3.2s] postgres ready``),
since a first start builds the model and can take minutes. The stack is supervised: when
any child exits on its own, everything is stopped and ``kvledger up`` exits 1 naming it.

Children share one JWT secret (end users), one subject-digest key and one
metrics token (the bearer token of every ``/metrics``, recorded in ``stack.json`` for
scrapers), generated once per state directory and kept there with mode 0600; an
Ed25519 operator key pair (``operator_key.pem``, 0600, and ``operator_key.pub.pem``)
signs operator tokens, and the coordinator and nodes verify them with its public half.

Trust (``docs/security.md``): the coordinator alone gets the master key, the database
URL and the command signing key (``command_key.pem`` in the state dir). Each node gets
its own key (``node_key.pem`` in its data dir), enrolled in the registry after the
migrations, and pins the command public key (``command_key.pub``); no node process
sees the master key, the database credentials or any other signing key. The stack's
producer key (``producer_key.pem``, 0600, ``producer_key_file`` in ``stack.json``) is enrolled
for every tenant, so ``kvledger publish`` and ``kvledger demo`` sign customer events with it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from coordinator.ledger.migrate import upgrade
from gpu_node.keys.node_identity import NODE_KEY_FILE
from identity.roles import ROUTER
from identity.signing import load_or_create_private_key, private_key_pem, public_key_pem
from identity.tokens import generate_ed25519_key_pair, issue_token
from kvledger.model_init import build_default_model, build_tiny_model, is_complete
from kvledger.nodes import enroll_node_key
from kvledger.processes import Process, spawn_cli
from kvledger.producers import enroll_producer_key
from kvledger.services import EmbeddedKafka, EmbeddedPostgres

READY_TIMEOUT_S = 120.0
COORDINATOR_ONLY_ENV = (
    "KVLEDGER_MASTER_KEY",
    "KVLEDGER_DATABASE_URL",
    "KVLEDGER_COMMAND_SIGNING_KEY",
    "KVLEDGER_RECEIPT_SIGNING_KEY",
)
"""Never in a node's environment, even when the shell that runs ``kvledger up`` has them."""


def _secret(path: Path, make=lambda: secrets.token_urlsafe(32)) -> str:
    """A per-state-dir secret, created once, readable by the owner only."""
    if path.exists():
        return path.read_text().strip()
    value = make()
    path.touch(mode=0o600)
    path.write_text(value)
    return value


def _operator_key_pair(state_dir: Path) -> tuple[Path, Path]:
    """The stack's operator key pair (private 0600, public), created once per state directory."""
    private_path, public_path = state_dir / "operator_key.pem", state_dir / "operator_key.pub.pem"
    if not (private_path.exists() and public_path.exists()):
        private_pem, public_pem = generate_ed25519_key_pair()
        private_path.unlink(missing_ok=True)
        private_path.touch(mode=0o600)
        private_path.write_bytes(private_pem)
        public_path.write_bytes(public_pem)
    return private_path, public_path


async def _wait_ready(url: str, process: Process, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with status {process.returncode} before it was ready"
                )
            try:
                if (await client.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if loop.time() >= deadline:
                raise TimeoutError(f"{what} not ready at {url} after {READY_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.2)


class ChildExited(Exception):
    """A child process of the stack exited on its own: the stack is incomplete and was stopped."""


class _Progress:
    """Prints each completed startup step with the seconds since ``kvledger up`` began."""

    def __init__(self) -> None:
        self._started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self._started:6.1f}s] {message}", flush=True)


async def _stop(processes: list[Process]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
    for process in reversed(processes):
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), 20)
        except TimeoutError:
            process.kill()


async def up(args: argparse.Namespace) -> None:
    """Start the stack and supervise it until a signal (returns) or a child's exit (raises
    ChildExited)."""
    progress = _Progress()
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir).resolve()
    if is_complete(model_dir):
        progress(f"model found in {model_dir}")
    else:
        # The default is the real SmolLM2-135M-Instruct; the tiny test model is seconds to build and
        # says nothing.
        progress(
            f"building the {'tiny' if args.tiny else 'SmolLM2-135M-Instruct'} model in {model_dir}"
        )
        await asyncio.to_thread(build_tiny_model if args.tiny else build_default_model, model_dir)
        progress("model built")

    postgres = kafka = None
    processes: list[Process] = []
    names: dict[int, str] = {}
    """Child pid → what it runs, to say which one exited."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        if args.database_url:
            database_url = args.database_url
        else:
            postgres = await EmbeddedPostgres(state_dir / "postgres").start()
            database_url = postgres.database_url
            progress("postgres ready")
        if args.kafka_bootstrap:
            kafka_bootstrap = args.kafka_bootstrap
        else:
            kafka = await EmbeddedKafka(state_dir=state_dir).start()
            kafka_bootstrap = kafka.bootstrap
            progress("broker ready")
        await asyncio.to_thread(upgrade, database_url)
        progress("migrations applied")

        env = _environments(state_dir, database_url, kafka_bootstrap)
        coordinator_env, node_env = env.coordinator, env.node
        node_ids = [f"node-{index}" for index in range(args.nodes)]
        producer_key_file = await _enroll_keys(state_dir, database_url, node_ids, progress)
        logs = state_dir / "logs"
        logs.mkdir(exist_ok=True)

        coordinator_port = args.port - 100
        coordinator_url = f"http://127.0.0.1:{coordinator_port}"
        coordinator = spawn_cli(
            ["coordinator", "--port", str(coordinator_port)],
            coordinator_env,
            logs / "coordinator.log",
        )
        processes.append(coordinator)
        names[coordinator.pid] = "coordinator"
        # nodes fetch their data keys from the coordinator, so it must answer first
        await _wait_ready(coordinator_url, coordinator, "coordinator")
        progress(f"coordinator ready at {coordinator_url}")
        node_env["KVLEDGER_COORDINATOR_URL"] = coordinator_url
        # Each node may pull a prefix from the others (docs/architecture.md "Replicas"): the trusted
        # peer list a router's pull hint is resolved in, never an address a request brings.
        node_env["KVLEDGER_NODE_PEERS__URLS"] = json.dumps(
            {
                node_id: f"http://127.0.0.1:{args.port + index}"
                for index, node_id in enumerate(node_ids)
            }
        )
        node_urls = []
        for index, node_id in enumerate(node_ids):
            port = args.port + index
            node = spawn_cli(
                [
                    "node",
                    "--model",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--node-id",
                    node_id,
                    "--data-dir",
                    str(state_dir / node_id),
                ],
                node_env,
                logs / f"{node_id}.log",
            )
            processes.append(node)
            names[node.pid] = node_id
            node_urls.append(f"http://127.0.0.1:{port}")
        for url, node in zip(node_urls, processes[1:], strict=True):
            await _wait_ready(url, node, f"node at {url}")
            progress(f"{names[node.pid]} ready at {url}")
        router_url = f"http://127.0.0.1:{args.port + ROUTER_PORT_OFFSET}"
        router_env = _router_env(
            state_dir,
            node_env,
            env.operator_private_key_file,
            dict(zip(node_ids, node_urls, strict=True)),
        )
        router = spawn_cli(
            ["router", "--model", str(model_dir), "--port", str(args.port + ROUTER_PORT_OFFSET)],
            router_env,
            logs / "router.log",
        )
        processes.append(router)
        names[router.pid] = "router"
        await _wait_ready(router_url, router, f"router at {router_url}")
        progress(f"router ready at {router_url}")

        _write_stack_file(
            state_dir,
            {
                "coordinator_url": coordinator_url,
                "node_urls": node_urls,
                "router_url": router_url,
                "kafka_bootstrap": kafka_bootstrap,
                "database_url": database_url,
                "jwt_secret": env.jwt_secret,
                "operator_private_key_file": str(env.operator_private_key_file),
                "operator_public_key_file": str(env.operator_public_key_file),
                "producer_key_file": str(producer_key_file),
                "metrics_token": env.metrics_token,
                "model_dir": str(model_dir),
                "logs": str(logs),
                "pids": {names[process.pid]: process.pid for process in processes},
            },
        )
        await _supervise(processes, names, stopping, logs)
    finally:
        await _stop(processes)
        if kafka is not None:
            await kafka.stop()
        if postgres is not None:
            await postgres.stop()


ROUTER_PORT_OFFSET = 100
"""The router listens 100 above the first node's port (8200 by default), as the coordinator listens 100 below it."""
ROUTER_TOKEN_FILE = "router_token"
ROUTER_TOKEN_TTL_S = 30 * 24 * 3600
"""The dev router's operator token (role ``router``) is minted again at every ``kvledger up``; a month outlasts any session."""


def _router_env(
    state_dir: Path,
    node_env: dict[str, str],
    operator_private_key_file: Path,
    node_urls: dict[str, str],
) -> dict[str, str]:
    """The router's environment: what a node gets (no coordinator secrets), its nodes, and an operator token with the
    ``router`` role (``router_token``, 0600, signed with the stack's operator key) for the coordinator's ``/v1/router/*``."""
    token = issue_token(
        tenant="platform",
        sub="kvledger-up-router",
        roles=[ROUTER],
        ttl_s=ROUTER_TOKEN_TTL_S,
        private_key_pem=operator_private_key_file.read_bytes(),
    )
    token_file = state_dir / ROUTER_TOKEN_FILE
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    return node_env | {
        "KVLEDGER_ROUTER_NODES": json.dumps(
            [{"node_id": node_id, "url": url} for node_id, url in node_urls.items()]
        ),
        "KVLEDGER_ROUTER_COORDINATOR_TOKEN_FILE": str(token_file),
        "KVLEDGER_ROUTER_COORDINATOR_PUBLIC_KEY_FILE": node_env[
            "KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE"
        ],
    }


PRODUCER_KEY_FILE = "producer_key.pem"
"""The dev stack's customer-event producer key in the state directory, enrolled for every tenant."""


async def _enroll_keys(
    state_dir: Path, database_url: str, node_ids: list[str], progress: _Progress
) -> Path:
    """Enroll each node's key (created in its data dir if missing) and the stack's producer key
    (``producer_key.pem``, 0600, bound to all tenants: what ``kvledger publish`` and ``kvledger
    demo`` sign with); returns the producer key's path."""
    for node_id in node_ids:
        node_key = load_or_create_private_key(state_dir / node_id / NODE_KEY_FILE)
        await enroll_node_key(database_url, node_id, node_key.public_key())
    progress(f"node keys enrolled ({', '.join(node_ids)})")
    producer_key_file = state_dir / PRODUCER_KEY_FILE
    producer_key = load_or_create_private_key(producer_key_file)
    await enroll_producer_key(
        database_url, producer_key.public_key(), None, name="kvledger-up dev producer"
    )
    progress(f"producer key enrolled for all tenants ({producer_key_file})")
    return producer_key_file


@dataclass(frozen=True)
class _Environments:
    """The stack's secrets and the environment each kind of child starts with."""

    jwt_secret: str
    operator_private_key_file: Path
    operator_public_key_file: Path
    metrics_token: str
    coordinator: dict[str, str]
    node: dict[str, str]


def _environments(state_dir: Path, database_url: str, kafka_bootstrap: str) -> _Environments:
    """Secrets are made once in the state directory and reused by later runs; the coordinator alone
    gets the master key, the database and the command signing key (nodes never see them)."""
    jwt_secret = os.environ.get("KVLEDGER_JWT_SECRET") or _secret(state_dir / "jwt_secret")
    operator_private_key, operator_public_key = _operator_key_pair(state_dir)
    metrics_token = os.environ.get("KVLEDGER_METRICS_TOKEN") or _secret(state_dir / "metrics_token")
    shared_env = {
        "KVLEDGER_COORDINATOR_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE": str(operator_public_key),
        "KVLEDGER_NODE_OPERATOR_AUTH__JWT_PUBLIC_KEY_FILE": str(operator_public_key),
        "KVLEDGER_METRICS_TOKEN": metrics_token,
        "KVLEDGER_JWT_SECRET": jwt_secret,
        "KVLEDGER_SUBJECT_KEY": _secret(state_dir / "subject_key"),
        "KVLEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap,
    }
    command_key = load_or_create_private_key(state_dir / "command_key.pem")
    command_public_key_file = state_dir / "command_key.pub"
    command_public_key_file.write_bytes(public_key_pem(command_key.public_key()))
    coordinator_env = (
        dict(os.environ)
        | shared_env
        | {
            # data keys for tenant/user blocks at rest live in the coordinator, wrapped with this
            "KVLEDGER_MASTER_KEY": _secret(
                state_dir / "master_key", lambda: base64.b64encode(secrets.token_bytes(32)).decode()
            ),
            "KVLEDGER_DATABASE_URL": database_url,
            "KVLEDGER_COMMAND_SIGNING_KEY": private_key_pem(command_key).decode(),
        }
    )
    node_env = (
        {name: value for name, value in os.environ.items() if name not in COORDINATOR_ONLY_ENV}
        | shared_env
        | {
            "KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE": str(command_public_key_file),
        }
    )
    return _Environments(
        jwt_secret,
        operator_private_key,
        operator_public_key,
        metrics_token,
        coordinator_env,
        node_env,
    )


def _write_stack_file(state_dir: Path, stack: dict) -> Path:
    """Write ``stack.json`` (owner-only: it holds the stack's secrets) and print where things are."""
    stack_file = state_dir / "stack.json"
    stack_file.touch(mode=0o600)
    stack_file.write_text(json.dumps(stack, indent=2))
    print(f"coordinator  {stack['coordinator_url']}")
    for url in stack["node_urls"]:
        print(f"node         {url}   (OpenAI base_url {url}/v1)")
    print(f"kafka        {stack['kafka_bootstrap']}")
    print(f"database     {stack['database_url']}")
    print(f"stack file   {stack_file}   logs in {stack['logs']}")
    print("Ctrl-C stops everything.", flush=True)
    return stack_file


async def _supervise(
    processes: list[Process], names: dict[int, str], stopping: asyncio.Event, logs: Path
) -> None:
    """Wait for a stop signal (return) or the first child to exit (raise ChildExited naming it)."""
    waiters = [asyncio.create_task(asyncio.to_thread(p.wait)) for p in processes]
    stop_task = asyncio.create_task(stopping.wait())
    await asyncio.wait([stop_task, *waiters], return_when=asyncio.FIRST_COMPLETED)
    stop_task.cancel()
    if not stopping.is_set():
        exited = next(process for process in processes if process.poll() is not None)
        name = names[exited.pid]
        raise ChildExited(
            f"{name} (pid {exited.pid}) exited with status {exited.returncode}; stopped the stack (log: {logs / (name + '.log')})"
        )


def cli(args: argparse.Namespace) -> int:
    """0 after Ctrl-C or SIGTERM; 1 with one line on stderr when a child died or a service never became ready."""
    try:
        asyncio.run(up(args))
    except (ChildExited, RuntimeError, TimeoutError) as error:
        print(f"kvledger up: error: {error}", file=sys.stderr)
        return 1
    return 0
