"""``kvledger coordinator --role api|consumers|all``: one process, HTTP API and/or consumers.

The process owns SIGTERM/SIGINT: either one sets a stop event, uvicorn drains its
connections and runs the app's lifespan shutdown, the consumers finish and commit
their in-flight batch; then the process exits 0. If one half dies, the other is
stopped too and the exit status is 1, so a supervisor restarts the whole process.

``/readyz`` answers 200 only once the process's consumers are consuming
(:class:`coordinator.readiness.ConsumerReadiness`): with ``--role all`` on the API, with
``--role consumers`` on :mod:`coordinator.api.ops_app` (``/healthz``, ``/readyz``, ``/metrics``)
at the configured HTTP host and port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from coordinator.api.app import create_app
from coordinator.api.ops_app import create_ops_app
from coordinator.consumers import run_consumers
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings
from events.http_server import server_config
from events.logs import configure_logging

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`serve` decides when to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    settings: CoordinatorSettings,
    app: FastAPI,
    consumers: bool,
    readiness: ConsumerReadiness | None = None,
) -> int:
    """Run the HTTP ``app`` and, with ``consumers``, the consumers until SIGTERM/SIGINT; returns the
    exit status.

    ``readiness`` is handed to the consumers; the app's ``/readyz`` reads the same one (the
    API's with ``--role all``, :mod:`coordinator.api.ops_app`'s with ``--role consumers``).
    """
    # Imported libraries are ~10^5 long-lived objects; frozen, full collections stop rescanning
    # them (a pause of up to hundreds of ms in the middle of a batch).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task] = []
    if consumers:
        tasks.append(
            asyncio.create_task(
                run_consumers(settings, stop, readiness=readiness), name="consumers"
            )
        )
    server = _Server(
        server_config(app, settings.http.host, settings.http.port, settings.http_limits)
    )
    tasks.append(asyncio.create_task(server.serve(), name="http"))
    tasks.append(asyncio.create_task(_exit_on(stop, server), name="http stopper"))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped_by_signal = stop.is_set()
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        log.error("coordinator task failed: %s", type(failure).__name__, exc_info=failure)
    return 0 if stopped_by_signal and not failures else 1


async def _exit_on(stop: asyncio.Event, server: uvicorn.Server) -> None:
    await stop.wait()
    server.should_exit = True


def cli(args: argparse.Namespace) -> int:
    overrides: dict[str, dict] = {}
    if args.database_url:
        overrides["database"] = {"url": args.database_url}
    if args.kafka_bootstrap:
        overrides["kafka"] = {"bootstrap": args.kafka_bootstrap}
    http = {
        key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None
    }
    if http:
        overrides["http"] = http
    try:
        configure_logging()
        settings = CoordinatorSettings(**overrides)
        consumers = args.role in ("consumers", "all")
        readiness = ConsumerReadiness() if consumers else None
        if args.role in ("api", "all"):
            app = create_app(settings, consumers=readiness)
        else:
            app = create_ops_app(settings, readiness)
    except (
        ValueError
    ) as exc:  # configuration the operator has to fix (no JWT key, bad URL, log format, ...)
        print(f"kvledger coordinator: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(settings, app, consumers=consumers, readiness=readiness))
