"""``kvledger`` as a real process against the coordinator's API served over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn

from coordinator.api.app import create_app
from coordinator.settings import CoordinatorSettings
from helpers.ledger import OPERATOR_PRIVATE_KEY_PEM, eventually


@contextlib.asynccontextmanager
async def served_stack(settings: CoordinatorSettings, stack_dir: Path) -> AsyncIterator[Path]:
    """The coordinator's API on a free local port and ``stack_dir`` holding the stack file the CLI
    reads (its URL and the tests' operator key); yields ``stack_dir``."""
    key_file = stack_dir / "operator_key.pem"
    key_file.write_bytes(OPERATOR_PRIVATE_KEY_PEM)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started, what="the API server")
        port = server.servers[0].sockets[0].getsockname()[1]
        stack = {
            "coordinator_url": f"http://127.0.0.1:{port}",
            "operator_private_key_file": str(key_file),
        }
        (stack_dir / "stack.json").write_text(json.dumps(stack))
        yield stack_dir
    finally:
        server.should_exit = True
        await serving


async def kvledger(*args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run ``kvledger *args``; its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvledger.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    assert process.returncode is not None, "communicate() waits for the exit"
    return process.returncode, out.decode(), err.decode()
