"""In-process GPU nodes for the integration tests: assembled as ``gpu_node.entrypoints.server.serve`` assembles them.

:class:`NodeServices` holds one node's engine, publisher and command consumer;
:class:`ServedNode` adds its OpenAI-compatible app on a real uvicorn server
(:class:`Served`) and the official ``openai`` client; :class:`RunningNode` starts and
stops them in ``serve``'s order, restartable (a new epoch). Test modules subclass them
with their own view of what the node holds or their own fault injection.
:class:`CoordinatorThread` runs a coordinator (consumers and HTTP API) for nodes that
talk to it: on an event loop of its own in a thread, because a node's pool asks the key
service synchronously (from whatever thread touches the pool), which must never wait on
the loop that is making the call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx
import openai
import uvicorn

from coordinator.api.app import create_app as create_coordinator_app
from coordinator.settings import CoordinatorSettings
from events.tiers import Tier
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app as create_node_app
from gpu_node.entrypoints.server import make_command_consumer, make_publisher
from gpu_node.settings import CacheSettings, NodeSettings
from helpers.ledger import (
    GROUP_TIMING,
    JWT_SECRET,
    SUBJECT_KEY,
    RunningConsumers,
    command_public_key_file,
    eventually,
    install_node_key,
)
from identity.tokens import TokenVerifier
from kvledger.net import loopback_listener
from prefix_keys.blocks import CacheScope, DocumentRef, num_cacheable_blocks
from prefix_keys.prompt import ChatMessage, render_prompt

TIMEOUT_S = 30.0


async def demote_to_disk(
    engine: AsyncEngine, block_hash: str, timeout_s: float = TIMEOUT_S
) -> None:
    """Move a cached block to the disk tier, waiting until its scope's data key is in the node's
    memory.

    With the coordinator's key service, a request's prefetch waits at most ``prefetch_wait_s`` for
    its keys and the fetch finishes in the background; on a loaded machine that can be after the
    response. Until then a tenant or user block cannot be sealed and ``demote`` answers False,
    leaving the block where it was (its look-up asked for the key meanwhile), so it is retried.
    """

    async def moved() -> bool:
        return await asyncio.to_thread(engine.pool.demote, bytes.fromhex(block_hash), Tier.DISK)

    await eventually(
        moved, timeout_s=timeout_s, what=f"block {block_hash[:12]} sealed onto the disk tier"
    )


@contextmanager
def node_on_thread(
    engine: AsyncEngine, app, name: str, start_timeout_s: float = 120.0
) -> Iterator[str]:
    """Serve ``app`` as ``gpu_node.entrypoints.server.serve`` does — the engine starts on the server's own event loop —
    in a thread of its own, for tests that call the node synchronously (or from another process); yields its URL."""
    sock = loopback_listener()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    async def serve() -> None:
        await engine.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            await engine.stop()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive(), f"{name} exited during startup (see the log above)"
        assert time.monotonic() < deadline, f"{name} did not start within {start_timeout_s:.0f} s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def node_settings(
    node_id: str,
    model_dir: Path,
    data_dir: Path,
    kafka_bootstrap: str,
    cache: CacheSettings,
    **extra,
) -> NodeSettings:
    """A node of the test session: its broker, the tests' subject key and JWT secret, a fast publisher, the tests'
    consumer timing (``helpers.ledger.GROUP_TIMING``), the test key of ``node_id`` as its own (enroll it with
    ``helpers.ledger.enroll_nodes`` where a coordinator checks it) and the tests' command key pinned."""
    install_node_key(data_dir, node_id)
    extra.setdefault("identity", {"coordinator_public_key_file": command_public_key_file()})
    extra["kafka"] = {**GROUP_TIMING, **extra.get("kafka", {})}
    return NodeSettings(
        node_id=node_id,
        model_dir=model_dir,
        data_dir=data_dir,
        kafka_bootstrap=kafka_bootstrap,
        subject_key=SUBJECT_KEY,
        publish_interval_s=0.02,
        auth={"jwt_secret": JWT_SECRET},
        cache=cache,
        **extra,
    )


class Served:
    """An ASGI app on a real uvicorn server in the running loop, on a loopback socket bound before it starts (no port race)."""

    def __init__(self, app) -> None:
        self.sock = loopback_listener()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        )
        self.task: asyncio.Task | None = None

    async def start(self) -> Served:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

        async def started() -> bool:
            if self.task.done():
                self.task.result()
            return self.server.started

        await eventually(started, timeout_s=TIMEOUT_S, what=f"uvicorn on {self.url}")
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, TIMEOUT_S)
        self.sock.close()


class CoordinatorThread:
    """``run_consumers`` and the HTTP API of one coordinator, on an event loop of their own in a
    thread."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.sock = loopback_listener()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # noqa: BLE001 - reported to the test thread
            self.error = error
            self.ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        consumers = await RunningConsumers(self.settings).start()
        server = uvicorn.Server(
            uvicorn.Config(
                create_coordinator_app(self.settings), log_level="warning", access_log=False
            )
        )
        serving = asyncio.create_task(server.serve(sockets=[self.sock]))
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        self.ready.set()
        await self._stop.wait()
        server.should_exit = True
        await serving
        await consumers.stop()

    async def start(self) -> CoordinatorThread:
        self._thread.start()
        assert await asyncio.to_thread(self.ready.wait, 90), (
            "the coordinator did not start within 90 s"
        )
        if self.error is not None:
            raise self.error
        return self

    async def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        await asyncio.to_thread(self._thread.join, 90)
        self.sock.close()


class NodeServices:
    """One node's engine, publisher and command consumer. :meth:`assemble` makes a new set (a restart is a new epoch)."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    def assemble(self) -> None:
        self.engine = AsyncEngine.from_settings(self.settings)
        self.publisher = make_publisher(self.engine, self.settings)
        self.commands = make_command_consumer(self.engine, self.publisher, self.settings)

    async def start_replay(self) -> None:
        """As ``serve`` does after ``engine.start(ready=False)``: the publisher (a new epoch), then the command replay."""
        await self.publisher.start(Path(self.settings.data_dir))
        await self.commands.start()

    async def stop_replay(self) -> None:
        await self.commands.stop()
        await self.publisher.stop()


class ServedNode(NodeServices):
    """A node whose OpenAI-compatible app listens on a real socket; requests go through the official
    client."""

    async def serve_http(self) -> None:
        self.http = await Served(
            create_node_app(self.engine, TokenVerifier(self.settings.auth))
        ).start()

    def client(self, token: str) -> openai.AsyncOpenAI:
        """No retries: a refusal must surface as it is."""
        return openai.AsyncOpenAI(
            base_url=f"{self.http.url}/v1", api_key=token, max_retries=0, timeout=60
        )

    async def chat(self, token: str, messages: list[dict]):
        async with self.client(token) as client:
            return await client.chat.completions.create(
                model=self.engine.model_name, messages=messages, max_tokens=1, temperature=0
            )

    async def cached(self, token: str, messages: list[dict]) -> int:
        return (await self.chat(token, messages)).usage.prompt_tokens_details.cached_tokens

    def prefix_tokens(self, messages: list[dict]) -> tuple[int, int]:
        """(tokens a full prefix hit serves, tokens the public system message's own blocks serve) for ``messages``."""
        prompt = render_prompt(self.engine.runner.tokenizer, [engine_message(m) for m in messages])
        block_size = self.settings.cache.block_size
        full = num_cacheable_blocks(len(prompt.token_ids), block_size) * block_size
        return full, prompt.segments[0].end // block_size * block_size


class RunningNode(ServedNode):
    """A node started and stopped as ``serve`` does; stoppable and restartable (a new epoch)."""

    def __init__(self, settings: NodeSettings) -> None:
        super().__init__(settings)
        self.running = False
        self.replaying = False

    async def start(self, *, replay: bool = True) -> Self:
        """``engine.start(ready=False)`` → HTTP up → publisher → command replay; ``replay=False`` stops before the
        publisher (:meth:`replay` goes on). The HTTP server listens from the start, as in ``serve``, so readiness
        can be observed from outside."""
        self.assemble()
        await self.engine.start(ready=False)
        self.running = True
        await self.serve_http()
        if replay:
            await self.replay()
        return self

    async def replay(self) -> None:
        self.replaying = True
        await self.start_replay()

    async def replayed(self, timeout_s: float = 60.0) -> None:
        """Until the command log is replayed (the node then answers ready)."""
        await asyncio.wait_for(self.commands.replayed.wait(), timeout_s)

    async def ready(self) -> bool:
        async with httpx.AsyncClient(base_url=self.http.url) as client:
            return (await client.get("/readyz")).status_code == 200

    async def stop(self) -> None:
        """Idempotent, so a test that failed while the node was down leaves its fixture's teardown
        working."""
        if not self.running:
            return
        self.running = False
        await self.http.stop()
        if self.replaying:
            self.replaying = False
            await self.stop_replay()
        await self.engine.stop()


def engine_message(message: dict) -> ChatMessage:
    """An OpenAI-style chat message as the node's API turns it into an engine message."""
    document = message.get("document")
    if document is not None:
        ref = DocumentRef(document["id"], document["version"], document["auth_scope"])
        return ChatMessage(message["role"], message["content"], CacheScope.TENANT, ref)
    return ChatMessage(
        message["role"], message["content"], CacheScope.parse(message.get("cache_scope", "user"))
    )
