"""How many rank processes of a two-rank gloo job abort at interpreter exit (SIGABRT,
``terminate called without an active exception``) when the job ends right after a collective.

    python benchmarks/exit_aborts.py [--runs 20]

Each run starts two ranks (plain processes, a TCP rendezvous on 127.0.0.1) of one of:

* ``bare``: no distmon; one all-reduce of a tensor, then the script ends (torch's own hazard:
  in torch 2.11 to 2.14 gloo's thread drops the tensor's Python object under the GIL, which
  aborts once the interpreter began to finalize);
* ``close`` / ``exit``: ``tests/jobs/teardown_job.py``, a DDP job with distmon ending right after
  ``GradMonitor.close()``, or closed by distmon's exit handler, every thread but the training
  thread scheduled only when it is idle (as a loaded machine schedules gloo's thread late).

``--cost``: what the wait's bookkeeping adds to an ordinary step on CPU (one view handed to the
step's all-reduce and counted once it completed), median of 7 rounds of 100,000.

The counts in docs/deployment.md come from this script; the "before" ones with ``distmon/`` as
of 712d6e3, before ``distmon/step/release.py`` (``git stash push -- distmon`` over that change).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
from train import free_port  # noqa: E402

BARE = (
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "dist.all_reduce(torch.zeros(4096))\n"  # and the script ends: no destroy_process_group()
)
JOB = os.path.join(ROOT, "tests", "jobs", "teardown_job.py")


def aborted(kind: str) -> int:
    """One two-rank run: how many of its rank processes died of a signal."""
    port = str(free_port())
    argv = ["-c", BARE] if kind == "bare" else [JOB, kind]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=ROOT, **quiet))
    codes = [p.wait(timeout=300) for p in procs]
    return sum(code < 0 for code in codes)


def cost() -> float:
    """Microseconds per ordinary step of ``HandedViews``' bookkeeping (median of 7 rounds)."""
    import statistics
    import time

    import torch

    sys.path.insert(0, ROOT)
    from distmon.step.release import HandedViews

    views, buf, n, rounds = HandedViews(), torch.zeros(8), 100_000, []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(n):
            views.landed((buf.view_as(buf),))  # RankBuffers._hand's view, then its wait's count
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="two-rank runs of each kind")
    ap.add_argument("--kinds", default="bare,close,exit")
    ap.add_argument("--cost", action="store_true", help="the bookkeeping's cost per step, and nothing else")
    args = ap.parse_args()
    import torch

    if args.cost:
        print(f"torch {torch.__version__}: {cost():.2f} us per ordinary step (one view handed, counted)")
        return

    for kind in args.kinds.split(","):
        n = sum(aborted(kind) for _ in range(args.runs))
        print(f"torch {torch.__version__} {kind}: {n} of {2 * args.runs} rank processes aborted", flush=True)


if __name__ == "__main__":
    main()
