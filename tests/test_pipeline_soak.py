"""Pipeline parallelism soak (#23): 100 steps x 3 repeats at 4 ranks, never a hang, with and
without ``torch.profiler`` windows.

A pipeline job's collectives are many and on several groups: the schedule's send/recv between
the stages, DDP's all-reduce or FSDP2's all-gathers and reduce-scatters inside each stage, and
distmon's one per step over the whole job (an all-reduce, or an export's all-gather, on steps
that a step count or rank 0's clock picks). Any of them issued on some ranks only, or in a
different order on two ranks, hangs the job. Here real gloo ranks train the small GPT of
``layout_harness`` cut into 2 stages on a (pp=2, dp=2) mesh:

* DDP inside each stage, ScheduleGPipe, one micro-batch (torch's DDP inside a stage asserts with
  more); FSDP2 inside each stage, Schedule1F1B, four micro-batches;
* each for 100 optimizer steps, 3 times with a fresh model, stage and monitor on the same
  process group, exporting every 16 steps and on rank 0's clock (every 0.2 s: exports at steps
  that differ from run to run, agreed through the step's all-reduce);
* the second run of each calls distmon's ``clip_grad_norm_`` on every step (torchtitan's loop:
  the step's collective completed before the optimizer step), the others leave it in flight
  until the next step begins;
* once without a profiler, once with windows opening and closing at step boundaries and in the
  middle of a step (between the schedule's backward and ``optimizer.step()``, where distmon
  issues its collective), one window spanning a step boundary, and the last rank late to the
  optimizer step in a window of its own: distmon completes its collective inside the window
  it was issued in (a collective completed after its window closed crashed gloo in torch 2.13).

A hang fails the test: a collective left unmatched raises on its rank when gloo's timeout
(0.6 x ``run_ranks``' timeout) expires, any other hang with every rank's stack. Beyond finishing: every
rank reached step 100 with no monitor error, rank 0's JSONL log holds every step with valid
figures for every rank, and at steps 33, 66, 99 and 100 of every run the global and per-layer
norms equal a float64 reference: the gradients the optimizer steps with, made whole
(``full_tensor``) on each rank and merged across the stages by name, outside distmon.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from ddp_harness import run_ranks
from helpers import close
from layout_harness import LAYERS, Built, Layout, by_layer, combined, full_grad, torch_limit
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.slow  # real ranks: not in the fast tier

STEPS, REPEATS = 100, 3
CHECKED = (33, 66, 99, 100)  # steps compared with the float64 reference (in 4 window phases)
LAYOUTS = (
    Layout("pp_ddp_gpipe", {"pp": 2, "dp": 2}, dp="ddp", schedule="GPipe", microbatches=1),
    Layout("pp_fsdp_1f1b", {"pp": 2, "dp": 2}, dp="fsdp", schedule="1F1B", microbatches=4),
)
MONITORED = {"serve": "none", "export_every": 16, "export_interval_s": 0.2}
LATE_S = 0.01  # the last rank's delay before the optimizer step, in a window of its own

# Profiler windows over a cycle of 5 steps: where each opens and closes ("start" and "end" of the
# step, "mid": after the schedule's backward, before optimizer.step()). None: no change.
WINDOWS = (
    ("start", "end"),  # a window of its own, the last rank late to the optimizer step
    (None, None),  # not profiled
    ("start", "mid"),  # closes before distmon's collective is issued
    ("mid", None),  # opens just before it, stays open over the step boundary...
    (None, "mid"),  # ...to the middle of the next step
)


class Windows:
    """Opens and closes ``torch.profiler`` windows on the schedule of :data:`WINDOWS`."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.window: profile | None = None
        self.count = 0

    def at(self, step: int, where: str) -> None:
        if not self.enabled:
            return
        opens, closes = WINDOWS[(step - 1) % len(WINDOWS)]
        if closes == where:
            self.window.__exit__(None, None, None)
            self.window = None
        if opens == where:
            self.window = profile(activities=[ProfilerActivity.CPU])
            self.window.__enter__()
            self.count += 1

    def late(self, step: int) -> bool:
        return self.enabled and WINDOWS[(step - 1) % len(WINDOWS)] == ("start", "end")


def _run(rank: int, world: int, layout: Layout, profiled: bool, clip: bool, log: str) -> dict:
    """One run: a fresh stage and monitor, STEPS steps (``clip``: distmon's clip_grad_norm_ on
    every step, as torchtitan's loop does); what the test checks."""
    import distmon

    started = time.perf_counter()
    built = Built(layout)
    mon = distmon.GradMonitor(built.monitored, built.opt, log_path=log, **MONITORED)
    windows = Windows(profiled)
    sq, clipped = [], []
    for step in range(1, STEPS + 1):
        windows.at(step, "start")
        built.train_step(step)
        windows.at(step, "mid")
        if step in CHECKED:  # what the optimizer steps with, made whole (a collective under FSDP)
            sq.append({n: float(full_grad(p).pow(2).sum()) for n, p in built.named_params()})
        if clip:  # a bound never reached: the gradients are multiplied by 1.0, the norm returned
            norm = mon.clip_grad_norm_(1e9)
            if step in CHECKED:
                clipped.append(float(norm))
        if windows.late(step) and rank == world - 1:
            time.sleep(LATE_S)
        built.opt.step()
        built.opt.zero_grad()
        windows.at(step, "end")
    assert windows.window is None, "the window schedule must close its last window"
    last = mon.flush()
    mon.close()
    return {
        "steps": mon.step,
        "last": (last.step, last.monitor_errors, last.valid),
        "sq": sq,
        "clipped": clipped,
        "windows": windows.count,
        "seconds": time.perf_counter() - started,
    }


def _soak_job(rank: int, world: int, log_dir: str) -> dict:
    out = {}
    for profiled in (False, True):
        for layout in LAYOUTS:
            for repeat in range(REPEATS):
                key = (layout.name, profiled, repeat)
                log = os.path.join(log_dir, "{}-{}-{}.jsonl".format(*key))
                out[key] = _run(rank, world, layout, profiled, repeat == 1, log)
                if rank == 0:
                    with open(log) as f:
                        out[key]["snaps"] = [json.loads(line) for line in f]
    return out


def _problems(key: tuple, runs: list[dict]) -> list[str]:
    """What went wrong in one run, ``runs`` its result on every rank."""
    where = "{} {} #{}".format(key[0], "profiled" if key[1] else "plain", key[2])
    problems = []
    for r, run in enumerate(runs):
        if run["steps"] != STEPS or run["last"] != (STEPS, 0, True):
            problems.append(
                f"{where}: rank {r} ended at {run['steps']} steps, last (step, errors, valid) {run['last']}"
            )
    snaps = runs[0]["snaps"]
    if [s["step"] for s in snaps] != list(range(1, STEPS + 1)):
        problems.append(f"{where}: rank 0's log holds steps {[s['step'] for s in snaps][:8]}...")
    for s in snaps:
        if not (
            s["valid"]
            and all(s["rank_valid"])
            and s["monitor_errors"] == 0
            and s["world_size"] == len(runs)
            and math.isfinite(s["grad_norm"])
            and s["grad_norm"] > 0
        ):
            seen = {k: s[k] for k in ("valid", "rank_valid", "monitor_errors", "world_size", "grad_norm")}
            problems.append(f"{where}: step {s['step']}: {seen}")
    opened = sum(1 for opens, _ in WINDOWS if opens) * STEPS // len(WINDOWS) if key[1] else 0
    if any(run["windows"] != opened for run in runs):
        problems.append(f"{where}: profiler windows opened {[run['windows'] for run in runs]}, not {opened}")
    by_step = {s["step"]: s for s in snaps}
    for i, step in enumerate(CHECKED):
        ref = combined(runs, i + 1)  # out["sq"][i]: the CHECKED steps in order
        layers = by_layer(ref)
        snap = by_step.get(step)
        if snap is None:
            continue
        want = math.sqrt(sum(ref.values()))
        if not close(snap["grad_norm"], want) or set(snap["layer_grad_norms"]) != set(LAYERS):
            problems.append(f"{where}: step {step}: global norm {snap['grad_norm']}, reference {want}")
        got = snap["layer_grad_norms"]
        off = [n for n in LAYERS if not close(got.get(n, math.nan), math.sqrt(layers[n]))]
        if off:
            problems.append(f"{where}: step {step}: layers {off} differ from the reference")
        norms = [run["clipped"][i] for run in runs if run["clipped"]]
        if key[2] == 1 and (len(norms) != len(runs) or not all(close(n, want) for n in norms)):
            problems.append(f"{where}: step {step}: clip_grad_norm_ returned {norms}, reference {want}")
    return problems


def test_pipeline_100_steps_3_repeats_4_ranks_never_hang_with_and_without_profiler(tmp_path):
    for limit in filter(None, map(torch_limit, LAYOUTS)):
        pytest.skip(limit)  # torch's own limit on CPU/gloo, not distmon's
    results = run_ranks(_soak_job, 4, str(tmp_path), timeout=300)
    problems = []
    for key in results[0]:
        runs = [res[key] for res in results]
        problems += _problems(key, runs)
    timing = {k: round(max(res[k]["seconds"] for res in results), 1) for k in results[0]}
    assert not problems, "\n".join(problems[:20]) + f"\nseconds per run: {timing}"
    print("seconds per run:", timing)
