"""Static checks of deploy/: Kubernetes manifests, Grafana dashboard and provisioning, compose.

Everything here runs without a cluster, Grafana or Docker. The one check that needs
``promtool`` (every dashboard query parses as PromQL) skips without it, except under
CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_stack import commented_block, require_binary

from distmon.serve.prometheus_exporter import METRICS

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
RULES_DIR = DEPLOY / "prometheus" / "rules"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "distmon.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
COMPOSE = DEPLOY / "compose.yaml"

# The exporter's metric table is the single source of metric names.
SPEC_METRICS = set(METRICS)
HISTOGRAMS = {name for name, (kind, _, _) in METRICS.items() if kind == "histogram"}
DS_UID = "${datasource}"


def _yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _rule_groups() -> list[dict]:
    groups = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def _recording_names() -> set[str]:
    return {r["record"] for g in _rule_groups() for r in g["rules"] if "record" in r}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(distmon[_:][A-Za-z0-9_:]*)", expr))


def _base_name(name: str) -> str:
    for h in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            if name == h + suffix:
                return h
    return name


# --------------------------------------------------------------------------------------------
# Kubernetes


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_yaml_parses(path):
    docs = _yaml_docs(path)
    assert docs
    for d in docs:
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]


def test_kubernetes_manifests_present():
    kinds = {d["kind"] for p in K8S.glob("*.yaml") for d in _yaml_docs(p)}
    assert {"PodMonitor", "PrometheusRule", "PyTorchJob"} <= kinds


def test_prometheusrule_groups_equal_rule_files():
    (rule,) = _yaml_docs(K8S / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == _rule_groups()


def test_prometheusrule_is_regenerated():
    script = K8S / "gen_prometheusrule.py"
    r = subprocess.run([sys.executable, str(script), "--stdout"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (K8S / "prometheusrule.yaml").read_text(), (
        "prometheusrule.yaml is stale: run deploy/kubernetes/gen_prometheusrule.py"
    )
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _pytorchjob() -> dict:
    (job,) = _yaml_docs(K8S / "pytorchjob.yaml")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    return job


def test_podmonitor_scrapes_the_named_port_of_the_pytorchjob():
    (pm,) = _yaml_docs(K8S / "podmonitor.yaml")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "metrics"
    assert ep["honorLabels"] is True
    # The rules select up{job="distmon"}.
    assert {"action": "replace", "targetLabel": "job", "replacement": "distmon"} in ep.get("relabelings", [])
    selector = pm["spec"]["selector"]["matchLabels"]

    specs = _pytorchjob()["spec"]["pytorchReplicaSpecs"]
    assert sum(s["replicas"] for s in specs.values()) == 2
    for rtype, spec in specs.items():
        tmpl = spec["template"]
        labels = tmpl["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{rtype} pods not selected by the PodMonitor"
        (container,) = [c for c in tmpl["spec"]["containers"] if c["name"] == "pytorch"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get(ep["port"]) == 9290
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["DISTMON_ADDR"] == "0.0.0.0"
        assert env["DISTMON_SERVE"] == "node"
        cmd = container["command"] + container.get("args", [])
        assert cmd[0] == "torchrun" and "launch/train.py" in cmd


def test_podmonitor_secure_endpoint_example():
    """The commented TLS + basic-auth keys complete the endpoint, all from one Secret."""
    text = (K8S / "podmonitor.yaml").read_text()
    secure = yaml.safe_load(commented_block(text, "scheme: https", "---- end secured endpoint"))
    (pm,) = _yaml_docs(K8S / "podmonitor.yaml")
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert not secure.keys() & ep.keys()
    tls, auth = secure["tlsConfig"], secure["basicAuth"]
    assert secure["scheme"] == "https" and tls["serverName"]
    secrets = [
        tls["ca"]["secret"],
        tls["cert"]["secret"],
        tls["keySecret"],
        auth["username"],
        auth["password"],
    ]
    assert {s["name"] for s in secrets} == {"distmon-scrape"} and all(s["key"] for s in secrets)


# --------------------------------------------------------------------------------------------
# Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]):
    for p in panels:
        yield p
        yield from _panels(p.get("panels") or [])


def _dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def test_dashboard_is_regenerated():
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "gen_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_dashboard_variables(dashboard):
    assert "__inputs" not in dashboard and "__requires" not in dashboard
    assert "${DS_" not in DASHBOARD.read_text()
    assert 30 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "run_id", "layer"} <= variables.keys()

    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"

    run = variables["run_id"]
    assert run["type"] == "query"
    assert run["datasource"]["uid"] == DS_UID
    assert "label_values(distmon_run_info, run_id)" in json.dumps(run["query"])

    layer = variables["layer"]
    assert layer["type"] == "query" and layer["multi"] is True and layer["includeAll"] is True
    assert layer["datasource"]["uid"] == DS_UID
    assert 'label_values(distmon_layer_grad_norm{run_id="$run_id"}, layer)' in json.dumps(
        layer["query"]
    ).replace('\\"', '"')


def test_every_panel_uses_the_datasource_variable(dashboard):
    panels = list(_panels(dashboard["panels"]))
    with_targets = [p for p in panels if p["type"] != "row"]
    assert len(with_targets) >= 10
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in with_targets:
        assert p["datasource"]["uid"] == DS_UID, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
            assert t["expr"].strip(), p["title"]
            assert 'run_id="$run_id"' in t["expr"], p["title"]
    for a in dashboard["annotations"]["list"]:
        if a.get("datasource", {}).get("type") == "prometheus":
            assert a["datasource"]["uid"] == DS_UID
            assert a["expr"].startswith("ALERTS{") and "$run_id" in a["expr"]


def test_dashboard_covers_the_metrics(dashboard):
    exprs = "\n".join(_dashboard_exprs(dashboard))
    for needle in (
        "distmon_grad_norm{",
        "distmon_grad_norm_window_max",
        "distmon:grad_norm:median_30m",
        "distmon_step_grad_norm_bucket",
        "distmon_rank_grad_norm",
        "distmon_rank_outlier_score",
        "distmon:rank_grad_norm:robust_z",
        "distmon:rank_grad_norm:top5_abs_robust_z",
        "distmon_layer_grad_norm",
        "distmon_nonfinite_steps_total",
        "distmon_optimizer_steps_total",
        "distmon_last_step_timestamp_seconds",
        "distmon_anomalies_total",
        "distmon_monitor_errors_total",
    ):
        assert needle in exprs, needle
    types = {p["type"] for p in _panels(dashboard["panels"])}
    assert {"timeseries", "heatmap"} <= types
    # Per-layer panels are filtered by the multi-value layer variable and name the depth.
    layer_targets = [
        t
        for p in _panels(dashboard["panels"])
        for t in p.get("targets", [])
        if "distmon_layer_grad_norm" in t["expr"]
    ]
    assert layer_targets
    for t in layer_targets:
        assert 'layer=~"$layer"' in t["expr"]
        assert "{{depth}}" in t["legendFormat"]


def test_metric_names_are_exported_or_recorded(dashboard):
    recorded = _recording_names()
    exprs = _dashboard_exprs(dashboard)
    exprs += [r["expr"] for g in _rule_groups() for r in g["rules"]]
    seen = set()
    for expr in exprs:
        for name in _metric_names(expr):
            seen.add(name)
            if name in recorded:
                continue
            base = _base_name(name)
            assert base in SPEC_METRICS, f"{name} is neither a distmon metric nor a recording rule"
    assert seen & recorded and seen & SPEC_METRICS


def test_dashboard_queries_parse_as_promql(dashboard, tmp_path):
    """Every query, with Grafana's variables filled in, is valid PromQL for promtool."""
    promtool = require_binary("promtool", package="prometheus")
    fill = {
        "$__rate_interval": "1m",
        "$__range": "1h",
        "$__interval": "15s",
        "$run_id": "run",
        "$layer": ".*",
    }
    rules = []
    for i, expr in enumerate(_dashboard_exprs(dashboard)):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown variable in {expr!r}"
        rules.append({"record": f"dashboard:query:q{i}", "expr": expr})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning():
    (ds_doc,) = _yaml_docs(PROVISIONING / "datasources" / "prometheus.yml")
    (ds,) = ds_doc["datasources"]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http")
    (dash_doc,) = _yaml_docs(PROVISIONING / "dashboards" / "distmon.yml")
    (provider,) = dash_doc["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"]


# --------------------------------------------------------------------------------------------
# docker compose


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to deploy/) of the bind mounts."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            src, dst = v.get("source", ""), v["target"]
        else:
            src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = src
    return out


def test_compose_mounts_config_and_provisioning():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"prometheus", "alertmanager", "grafana"} <= services.keys()
    for name, svc in services.items():
        for src in _mounts(svc).values():
            assert (DEPLOY / src).exists(), f"{name}: mount source {src} missing"

    prom = _mounts(services["prometheus"])
    assert prom["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    assert prom["/etc/prometheus/rules"] == "./prometheus/rules"
    # The config's relative "file_sd/*.json" resolves next to the config file.
    assert prom["/etc/prometheus/file_sd"] == "./file_sd"
    assert any("--config.file=/etc/prometheus/prometheus.yml" in c for c in services["prometheus"]["command"])

    am = _mounts(services["alertmanager"])
    assert am["/etc/alertmanager/alertmanager.yml"] == "./alertmanager/alertmanager.yml"

    graf = _mounts(services["grafana"])
    assert graf["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    assert graf["/etc/grafana/provisioning/dashboards"] == "./grafana/provisioning/dashboards"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "distmon.yml").read_text())["providers"]
    assert graf[provider["options"]["path"]] == "./grafana/dashboards"


def test_compose_config_valid_if_docker_compose_available():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose not available")
    r = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
