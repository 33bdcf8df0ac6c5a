"""The metrics token: where node and coordinator take it from, and what they refuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.settings import CoordinatorSettings
from gpu_node.settings import NodeSettings
from identity.metrics_access import MetricsSettings, scrape_refusal


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVLEDGER_"):
            monkeypatch.delenv(name)


def test_unset_by_default():
    assert NodeSettings().metrics.token is None
    assert CoordinatorSettings().metrics.token is None


def test_shared_variable_and_service_variable_precedence(monkeypatch):
    monkeypatch.setenv("KVLEDGER_METRICS_TOKEN", "shared-token")
    assert NodeSettings().metrics.token.get_secret_value() == "shared-token"
    assert CoordinatorSettings().metrics.token.get_secret_value() == "shared-token"
    monkeypatch.setenv("KVLEDGER_NODE_METRICS__TOKEN", "node-token")
    monkeypatch.setenv("KVLEDGER_COORDINATOR_METRICS__TOKEN", "coordinator-token")
    assert NodeSettings().metrics.token.get_secret_value() == "node-token"
    assert CoordinatorSettings().metrics.token.get_secret_value() == "coordinator-token"
    assert "node-token" not in repr(NodeSettings())


def test_token_file(monkeypatch, tmp_path: Path):
    token_file = tmp_path / "metrics_token"
    token_file.write_text("from-a-file\n")
    monkeypatch.setenv("KVLEDGER_METRICS_TOKEN_FILE", str(token_file))
    assert NodeSettings().metrics.token.get_secret_value() == "from-a-file"
    assert CoordinatorSettings().metrics.token.get_secret_value() == "from-a-file"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token": "t", "token_file": "FILE"}, "not both"),
        (
            {"token_file": "/nonexistent/metrics_token"},
            "cannot read the metrics token file /nonexistent/metrics_token",
        ),
        ({"token_file": "EMPTY"}, "is empty"),
    ],
)
def test_bad_token_configuration_is_refused(tmp_path: Path, fields, message):
    (tmp_path / "file").write_text("t")
    (tmp_path / "empty").write_text(" \n")
    paths = {"FILE": str(tmp_path / "file"), "EMPTY": str(tmp_path / "empty")}
    with pytest.raises(ValidationError, match=message):
        MetricsSettings(**{name: paths.get(value, value) for name, value in fields.items()})


def test_scrape_refusal():
    token = MetricsSettings(token="right").token
    assert scrape_refusal("Bearer right", token) is None
    assert scrape_refusal("bearer  right ", token) is None
    refused = (401, "invalid_metrics_token", "this route needs the metrics bearer token")
    for header in (
        None,
        "",
        "Bearer",
        "Bearer wrong",
        "Basic right",
        "right",
        "Bearer righ",
        "Bearer rightt",
    ):
        assert scrape_refusal(header, token) == refused
    assert scrape_refusal("Bearer right", None) == (
        404,
        "metrics_disabled",
        "operational metrics are disabled: no metrics token is configured",
    )
