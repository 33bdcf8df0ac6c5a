"""A request with the most messages the API accepts must not take the node off the air.

The node runs as its own process (``kvledger node``, the tiny model), exactly as
deployed. While it parses a 10,000-message request, ``/healthz`` is polled
concurrently: every answer must come within a second, and the big request itself
must be answered. Rendering every prompt prefix on the event loop (the old way)
held the loop for minutes on this request.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from helpers.fork_server import ForkServer

from identity.tokens import issue_token
from kvledger.net import loopback_listener
from kvledger.processes import spawn_cli

SECRET = "prompt-dos-test-secret-0123456789abcdef"
NUM_MESSAGES = 10_000
MAX_HEALTH_LATENCY_S = 1.0
MAX_REQUEST_S = 60.0
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def node_url(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
):
    data_dir = tmp_path_factory.mktemp("dos-node")
    with loopback_listener() as probe:
        port = probe.getsockname()[1]
    env = os.environ | {"KVLEDGER_NODE_AUTH__JWT_SECRET": SECRET}
    env.pop("KVLEDGER_KAFKA_BOOTSTRAP", None)
    env.pop("KVLEDGER_NODE_KAFKA_BOOTSTRAP", None)
    log_path = data_dir / "node.log"
    args = [
        "node",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--node-id",
        "dos-node",
        "--data-dir",
        str(data_dir),
    ]
    process = spawn_cli(args, env, log_path, launcher=fork_server.launch)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, (
                f"the node exited ({process.returncode}):\n{log_path.read_text()[-4000:]}"
            )
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (
                f"the node was not ready after {STARTUP_TIMEOUT_S:.0f} s"
            )
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _poll_health(client: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
    latencies = []
    while not done.is_set():
        started = time.perf_counter()
        response = await client.get("/healthz", timeout=30)
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200
        await asyncio.sleep(0.02)
    return latencies


async def test_node_stays_responsive_while_parsing_the_largest_request(node_url: str):
    token = issue_token(
        tenant="acme", sub="mallory", scopes=(), pv=1, roles=(), ttl_s=600, secret=SECRET
    )
    messages = [
        {
            "role": "user" if index % 2 == 0 else "assistant",
            "content": f"message {index}: all work and no play",
        }
        for index in range(NUM_MESSAGES)
    ]
    async with httpx.AsyncClient(base_url=node_url) as client:
        model = (
            await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
        ).json()["data"][0]["id"]
        done = asyncio.Event()
        poller = asyncio.create_task(_poll_health(client, done))
        started = time.perf_counter()
        try:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 1},
                headers={"Authorization": f"Bearer {token}"},
                timeout=MAX_REQUEST_S,
            )
        finally:
            elapsed_s = time.perf_counter() - started
            done.set()
            latencies = await poller
    assert elapsed_s < MAX_REQUEST_S
    # The tiny model's context is far shorter than 10,000 messages: a clear refusal, after rendering
    # them all.
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert latencies, "no health check ran while the request was parsed"
    assert max(latencies) < MAX_HEALTH_LATENCY_S, (
        f"/healthz took up to {max(latencies):.2f} s ({len(latencies)} polls)"
    )
