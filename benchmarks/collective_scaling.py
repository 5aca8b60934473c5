#!/usr/bin/env python3
"""How does distmon's per-step collective grow with the number of ranks? Measured on gloo.

    python benchmarks/collective_scaling.py                 # 2, 4, 8, 16 ranks, 64 layers
    python benchmarks/collective_scaling.py --ranks 2 4 --layers 128

For each world size, spawned gloo ranks on this machine time (median over ``--steps``, after a
barrier each step, the slowest rank's) two per-step schedules with the same layer count:

* ``gather`` (distmon today): every rank's packed row (the rank x layer local sums, errors,
  valid: layers + 2 floats) all-gathered: world x (layers + 2) floats per rank per step;
* ``fixed all-reduce`` (the alternative issue #14 proposes): one all-reduce of a fixed 16
  floats (cross-rank sums, maxima, flags), whatever the world size.

On 2 CPU cores, ranks beyond 2 share cores: absolute times grow with oversubscription as
well as with the algorithm, so read the ratio between the schedules and the trend.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


def _rank(rank: int, world: int, layers: int, steps: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    width = layers + 2
    send = torch.rand(width)
    gathered = torch.empty(world * width)
    fixed = torch.rand(16)
    times = {"gather": [], "fixed all-reduce": []}
    for step in range(steps + 5):
        for name in times:
            dist.barrier()
            t = time.perf_counter()
            if name == "gather":
                dist.all_gather_into_tensor(gathered, send)
            else:
                dist.all_reduce(fixed)
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 5:
                times[name].append(float(dt))
    if rank == 0:
        with open(out, "w") as f:
            for name, ts in times.items():
                f.write(f"{name}\t{statistics.median(ts) * 1e6:.1f}\n")
    dist.destroy_process_group()


def main(argv=None) -> int:  # noqa: ANN001
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.tsv")
            mp.start_processes(
                _rank,
                args=(world, args.layers, args.steps, os.path.join(tmp, "store"), out),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                res = dict(line.rstrip("\n").split("\t") for line in f)
        rows.append(
            (world, world * (args.layers + 2) * 4, float(res["gather"]), float(res["fixed all-reduce"]))
        )
    print(
        f"gloo on {os.cpu_count()} CPU cores, {args.layers} layers, "
        f"median of {args.steps} steps (slowest rank)\n"
    )
    print("| ranks | gather bytes received per rank | gather us | fixed 16-float all-reduce us |")
    print("|---:|---:|---:|---:|")
    for world, nbytes, gather, fixed in rows:
        print(f"| {world} | {nbytes:,} | {gather:.0f} | {fixed:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
