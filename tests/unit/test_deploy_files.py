"""docker-compose.yml, Prometheus and Grafana files: valid, consistent with each other and with the code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client import generate_latest

import coordinator.metrics  # noqa: F401 - registers the coordinator's metrics in the default registry
from gpu_node.metrics import NodeMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_against_the_compose_spec():
    validator = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or shutil.which("check-jsonschema")
    assert validator, "check-jsonschema is a test dependency"
    result = subprocess.run(
        [validator, "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_has_the_production_services_wired_together():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"kafka", "postgres", "migrate", "coordinator", "gpu-node", "prometheus", "grafana"}
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert services["coordinator"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["gpu-node"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "nvidia/cuda" in (ROOT / services["gpu-node"]["build"]["dockerfile"]).read_text()
    assert any(volume.startswith("models:") and volume.endswith(":ro") for volume in services["gpu-node"]["volumes"])
    for dockerfile in {services[name]["build"]["dockerfile"] for name in ("migrate", "coordinator", "gpu-node")}:
        assert (ROOT / dockerfile).is_file()


def test_the_node_gets_no_coordinator_secret_and_pins_the_command_key():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    node_env = services["gpu-node"]["environment"]
    for secret in ("KVLEDGER_MASTER_KEY", "KVLEDGER_DATABASE_URL", "KVLEDGER_COMMAND_SIGNING_KEY", "KVLEDGER_RECEIPT_SIGNING_KEY"):
        assert secret not in node_env, f"the node must not hold {secret}"
        assert "POSTGRES_PASSWORD" not in str(node_env)
    pinned = node_env["KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE"]
    assert [config["target"] for config in services["gpu-node"]["configs"]] == [pinned]
    for name in ("coordinator", "migrate"):
        assert {"KVLEDGER_DATABASE_URL", "KVLEDGER_MASTER_KEY", "KVLEDGER_COMMAND_SIGNING_KEY"} <= set(services[name]["environment"])


def test_prometheus_scrapes_the_ports_the_services_listen_on():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = {target for job in scrape["scrape_configs"] for config in job["static_configs"] for target in config["targets"]}
    published = {f"{name}:{port.split(':')[1]}" for name, service in compose["services"].items() for port in service.get("ports", [])}
    assert targets == {"coordinator:8000", "gpu-node:8100"}
    assert targets <= published


def test_prometheus_and_the_services_share_the_metrics_token_file():
    """/metrics answers only the metrics token: every scrape job sends the file the services read it from."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    services = compose["services"]
    secret_path = "/run/secrets/metrics_token"
    assert compose["secrets"]["metrics_token"]["file"] == "./docker/secrets/metrics_token"
    for job in scrape["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": secret_path}
    for name in ("coordinator", "gpu-node"):
        assert services[name]["environment"]["KVLEDGER_METRICS_TOKEN_FILE"] == secret_path
    for name in ("coordinator", "gpu-node", "prometheus"):
        assert services[name]["secrets"] == ["metrics_token"]


def test_every_dashboard_metric_is_exported_by_a_node_or_the_coordinator():
    dashboard = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "kvledger.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    referenced = {re.sub(r"_(bucket|sum|count)$", "", name) for expr in expressions for name in re.findall(r"kvledger_[a-z_]+", expr)}
    exported_text = generate_latest(NodeMetrics().registry).decode() + generate_latest().decode()
    exported = set(re.findall(r"^# TYPE (kvledger_[a-z_]+) ", exported_text, re.MULTILINE))
    exported |= {name + "_total" for name in exported}
    assert referenced <= exported, sorted(referenced - exported)
