#!/usr/bin/env python3
"""How does distmon's per-step collective grow with the number of ranks? Measured on gloo.

    python benchmarks/collective_scaling.py                 # 2, 4, 8, 16 ranks, 64 layers
    python benchmarks/collective_scaling.py --ranks 2 4 --layers 128 --export-every 10

For each world size, spawned gloo ranks on this machine time (after a barrier each step, the
slowest rank's time) the two per-step schedules with the same layer count, over the same
``--steps`` steps:

* ``old`` (distmon before issue #14): every step, every rank's packed row (the rank x layer
  local sums, errors, valid: layers + 2 floats) all-gathered: world x (layers + 2) floats
  received per rank per step, a ring's world - 1 latency terms every step;
* ``new`` (distmon now): an ordinary step all-reduces one float (rank 0's export vote); every
  ``--export-every``-th step all-gathers, in its place, the rows (layers + 3 floats: the vote
  too) of every step since the last export. The same bytes per step on average, and the
  world-sized latency once per export.

Reported: the median ordinary step of each schedule, the median export step of ``new``, and
each schedule's mean over whole export cycles (what a step costs on average). On 2 CPU cores,
ranks beyond 2 share cores: absolute times grow with oversubscription as well as with the
algorithm, so read the ratio between the schedules and the trend.

    python benchmarks/collective_scaling.py --model         # the alpha-beta model, 64-16,384 GPUs

prints, instead of measuring, the alpha-beta cost model of both schedules on NCCL (a ring
all-gather: ``(W - 1)(alpha + n beta)`` for n bytes received from each rank; a tree
all-reduce of a few bytes: ``2 log2(W) alpha``), per-step bytes received, latency and the
ratio to a 1 s step, with ``--alpha-us`` (per hop, default 10 us between nodes) and
``--gbps`` (default 25 GB/s per GPU).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


def _rank(rank: int, world: int, layers: int, steps: int, every: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    old_row = torch.rand(layers + 2)
    old_out = torch.empty(world * (layers + 2))
    new_rows = torch.rand(every, layers + 3)
    new_out = torch.empty(world * every * (layers + 3))
    vote = torch.zeros(1)

    def old(step: int) -> None:
        dist.all_gather_single(old_out, old_row)

    def new(step: int) -> None:
        if step % every == 0:
            dist.all_gather_single(new_out, new_rows.view(-1))
        else:
            dist.all_reduce(vote)

    times: dict[str, list[float]] = {"old": [], "new": []}
    warm = every
    for step in range(1, steps + warm + 1):
        for name, fn in (("old", old), ("new", new)):
            dist.barrier()
            t = time.perf_counter()
            fn(step)
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step > warm:
                times[name].append(float(dt))
    if rank == 0:
        new_t = times["new"]
        exports = [t for s, t in enumerate(new_t, warm + 1) if s % every == 0]
        ordinary = [t for s, t in enumerate(new_t, warm + 1) if s % every]
        with open(out, "w") as f:
            for key, value in (
                ("old step", statistics.median(times["old"])),
                ("old mean", statistics.mean(times["old"])),
                ("new ordinary", statistics.median(ordinary)),
                ("new export", statistics.median(exports)),
                ("new mean", statistics.mean(new_t)),
            ):
                f.write(f"{key}\t{value * 1e6:.1f}\n")
    dist.destroy_process_group()


def cost_model(layers: int, every: int, alpha_us: float, gbps: float) -> str:
    """The alpha-beta table of both schedules for 64 to 16,384 GPUs, as markdown."""
    import math

    beta_us = 1e6 / (gbps * 1e9)  # per byte
    old_row, new_row = 4 * (layers + 2), 4 * (layers + 3)  # bytes per rank per step
    lines = [
        f"alpha {alpha_us:g} us per hop, {gbps:g} GB/s, {layers} layers, export every {every} steps; "
        "ms; ratio to a 1 s step\n",
        "| GPUs | bytes received per step (both) | old: every step | new: ordinary step "
        "| new: export step | new: mean per step | old / new (mean) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in (64, 256, 1024, 4096, 16384):
        old = (w - 1) * (alpha_us + old_row * beta_us) / 1e3
        ordinary = 2 * math.log2(w) * alpha_us / 1e3
        export = (w - 1) * (alpha_us + every * new_row * beta_us) / 1e3
        mean = (export + (every - 1) * ordinary) / every
        lines.append(
            f"| {w:,} | {(w - 1) * old_row:,} | {old:.2f} ({old / 10:.2f}%) | {ordinary:.2f} "
            f"| {export:.1f} | {mean:.2f} ({mean / 10:.2f}%) | {old / mean:.1f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:  # noqa: ANN001
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="timed steps (whole export cycles)")
    p.add_argument("--export-every", type=int, default=10)
    p.add_argument("--model", action="store_true", help="print the alpha-beta model instead of measuring")
    p.add_argument("--alpha-us", type=float, default=10.0)
    p.add_argument("--gbps", type=float, default=25.0)
    args = p.parse_args(argv)
    if args.model:
        print(cost_model(args.layers, args.export_every, args.alpha_us, args.gbps))
        return 0
    steps = max(args.export_every, args.steps - args.steps % args.export_every)
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.tsv")
            mp.start_processes(
                _rank,
                args=(world, args.layers, steps, args.export_every, os.path.join(tmp, "store"), out),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                res = {k: float(v) for k, v in (line.rstrip("\n").split("\t") for line in f)}
        rows.append((world, res))
    print(
        f"gloo on {os.cpu_count()} CPU cores, {args.layers} layers, export every {args.export_every} "
        f"steps, {steps} steps (slowest rank per step; us)\n"
    )
    print(
        "| ranks | old: step (median) | old: mean per step | new: ordinary step (median) "
        "| new: export step (median) | new: mean per step |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for world, r in rows:
        print(
            f"| {world} | {r['old step']:.0f} | {r['old mean']:.0f} | {r['new ordinary']:.0f} "
            f"| {r['new export']:.0f} | {r['new mean']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
