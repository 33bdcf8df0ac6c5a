"""The images build on a Debian base made on this machine and run: the coordinator's without torch, the node's with it.

Registry images cannot be pulled everywhere the suite runs; ``docker/build-base.sh`` makes the base
with debootstrap (and starts dockerd where none answers). These tests run in the containers mode
only (``KVLEDGER_TEST_SERVICES=containers``), and are skipped with the reason where no Docker
engine can start. The node image (torch, about 1.7 GB, minutes to build) is built only when
``KVLEDGER_TEST_NODE_IMAGE=1`` asks for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.containers import (
    LABEL,
    ROOT,
    EngineUnavailable,
    build,
    distribution_packages,
    prepare_engine,
)

containers_mode = pytest.mark.skipif(
    os.environ.get("KVLEDGER_TEST_SERVICES") != "containers",
    reason="builds Docker images: runs with KVLEDGER_TEST_SERVICES=containers",
)

RUN_TIMEOUT_S = 120
TORCH = "torch==2.13.0"


@pytest.fixture(scope="module")
def engine() -> None:
    try:
        prepare_engine()
    except EngineUnavailable as exc:
        pytest.skip(f"no Docker engine can start here: {exc}")


def _context(directory: Path) -> Path:
    """A build context of exactly what the Dockerfiles COPY (the checkout's own stays untouched)."""
    directory.mkdir(exist_ok=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, directory / name)
    for package in sorted(distribution_packages()):
        shutil.copytree(
            ROOT / package,
            directory / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    (directory / "docker" / "wheels").mkdir(parents=True)
    shutil.copy(ROOT / "docker" / "secrets-env.sh", directory / "docker" / "secrets-env.sh")
    return directory


def _run(image: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "run", "--rm", "--label", f"{LABEL}=image-test", image, *command],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
    )  # fmt: skip


@pytest.mark.containers
@containers_mode
def test_coordinator_image_builds_on_the_local_base_and_runs_without_torch(
    engine: None, tmp_path: Path
) -> None:
    image = build(ROOT / "docker" / "Dockerfile", "kvledger/coordinator:local", _context(tmp_path))
    usage = _run(image, "kvledger", "verify-receipt", "--help")
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: kvledger verify-receipt")
    imports = _run(
        image,
        "python",
        "-c",
        "import importlib.util, coordinator.api.app, coordinator.consumers; print(importlib.util.find_spec('torch'))",
    )
    assert (imports.returncode, imports.stdout) == (0, "None\n"), imports.stderr
    user = _run(image, "id", "-u")
    assert (user.returncode, user.stdout) == (0, "10001\n"), user.stderr


@pytest.mark.containers
@containers_mode
def test_node_image_builds_on_the_local_base_with_the_cpu_torch(
    engine: None, tmp_path: Path
) -> None:
    if os.environ.get("KVLEDGER_TEST_NODE_IMAGE") != "1":
        pytest.skip(
            "the node image (torch, ~1.7 GB, ~5 min to build) is built only with KVLEDGER_TEST_NODE_IMAGE=1"
        )
    context = _context(tmp_path / "context")
    # pip's own sources decide where the wheel comes from (a local wheel directory where the machine
    # has one)
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(context / "docker" / "wheels"), TORCH],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert download.returncode == 0, download.stderr
    image = build(ROOT / "docker" / "Dockerfile.gpu", "kvledger/node:local", context)
    imports = _run(
        image, "python", "-c", "import torch, gpu_node; print(torch.__version__.split('+')[0])"
    )
    assert (imports.returncode, imports.stdout) == (0, "2.13.0\n"), imports.stderr
    usage = _run(image, "kvledger", "node", "--help")
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: kvledger node")


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="as non-root the script starts dockerd through sudo, whose PATH skips the stubs",
)
def test_where_no_engine_can_start_the_reason_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skip reason of the containers mode: dockerd is started, does not answer, and the script says so."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("docker", "dockerd", "debootstrap"):  # an engine that never answers
        (stubs / name).write_text("#!/bin/sh\nexit 1\n")
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    monkeypatch.setenv("KVLEDGER_DOCKERD_LOG", str(tmp_path / "dockerd.log"))
    monkeypatch.setenv("KVLEDGER_DOCKERD_START_TIMEOUT_S", "1")
    monkeypatch.setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
    with pytest.raises(EngineUnavailable) as raised:
        prepare_engine()
    assert str(raised.value).startswith("docker/build-base.sh exited 1: ")
    assert "dockerd did not answer within 1s" in str(raised.value)
