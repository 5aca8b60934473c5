"""The rank side of torchrun restart runs (``benchmarks/restart_reliability.py``, ``tests/test_restarts.py``).

``python -m torch.distributed.run --max-restarts 1 ... tests/jobs/restart_job.py OUT [options]``

A 2-rank gloo DDP job as a user writes it: distmon on every rank (``port=`` on rank 0, ``port=0``
elsewhere, ``linger_s=0``, ``log_path=``, ``export_every=5``; ``--no-monitor``: the bare twin), a
checkpoint after step ``--ckpt-step`` holding ``mon.state_dict()``, a failure at ``--fail-step`` of
the first attempt, and the restarted workers resuming from the checkpoint to ``--steps``. The
script closes the monitor itself (``mon.close()`` after the loop), as the README's script does.

Failures (``--fail``): ``exception`` (``--fail-rank`` raises, the script dies of it), ``sigkill``
(it SIGKILLs itself: nothing of Python's runs), ``exit`` (``os._exit(1)``, the issue's case),
``sysexit`` (``sys.exit(1)``: a script that catches its error and exits with a status; the
monitor is then closed by distmon's exit guard, not by an exception).

Each event is one JSON line appended to ``OUT/events.jsonl`` (one ``write`` of a small line on an
``O_APPEND`` file: whole lines, whatever the order): ``init`` (the process group is up), ``step``
(the first and last step of each attempt), ``fail`` (just before the injected failure), ``done``
and ``atexit`` (the last exit handler to run: after distmon's), each with its wall time, rank,
attempt (``TORCHELASTIC_RESTART_COUNT``) and pid.
"""

import argparse
import atexit
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--no-monitor", action="store_true")
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--ckpt-step", type=int, default=20)
parser.add_argument("--fail-step", type=int, default=25)
parser.add_argument("--fail-rank", type=int, default=1)
parser.add_argument("--fail", choices=("exception", "sigkill", "exit", "sysexit"), default="exception")
parser.add_argument("--step-s", type=float, default=0.02, help="each step lasts at least this long")
parser.add_argument("--exit-wait-s", type=float, default=None, help="distmon's wait for the others at exit")
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
events = os.open(os.path.join(args.out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def event(kind: str, **fields: object) -> None:
    line = {
        "t": time.time(),
        "ev": kind,
        "rank": int(os.environ["RANK"]),
        "attempt": attempt,
        "pid": os.getpid(),
    }
    os.write(events, (json.dumps(line | fields) + "\n").encode())


# registered first, so it runs last of the exit handlers (after distmon's, at a death by exception)
atexit.register(lambda: event("atexit"))
distmon = None
if not args.no_monitor:  # imported where a script imports it, before the process group
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import distmon
    import distmon.setup.lifecycle

    if args.exit_wait_s is not None:  # a test's shorter wait (the behaviour is the same at 30 s)
        distmon.setup.lifecycle.EXIT_GATHER_S = args.exit_wait_s
dist.init_process_group("gloo")
rank = dist.get_rank()
event("init")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mon = None
if distmon is not None:
    mon = distmon.GradMonitor(
        model,
        opt,
        port=args.port if rank == 0 else 0,
        linger_s=0,
        log_path=os.path.join(args.out, "log.jsonl"),
        export_every=5,
    )
ckpt = os.path.join(args.out, "ckpt.pt")
first = 1
if os.path.exists(ckpt):
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if mon is not None:
        mon.load_state_dict(state["distmon"])
    first = state["step"] + 1

for step in range(first, args.steps + 1):
    began = time.monotonic()
    if attempt == 0 and step == args.fail_step and rank == args.fail_rank:
        event("fail", step=step, how=args.fail)
        if args.fail == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fail == "exit":
            os._exit(1)
        if args.fail == "sysexit":  # a script that catches its error and exits with a status
            sys.exit(1)
        raise RuntimeError(f"rank {rank} fails at step {step} (injected)")
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 8, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step in (first, args.steps):
        event("step", step=step)
    if step == args.ckpt_step:
        state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict()}
        state["distmon"] = mon.state_dict() if mon is not None else None  # on every rank: a collective
        if rank == 0:
            torch.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()  # the checkpoint is whole before any rank can fail
    time.sleep(max(0.0, args.step_s - (time.monotonic() - began)))

if mon is not None:
    mon.close()
event("done")
dist.destroy_process_group()
