#!/usr/bin/env python3
"""Do torchrun restarts of a 2-rank gloo job finish, with and without distmon, under CPU load?

    python benchmarks/restart_reliability.py                 # every mode and failure, 5 runs each, load 2
    python benchmarks/restart_reliability.py --runs 10 --modes c10d --failures exception --load 2
    python benchmarks/restart_reliability.py --runs 3 --out /tmp/restarts   # results elsewhere

Each run is ``tests/jobs/restart_job.py`` under ``torchrun --nproc-per-node 2 --max-restarts 1``
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): distmon on every rank, or not at all (the bare
twin, ``--no-monitor``), a checkpoint after step 20, a failure at step 25 of the first attempt,
the restarted workers resuming to step 40. Runs alternate between the monitored job and its
bare twin, so both see the same load.

Modes (``--modes``): ``static`` (``--master-port P --rdzv-id ID``, torchrun's default rendezvous)
and ``c10d`` (``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --rdzv-id ID``). Failures
(``--failures``): ``exception`` (rank 1 raises), ``sigkill`` (rank 1 is SIGKILLed), ``exit``
(rank 1 calls ``os._exit(1)``), ``rank0`` (rank 0 raises). ``--load N`` starts N busy processes
(one ``while True: pass`` each) before the first run and stops them after the last.

Recorded per run: whether the job finished (torchrun's exit status 0) and, if not, its failure's
first error line (from the restarted attempt's worker logs, ``torchrun --log-dir``) or "hung" (no
exit within ``--timeout``); seconds from the failing worker's death (its process exit, seen
through a pidfd) to each other worker's exit, and to the restarted attempt's first step (its
``step`` event); and from the injected failure to the failing worker's own exit. Written as
``OUT.json`` (every run) and ``OUT.md`` (a table per mode, failure and monitor).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "launch"))
from train import free_port  # noqa: E402  (launch/train.py)

JOB = REPO / "tests" / "jobs" / "restart_job.py"
MODES = ("static", "c10d")
FAILURES = {  # name -> restart_job.py flags
    "exception": ["--fail", "exception", "--fail-rank", "1"],
    "sigkill": ["--fail", "sigkill", "--fail-rank", "1"],
    "exit": ["--fail", "exit", "--fail-rank", "1"],
    "sysexit": ["--fail", "sysexit", "--fail-rank", "1"],
    "rank0": ["--fail", "exception", "--fail-rank", "0"],
}
DEFAULT_FAILURES = ("exception", "sigkill", "rank0")
CKPT_STEP, FAIL_STEP, STEPS = 20, 25, 40  # the job; tests/test_restarts.py runs a shorter one
# the first line of a restarted worker's log that says why it failed (the injected failure and
# the elastic agent's own report excepted)
ERROR_LINE = re.compile(r"Error|error|refused|[Tt]imed out|Timeout")
NOT_A_CAUSE = ("(injected)", "ChildFailedError", "elastic/multiprocessing/api.py", "debug_logger.cc")


class Load:
    """``n`` busy processes (one core each, at normal priority) while the ``with`` block runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


@dataclass
class Worker:
    """One worker process torchrun started: its rank, attempt and when it exited (wall time)."""

    pid: int
    rank: int
    attempt: int
    exited: float | None = None


class WorkerWatch:
    """Finds the launcher's worker processes (its children) and notes when each exits.

    A worker is not our child, so its exit is seen through a pidfd (readable once the process has
    exited): exact, where polling ``/proc`` would be as late as its interval. The children are
    listed every 10 ms from ``/proc/<launcher>/task/*/children``.
    """

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.workers: dict[int, Worker] = {}
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)
        self._thread.start()

    def _children(self) -> set[int]:
        pids: set[int] = set()
        for path in glob.glob(f"/proc/{self.launcher}/task/*/children"):
            with contextlib.suppress(OSError), open(path) as f:
                pids |= {int(p) for p in f.read().split()}
        return pids

    def _adopt(self, pid: int) -> None:
        """Watch ``pid`` once it runs the worker (before its exec it still has the launcher's env)."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            if b"RANK" not in env or b"TORCHELASTIC_RESTART_COUNT" not in env:
                return
            fd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return
        self.workers[pid] = Worker(pid, int(env[b"RANK"]), int(env[b"TORCHELASTIC_RESTART_COUNT"]))
        self._fds[fd] = pid
        self._poll.register(fd, select.POLLIN)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._children() - self.workers.keys():
                self._adopt(pid)
            for fd, _ in self._poll.poll(10):
                self.workers[self._fds.pop(fd)].exited = time.time()
                self._poll.unregister(fd)
                os.close(fd)

    def alive(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.exited is None]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for fd in list(self._fds):
            os.close(fd)


@dataclass
class Run:
    """One restarted job's outcome and timings (seconds; None where the run did not get there)."""

    mode: str
    failure: str
    monitor: bool
    index: int
    steps: tuple[int, int, int] = (CKPT_STEP, FAIL_STEP, STEPS)  # checkpoint, failure, last step
    job_args: tuple[str, ...] = ()  # more flags of restart_job.py
    finished: bool = False
    outcome: str = ""  # finished | failed | hung
    error: str | None = None
    wall_s: float = 0.0
    load_avg: float = 0.0  # the machine's 1-minute load average as the run began (others' jobs too)
    failure_to_death_s: float | None = None  # the injected failure to the failing worker's exit
    failure_to_handlers_s: float | None = None  # ... to the end of its exit handlers (distmon's close)
    death_to_exit_s: list[float] = field(default_factory=list)  # to each other worker's exit
    death_to_restart_step_s: float | None = None  # to the restarted attempt's first step


def torchrun_command(mode: str, out: Path, job_args: list[str]) -> list[str]:
    port, run_id = free_port(), f"restart-{uuid.uuid4().hex[:8]}"
    if mode == "static":
        rdzv = ["--master-port", str(port), "--rdzv-id", run_id]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    logs = ["--log-dir", str(out / "logs"), "--redirects", "3"]  # each attempt's worker logs apart
    return launch + rdzv + logs + [str(JOB), str(out)] + job_args


def read_events(out: Path) -> list[dict]:
    try:
        with open(out / "events.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def first_error(out: Path) -> str | None:
    """The first line of the latest attempt's worker logs that says why it failed, else of the launcher's."""
    attempts = sorted(
        glob.glob(str(out / "logs" / "*" / "attempt_*")), key=lambda p: int(p.rsplit("_", 1)[1])
    )
    files = sorted(glob.glob(os.path.join(attempts[-1], "*", "std*.log"))) if attempts else []
    for path in files + [str(out / "launcher.log")]:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            for line in f:
                if ERROR_LINE.search(line) and not any(n in line for n in NOT_A_CAUSE):
                    return re.sub(r"^\[rank\d+\]:\s*", "", line.strip())[:300]
    return None


def timings(run: Run, workers: list[Worker], events: list[dict]) -> None:
    """Fill ``run``'s seconds from the first attempt's workers' exits and the job's events."""
    fail_rank = 0 if run.failure == "rank0" else 1
    first = {w.rank: w for w in workers if w.attempt == 0}
    dead = first.get(fail_rank)
    if dead is None or dead.exited is None:
        return
    failed = [e["t"] for e in events if e["ev"] == "fail"]
    if failed:
        run.failure_to_death_s = round(dead.exited - failed[0], 3)
    handlers_timing(run, events)
    run.death_to_exit_s = [
        round(w.exited - dead.exited, 3) for r, w in first.items() if r != fail_rank and w.exited
    ]
    resumed = [
        e["t"] for e in events if e["ev"] == "step" and e["attempt"] == 1 and e["step"] == run.steps[0] + 1
    ]
    if len(resumed) == 2:
        run.death_to_restart_step_s = round(max(resumed) - dead.exited, 3)


def handlers_timing(run: Run, events: list[dict]) -> None:
    """Seconds from the injected failure to the end of the failing worker's exit handlers (the job's
    last ``atexit`` handler: after distmon's close at exit and the traceback's printing)."""
    failed = [e for e in events if e["ev"] == "fail"]
    if failed:
        done = [e["t"] for e in events if e["ev"] == "atexit" and e["pid"] == failed[0]["pid"]]
        run.failure_to_handlers_s = round(done[0] - failed[0]["t"], 3) if done else None


def rescore(path: str, workdir: Path) -> dict:
    """An earlier ``path``.json with what its runs' own files hold recomputed (:func:`handlers_timing`)."""
    with open(path + ".json") as f:
        result = json.load(f)
    tuples = ("steps", "job_args")
    runs = [Run(**{k: tuple(v) if k in tuples else v for k, v in r.items()}) for r in result["runs"]]
    for run in runs:
        handlers_timing(run, read_events(workdir / run_dir(run)))
    said = "Recomputed from the runs' own files (`--rescore`): the failure -> exit handlers column."
    note = result.get("note", "")
    result.update(summary=summarize(runs), runs=[asdict(r) for r in runs])
    result["note"] = note if said in note else f"{note} {said}".strip()
    return result


def kill(pids: list[int], launcher: subprocess.Popen) -> None:
    """SIGKILL what is left of a job: its workers (sessions of their own) and the launcher's group."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def run_dir(run: Run) -> str:
    return f"{run.mode}-{run.failure}-{'distmon' if run.monitor else 'bare'}-{run.index}"


def run_once(run: Run, workdir: Path, timeout: float) -> Run:
    out = workdir / run_dir(run)
    out.mkdir(parents=True)
    ckpt, fail, last = (str(step) for step in run.steps)
    job_args = FAILURES[run.failure] + ["--ckpt-step", ckpt, "--fail-step", fail, "--steps", last]
    job_args += ["--port", str(free_port())] if run.monitor else ["--no-monitor"]
    job_args += run.job_args
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTMON_", "TORCHELASTIC_"))}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    began, run.load_avg = time.monotonic(), round(os.getloadavg()[0], 1)
    with open(out / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(
            torchrun_command(run.mode, out, job_args),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    watch = WorkerWatch(launcher.pid)
    try:
        rc: int | None = launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
        kill(watch.alive(), launcher)
    time.sleep(0.05)  # the last pidfd's exit, noted
    watch.stop()
    run.wall_s = round(time.monotonic() - began, 1)
    run.finished = rc == 0
    run.outcome = "finished" if rc == 0 else "hung" if rc is None else "failed"
    if not run.finished:
        run.error = f"hung: killed after {timeout:.0f} s" if rc is None else first_error(out)
    timings(run, list(watch.workers.values()), read_events(out))
    return run


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(runs: list[Run]) -> list[dict]:
    """One row per (mode, failure, monitor): runs, finished, medians of the timings."""
    rows = []
    keys = dict.fromkeys((r.mode, r.failure, r.monitor) for r in runs)
    for mode, failure, monitor in keys:
        some = [r for r in runs if (r.mode, r.failure, r.monitor) == (mode, failure, monitor)]
        rows.append(
            {
                "mode": mode,
                "failure": failure,
                "monitor": monitor,
                "runs": len(some),
                "finished": sum(r.finished for r in some),
                "hung": sum(r.outcome == "hung" for r in some),
                "load_avg": median([r.load_avg for r in some]),
                "failure_to_death_s": median(
                    [r.failure_to_death_s for r in some if r.failure_to_death_s is not None]
                ),
                "failure_to_handlers_s": median(
                    [r.failure_to_handlers_s for r in some if r.failure_to_handlers_s is not None]
                ),
                "death_to_exit_s": median([s for r in some for s in r.death_to_exit_s]),
                "death_to_exit_max_s": max((s for r in some for s in r.death_to_exit_s), default=None),
                "death_to_restart_step_s": median(
                    [r.death_to_restart_step_s for r in some if r.death_to_restart_step_s is not None]
                ),
            }
        )
    return rows


def markdown(result: dict) -> str:
    """The results as a page: how they were made, the table, every failed run's first error line."""
    cell = lambda v: "-" if v is None else f"{v}"  # noqa: E731
    lines = [
        "# torchrun restarts with and without distmon",
        "",
        f"Command: `{result['command']}` ({result['machine']}; torch {result['torch']}; "
        f"{result['load']} busy processes started before the first run and stopped after the last; "
        f"{result['seconds']:.0f} s in all).",
        *([f"\n{result['note']}"] if result.get("note") else []),
        "",
        "2 gloo ranks, `--max-restarts 1`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`; a checkpoint after "
        f"step {CKPT_STEP}, the failure at step {FAIL_STEP}, the restarted workers resume to step "
        f"{STEPS}. "
        "Seconds are medians: from the failing worker's death (its process exit) to the other worker's "
        "exit (and the largest), to the restarted attempt's first step; and from the injected failure "
        "to the failing worker's own exit, and to the end of its exit handlers (distmon's close at "
        "exit among them; the rest of the exit is the interpreter's and torch's teardown). Load avg: "
        "the machine's 1-minute load average as the runs began (median; the busy processes and other "
        "users' jobs).",
        "",
        "| rendezvous | failure | distmon | finished | hung | failure -> its exit s "
        "| failure -> its exit handlers done s | death -> other's exit s (max) "
        "| death -> restarted first step s | load avg |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        lines.append(
            f"| {row['mode']} | {row['failure']} | {'yes' if row['monitor'] else 'no'} | "
            f"{row['finished']}/{row['runs']} | {row['hung']} | {cell(row['failure_to_death_s'])} | "
            f"{cell(row.get('failure_to_handlers_s'))} | "
            f"{cell(row['death_to_exit_s'])} ({cell(row['death_to_exit_max_s'])}) | "
            f"{cell(row['death_to_restart_step_s'])} | {cell(row['load_avg'])} |"
        )
    lines += ["", "Per rendezvous mode, every failure kind together:", ""]
    lines += ["| rendezvous | distmon | finished | failed | hung |", "|---|---|---:|---:|---:|"]
    for mode in dict.fromkeys(r["mode"] for r in result["runs"]):
        for monitor in (True, False):
            some = [r for r in result["runs"] if r["mode"] == mode and r["monitor"] == monitor]
            done, hung = sum(r["finished"] for r in some), sum(r["outcome"] == "hung" for r in some)
            lines.append(
                f"| {mode} | {'yes' if monitor else 'no'} | {done}/{len(some)} | "
                f"{len(some) - done - hung} | {hung} |"
            )
    failed = [r for r in result["runs"] if not r["finished"]]
    if failed:
        lines += [
            "",
            "Runs that did not finish (in order), with the first error line of the restarted attempt:",
            "",
        ]
        for r in failed:
            who = "distmon" if r["monitor"] else "bare"
            lines.append(f"- {r['mode']} / {r['failure']} / {who} #{r['index']}: `{r['error']}`")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs", type=int, default=5, help="runs per mode, failure and monitor (each with its twin)"
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: static, c10d")
    p.add_argument(
        "--failures", default=",".join(DEFAULT_FAILURES), help=f"comma-separated: {', '.join(FAILURES)}"
    )
    p.add_argument("--load", type=int, default=2, help="busy processes running meanwhile")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as hung")
    p.add_argument(
        "--workdir", default=None, help="where the runs' files go (default: a temporary directory)"
    )
    p.add_argument("--out", default=str(HERE / "results" / "restarts"), help="writes OUT.json and OUT.md")
    p.add_argument("--note", default="", help="a line for OUT.md: which code ran (a commit, say)")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="recompute OUT.json from its runs' files in --workdir (no runs)",
    )
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    args.failures = args.failures.split(",")
    bad = [m for m in args.modes if m not in MODES] + [f for f in args.failures if f not in FAILURES]
    if bad or args.runs < 1 or args.load < 0:
        p.error(f"unknown mode or failure {bad}" if bad else "--runs >= 1 and --load >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    import torch

    args = parse_args(argv)
    if args.rescore:
        return write(rescore(args.out, Path(args.workdir)), args.out)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="restarts-"))
    runs: list[Run] = []
    began = time.monotonic()
    with Load(args.load):
        for mode in args.modes:
            for failure in args.failures:
                for i in range(1, args.runs + 1):
                    for monitor in (True, False) if i % 2 else (False, True):  # who goes first alternates
                        run = run_once(Run(mode, failure, monitor, i), workdir, args.timeout)
                        runs.append(run)
                        print(json.dumps(asdict(run)), flush=True)
    result = {
        "command": "python benchmarks/restart_reliability.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        "torch": torch.__version__,
        "load": args.load,
        "note": args.note,
        "seconds": round(time.monotonic() - began),
        "summary": summarize(runs),
        "runs": [asdict(r) for r in runs],
    }
    return write(result, args.out)


def write(result: dict, out: str) -> dict:
    """``out``.json (every run) and ``out``.md (the tables); the page printed."""
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
