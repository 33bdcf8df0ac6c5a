"""Shared fixtures. The tiny model is built once per session (seconds, deterministic, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.model_init import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny Llama checkpoint (seed 0) loadable with ``from_pretrained``. Treat it as read-only."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)
