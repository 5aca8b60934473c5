"""Prometheus rules of distmon: syntax, unit tests, metadata, and that the unit tests can fail.

Runs the real ``promtool`` (Debian package ``prometheus``). Without promtool these
tests skip, except under CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from e2e_stack import require_binary, secure_scrape_job

from distmon.serve.prometheus_exporter import METRICS

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"
RULES_DIR = PROM_DIR / "rules"
TESTS_DIR = PROM_DIR / "tests"
ALERTS_FILE = RULES_DIR / "distmon-alerts.yml"
RECORDING_FILE = RULES_DIR / "distmon-recording.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
AM_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"

RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
TEST_FILES = sorted(TESTS_DIR.glob("*.yml"))

# The exporter's metric table is the single source of metric names.
SPEC_METRICS = set(METRICS)
HISTOGRAMS = {name for name, (kind, _, _) in METRICS.items() if kind == "histogram"}

# The alerts the end-to-end test and the dashboard rely on.
EXPECTED_ALERTS = {
    "DistmonNonFiniteGradients",
    "DistmonDivergenceAhead",
    "DistmonNonFiniteGradientsRank",
    "DistmonGradientExplosion",
    "DistmonGradientSpikeBetweenScrapes",
    "DistmonRankOutlier",
    "DistmonTrainingStalled",
    "DistmonMetricsVanished",
    "DistmonTargetDown",
    "DistmonMonitorErrors",
    "DistmonAnomalyDetected",
    "DistmonScalerStuck",
    "DistmonRunRestarted",
    "DistmonRankOutlierSustained",
}
SEVERITIES = {"critical", "warning", "info"}


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_binary("promtool", package="prometheus")


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


def _rules(kind: str) -> list[dict]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [r for r in group["rules"] if kind in r]
    return out


def _alerts() -> list[dict]:
    return _rules("alert")


def _records() -> list[dict]:
    return _rules("record")


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(distmon[_:][A-Za-z0-9_:]*)", expr))


# --------------------------------------------------------------------------------------------
# Syntax and unit tests


def test_rule_and_test_files_present():
    assert ALERTS_FILE in RULE_FILES and RECORDING_FILE in RULE_FILES
    assert TEST_FILES, "no promtool unit tests in deploy/prometheus/tests"


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(promtool, path):
    r = _run(promtool, "check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(promtool, path):
    r = _run(promtool, "test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_unit_tests_load_the_rule_files():
    for path in TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        loaded = {(path.parent / f).resolve() for f in doc["rule_files"]}
        assert loaded <= {p.resolve() for p in RULE_FILES}, path
        assert RECORDING_FILE.resolve() in loaded, f"{path.name} must load the recording rules"


def _alert_cases() -> list[dict]:
    cases = []
    for path in TEST_FILES:
        for group in yaml.safe_load(path.read_text())["tests"]:
            cases += group.get("alert_rule_test") or []
    return cases


def test_every_alert_is_tested_firing_and_not_firing():
    names = {a["alert"] for a in _alerts()}
    assert names == EXPECTED_ALERTS
    cases = _alert_cases()
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert names - firing == set(), "alerts without a firing test"
    assert names - silent == set(), "alerts without a not-firing test"


def test_every_recording_rule_is_tested():
    exprs = []
    for path in TEST_FILES:
        for group in yaml.safe_load(path.read_text())["tests"]:
            exprs += [c["expr"] for c in group.get("promql_expr_test") or []]
    tested = set().union(*(_metric_names(e) for e in exprs))
    missing = {r["record"] for r in _records()} - tested
    assert not missing, f"recording rules without a promql_expr_test: {sorted(missing)}"


def test_unit_test_series_use_real_metric_names():
    """A typo in an input series would make a 'does not fire' test pass vacuously."""
    allowed = SPEC_METRICS | {f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")}
    allowed |= {"up"}
    for path in TEST_FILES:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for s in group.get("input_series") or []:
                name = s["series"].split("{", 1)[0].strip()
                assert name in allowed, f"{path.name}: unknown series {name}"


# --------------------------------------------------------------------------------------------
# Metadata


@pytest.mark.parametrize("rule", _alerts(), ids=lambda r: r["alert"])
def test_alert_metadata(rule):
    labels = rule.get("labels") or {}
    ann = rule.get("annotations") or {}
    assert labels.get("severity") in SEVERITIES
    for key in ("summary", "description", "runbook"):
        assert ann.get(key, "").strip(), f"{rule['alert']} lacks annotation {key}"
    assert "$value" in ann["summary"], "summary should show the value"
    assert "$labels.run_id" in ann["summary"], "summary should name the run"
    # Every aggregation keeps run_id, so the alert is per run.
    for by in re.findall(r"\bby\s*\(([^)]*)\)", rule["expr"]):
        assert "run_id" in [x.strip() for x in by.split(",")], (rule["alert"], by)
    for on in re.findall(r"\bon\s*\(([^)]*)\)", rule["expr"]):
        assert "run_id" in [x.strip() for x in on.split(",")], (rule["alert"], on)


def test_rule_names_and_metrics_exist():
    recorded = {r["record"] for r in _records()}
    allowed = SPEC_METRICS | recorded
    allowed |= {f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")}
    for rule in _records() + _alerts():
        unknown = _metric_names(rule["expr"]) - allowed
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)
    for name in recorded:
        assert re.fullmatch(r"distmon:[a-z0-9_]+:[a-z0-9_]+", name), name


# --------------------------------------------------------------------------------------------
# The unit tests must be able to fail: break one threshold at a time and expect promtool
# to report failures.

MUTATIONS = {
    # name: (rule file, text, replacement, occurrences of text, the test file that must catch it)
    "divergence_gauge_ignored": (
        ALERTS_FILE.name,
        "max by (run_id) (distmon_divergence_warning) > 0",
        "max by (run_id) (distmon_divergence_warning) > 1",
        1,
        "precursor.test.yml",
    ),
    "divergence_event_kind": (
        ALERTS_FILE.name,
        'increase(distmon_anomalies_total{kind="divergence_warning"}[10m])',
        'increase(distmon_anomalies_total{kind="divergence"}[10m])',
        1,
        "precursor.test.yml",
    ),
    "divergence_event_window": (
        ALERTS_FILE.name,
        'increase(distmon_anomalies_total{kind="divergence_warning"}[10m])',
        'increase(distmon_anomalies_total{kind="divergence_warning"}[30m])',
        1,
        "precursor.test.yml",
    ),
    "divergence_also_informational": (
        ALERTS_FILE.name,
        'kind!~"nonfinite|rank_outlier|scaler_stuck|divergence_warning"',
        'kind!~"nonfinite|rank_outlier|scaler_stuck"',
        1,
        "precursor.test.yml",
    ),
    "nonfinite_threshold": (
        ALERTS_FILE.name,
        "sum by (run_id) (increase(distmon_nonfinite_steps_total[5m])) > 0",
        "sum by (run_id) (increase(distmon_nonfinite_steps_total[5m])) > 1000",
        1,
        "nonfinite.test.yml",
    ),
    "explosion_factor": (
        ALERTS_FILE.name,
        "max by (run_id) (distmon_grad_norm < +Inf) / distmon:grad_norm:median_30m > 10",
        "max by (run_id) (distmon_grad_norm < +Inf) / distmon:grad_norm:median_30m > 100",
        1,
        "explosion_spike.test.yml",
    ),
    "no_history_requirement": (
        RECORDING_FILE.name,
        "count_over_time(distmon:grad_norm:healthy[30m]) >= 20",
        "count_over_time(distmon:grad_norm:healthy[30m]) >= 0",
        1,
        "explosion_spike.test.yml",
    ),
    "spike_histogram_factor": (
        ALERTS_FILE.name,
        "distmon:step_grad_norm:max_bucket_5m / distmon:grad_norm:median_30m > 25",
        "distmon:step_grad_norm:max_bucket_5m / distmon:grad_norm:median_30m > 250",
        1,
        "explosion_spike.test.yml",
    ),
    "rank_outlier_with_two_ranks": (
        ALERTS_FILE.name,
        "count by (run_id) (distmon_rank_outlier_score) >= 3",
        "count by (run_id) (distmon_rank_outlier_score) >= 2",
        1,
        "ranks_monitor.test.yml",
    ),
    "stall_ignores_finished": (
        ALERTS_FILE.name,
        "and on (run_id) max by (run_id) (distmon_run_finished) == 0",
        "and on (run_id) max by (run_id) (distmon_run_finished) >= 0",
        1,
        "lifecycle.test.yml",
    ),
    "vanished_ignores_clean_finish": (
        ALERTS_FILE.name,
        "max by (run_id) (max_over_time(distmon_run_finished[1h])) == 0",
        "max by (run_id) (max_over_time(distmon_run_finished[1h])) >= 0",
        1,
        "lifecycle.test.yml",
    ),
    "scaler_stuck_not_sustained": (
        ALERTS_FILE.name,
        "increase(distmon_scaler_skipped_steps_total[5m]))\n              >= on (run_id)",
        "increase(distmon_scaler_skipped_steps_total[5m]))\n              > on (run_id)",
        1,
        "scaler.test.yml",
    ),
    "baseline_learns_the_explosion": (
        RECORDING_FILE.name,
        "(distmon:grad_norm:finite > on (run_id) 10 * distmon:grad_norm:median_30m)",
        "(distmon:grad_norm:finite > on (run_id) 1e9 * distmon:grad_norm:median_30m)",
        1,
        "explosion_spike.test.yml",
    ),
    "baseline_not_carried_forward": (
        RECORDING_FILE.name,
        "or last_over_time(distmon:grad_norm:median_30m[10m])",
        "or last_over_time(distmon:grad_norm:median_30m[10s])",
        1,
        "explosion_spike.test.yml",
    ),
    "restart_compares_with_itself": (
        ALERTS_FILE.name,
        "max by (run_id) (distmon_restart_count) > max by (run_id) (distmon_restart_count offset 10m)",
        "max by (run_id) (distmon_restart_count) >= max by (run_id) (distmon_restart_count offset 10m)",
        1,
        "lifecycle.test.yml",
    ),
    "restart_before_first_scrape_missed": (
        ALERTS_FILE.name,
        "max by (run_id) (distmon_restart_count) > 0\n",
        "max by (run_id) (distmon_restart_count) > 5\n",
        1,
        "lifecycle.test.yml",
    ),
    "median_without_nan_filter": (
        RECORDING_FILE.name,
        "max by (run_id) (distmon_grad_norm >= 0 < +Inf)",
        "max by (run_id) (distmon_grad_norm)",
        1,
        "recording.test.yml",
    ),
    # The cross-rank comparison (group distmon-rank-comparison) and DistmonRankOutlierSustained.
    "rank_comparison_keeps_nonfinite_ranks": (
        RECORDING_FILE.name,
        "(distmon_rank_grad_norm > 0 < +Inf)",
        "(distmon_rank_grad_norm)",
        1,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_scores_groups_of_two": (
        RECORDING_FILE.name,
        "(distmon:rank_grad_norm:log10) >= 3",
        "(distmon:rank_grad_norm:log10) >= 2",
        1,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_across_peer_groups": (
        RECORDING_FILE.name,
        "(run_id, tp_rank, pp_stage, ep_rank)",
        "(run_id)",
        7,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_without_mad_floor": (
        RECORDING_FILE.name,
        "clamp_min(distmon:rank_grad_norm:log10_mad, 0.05)",
        "distmon:rank_grad_norm:log10_mad",
        1,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_smaller_mad_floor": (
        RECORDING_FILE.name,
        "clamp_min(distmon:rank_grad_norm:log10_mad, 0.05)",
        "clamp_min(distmon:rank_grad_norm:log10_mad, 0.01)",
        1,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_mad_not_scaled_to_sigma": (
        RECORDING_FILE.name,
        "            / 1.4826\n",
        "            / 1\n",
        1,
        "rank_comparison.test.yml",
    ),
    "rank_comparison_top3": (
        RECORDING_FILE.name,
        "topk by (run_id) (5, abs(",
        "topk by (run_id) (3, abs(",
        1,
        "rank_comparison.test.yml",
    ),
    "sustained_outlier_threshold": (
        ALERTS_FILE.name,
        "distmon:rank_grad_norm:robust_z > 5\n",
        "distmon:rank_grad_norm:robust_z > 50\n",
        1,
        "rank_comparison.test.yml",
    ),
    "sustained_outlier_high_side_only": (
        ALERTS_FILE.name,
        "distmon:rank_grad_norm:robust_z < -5\n",
        "distmon:rank_grad_norm:robust_z < -50\n",
        1,
        "rank_comparison.test.yml",
    ),
    "sustained_outlier_not_sustained": (
        ALERTS_FILE.name,
        "\n        for: 5m\n",
        "\n        for: 30s\n",
        1,
        "rank_comparison.test.yml",
    ),
    # Per-rank series of one run come from one target per node (serve="node"): a count per
    # instance sees 2 ranks, never 3.
    "rank_outlier_counts_per_target": (
        ALERTS_FILE.name,
        "count by (run_id) (distmon_rank_outlier_score) >= 3",
        "count by (run_id, instance) (distmon_rank_outlier_score) >= 3",
        1,
        "rank_comparison.test.yml",
    ),
}


@pytest.mark.slow  # ~2.5 s each (a promtool run per mutation): kept out of the fast tier's edit loop
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_broken_rule_fails_unit_tests(promtool, tmp_path, name):
    fname, old, new, count, catcher = MUTATIONS[name]
    work = tmp_path / "prometheus"
    shutil.copytree(RULES_DIR, work / "rules")
    shutil.copytree(TESTS_DIR, work / "tests")
    target = work / "rules" / fname
    text = target.read_text()
    assert text.count(old) == count, f"mutation {name!r} does not match the rule file"
    target.write_text(text.replace(old, new))
    # The mutated file is still valid...
    r = _run(promtool, "check", "rules", str(target))
    assert r.returncode == 0, r.stdout + r.stderr
    # ...but the unit tests written for that rule catch the change (the other files are not
    # run: each takes promtool 0.1-1.8 s, and this runs once per mutation in the fast tier)
    r = _run(promtool, "test", "rules", str(work / "tests" / catcher))
    assert r.returncode != 0, f"{catcher} did not notice mutation {name!r}:\n{r.stdout}"
    assert "FAILED" in r.stdout + r.stderr


# --------------------------------------------------------------------------------------------
# Prometheus / Alertmanager configuration

# Strings the end-to-end test (and site setups) replace; each must occur exactly once
# outside comments.
SUBSTITUTIONS = {
    "scrape_interval: 15s": "scrape_interval: 1s",
    "evaluation_interval: 15s": "evaluation_interval: 1s",
    "localhost:9093": "127.0.0.1:{am_port}",
    "rules/*.yml": "{rules_dir}/*.yml",
    "file_sd/*.json": "{file_sd_dir}/*.json",
}


def _code_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_prometheus_config_structure():
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    assert cfg["global"]["scrape_interval"] == "15s"
    assert cfg["global"]["evaluation_interval"] == "15s"
    assert "scrape_timeout" not in cfg["global"], "would break a 1s scrape interval"
    assert cfg["rule_files"] == ["rules/*.yml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "distmon"]
    assert job["honor_labels"] is True
    assert job["file_sd_configs"][0]["files"] == ["file_sd/*.json"]
    targets = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["localhost:9093"]
    code = _code_lines(PROM_CONFIG.read_text())
    for s in SUBSTITUTIONS:
        assert code.count(s) == 1, f"{s!r} must occur exactly once outside comments"


def test_the_distmon_job_s_limits_admit_every_node_endpoint_at_max_layers(monkeypatch):
    """sample_limit and body_size_limit of the distmon job pass the largest body a node serves
    at the ``max_layers`` cap (global rank 0's, every optional family on: the real /metrics body
    that benchmarks/series_count.py builds), with room to spare, and stop one of many thousands."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("series_count", ROOT / "benchmarks" / "series_count.py")
    series_count = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "series_count", series_count)  # its dataclass looks itself up
    spec.loader.exec_module(series_count)
    jobs = yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]
    (job,) = [j for j in jobs if j["job_name"] == "distmon"]
    samples, size = job["sample_limit"], job["body_size_limit"]
    number, unit = re.fullmatch(r"(\d+)(KB|MB)", size).groups()
    size_bytes = int(number) * {"KB": 1 << 10, "MB": 1 << 20}[unit]
    largest = series_count.row(32, 16, 128, True)  # 2 nodes of 16 GPUs, 128 layer groups (the cap)
    assert largest["rank0_series"] * 2 <= samples and largest["rank0_bytes"] * 4 <= size_bytes, largest
    assert largest["node_series"] < samples and largest["node_bytes"] < size_bytes, largest
    assert samples < 10_000 and size_bytes <= 4 << 20  # still a limit


def test_promtool_check_config(promtool, tmp_path):
    r = _run(promtool, "check", "config", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr

    # The end-to-end substitution: 1 s intervals, absolute paths, another port.
    file_sd = tmp_path / "file_sd"
    file_sd.mkdir()
    (file_sd / "run-node0.json").write_text('[{"targets": ["127.0.0.1:9290"], "labels": {"run_id": "run"}}]')
    text = PROM_CONFIG.read_text()
    values = {"am_port": "19093", "rules_dir": str(RULES_DIR), "file_sd_dir": str(file_sd)}
    for old, new in SUBSTITUTIONS.items():
        text = text.replace(old, new.format(**values))
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(text)
    r = _run(promtool, "check", "config", str(cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout
    loaded = yaml.safe_load(text)
    assert loaded["global"]["scrape_interval"] == "1s"


def test_promtool_check_config_with_the_secure_job(promtool, tmp_path):
    """The commented distmon-secure job (TLS, basic auth), uncommented, is a valid config."""
    conf = tmp_path / "prometheus"
    shutil.copytree(PROM_DIR, conf)
    (conf / "tls").mkdir()
    for name in ("ca.pem", "client.pem", "client.key", "password"):
        (conf / "tls" / name).write_text("placeholder\n")  # promtool checks that they exist
    (job,) = yaml.safe_load(secure_scrape_job(PROM_CONFIG.read_text()))
    assert job["scheme"] == "https" and job["honor_labels"] is True
    assert job["tls_config"]["ca_file"] and job["basic_auth"]["password_file"]
    assert {"target_label": "job", "replacement": "distmon"} in job[
        "relabel_configs"
    ]  # the rules' up{job=...}
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["scrape_configs"].append(job)
    (conf / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = _run(promtool, "check", "config", str(conf / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_config():
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    assert set(cfg["route"]["group_by"]) >= {"alertname", "run_id"}
    urls = [w["url"] for rcv in cfg["receivers"] for w in rcv.get("webhook_configs", [])]
    assert "http://127.0.0.1:5001/" in urls
    amtool = shutil.which("amtool")
    if amtool:
        r = _run(amtool, "check-config", str(AM_CONFIG))
        assert r.returncode == 0, r.stdout + r.stderr
