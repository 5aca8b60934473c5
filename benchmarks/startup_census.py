#!/usr/bin/env python3
"""What the job's reading of its layout (#27, ``distmon/layout/census.py``) adds to GradMonitor's start-up.

    python benchmarks/startup_census.py                     # 4 and 8 ranks
    python benchmarks/startup_census.py --ranks 4 --repeats 15 --blocks 24

On spawned gloo ranks, each layout (DDP over every rank, FSDP2 over every rank, TP + FSDP2 on a
2-D mesh) builds and closes ``GradMonitor`` ``--repeats`` times with the census and as many times
without it (the same start-up with ``census.read_job`` replaced by the one-process reading and
``sources.enclosing`` by the identity: what start-up cost before #27), interleaved, after a
barrier; the slowest rank's time counts. Reported: the median of each and the median of the
paired differences (what the census adds), per layout and world size. ``--blocks``: residual
blocks of the model (more parameters to fingerprint and judge; each block is 4 tensors).

On 2 CPU cores, ranks beyond 2 share cores: read the difference, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def _rank(rank: int, world: int, blocks: int, repeats: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import distmon
    import distmon.monitor
    from distmon.layout.census import alone

    census = (distmon.monitor.read_job, distmon.monitor.enclosing)
    without = (lambda parts, group: parts and alone(parts), lambda model: model)

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.fc2(torch.tanh(self.fc1(h)))

    def model(layout: str) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        net = nn.Sequential(*[Block(64) for _ in range(blocks)])
        if layout == "ddp":
            return nn.parallel.DistributedDataParallel(net)
        if layout == "fsdp":
            for block in net:
                fully_shard(block)
            return fully_shard(net)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in net:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(net, mesh=mesh["dp"])

    results = {}
    for layout in ("ddp", "fsdp", "tp_fsdp"):
        net = model(layout)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for i in range(2 * repeats + 2):  # two warm-up builds, then interleaved
            which = "with" if i % 2 == 0 else "without"
            distmon.monitor.read_job, distmon.monitor.enclosing = census if which == "with" else without
            dist.barrier()
            t0 = time.perf_counter()
            mon = distmon.GradMonitor(net, opt, serve="none", export_interval_s=0)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            mon.close()
            if i >= 2:
                times[which].append(float(took))
        results[layout] = times
    distmon.monitor.read_job, distmon.monitor.enclosing = census
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args()
    import json

    import torch.multiprocessing as mp

    print(
        f"GradMonitor start-up, {args.blocks} blocks ({4 * args.blocks} parameter tensors), "
        f"median of {args.repeats} interleaved builds, slowest rank, ms"
    )
    print(f"{'ranks':>5} {'layout':>8} {'with':>8} {'without':>8} {'added':>8}")
    for world in args.ranks:
        tmp = tempfile.mkdtemp()
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        mp.start_processes(
            _rank, args=(world, args.blocks, args.repeats, store, out), nprocs=world, start_method="spawn"
        )
        with open(out) as f:
            results = json.load(f)
        for layout, times in results.items():
            added = statistics.median(a - b for a, b in zip(times["with"], times["without"]))
            print(
                f"{world:>5} {layout:>8} {1e3 * statistics.median(times['with']):>8.1f} "
                f"{1e3 * statistics.median(times['without']):>8.1f} {1e3 * added:>8.1f}"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
