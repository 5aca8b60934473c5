#!/usr/bin/env python3
"""What does distmon cost an FSDP2 training step? Bare FSDP2 against FSDP2 + distmon, interleaved.

Run it (it starts ``torchrun`` itself when not already under it)::

    python benchmarks/fsdp_overhead.py                  # 1M and 5M, 2 ranks, 30 rounds
    python benchmarks/fsdp_overhead.py --sizes 1M --rounds 6   # a quick look

The models are ``benchmarks/overhead.py``'s GPT sizes (``overheadbench.sizes``), each block a
``fully_shard`` unit and the root another. Two copies of the same seeded model, one bare and one with
``distmon.GradMonitor(model, opt, serve="none")`` (defaults), train on the same batch: every
round runs one step of each, in a balanced order (ABBA), after a barrier; a step's time is the
slowest rank's. Reported: the median of the per-round ratios (distmon / bare), the median
extra milliseconds, and the extra time in *gradient passes*: units of one fused read
(``torch._foreach_norm``) of a full-size copy of the gradients, the bytes distmon reads on the
local side (the unsharded reduce-scatter input), timed alone on each rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

from overheadbench.paths import use_checkout
from overheadbench.runner import round_order
from overheadbench.sizes import SIZES

use_checkout()  # this checkout's distmon and launch/model.py


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = [s for s in SIZES if s != "2k-tensors"]
    p.add_argument("--sizes", nargs="+", default=["1M", "5M"], choices=sizes)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per size (after 3 warm-up rounds)")
    p.add_argument("--ranks", type=int, default=2, help="ranks when this script starts torchrun itself")
    return p.parse_args(argv)


def _build(size: str, device: object) -> tuple[list, int, int]:
    import torch
    from model import GPT, GPTConfig  # launch/model.py
    from torch.distributed.fsdp import fully_shard

    import distmon

    shape = dict(SIZES[size])
    batch = shape.pop("batch")
    torch.manual_seed(1234)
    base = GPT(GPTConfig(**shape))
    copies = []
    for monitored in (False, True):
        model = copy.deepcopy(base).to(device)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mon = distmon.GradMonitor(model, opt, serve="none") if monitored else None
        copies.append((model, opt, mon))
    return copies, batch, shape["seq_len"]


def _floor_ms(copies: list, reps: int = 20) -> float:
    """One fused read of a full-size copy of the gradients, timed alone (median, ms)."""
    import torch

    full = [torch.randn(p.full_tensor().shape) for p in copies[0][0].parameters()]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch._foreach_norm(full)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _step(model, opt, x, y) -> float:  # noqa: ANN001
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    rows = []
    for size in args.sizes:
        copies, batch, seq = _build(size, device)
        vocab = SIZES[size]["vocab"]
        g = torch.Generator().manual_seed(rank)
        per_round = []
        for r in range(args.rounds + 3):
            x = torch.randint(0, vocab, (batch, seq), generator=g)
            y = torch.randint(0, vocab, (batch, seq), generator=g)
            order = [copies[i] for i in round_order(r, len(copies))]
            times = {id(c): _step(c[0], c[1], x, y) for c in order}
            t = torch.tensor([times[id(c)] for c in copies])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if r >= 3:
                per_round.append(t.tolist())
        floor = torch.tensor([_floor_ms(copies)])
        dist.all_reduce(floor, op=dist.ReduceOp.MAX)
        copies[1][2].close()
        bare = statistics.median(t[0] for t in per_round) * 1e3
        ratio = statistics.median(t[1] / t[0] for t in per_round)
        extra = statistics.median((t[1] - t[0]) * 1e3 for t in per_round)
        n = sum(p.numel() for p in copies[0][0].parameters())
        rows.append((size, n, batch * seq, bare, ratio, extra, float(floor), extra / float(floor)))
    if rank == 0:
        print(
            f"FSDP2, {world} gloo ranks, torch {torch.__version__}, {args.rounds} interleaved rounds "
            f"(medians; a step's time is the slowest rank's)\n"
        )
        print(
            "| model | params | tokens/rank | bare FSDP2 step ms | distmon ratio | extra ms | floor ms "
            "| extra passes |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for size, n, tok, bare, ratio, extra, floor_ms, passes in rows:
            print(
                f"| {size} | {n / 1e6:.2f}M | {tok} | {bare:.1f} | {ratio:.3f} | {extra:.1f} | "
                f"{floor_ms:.2f} | {passes:.1f} |"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:  # a plain script: become torchrun
        ranks = f"--nproc-per-node={args.ranks}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", ranks]
        rest = argv if argv is not None else sys.argv[1:]
        return subprocess.call([*cmd, os.path.abspath(__file__), *rest])
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
