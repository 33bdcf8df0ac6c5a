"""The container images install only their profile and ship every package the install needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages() -> set[str]:
    """Top-level packages of the distribution (``[tool.setuptools.packages.find] include``)."""
    return {pattern.rstrip("*") for pattern in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}


def _instructions(dockerfile: str) -> list[str]:
    text = (ROOT / "docker" / dockerfile).read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _copied_dirs(instructions: list[str]) -> set[str]:
    return {m.group(1) for line in instructions if (m := re.fullmatch(r"COPY (\w+) \./\1", line))}


def test_images_take_their_base_image_as_a_build_argument() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        instructions = _instructions(dockerfile)
        assert instructions[0].startswith("ARG BASE_IMAGE="), dockerfile
        assert instructions[1] == "FROM ${BASE_IMAGE}", dockerfile


def test_coordinator_image_installs_the_base_profile_only() -> None:
    instructions = _instructions("Dockerfile")
    assert _copied_dirs(instructions) == _packages()
    installs = [line for line in instructions if "pip install" in line]
    assert installs == ["RUN pip install . && useradd --system --uid 10001 kvledger"]
    assert not any("torch" in line for line in instructions)


def test_node_image_installs_the_node_profile() -> None:
    instructions = _instructions("Dockerfile.gpu")
    assert _copied_dirs(instructions) == _packages()
    installs = [re.search(r"pip install (\S+)", line).group(1) for line in instructions if "pip install" in line]
    assert installs == ['"torch==2.13.0"', '".[node]"']
    assert set(PROJECT["project"]["optional-dependencies"]) >= {"node", "embedded", "test"}
