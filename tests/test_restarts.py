"""torchrun restarts (#30): a worker failing under ``--max-restarts``, and a shutdown by SIGTERM.

A restart: rank 1 of a 2-rank ``launch/train.py`` job fails at step 25 of the first attempt;
torchrun restarts both workers, which resume from the checkpoint of step 20. The restarted
rank 0 serves on the same port within 10 s of its process starting, with the same run id
(torchrun's ``--rdzv-id``) and ``distmon_restart_count`` 1, and the log reads as one run with
one resume. (``tests/test_e2e_deploy.py`` runs the same with a real Prometheus and the shipped
rules, among a dozen other processes.)

A shutdown by SIGTERM: what torchrun sends every worker when one fails or the job is stopped.

torchrun SIGKILLs what is still running 30 s later, and restarts the workers only once all are
gone: a monitor that spent that window lingering would delay every restart by 30 s. Each worker
of a 2-rank ``launch/train.py`` job gets SIGTERM mid-run; each must be gone within 5 s, its port
free at once, the JSONL log whole up to its last exported step (every line a snapshot, the steps
1..k without a gap, k a multiple of ``export_every``).

Restarts under load (#39): torchrun's c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(what docs/deployment.md recommends), 2 busy processes started and stopped by the test: 10
restarted 2-rank jobs with distmon (``tests/jobs/restart_job.py``, through
``benchmarks/restart_reliability.py``'s runs; the failure kinds in turn: an exception, ``os._exit``,
a SIGKILL, rank 0's exception) and their 10 bare twins, each pair side by side, all finish (one
pair at a time: with two, 4 jobs' launchers and rank 0s pick free ports at once, and a
restarted rank 0's store once found its port taken, EADDRINUSE, torch's pick-then-bind race). Static
rendezvous is left to the benchmark: its restarts fail under load with or without distmon (torch's,
docs/deployment.md). And a rank that ends with ``sys.exit(1)`` without ``close()`` while its peer
waits in a reduction: distmon's exit guard no longer gathers with a peer that never comes (the job
hung until killed), so the job restarts and finishes like its bare twin.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from ddp_harness import free_port
from e2e_stack import EndpointWatch, TorchrunJob, wait_for

from distmon.report.log_reader import read_log

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from restart_reliability import Load, Run, run_once  # noqa: E402  (the benchmark's own runs)

pytestmark = pytest.mark.slow

EXPORT_EVERY = 5


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _listeners(port: int) -> dict[int, str]:
    """Who listens on ``port`` (state 0A in /proc/net/tcp*): pid -> ``state cmdline`` of each owner
    (pid -1: a socket whose owner was not found)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        inodes |= {r[9] for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A"}
    owners: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")) if inodes else ():
        try:
            fds = set()
            # every thread's table: a process whose first thread exited shows it as a zombie, and
            # its descriptors only under its live threads
            for task in os.listdir(f"/proc/{pid}/task"):
                for fd in os.listdir(f"/proc/{pid}/task/{task}/fd"):
                    try:
                        fds.add(os.readlink(f"/proc/{pid}/task/{task}/fd/{fd}"))
                    except OSError:  # closed meanwhile (the listing's own descriptor, say)
                        continue
            if any(f"socket:[{inode}]" in fds for inode in inodes):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
                with open(f"/proc/{pid}/status") as f:
                    state = next(line for line in f if line.startswith("State:")).split(None, 1)[1].strip()
                owners[int(pid)] = f"{state} {cmd}"
        except OSError:
            continue
    return owners or ({-1: f"socket inodes {sorted(inodes)}"} if inodes else {})


@pytest.mark.serial  # a bound of 5 s: run alone
def test_sigterm_to_every_worker_leaves_a_whole_log_and_a_free_port_within_5_s(tmp_path: Path):
    port, log = free_port(), tmp_path / "log.jsonl"
    args = ["--preset", "tiny", "--steps", "100000", "--min-step-s", "0.05", "--port", str(port)]
    args += ["--log-path", str(log), "--export-every", str(EXPORT_EVERY)]
    job = TorchrunJob("sigterm", tmp_path, args, {}).start()
    try:
        wait_for(
            lambda: log.exists() and log.read_text().count("\n") >= 20, 180, "20 logged steps", job.log_tail
        )
        workers = job.worker_pids()
        assert len(workers) == 2, job.log_tail()
        sent = time.monotonic()
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not any(map(_alive, workers)), 30, "the workers to exit", job.log_tail)
        took = time.monotonic() - sent
        assert took <= 5.0, f"{took:.1f} s to exit after SIGTERM\n{job.log_tail()}"

        # No process of the job (the agent, a worker, anything they started) still listens there. A
        # bind is not the test: another process's outgoing connection or server may draw the freed
        # port as an ephemeral one, which is not distmon's (named here when it happens).
        def held() -> dict[int, str]:
            mine = set(job.pids()) | set(workers)
            return {pid: who for pid, who in _listeners(port).items() if pid in mine or pid < 0}

        while held() and time.monotonic() < sent + 5.0:
            time.sleep(0.1)
        assert not held(), f"the job still listens on {port} 5 s after SIGTERM: {held()}\n{job.log_tail()}"
        listening = _listeners(port)
        if listening:
            print(f"port {port} taken again by another process after the workers exited: {listening}")
        rows = [json.loads(line) for line in log.read_text().splitlines()]  # every line whole
        steps = [row["step"] for row in rows]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) % EXPORT_EVERY == 0, steps[-7:]
    finally:
        job.kill_all()


@pytest.mark.serial  # a bound of 10 s: run alone
def test_a_restarted_worker_serves_on_its_port_within_10_s_and_resumes_the_run(tmp_path: Path):
    port, log = free_port(), tmp_path / "log.jsonl"
    args = ["--preset", "tiny", "--steps", "40", "--min-step-s", "0.05", "--port", str(port)]
    args += ["--log-path", str(log), "--crash-step", "25", "--crash-rank", "1", "--linger", "0"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712 (README)
    job = TorchrunJob("restart", tmp_path, args, env, rdzv_id="job-restart", max_restarts=1).start()
    watch = EndpointWatch(f"http://127.0.0.1:{port}/metrics", job)
    try:
        assert job.wait(300, job.log_tail) == 0, job.log_tail()
    finally:
        watch.stop()
        job.kill_all()
    restarted = [start for start, count in watch.workers.values() if count == 1]
    back = [t for t, count in watch.scrapes if count == 1.0]
    assert len(restarted) == 2 and back, (watch.workers, job.log_tail())
    assert back[0] - max(restarted) <= 10.0, f"{back[0] - max(restarted):.1f} s"
    assert [c for _, c in watch.scrapes if c is not None][0] == 0.0  # the first attempt served too
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert {row["run_id"] for row in rows} == {"job-restart"} and {row["restart"] for row in rows} == {0, 1}
    read = read_log(str(log))
    assert read.run_count == 1 and list(read.run.steps) == list(range(1, 41))
    assert [step for step, _ in read.run.restarts] == [20]


LOAD = 2  # busy processes while the restarts run: the "two busy loops"
SHORT = (2, 4, 6)  # checkpoint after step 2, the failure at step 4 (step 3 not exported yet), last step 6
RUN_TIMEOUT_S = 150.0


def _side_by_side(runs: list[Run], workdir: Path) -> list[Run]:
    """Run each of ``runs`` at once (a monitored job and its bare twin under the same load)."""
    threads = [threading.Thread(target=run_once, args=(run, workdir, RUN_TIMEOUT_S)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def _said(runs: list[Run]) -> str:
    return "\n".join(
        f"{r.mode}/{r.failure}/{'distmon' if r.monitor else 'bare'} #{r.index}: {r.outcome} {r.error or ''} "
        f"(death -> other's exit {r.death_to_exit_s} s, -> restarted step {r.death_to_restart_step_s} s)"
        for r in runs
    )


def test_ten_restarts_with_distmon_and_their_bare_twins_all_finish_under_load_with_c10d(tmp_path: Path):
    failures = ("exception", "exit", "sigkill", "rank0")
    runs: list[Run] = []
    began = time.monotonic()
    with Load(LOAD):
        for i in range(10):
            failure = failures[i % len(failures)]
            pair = [Run("c10d", failure, monitor, i + 1, steps=SHORT) for monitor in (True, False)]
            runs += _side_by_side(pair, tmp_path)
    print(f"\n{len(runs)} restarted jobs in {time.monotonic() - began:.0f} s\n{_said(runs)}")
    assert all(r.finished for r in runs), _said([r for r in runs if not r.finished])


def test_a_rank_ending_with_sys_exit_restarts_like_its_bare_twin(tmp_path: Path):
    """Before: distmon's exit guard gathered with a peer blocked in the step's reduction; the gather
    timed out, its work stayed in flight and the process never exited (hung until killed)."""
    flags = ("--exit-wait-s", "5")  # the guard's wait for the others (30 s shipped): the same path
    pair = [Run("c10d", "sysexit", monitor, 1, steps=SHORT, job_args=flags) for monitor in (True, False)]
    with Load(LOAD):
        runs = _side_by_side(pair, tmp_path)
    assert all(r.finished for r in runs), _said(runs)
    monitored = runs[0]
    assert monitored.failure_to_death_s is not None and monitored.failure_to_death_s < 5.0 + 25.0, _said(runs)
