"""docker-compose.yml, Prometheus and Grafana files: valid, consistent with each other and with the code.

Every PromQL expression of the dashboard and of the alert rules is checked against the
series the code exports, with their types: ``_bucket``/``_sum``/``_count`` only on
histograms, ``_total`` only on counters, ``rate()``/``increase()`` only over counters
and histogram parts, label names only those the metric has. ``promtool`` (the Debian
package ``prometheus``) validates the rules, the config and the rules' unit tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

import coordinator.metrics  # noqa: F401 - registers the coordinator's metrics in the default registry
import events.metrics  # noqa: F401 - registers the Kafka helpers' metrics in the default registry
from gpu_node.metrics import NodeMetrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "kvledger.json"


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
    scrape = yaml.safe_load(PROMETHEUS_DIR.joinpath("prometheus.yml").read_text())
    targets = {target for job in scrape["scrape_configs"] for config in job["static_configs"] for target in config["targets"]}
    published = {f"{name}:{port.split(':')[1]}" for name, service in compose["services"].items() for port in service.get("ports", [])}
    assert targets == {"coordinator:8000", "gpu-node:8100"}
    assert targets <= published


def test_prometheus_and_the_services_share_the_metrics_token_file():
    """/metrics answers only the metrics token: every scrape job sends the file the services read it from."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load(PROMETHEUS_DIR.joinpath("prometheus.yml").read_text())
    services = compose["services"]
    secret_path = "/run/secrets/metrics_token"
    assert compose["secrets"]["metrics_token"]["file"] == "./docker/secrets/metrics_token"
    for job in scrape["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": secret_path}
    for name in ("coordinator", "gpu-node"):
        assert services[name]["environment"]["KVLEDGER_METRICS_TOKEN_FILE"] == secret_path
    for name in ("coordinator", "gpu-node", "prometheus"):
        assert services[name]["secrets"] == ["metrics_token"]


def test_prometheus_loads_the_alert_rules_compose_mounts():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load(PROMETHEUS_DIR.joinpath("prometheus.yml").read_text())
    assert scrape["rule_files"] == ["alerts.yml"]
    assert PROMETHEUS_DIR.joinpath("alerts.yml").is_file()
    prometheus = compose["services"]["prometheus"]
    assert "./docker/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


# -- every query against the exported series ------------------------------------------

IMPLICIT_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus attaches to every scraped series."""
JOBS = {"kvledger-gpu-node": "node", "kvledger-coordinator": "coordinator"}
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase"})
GAUGE_FUNCTIONS = frozenset({"delta", "deriv", "idelta", "max_over_time", "min_over_time", "avg_over_time"})


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]


def families(registry: CollectorRegistry) -> dict[str, Family]:
    """Name → family for everything ``registry`` exports (labels from the collectors, as unused labels have no samples)."""
    found = {}
    for metric in registry.collect():
        collector = registry._names_to_collectors[metric.name]
        found[metric.name] = Family(metric.name, metric.type, frozenset(getattr(collector, "_labelnames", ())))
    return found


EXPORTED = {"node": families(NodeMetrics().registry), "coordinator": families(REGISTRY)}


@dataclass(frozen=True)
class Series:
    family: Family
    part: str  # "counter", "gauge", "histogram part"
    labels: frozenset[str]


def resolve(name: str, process: str | None) -> Series:
    """The exported series ``name`` refers to, in ``process`` ("node"/"coordinator") or either; fails the test otherwise."""
    if name == "up":
        return Series(Family("up", "gauge", frozenset()), "gauge", IMPLICIT_LABELS)
    candidates = [EXPORTED[process]] if process else list(EXPORTED.values())
    for exported in candidates:
        if name in exported and exported[name].type == "gauge":
            return Series(exported[name], "gauge", exported[name].labels | IMPLICIT_LABELS)
        base, _, suffix = name.rpartition("_")
        if suffix == "total" and base in exported and exported[base].type == "counter":
            return Series(exported[base], "counter", exported[base].labels | IMPLICIT_LABELS)
        if suffix in ("bucket", "sum", "count") and base in exported and exported[base].type == "histogram":
            extra = {"le"} if suffix == "bucket" else set()
            return Series(exported[base], "histogram part", exported[base].labels | IMPLICIT_LABELS | extra)
        if name in exported:
            pytest.fail(f"{name} is a {exported[name].type}: query it as {_proper_names(exported[name])}")
    pytest.fail(f"{name} is not exported by {process or 'any process'}")


def _proper_names(family: Family) -> str:
    return {"counter": f"{family.name}_total", "histogram": f"{family.name}_bucket/_sum/_count"}.get(family.type, family.name)


SELECTOR = re.compile(r"\b(kvledger_[a-z0-9_]+|up)\b\s*(\{[^}]*\})?\s*(\[[^\]]+\])?")
LABEL_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def check_expression(expr: str) -> list[str]:
    """Check one PromQL expression against the exported series; returns the metric names it uses."""
    names = []
    labels_in_scope: set[str] = set()
    for match in SELECTOR.finditer(expr):
        name, braces, range_ = match.groups()
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function name, not a metric
        matchers = LABEL_MATCHER.findall(braces or "")
        job = re.search(r'\bjob\s*=\s*"([^"]+)"', braces or "")
        series = resolve(name, JOBS[job.group(1)] if job and job.group(1) in JOBS else None)
        unknown = set(matchers) - series.labels
        assert not unknown, f"{expr}: {name} has no label(s) {sorted(unknown)}"
        labels_in_scope |= series.labels
        function = re.search(r"([a-z_]+)\(\s*$", expr[: match.start()])
        function_name = function.group(1) if function else None
        if series.part in ("counter", "histogram part"):
            assert range_ and function_name in COUNTER_FUNCTIONS, f"{expr}: {name} must be read through rate()/increase()"
        else:
            assert function_name not in COUNTER_FUNCTIONS, f"{expr}: {function_name}() over the {series.family.type} {name}"
            assert range_ is None or function_name in GAUGE_FUNCTIONS, f"{expr}: range over the gauge {name} in {function_name}()"
        if name.endswith("_bucket"):
            assert "histogram_quantile(" in expr, f"{expr}: {name} outside histogram_quantile()"
        names.append(name)
    assert names, f"{expr}: no metric"
    for grouping in GROUPING.findall(expr):
        unknown = {label.strip() for label in grouping.split(",") if label.strip()} - labels_in_scope
        assert not unknown, f"{expr}: grouping by label(s) {sorted(unknown)} no metric of the expression has"
    return names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def alert_rules() -> list[dict]:
    rules = yaml.safe_load(PROMETHEUS_DIR.joinpath("alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_every_dashboard_query_reads_exported_series_by_their_type():
    used = {name for expr in dashboard_expressions() for name in check_expression(expr)}
    # The panels the operator needs are there: quantiles from histograms, not gauges.
    for needed in (
        "kvledger_ledger_ingest_lag_seconds_bucket",
        "kvledger_invalidation_seconds_bucket",
        "kvledger_erasure_seconds_bucket",
        "kvledger_http_request_seconds_bucket",
        "kvledger_ledger_erasures_unverified",
        "kvledger_ledger_invalidations_open",
    ):
        assert needed in used, needed


def test_the_node_variable_lists_the_nodes_instances():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == {"node"}  # no tenant variable: no metric carries a tenant label
    query = re.fullmatch(r'label_values\((\w+)\{job="kvledger-gpu-node"\}, instance\)', variables["node"]["query"]["query"])
    assert query is not None
    resolve(query.group(1), "node")
    node_panels = [expr for expr in dashboard_expressions() if 'job="kvledger-gpu-node"' in expr]
    assert node_panels and all('instance=~"$node"' in expr for expr in node_panels)


def test_every_alert_reads_exported_series_by_their_type():
    rules = alert_rules()
    for rule in rules:
        check_expression(rule["expr"])
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    assert {rule["alert"] for rule in rules} >= {
        "KvledgerErasureOrPermissionDeadLettered",
        "KvledgerErasureUnverifiedPastSla",
        "KvledgerUnverifiedRecords",
        "KvledgerStaleNodes",
        "KvledgerOutboxBacklog",
        "KvledgerIngestLag",
    }


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("histogram_quantile(0.99, sum by (le) (rate(kvledger_outbox_pending_bucket[5m])))", "not exported"),
        ("kvledger_ledger_ingest_lag_seconds", "is a histogram"),
        ("rate(kvledger_outbox_pending[5m])", "rate"),
        ("kvledger_requests_total", "rate()/increase()"),
        ("sum by (tenant) (kvledger_tier_bytes)", "tenant"),
        ('kvledger_tier_bytes{tenant="acme"}', "tenant"),
        ('kvledger_ledger_nodes{job="kvledger-gpu-node"}', "not exported by node"),
        ("rate(kvledger_ttft_seconds_bucket[5m])", "histogram_quantile"),
    ],
)
def test_the_query_check_catches_wrong_types_and_labels(expr: str, problem: str):
    with pytest.raises((AssertionError, pytest.fail.Exception)) as failure:
        check_expression(expr)
    assert problem in str(failure.value)


# -- promtool ----------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")


def promtool(*args: str, cwd: Path) -> None:
    result = subprocess.run([PROMTOOL, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_the_alert_rules():
    promtool("check", "rules", "alerts.yml", cwd=PROMETHEUS_DIR)


@needs_promtool
def test_promtool_accepts_the_prometheus_config(tmp_path: Path):
    """The config as compose mounts it, with the metrics-token secret at a path that exists here."""
    token_file = tmp_path / "metrics_token"
    token_file.write_text("test-token\n")
    config = PROMETHEUS_DIR.joinpath("prometheus.yml").read_text()
    assert config.count("/run/secrets/metrics_token") == 2
    tmp_path.joinpath("prometheus.yml").write_text(config.replace("/run/secrets/metrics_token", str(token_file)))
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)


@needs_promtool
def test_alerts_fire_on_their_unit_test_series():
    """Dead letter on kvledger.erasures, a stale node, an erasure past its SLA (tests/unit/prometheus/alerts_test.yml)."""
    promtool("test", "rules", "alerts_test.yml", cwd=ROOT / "tests" / "unit" / "prometheus")
