"""The container images install only their profile and ship every package the install needs."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from helpers.containers import distribution_packages

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(dockerfile: str) -> list[str]:
    text = (ROOT / "docker" / dockerfile).read_text().replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _copied_dirs(instructions: list[str]) -> set[str]:
    return {m.group(1) for line in instructions if (m := re.fullmatch(r"COPY (\w+) \./\1", line))}


def test_images_take_their_base_image_as_a_build_argument() -> None:
    """The public image by default; the local Debian base of docker/build-base.sh where registries are out of reach."""
    defaults = {
        "Dockerfile": "python:3.11-slim",
        "Dockerfile.gpu": "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04",
        "Dockerfile.postgres": "debian:bookworm-slim",
        "Dockerfile.tansu": "debian:bookworm-slim",
    }
    for dockerfile, default in defaults.items():
        instructions = _instructions(dockerfile)
        assert instructions[0] == f"ARG BASE_IMAGE={default}", dockerfile
        assert instructions[1] == "FROM ${BASE_IMAGE}", dockerfile
        users = [line for line in instructions if line.startswith("USER ")]
        assert users and users[-1] != "USER root", dockerfile


def test_images_build_without_buildkit() -> None:
    """The legacy builder (the only one where buildx is not installed) rejects ``COPY --chmod`` and
    ``RUN --mount``."""
    for dockerfile in ("Dockerfile", "Dockerfile.gpu", "Dockerfile.postgres", "Dockerfile.tansu"):
        for line in _instructions(dockerfile):
            assert not re.match(r"(COPY|ADD|RUN) --(chmod|chown|mount|link)", line), (
                dockerfile,
                line,
            )


def test_coordinator_image_installs_the_base_profile_only() -> None:
    instructions = _instructions("Dockerfile")
    assert _copied_dirs(instructions) == distribution_packages()
    installs = [line for line in instructions if "pip install" in line]
    assert installs == [
        "RUN pip install . && chmod 755 /usr/local/bin/kvledger-secrets-env && useradd --system --uid 10001 kvledger"
    ]
    assert not any("torch" in line for line in instructions)


def test_node_image_installs_the_node_profile() -> None:
    instructions = _instructions("Dockerfile.gpu")
    assert _copied_dirs(instructions) == distribution_packages()
    installs = [
        re.search(r"pip install (--find-links /tmp/wheels )?(\S+)", line).group(2)
        for line in instructions
        if "pip install" in line
    ]
    assert installs == ['"torch==2.13.0"', '".[node]"']
    # a torch wheel put in docker/wheels/ (the CPU build, for a CPU-only image) wins over the index
    assert "COPY docker/wheels/ /tmp/wheels/" in instructions
    assert set(PROJECT["project"]["optional-dependencies"]) >= {"node", "embedded", "test"}


def test_images_read_secrets_from_files_through_their_entrypoint() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        instructions = _instructions(dockerfile)
        assert "COPY docker/secrets-env.sh /usr/local/bin/kvledger-secrets-env" in instructions, (
            dockerfile
        )
        assert "chmod 755 /usr/local/bin/kvledger-secrets-env" in next(
            line for line in instructions if "useradd" in line
        ), dockerfile
        assert instructions.index('ENTRYPOINT ["kvledger-secrets-env"]') > instructions.index(
            "USER kvledger"
        ), dockerfile


def test_node_image_lets_its_user_fill_a_fresh_model_volume() -> None:
    (install,) = [
        line for line in _instructions("Dockerfile.gpu") if 'pip install ".[node]"' in line
    ]
    assert install.endswith(
        "mkdir -p /var/lib/kvledger /models && chown kvledger /var/lib/kvledger /models"
    )


def _shim(env: dict[str, str], *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(ROOT / "docker" / "secrets-env.sh"), *command],
        env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_the_entrypoint_turns_secret_files_into_variables(tmp_path: Path) -> None:
    pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n"
    (tmp_path / "command_signing_key").write_text(pem)
    (tmp_path / "jwt_secret").write_text("a secret with spaces $HOME and 'quotes'\n\n")
    show = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('KVLEDGER_')}))"
    run = _shim(
        {"KVLEDGER_COMMAND_SIGNING_KEY_FILE": str(tmp_path / "command_signing_key"), "KVLEDGER_JWT_SECRET_FILE": str(tmp_path / "jwt_secret"),
         "KVLEDGER_METRICS_TOKEN_FILE": "/run/secrets/metrics_token"},
        sys.executable, "-c", show,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (
        json.loads(run.stdout)
        == {
            "KVLEDGER_COMMAND_SIGNING_KEY": pem.rstrip("\n"),
            "KVLEDGER_JWT_SECRET": "a secret with spaces $HOME and 'quotes'",
            "KVLEDGER_METRICS_TOKEN_FILE": "/run/secrets/metrics_token",  # read by the services themselves
        }
    )
    both = _shim(
        {"KVLEDGER_JWT_SECRET": "x", "KVLEDGER_JWT_SECRET_FILE": str(tmp_path / "jwt_secret")},
        "true",
    )
    assert (both.returncode, both.stderr) == (
        2,
        "kvledger: set KVLEDGER_JWT_SECRET or KVLEDGER_JWT_SECRET_FILE, not both\n",
    )
    missing = _shim({"KVLEDGER_MASTER_KEY_FILE": str(tmp_path / "absent")}, "true")
    assert (missing.returncode, missing.stderr) == (
        2,
        f"kvledger: cannot read KVLEDGER_MASTER_KEY_FILE ({tmp_path / 'absent'})\n",
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="make-secrets.sh needs openssl")
def test_make_secrets_writes_every_compose_secret_once(tmp_path: Path) -> None:
    docker = tmp_path / "docker"
    docker.mkdir()
    shutil.copy(ROOT / "docker" / "make-secrets.sh", docker)
    run = subprocess.run(
        ["sh", str(docker / "make-secrets.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    secrets = docker / "secrets"
    # The router's operator token comes from the operator issuer, which the script cannot mint (the
    # router service's comment).
    assert {path.name for path in secrets.iterdir()} == set(compose["secrets"]) - {"router_token"}
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert {stat.S_IMODE(path.stat().st_mode) for path in secrets.iterdir()} == {0o644}
    password = (secrets / "postgres_password").read_text().strip()
    assert (
        secrets / "database_url"
    ).read_text() == f"postgresql+asyncpg://kvledger:{password}@postgres:5432/kvledger\n"
    assert (secrets / "command_signing_key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert (docker / "command_key.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    before = {path.name: path.read_bytes() for path in secrets.iterdir()}
    again = subprocess.run(
        ["sh", str(docker / "make-secrets.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (again.returncode, again.stdout) == (0, "")
    assert {path.name: path.read_bytes() for path in secrets.iterdir()} == before


def test_the_build_context_leaves_out_secrets_and_keeps_what_the_images_copy() -> None:
    patterns = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    for private in (".git", ".venv", ".kvledger", ".env", "docker/secrets", "**/*.pem", "tests"):
        assert private in patterns
    copied = {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "docker/secrets-env.sh",
        "docker/wheels",
        "docker/postgres-entrypoint.sh",
    } | distribution_packages()
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        copied |= _copied_dirs(_instructions(dockerfile))
    for path in copied:
        assert not any(
            fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/")
            for pattern in patterns
        ), path
        assert (ROOT / path).exists(), path
