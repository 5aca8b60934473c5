"""Helpers of the end-to-end deployment test (``tests/test_e2e_deploy.py``).

A real Prometheus and Alertmanager (Debian packages) on 127.0.0.1, a webhook receiver for
Alertmanager's notifications, torchrun jobs of the demo trainer, and a recorder that polls
the servers' HTTP APIs in the background, so an alert that fires and resolves between two
checks of a test is still seen.

Every process started here runs in its own session and is stopped by its ``stop()`` /
``kill_all()``; torchrun starts its workers in sessions of their own, so a job's processes
are found by a token in their environment, not by process group.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from ddp_harness import free_port
from helpers import http_get

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from train import torchrun_command  # noqa: E402  (launch/train.py)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


# --------------------------------------------------------------------------- small helpers


def require_binary(*candidates: str, package: str) -> str:
    """Path of the first binary found; skip the test if none (fail under ``CI=true``)."""
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    msg = f"{' / '.join(candidates)} not found (apt-get install {package})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def substitute(text: str, replacements: Mapping[str, str]) -> str:
    """Plain string replacement outside comment lines; each key must occur exactly once there.

    A configuration change that drops or duplicates a replaced string fails loudly here.

    >>> substitute("# a: 1\\na: 1\\nb: 2\\n", {"a: 1": "a: 3"})
    '# a: 1\\na: 3\\nb: 2\\n'
    """
    lines = text.splitlines(keepends=True)
    code = [i for i, line in enumerate(lines) if not line.lstrip().startswith("#")]
    for old, new in replacements.items():
        hits = sum(lines[i].count(old) for i in code)
        assert hits == 1, f"{old!r} occurs {hits} times outside comments (expected exactly once)"
        for i in code:
            lines[i] = lines[i].replace(old, new)
    return "".join(lines)


def commented_block(text: str, first: str, end: str) -> str:
    """The commented-out lines from the one reading ``first`` to the one reading ``end``
    (exclusive), uncommented and dedented: a documented example, run as written.

    >>> print(commented_block("a: 1\\n  # - b: 2\\n  #   c: 3  # note\\n  # end\\n", "- b: 2", "end"), end="")
    - b: 2
      c: 3  # note
    """
    lines = [
        re.sub(r"^(\s*)# ?", r"\1", line) if line.lstrip().startswith("#") else None
        for line in text.splitlines(keepends=True)
    ]
    start = next(i for i, line in enumerate(lines) if line is not None and line.strip() == first)
    stop = next(i for i, line in enumerate(lines[start:], start) if line is None or line.strip() == end)
    assert lines[stop] is not None, f"the block from {first!r} has an uncommented line before {end!r}"
    return textwrap.dedent("".join(lines[start:stop]))


def secure_scrape_job(config_text: str) -> str:
    """The commented ``distmon-secure`` job of deploy/prometheus/prometheus.yml, uncommented (a YAML list)."""
    return commented_block(config_text, "- job_name: distmon-secure", "---- end distmon-secure")


def parse_duration(text: str) -> float:
    """Seconds of a Prometheus duration such as ``30s``, ``1m`` or ``1h30m``.

    >>> parse_duration("1m30s"), parse_duration("30s"), parse_duration("2h")
    (90.0, 30.0, 7200.0)
    """
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    total, num, i = 0.0, "", 0
    while i < len(text):
        c = text[i]
        if c.isdigit():
            num += c
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else c
        total += int(num) * units[unit]
        num, i = "", i + len(unit)
    assert not num, f"bad duration {text!r}"
    return total


def parse_rfc3339(text: str) -> float:
    """Unix time of a Prometheus/Alertmanager timestamp (nanosecond fractions allowed).

    >>> parse_rfc3339("1970-01-01T00:00:01.5000000009Z")
    1.5
    """
    text = text.replace("Z", "+00:00")
    if "." in text:
        head, rest = text.split(".", 1)
        digits = "".join(c for c in rest if c.isdigit())
        tz = rest[len(digits) :]
        text = f"{head}.{digits[:6]}{tz}"
    return _dt.datetime.fromisoformat(text).timestamp()


def get_json(url: str, params: Mapping[str, Any] | None = None, timeout: float = 5.0) -> Any:
    """GET a JSON document (no proxy: helpers.http_get)."""
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        return json.loads(http_get(url, timeout)[2])
    except urllib.error.HTTPError as e:  # Prometheus explains a bad query in the body
        raise AssertionError(
            f"GET {urllib.parse.unquote(url)} -> {e.code}: {e.read().decode(errors='replace')[:2000]}"
        ) from None


def tail(path: Path, chars: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"<{path}: {e}>"
    text = data[-chars:].decode(errors="replace")
    return ("..." if len(data) > chars else "") + text


def wait_for(
    cond: Callable[[], Any], timeout: float, what: str, diagnose: Callable[[], str], interval: float = 0.5
) -> Any:
    """Poll ``cond()`` until it returns something truthy (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n\n{diagnose()}", pytrace=False)
        time.sleep(interval)


# --------------------------------------------------------------------------- webhook receiver


class Webhook:
    """Alertmanager webhook receiver on 127.0.0.1 (http.server in a thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._payloads: list[tuple[float, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsed": body.decode(errors="replace")}
                with outer._lock:
                    outer._payloads.append((time.time(), payload))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="e2e-webhook", daemon=True)
        self._thread.start()

    def alerts(self) -> list[dict]:
        """Every alert of every notification received: dicts with status, labels, annotations."""
        with self._lock:
            payloads = list(self._payloads)
        return [dict(a, received=t) for t, p in payloads for a in p.get("alerts", [])]

    def received(self, alertname: str, run_id: str, status: str = "firing") -> list[dict]:
        return [
            a
            for a in self.alerts()
            if a.get("status") == status
            and a["labels"].get("alertname") == alertname
            and a["labels"].get("run_id") == run_id
        ]

    def summary(self) -> str:
        seen = sorted(
            {
                (a["labels"].get("alertname", "?"), a["labels"].get("run_id", "?"), a.get("status", "?"))
                for a in self.alerts()
            }
        )
        return "\n".join(f"  {n} run_id={r} {s}" for n, r, s in seen) or "  (nothing received)"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------- servers


class ServerProcess:
    """A server binary in its own session, output in a log file, stopped by :meth:`stop`."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, ready_url: str, cwd: Path) -> None:
        self.name, self.cmd, self.log_path, self.ready_url = name, list(cmd), log_path, ready_url
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with {self.proc.returncode}: {' '.join(self.cmd)}\n"
                    f"{tail(self.log_path)}",
                    pytrace=False,
                )
            try:
                if http_get(self.ready_url, timeout=2)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{self.name} not ready at {self.ready_url} after {timeout:.0f} s\n{tail(self.log_path)}",
                    pytrace=False,
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._log.close()


class Prometheus(ServerProcess):
    """``prometheus`` with a config directory, TSDB in ``workdir``; a thin HTTP API client."""

    def __init__(self, binary: str, config_file: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = workdir / "prometheus-data"
        data.mkdir()
        super().__init__(
            "prometheus",
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            workdir / "prometheus.log",
            self.url + "/-/ready",
            cwd=workdir,
        )

    def api(self, path: str, **params: Any) -> Any:
        doc = get_json(self.url + "/api/v1/" + path, params)
        assert doc.get("status") == "success", doc
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query (vector results), at unix time ``at`` (default: now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return data["result"]

    def values(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        return [(r["metric"], float(r["value"][1])) for r in self.query(expr, at)]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]


class Alertmanager(ServerProcess):
    """``prometheus-alertmanager`` on 127.0.0.1, clustering off, storage in ``workdir``."""

    def __init__(self, binary: str, config_file: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = workdir / "alertmanager-data"
        data.mkdir()
        super().__init__(
            "alertmanager",
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.path={data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            workdir / "alertmanager.log",
            self.url + "/-/ready",
            cwd=workdir,
        )

    def alerts(self) -> list[dict]:
        """``GET /api/v2/alerts``: active alerts, including inhibited (state "suppressed") ones."""
        return get_json(self.url + "/api/v2/alerts")


# --------------------------------------------------------------------------- recorder


def _key(labels: Mapping[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


class Recorder:
    """Polls Prometheus' alerts and targets and Alertmanager's alerts, keeping their history.

    Alerts resolve (a NaN ends an explosion, a counter's increase leaves its window) and
    targets leave discovery; tests assert on what was seen at any point of the run.
    """

    def __init__(self, prom: Prometheus, am: Alertmanager, interval: float = 0.5) -> None:
        self.prom, self.am, self.interval = prom, am, interval
        self._lock = threading.Lock()
        self.prom_alerts: dict[tuple, dict] = {}
        self.am_alerts: dict[tuple, dict] = {}
        self.targets: dict[tuple, dict] = {}
        self.errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e2e-recorder", daemon=True)
        self._thread.start()

    @staticmethod
    def _note(
        book: dict[tuple, dict], key: tuple, labels: Mapping[str, str], state: str, now: float, **info: Any
    ) -> None:
        rec = book.setdefault(key, {"labels": dict(labels), "states": {}})
        first, _ = rec["states"].get(state, (now, now))
        rec["states"][state] = (first, now)
        for k, v in info.items():
            rec.setdefault(k, v)  # first value seen
            rec["last_" + k] = v

    def poll_once(self) -> None:
        sources: list[tuple[str, Callable[[], list[dict]]]] = [
            ("prometheus alerts", self.prom.alerts),
            ("alertmanager alerts", self.am.alerts),
            ("prometheus targets", self.prom.targets),
        ]
        for name, fetch in sources:
            try:
                items = fetch()
            except Exception as e:  # noqa: BLE001 - recorded, shown in diagnostics
                with self._lock:
                    self.errors[name] = repr(e)
                continue
            now = time.time()
            with self._lock:
                for a in items:
                    if name == "prometheus alerts":
                        self._note(
                            self.prom_alerts,
                            _key(a["labels"]),
                            a["labels"],
                            a["state"],
                            now,
                            activeAt=a.get("activeAt"),
                            value=a.get("value"),
                            annotations=a.get("annotations", {}),
                        )
                    elif name == "alertmanager alerts":
                        st = a.get("status", {})
                        self._note(
                            self.am_alerts,
                            _key(a["labels"]),
                            a["labels"],
                            st.get("state", "?"),
                            now,
                            annotations=a.get("annotations", {}),
                            inhibitedBy=st.get("inhibitedBy") or [],
                            startsAt=a.get("startsAt"),
                        )
                    else:
                        self._note(
                            self.targets,
                            (a["scrapeUrl"],) + _key(a["labels"]),
                            a["labels"],
                            a["health"],
                            now,
                            scrapeUrl=a["scrapeUrl"],
                            discoveredLabels=a.get("discoveredLabels", {}),
                            lastError=a.get("lastError"),
                        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- queries -----------------------------------------------------------------------------
    @staticmethod
    def _match(rec: dict, alertname: str | None, run_id: str | None, labels: Mapping[str, str]) -> bool:
        lab = rec["labels"]
        return (
            (alertname is None or lab.get("alertname") == alertname)
            and (run_id is None or lab.get("run_id") == run_id)
            and all(lab.get(k) == v for k, v in labels.items())
        )

    def prom_alert(self, alertname: str, run_id: str, state: str | None = None, **labels: str) -> list[dict]:
        """Prometheus alert records (any state, or ``state``) seen so far."""
        with self._lock:
            recs = [
                json.loads(json.dumps(r))
                for r in self.prom_alerts.values()
                if self._match(r, alertname, run_id, labels)
            ]
        return [r for r in recs if state is None or state in r["states"]]

    def am_alert(self, alertname: str, run_id: str, **labels: str) -> list[dict]:
        """Alertmanager alert records seen so far (state "active" or "suppressed")."""
        with self._lock:
            return [
                json.loads(json.dumps(r))
                for r in self.am_alerts.values()
                if self._match(r, alertname, run_id, labels)
            ]

    def target_records(self, run_id: str) -> list[dict]:
        with self._lock:
            return [
                json.loads(json.dumps(r))
                for r in self.targets.values()
                if r["labels"].get("run_id") == run_id
            ]

    def summary(self, run_ids: Iterable[str] | None = None) -> str:
        wanted = set(run_ids) if run_ids is not None else None
        lines = []
        with self._lock:
            for title, book in (
                ("Prometheus alerts seen", self.prom_alerts),
                ("Alertmanager alerts seen", self.am_alerts),
            ):
                lines.append(title + ":")
                for rec in book.values():
                    lab = rec["labels"]
                    if wanted is None or lab.get("run_id") in wanted:
                        extra = {k: v for k, v in lab.items() if k not in ("alertname", "run_id", "severity")}
                        states = ", ".join(f"{s} {_hms(a)}-{_hms(b)}" for s, (a, b) in rec["states"].items())
                        lines.append(
                            f"  {lab.get('alertname')} run_id={lab.get('run_id')} {extra or ''} [{states}]"
                        )
            lines.append("Prometheus targets seen:")
            for rec in self.targets.values():
                tl = rec["labels"]
                if wanted is None or tl.get("run_id") in wanted:
                    states = ", ".join(f"{s} {_hms(a)}-{_hms(b)}" for s, (a, b) in rec["states"].items())
                    lines.append(
                        f"  {rec['scrapeUrl']} {tl} [{states}] lastError={rec.get('last_lastError')!r}"
                    )
            if self.errors:
                lines.append(f"poll errors (last): {self.errors}")
        return "\n".join(lines)


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# --------------------------------------------------------------------------- prometheus data


def has_data(result: list[dict]) -> bool:
    """True if a query result (vector or matrix) holds at least one sample that is not NaN."""
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(not math.isnan(float(v)) for _, v in points):
            return True
    return False


# --------------------------------------------------------------------------- torchrun jobs


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without distmon/torchrun settings, one OpenMP thread."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTMON_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class EndpointWatch:
    """Scrapes ``url`` every ``interval`` s from a thread: when it answered, with which
    ``distmon_restart_count``, and when each worker of ``job`` (its launcher's restart count in
    its environment) started, from ``/proc``. For a job that torchrun restarts."""

    def __init__(self, url: str, job: TorchrunJob, interval: float = 0.2) -> None:
        self.url, self.job, self.interval = url, job, interval
        self.scrapes: list[tuple[float, float | None]] = []  # (time, restart count; None: no answer)
        self.workers: dict[int, tuple[float, int]] = {}  # pid -> (its start time, its restart count)
        self._stop = threading.Event()
        self._ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            self._boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        self._thread = threading.Thread(target=self._run, name="e2e-endpoint-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                body = http_get(self.url, timeout=1)[2]
                found = re.search(r"^distmon_restart_count\{[^}]*\} (\S+)$", body, re.M)
                self.scrapes.append((time.time(), float(found[1]) if found else -1.0))
            except OSError:
                self.scrapes.append((time.time(), None))
            for pid in self.job.worker_pids():
                if pid not in self.workers:
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                        with open(f"/proc/{pid}/stat") as f:
                            start = int(f.read().rsplit(")", 1)[1].split()[19]) / self._ticks + self._boot
                    except (OSError, ValueError):
                        continue
                    if b"TORCHELASTIC_RESTART_COUNT" in env:  # a worker, not the launcher
                        self.workers[pid] = (start, int(env[b"TORCHELASTIC_RESTART_COUNT"]))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class TorchrunJob:
    """One ``torchrun`` launcher (``python -m torch.distributed.run``) of launch/train.py.

    The launcher runs in its own session; torchrun starts each worker in a session of its
    own too (``start_new_session=True``), so the job's processes are found by the token
    ``E2E_JOB_TOKEN`` in their environment (inherited by the workers).
    """

    def __init__(
        self,
        name: str,
        workdir: Path,
        train_args: Sequence[str],
        env: Mapping[str, str],
        *,
        nproc: int = 2,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        rdzv_id: str | None = None,
        rdzv_conf: str | None = None,
        max_restarts: int = 0,
    ) -> None:
        self.name = name
        self.token = f"{name}-{uuid.uuid4().hex}"
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        self.cmd = torchrun_command(
            nproc,
            train_args,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id,
            rdzv_conf=rdzv_conf,
            max_restarts=max_restarts,
        )
        self.env = clean_env(**env, E2E_JOB_TOKEN=self.token)
        self.proc: subprocess.Popen | None = None
        self.started: float | None = None
        self.ended: float | None = None  # when the launcher exited (set by a waiter thread)

    def start(self) -> TorchrunJob:
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started = time.time()
        threading.Thread(target=self._note_exit, name=f"e2e-wait-{self.name}", daemon=True).start()
        return self

    def _note_exit(self) -> None:
        self.proc.wait()
        self.ended = time.time()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float, diagnose: Callable[[], str]) -> int:
        wait_for(
            lambda: self.poll() is not None and self.ended is not None,
            timeout,
            f"job {self.name} to exit",
            diagnose,
        )
        return self.proc.returncode

    def pids(self) -> list[int]:
        """Live processes (launcher and workers) carrying this job's token."""
        needle = f"E2E_JOB_TOKEN={self.token}\0".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def worker_pids(self) -> list[int]:
        return [p for p in self.pids() if p != self.proc.pid]

    def kill_launcher(self) -> None:
        """SIGKILL the torchrun launcher (agent) process alone."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def kill_all(self, timeout: float = 20.0) -> list[int]:
        """SIGKILL every process of the job (each one's process group); returns the pids hit."""
        hit = []
        for _ in range(3):  # a launcher may still spawn a worker while we look
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(pid) == pid:  # a session/group leader: its children too
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        return hit

    def log_tail(self, chars: int = 2500) -> str:
        return (
            f"--- {self.name}: {' '.join(self.cmd)}\n"
            f"    returncode={self.proc.poll() if self.proc else None}\n"
            f"--- stdout (tail):\n{tail(self.out, chars)}\n--- stderr (tail):\n{tail(self.err, chars)}"
        )
