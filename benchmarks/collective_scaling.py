#!/usr/bin/env python3
"""How do distmon's per-step collectives grow with the number of ranks? Measured on gloo, modelled for NCCL.

    python benchmarks/collective_scaling.py                 # 2, 4, 8, 16 ranks, nodes of 2 ranks
    python benchmarks/collective_scaling.py --ranks 2 4 --per-node 2 --steps 50
    python benchmarks/collective_scaling.py --steps 200 --parts   # benchmarks/results/

For each world size, spawned gloo ranks on this machine, laid out as nodes of ``--per-node``
consecutive ranks, time (after a barrier each step, the slowest rank's time) the two export
schedules with the same layer count over the same ``--steps`` steps, interleaved (the order
swaps every export cycle):

* ``gather`` (distmon before issue #28): an ordinary step all-reduces one float32 (rank 0's
  export vote); every ``--export-every``-th step all-gathers, in its place, every rank's kept
  rows (``export_every x (layers + 3)`` float32: the vote too) over the whole job: the bytes
  and the latency terms of a ring grow with the world size;
* ``node`` (issue #28): the same ordinary step; an export step issues, asynchronously (all three
  started, then waited, as distmon does), (1) the all-gather of the kept rows over the node's
  ranks only (a group per node, ``dist.new_group``), (2) a SUM all-reduce over the job of
  ``7 x export_every + 1`` float64 (per kept step: reported, valid, errors, non-finite ranks,
  the peer group's n, sum x, sum x^2; plus the vote) and (3) a MAX all-reduce over the job of
  ``3 x export_every`` int64 (per kept step: the first non-finite key, the peer group's largest
  and smallest x packed with its rank). These are distmon's sizes at defaults (DDP: one peer
  group; no noise scale, no activations: ``distmon/step/crossrank.py``). Nothing grows with the
  world size.

Reported per schedule: the bytes a rank sends (= receives) per step on average, from the sizes
of the tensors the ranks handed the collectives (an all-gather over ``G`` ranks of ``n`` bytes
each: ``(G - 1) n``, a ring's; an all-reduce of ``n`` bytes: ``2 n``, a reduce then a broadcast),
the median ordinary step, the median export step and the mean step of an export cycle (what a
step costs on average; the median over the cycles, as another engineer's process on these
shared cores can stall any one step). On 2 CPU cores, ranks beyond 2 share cores: absolute
times grow with the oversubscription as well as with the algorithm, so read the ratio between
the schedules. ``--parts`` also times each collective of an export step alone; ``--no-vote``
leaves out the vote (``export_interval_s=0`` on DDP: ordinary steps send nothing).

    python benchmarks/collective_scaling.py --model         # the alpha-beta model, 64-16,384 GPUs

prints, instead of measuring, the alpha-beta model of both schedules (``--model-per-node``
GPUs per node, default 8): a ring all-gather over ``G`` ranks costs ``(G - 1)(alpha + n beta)``
for ``n`` bytes per rank, a tree all-reduce over ``W`` ranks ``2 log2(W) alpha + 2 n beta``;
the node's all-gather is charged the same ``alpha`` as a hop between nodes (NVLink's is lower:
the model errs on the slow side), and the three collectives of an export are added up, not
overlapped. ``--alpha-us`` (per hop, default 10 us), ``--gbps`` (default 25 GB/s per GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial

SCHEDULES = ("gather", "node")
MODEL_GPUS = (64, 1024, 4096, 16384)
TARGET_MS = 1.0  # issue #28's acceptance: the node schedule's mean per step at 16,384 GPUs
# Per kept step at defaults (one peer group; crossrank.py's sum_width and max_width):
SUM_PER_STEP = 4 + 3  # float64: reported, valid, errors, non-finite ranks; the group's n, sum x, sum x^2
MAX_PER_STEP = 1 + 2  # int64: the first non-finite key; the group's largest and smallest x with its rank
F32, F64, I64 = 4, 8, 8  # bytes per element

# A collective as the benchmark issues it: (kind, ranks in its group, bytes in each rank's tensor).
Call = tuple[str, int, int]


def export_calls(
    schedule: str, world: int, per_node: int, layers: int, every: int, vote: bool = True
) -> list[Call]:
    """The collectives of one export step (``every`` steps kept since the last export).

    >>> export_calls("node", 64, 8, 128, 10)
    [('all_gather', 8, 5240), ('all_reduce', 64, 568), ('all_reduce', 64, 240)]
    """
    rows = every * (layers + 3) * F32
    if schedule == "gather":
        return [("all_gather", world, rows)]
    sums = (SUM_PER_STEP * every + vote) * F64
    return [
        ("all_gather", per_node, rows),
        ("all_reduce", world, sums),
        ("all_reduce", world, MAX_PER_STEP * every * I64),
    ]


def ordinary_calls(world: int, vote: bool = True) -> list[Call]:
    """The collective of an ordinary step (both schedules): rank 0's export vote, one float32;
    none without the vote (``export_interval_s=0`` on DDP)."""
    return [("all_reduce", world, F32)] if vote else []


def traffic(calls: list[Call]) -> int:
    """Bytes a rank sends (and as many it receives) for ``calls``: ``(G - 1) n`` for a ring
    all-gather over G ranks, ``2 n`` for an all-reduce (a reduce then a broadcast)."""
    return sum((g - 1) * n if kind == "all_gather" else 2 * n * (g > 1) for kind, g, n in calls)


def model_us(calls: list[Call], alpha_us: float, beta_us: float) -> float:
    """Alpha-beta time of ``calls`` one after the other: a ring all-gather ``(G - 1)(alpha + n
    beta)``, a tree all-reduce ``2 log2(G) alpha + 2 n beta``."""
    return sum(
        (g - 1) * (alpha_us + n * beta_us)
        if kind == "all_gather"
        else (2 * math.log2(g) * alpha_us + 2 * n * beta_us) * (g > 1)
        for kind, g, n in calls
    )


def per_step(export: float, ordinary: float, every: int) -> float:
    """The mean over an export cycle: one export step and ``every - 1`` ordinary steps."""
    return (export + (every - 1) * ordinary) / every


def mean_bytes(schedule: str, world: int, per_node: int, layers: int, every: int, vote: bool = True) -> float:
    """Bytes a rank sends (= receives) per step on average under ``schedule``."""
    export = traffic(export_calls(schedule, world, per_node, layers, every, vote))
    return per_step(export, traffic(ordinary_calls(world, vote)), every)


def _rank(
    rank: int,
    world: int,
    per_node: int,
    layers: int,
    steps: int,
    every: int,
    vote_on: bool,
    parts: bool,
    store: str,
    out: str,
) -> None:
    import torch
    import torch.distributed as dist

    from distmon.compat import all_gather

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # every rank creates every node's group (new_group is collective), and keeps its own
    nodes = [dist.new_group(list(range(n, n + per_node))) for n in range(0, world, per_node)]
    node = nodes[rank // per_node]
    vote = torch.zeros(1)
    rows = torch.rand(every * (layers + 3))
    job_rows = torch.empty(world * rows.numel())
    node_rows = torch.empty(per_node * rows.numel())
    sums = torch.zeros(SUM_PER_STEP * every + vote_on, dtype=torch.float64)  # zeros: a SUM stays finite
    maxes = torch.zeros(MAX_PER_STEP * every, dtype=torch.int64)
    issued: dict[str, list[Call]] = {"gather": [], "node": []}  # what the export steps handed gloo

    def ordinary() -> None:
        if vote_on:
            dist.all_reduce(vote)

    def gather(export: bool) -> None:
        if not export:
            return ordinary()
        all_gather(job_rows, rows, group=None, async_op=False)
        issued["gather"] = [("all_gather", world, rows.nbytes)]

    def node_schedule(export: bool) -> None:
        if not export:
            return ordinary()
        works = [
            all_gather(node_rows, rows, group=node, async_op=True),
            dist.all_reduce(sums, async_op=True),
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, async_op=True),
        ]
        for work in works:
            work.wait()
        issued["node"] = [
            ("all_gather", dist.get_world_size(node), rows.nbytes),
            ("all_reduce", world, sums.nbytes),
            ("all_reduce", world, maxes.nbytes),
        ]

    def node_in_turn() -> None:
        all_gather(node_rows, rows, group=node, async_op=False)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)

    fns = {"gather": gather, "node": node_schedule}
    # --parts: each collective alone, on export steps (what an export step's time is made of)
    part_fns = {
        "vote": lambda: dist.all_reduce(vote),
        "job gather": lambda: all_gather(job_rows, rows, group=None, async_op=False),
        "node gather": lambda: all_gather(node_rows, rows, group=node, async_op=False),
        "sum": lambda: dist.all_reduce(sums),
        "max": lambda: dist.all_reduce(maxes, op=dist.ReduceOp.MAX),
        "node in turn": node_in_turn,
        "node async": lambda: node_schedule(True),
    }
    times: dict[str, list[float]] = {s: [] for s in (*SCHEDULES, *(part_fns if parts else ()))}
    warm = every
    for step in range(1, steps + warm + 1):
        export = step % every == 0
        cycle = (step - 1) // every
        order = [
            (name, partial(fns[name], export)) for name in (SCHEDULES if cycle % 2 == 0 else SCHEDULES[::-1])
        ]
        if parts and export:
            names = list(part_fns)[cycle % len(part_fns) :] + list(part_fns)[: cycle % len(part_fns)]
            order += [(name, part_fns[name]) for name in names]
        for name, fn in order:
            dist.barrier()
            t = time.perf_counter()
            fn()
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step > warm:
                times[name].append(float(dt))
    if rank == 0:
        with open(out, "w") as f:
            for name in SCHEDULES:
                t = times[name]  # steps warm + 1 ..., whole cycles: an export step ends each
                exports = t[every - 1 :: every]
                ordinary = [x for i, x in enumerate(t) if (i + 1) % every]
                cycles = [statistics.mean(t[i : i + every]) for i in range(0, len(t), every)]
                f.write(f"{name} ordinary\t{statistics.median(ordinary) * 1e6:.1f}\n")
                f.write(f"{name} export\t{statistics.median(exports) * 1e6:.1f}\n")
                f.write(f"{name} mean\t{statistics.median(cycles) * 1e6:.1f}\n")
                sent = per_step(traffic(issued[name]), traffic(ordinary_calls(world, vote_on)), every)
                f.write(f"{name} bytes\t{sent}\n")
            for name in times.keys() - set(SCHEDULES):
                f.write(f"part {name}\t{statistics.median(times[name]) * 1e6:.1f}\n")
    dist.destroy_process_group()


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def cost_model(
    layers: int, every: int, per_node: int, alpha_us: float, gbps: float, vote: bool = True
) -> str:
    """The alpha-beta table of both schedules for 64 to 16,384 GPUs, as markdown."""
    beta_us = 1e6 / (gbps * 1e9)  # per byte
    lines = [
        f"alpha {alpha_us:g} us per hop (inside a node too), {gbps:g} GB/s, {layers} layers, "
        f"export every {every} steps{'' if vote else ', no vote'}, {per_node} GPUs per node; "
        "bytes a GPU sends (= receives) per step on average; ms, and % of a 1 s step\n",
        "| GPUs | schedule | bytes per step | ordinary step | export step | mean per step "
        "| gather / node (mean) |",
        "|---:|:---|---:|---:|---:|---:|---:|",
    ]
    means: dict[str, float] = {}
    for w in MODEL_GPUS:
        ordinary = model_us(ordinary_calls(w, vote), alpha_us, beta_us)
        for s in SCHEDULES:
            export = model_us(export_calls(s, w, per_node, layers, every, vote), alpha_us, beta_us)
            means[s] = per_step(export, ordinary, every)
            ratio = f"{means['gather'] / means['node']:.1f}x" if s == "node" else ""
            lines.append(
                f"| {w:,} | {s} | {mean_bytes(s, w, per_node, layers, every, vote):,.0f} | {_ms(ordinary)} "
                f"| {_ms(export)} | {_ms(means[s])} ({means[s] / 1e4:.3f}%) | {ratio} |"
            )
    verdict = "met" if means["node"] / 1e3 <= TARGET_MS else "NOT met"
    lines.append(
        f"\nnode at {MODEL_GPUS[-1]:,} GPUs: {_ms(means['node'])} ms per step on average "
        f"(target <= {TARGET_MS:g} ms, {TARGET_MS / 10:g}% of 1 s): {verdict}"
    )
    return "\n".join(lines)


def measured_table(rows: list[tuple[int, dict[str, float]]]) -> str:
    """The measured figures per world size and schedule, as markdown."""
    lines = [
        "| ranks | schedule | bytes per step | ordinary step (median) | export step (median) "
        "| mean per step | gather / node (mean) |",
        "|---:|:---|---:|---:|---:|---:|---:|",
    ]
    for world, r in rows:
        for s in SCHEDULES:
            ratio = f"{r['gather mean'] / r['node mean']:.1f}x" if s == "node" else ""
            lines.append(
                f"| {world} | {s} | {r[s + ' bytes']:,.0f} | {r[s + ' ordinary']:,.0f} "
                f"| {r[s + ' export']:,.0f} | {r[s + ' mean']:,.0f} | {ratio} |"
            )
    return "\n".join(lines)


def parts_table(rows: list[tuple[int, dict[str, float]]], layers: int, every: int, vote: bool) -> str:
    """Each collective of an export step timed alone (median us), as markdown."""
    row = every * (layers + 3)
    lines = [
        "Each collective alone on export steps (median us): the vote (all-reduce of 1 float32), "
        f"the rows ({row} float32 per rank) all-gathered over the job and over the node, the SUM "
        f"all-reduce of {SUM_PER_STEP * every + vote} float64 and the MAX all-reduce of "
        f"{MAX_PER_STEP * every} int64 over the job, and the node schedule's three waited in turn "
        "and started together (async)\n",
        "| ranks | vote | rows over the job | rows over the node | SUM | MAX | node's three in turn "
        "| node's three async |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("vote", "job gather", "node gather", "sum", "max", "node in turn", "node async")
    for world, r in rows:
        lines.append(f"| {world} | " + " | ".join(f"{r['part ' + k]:,.0f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--per-node", type=int, default=2, help="ranks per node in the measured runs")
    p.add_argument("--layers", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="timed steps (whole export cycles)")
    p.add_argument("--export-every", type=int, default=10)
    p.add_argument("--model", action="store_true", help="print the alpha-beta model instead of measuring")
    p.add_argument("--model-per-node", type=int, default=8, help="GPUs per node in the model")
    p.add_argument("--alpha-us", type=float, default=10.0)
    p.add_argument("--gbps", type=float, default=25.0)
    p.add_argument("--parts", action="store_true", help="also time each collective of an export step alone")
    p.add_argument(
        "--no-vote",
        action="store_true",
        help="no export vote (export_interval_s=0 on DDP): ordinary steps send nothing",
    )
    args = p.parse_args(argv)
    vote = not args.no_vote
    if args.export_every < 1 or args.layers < 1 or args.per_node < 1:
        p.error("--export-every, --layers and --per-node must be at least 1")
    if args.model_per_node < 1 or MODEL_GPUS[0] % args.model_per_node:
        p.error(f"--model-per-node must divide {MODEL_GPUS[0]} (the model's smallest job)")
    if args.model:
        print(cost_model(args.layers, args.export_every, args.model_per_node, args.alpha_us, args.gbps, vote))
        return 0
    if any(w < 2 or w % args.per_node for w in args.ranks):
        p.error(f"every --ranks must be at least 2 and a multiple of --per-node ({args.per_node})")
    steps = max(args.export_every, args.steps - args.steps % args.export_every)
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.tsv")
            mp.start_processes(
                _rank,
                args=(
                    world,
                    args.per_node,
                    args.layers,
                    steps,
                    args.export_every,
                    vote,
                    args.parts,
                    os.path.join(tmp, "store"),
                    out,
                ),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                res = {k: float(v) for k, v in (line.rstrip("\n").split("\t") for line in f)}
        for s in SCHEDULES:  # what the ranks handed gloo is what the model charges
            want = mean_bytes(s, world, args.per_node, args.layers, args.export_every, vote)
            assert math.isclose(res[s + " bytes"], want), (s, world, res[s + " bytes"], want)
        rows.append((world, res))
    print(
        f"gloo on {os.cpu_count()} CPU cores, nodes of {args.per_node} ranks, {args.layers} layers, "
        f"export every {args.export_every} steps{'' if vote else ', no vote'}, {steps} steps (slowest rank "
        "per step; us; bytes a rank sends (= receives) per step on average)\n"
    )
    print(measured_table(rows))
    if args.parts:
        print(f"\n{parts_table(rows, args.layers, args.export_every, vote)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
