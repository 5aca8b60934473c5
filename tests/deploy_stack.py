"""The deployment under test: deploy/'s Prometheus and Alertmanager, run as the e2e tests run them.

``stack`` (a module fixture: each module that imports it gets a stack of its own): a real
Prometheus (Debian package) on the repository's ``deploy/prometheus`` config and rule files
(rules unmodified; ``scrape_interval`` and ``evaluation_interval`` 1 s instead of 15 s; the
commented ``distmon-secure`` TLS + basic-auth job enabled as written, and a copy of it without
``basic_auth``, where openssl can make the certificates), a real Alertmanager on
``deploy/alertmanager/alertmanager.yml`` with its webhook pointed at a receiver in the test, and
a recorder of what both saw. Jobs announce themselves through the ``file_sd`` directory alone.
Also the readers the e2e modules share: :func:`read_jsonl`, :func:`scalar`, :func:`targets_of`,
:func:`wait_scraped`, :func:`rule_for`, and the dashboard's queries as Grafana sends them
(:func:`dashboard_queries`, :func:`grafana_substitute`, :func:`grafana_regex_escape`). Used by
tests/test_e2e_deploy.py and tests/test_e2e_nodes.py.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_stack import (
    DEPLOY,
    Alertmanager,
    Prometheus,
    Recorder,
    TorchrunJob,
    Webhook,
    parse_duration,
    require_binary,
    secure_scrape_job,
    substitute,
    tail,
    wait_for,
)
from secure_endpoint import Pki, make_pki

yaml = pytest.importorskip("yaml")

SCRAPE_S = 1.0  # the test Prometheus' scrape and evaluation interval
STEP_S = 0.25  # --min-step-s of every job: 4 optimizer steps per second at most
STARTUP_S = 120.0  # bound on torchrun + torch import + rendezvous on a loaded 2-core machine
ANONYMOUS_JOB = "distmon-secure-anonymous"  # the secure job without basic_auth: refused


def alert_rules() -> dict[str, dict]:
    rules = {}
    for path in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rules[rule["alert"]] = rule
    return rules


def rule_for(name: str) -> float:
    return parse_duration(alert_rules()[name].get("for", "0s"))


@dataclass(frozen=True)
class SecureScrape:
    """What the ``distmon-secure`` job of the test's Prometheus uses: certificates in the
    config directory's ``tls/`` (the names the job reads), its user and password, and the
    ``file_sd_secure/`` directory it discovers targets in."""

    pki: Pki
    username: str
    password: str
    sd_dir: Path


@dataclass
class Stack:
    workdir: Path
    sd_dir: Path
    prom: Prometheus
    am: Alertmanager
    webhook: Webhook
    recorder: Recorder
    secure: SecureScrape | None  # None without openssl

    def diagnose(self, jobs: Iterable[TorchrunJob] = (), run_ids: Iterable[str] | None = None) -> str:
        run_ids = list(run_ids) if run_ids is not None else None
        out = [f"now {time.strftime('%H:%M:%S')}"]
        try:
            alerts = self.prom.alerts()
            out.append("Prometheus /api/v1/alerts now:")
            out += [
                f"  {a['labels'].get('alertname')} {a['state']} run_id={a['labels'].get('run_id')} "
                f"activeAt={a.get('activeAt')} value={a.get('value')}"
                for a in alerts
            ] or ["  (none)"]
            out.append("Prometheus /api/v1/targets now:")
            out += [
                f"  {t['scrapeUrl']} {t['labels']} health={t['health']} lastError={t.get('lastError')!r}"
                for t in self.prom.targets()
            ] or ["  (none)"]
            out.append("Alertmanager /api/v2/alerts now:")
            out += [
                f"  {a['labels'].get('alertname')} run_id={a['labels'].get('run_id')} "
                f"{a.get('status', {}).get('state')}"
                for a in self.am.alerts()
            ] or ["  (none)"]
        except Exception as e:  # noqa: BLE001 - diagnostics must not raise
            out.append(f"(API error: {e!r})")
        out.append("Webhook received:\n" + self.webhook.summary())
        out.append(self.recorder.summary(run_ids))
        out.append(f"file_sd dir: {sorted(p.name for p in self.sd_dir.iterdir())}")
        for job in jobs:
            out.append(job.log_tail())
        out.append(f"--- prometheus log (tail):\n{tail(self.prom.log_path, 1500)}")
        out.append(f"--- alertmanager log (tail):\n{tail(self.am.log_path, 1000)}")
        return "\n".join(out)


def add_secure_jobs(conf_dir: Path, text: str) -> tuple[str, SecureScrape]:
    """The config with the commented ``distmon-secure`` job enabled as written, and a copy of
    it without ``basic_auth`` (job ``distmon-secure-anonymous``); the files they read."""
    (job,) = yaml.safe_load(secure_scrape_job(text))
    (targets,) = job["file_sd_configs"][0]["files"]
    secure = SecureScrape(
        make_pki(conf_dir / "tls"),
        job["basic_auth"]["username"],
        uuid.uuid4().hex,
        (conf_dir / targets).parent,
    )
    (conf_dir / job["basic_auth"]["password_file"]).write_text(secure.password)
    secure.sd_dir.mkdir()
    tls = job["tls_config"]
    for path in (tls["ca_file"], tls["cert_file"], tls["key_file"]):
        assert (conf_dir / path).exists(), f"distmon-secure reads {path}, which make_pki does not write"
    anonymous = {k: v for k, v in job.items() if k not in ("basic_auth", "relabel_configs")}
    cfg = yaml.safe_load(text)
    cfg["scrape_configs"] += [job, dict(anonymous, job_name=ANONYMOUS_JOB)]
    return yaml.safe_dump(cfg, sort_keys=False), secure


def prometheus_config(workdir: Path, am_port: int, sd_dir: Path) -> tuple[Path, SecureScrape | None]:
    """deploy/prometheus copied to ``workdir``; prometheus.yml adapted by string replacement,
    plus its commented TLS + basic-auth job (where openssl can make the certificates)."""
    conf_dir = workdir / "prometheus"
    shutil.copytree(DEPLOY / "prometheus", conf_dir)
    cfg = conf_dir / "prometheus.yml"
    text = substitute(
        cfg.read_text(),
        {
            # Deliberate, documented deviation from "only paths and ports": production's 15 s
            # would make this test take many minutes (module docstring).
            "scrape_interval: 15s": f"scrape_interval: {SCRAPE_S:g}s",
            "evaluation_interval: 15s": f"evaluation_interval: {SCRAPE_S:g}s",
            "localhost:9093": f"127.0.0.1:{am_port}",
            "file_sd/*.json": f"{sd_dir}/*.json",
        },
    )
    secure = None
    if shutil.which("openssl"):
        text, secure = add_secure_jobs(conf_dir, text)
    cfg.write_text(text)
    # "rules/*.yml" resolves against the copied directory: the repo's rule files, unmodified.
    for rule_file in (DEPLOY / "prometheus" / "rules").glob("*.yml"):
        assert (conf_dir / "rules" / rule_file.name).read_text() == rule_file.read_text()
    return cfg, secure


def alertmanager_config(workdir: Path, webhook_url: str) -> Path:
    cfg = workdir / "alertmanager.yml"
    text = (DEPLOY / "alertmanager" / "alertmanager.yml").read_text()
    cfg.write_text(substitute(text, {"http://127.0.0.1:5001/": webhook_url}))
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prom_bin = require_binary("prometheus", package="prometheus")
    am_bin = require_binary("prometheus-alertmanager", "alertmanager", package="prometheus-alertmanager")
    workdir = tmp_path_factory.mktemp("e2e")
    sd_dir = workdir / "file_sd"
    sd_dir.mkdir()
    stops: list[Callable[[], None]] = []
    try:
        webhook = Webhook()
        stops.append(webhook.close)
        am = Alertmanager(am_bin, alertmanager_config(workdir, webhook.url), workdir)
        stops.append(am.stop)
        prom_config, secure = prometheus_config(workdir, am.port, sd_dir)
        prom = Prometheus(prom_bin, prom_config, workdir)
        stops.append(prom.stop)
        am.wait_ready()
        prom.wait_ready()
        recorder = Recorder(prom, am)
        stops.append(recorder.stop)
        yield Stack(workdir, sd_dir, prom, am, webhook, recorder, secure)
    finally:
        for stop in reversed(stops):
            stop()


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines of a JSONL log that may still be written."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def scalar(prom: Prometheus, expr: str, at: float | None = None) -> float | None:
    vals = prom.values(expr, at)
    return vals[0][1] if len(vals) == 1 else None


def targets_of(stack: Stack, run_id: str) -> list[dict]:
    return [t for t in stack.prom.targets() if t["labels"].get("run_id") == run_id]


def wait_scraped(stack: Stack, job: TorchrunJob, run_id: str, steps: int, diag: Callable[[], str]) -> None:
    """Wait until Prometheus has scraped ``steps`` optimizer steps of the run from a healthy target."""

    def ok() -> bool:
        if job.poll() is not None:
            pytest.fail(f"job {job.name} exited early\n{diag()}", pytrace=False)
        v = scalar(stack.prom, f'distmon_optimizer_steps_total{{run_id="{run_id}"}}')
        return v is not None and v >= steps and any(t["health"] == "up" for t in targets_of(stack, run_id))

    wait_for(ok, STARTUP_S + steps * STEP_S * 3, f"Prometheus to scrape {steps} steps of {run_id}", diag)


GRAFANA_VAR = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def grafana_substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$var``, ``${var}``, ``${var:fmt}`` and ``[[var]]`` as Grafana does; unknown ones fail."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"dashboard query uses variable ${name} the test does not know: {expr!r}"
        return values[name]

    return GRAFANA_VAR.sub(repl, expr)


def grafana_regex_escape(value: str) -> str:
    r"""A multi-value variable's value as Grafana's Prometheus data source writes it into a
    regex matcher: regex metacharacters escaped with a double backslash (PromQL strings
    take Go escapes, so ``"\\."`` reaches the regex engine as ``\.``).

    >>> print(grafana_regex_escape("blocks.0.ln1"))
    blocks\\.0\\.ln1
    """
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def dashboard_queries(dash: dict) -> list[tuple[str, str, str, bool]]:
    """(panel title, refId, expr, instant) of every panel target (nested rows included)."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((p.get("title", "?"), t.get("refId", "?"), t["expr"], bool(t.get("instant"))))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out
