#!/usr/bin/env python3
"""What does distmon cost a DeepSpeed training step? A bare engine against one with distmon, interleaved.

Run it (it starts ``torchrun`` itself when not already under it; needs DeepSpeed)::

    python benchmarks/deepspeed_overhead.py                        # ZeRO 0-3, 1M, 2 ranks, 20 rounds
    python benchmarks/deepspeed_overhead.py --stages 2 3 --rounds 6   # a quick look

Per ZeRO stage, two engines of the same seeded GPT (``benchmarks/overhead.py``'s sizes,
``launch/model.py``), fp32, a client AdamW, ``gradient_clipping`` 1.0, one micro-batch per step:
one bare, one with ``distmon.GradMonitor(engine, optimizer, serve="none")`` (defaults). Every
round runs one step (``engine(x)``, ``engine.backward``, ``engine.step``) of each, in a balanced
order (ABBA), after a barrier; a step's time is the slowest rank's. Reported: the median of the
per-round ratios (distmon / bare) with its 95% bootstrap interval and the median extra
milliseconds. After the timed rounds one more step of the monitored engine checks distmon's
figures: valid on every rank, ``grad_norm`` against the float64 norm of
``deepspeed.utils.safe_get_full_grad``; the script exits 1 when they disagree.

On CPU every op runs synchronously: a GPU hides host work behind the device queue (DESIGN.md).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import statistics
import subprocess
import sys
import time

from overheadbench.paths import use_checkout
from overheadbench.runner import leave, round_order
from overheadbench.sizes import SIZES
from overheadbench.stats import paired_ratio

use_checkout()  # this checkout's distmon and launch/model.py


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    p.add_argument("--size", default="1M", choices=list(SIZES))
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per stage (after 3 warm-up rounds)")
    p.add_argument("--ranks", type=int, default=2, help="ranks when this script starts torchrun itself")
    return p.parse_args(argv)


def _engines(stage: int, size: str) -> list[tuple[object, object]]:
    """(engine, monitor or None): bare, then monitored, from one seeded model."""
    import deepspeed
    import torch
    from model import GPT, GPTConfig  # launch/model.py

    import distmon

    shape = {k: v for k, v in SIZES[size].items() if k != "batch"}
    torch.manual_seed(1234)
    base = GPT(GPTConfig(**shape))
    config = {
        "train_micro_batch_size_per_gpu": SIZES[size]["batch"],
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
    }
    out = []
    for monitored in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        out.append((engine, distmon.GradMonitor(engine, opt, serve="none") if monitored else None))
    return out


def _step(engine, x, y) -> float:  # noqa: ANN001
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t


def _check(engine, mon, x, y) -> tuple[bool, float]:  # noqa: ANN001
    """One more monitored step: (its snapshot valid on every rank, grad_norm's relative error)."""
    from deepspeed.utils import safe_get_full_grad

    _, loss = engine(x, y)
    engine.backward(loss)
    ref = math.sqrt(
        sum(float(safe_get_full_grad(p).double().pow(2).sum()) for p in engine.module.parameters())
    )
    engine.step()
    snap = mon.flush()
    valid = snap is not None and snap.valid and all(snap.rank_valid) and snap.monitor_errors == 0
    return valid, abs(snap.grad_norm - ref) / ref if snap is not None else math.nan


def _time_stage(stage: int, size: str, rounds: int) -> tuple[float, float, float, float, float, bool, float]:
    import torch
    import torch.distributed as dist

    engines = _engines(stage, size)
    shape = SIZES[size]
    g = torch.Generator().manual_seed(dist.get_rank())

    def data() -> tuple:
        return tuple(
            torch.randint(0, shape["vocab"], (shape["batch"], shape["seq_len"]), generator=g) for _ in "xy"
        )

    per_round = []
    for r in range(rounds + 3):
        x, y = data()
        order = [engines[i] for i in round_order(r, len(engines))]
        times = {id(e): _step(e[0], x, y) for e in order}
        t = torch.tensor([times[id(e)] for e in engines])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        if r >= 3:
            per_round.append(t.tolist())
    valid, err = _check(*engines[1], *data())
    engines[1][1].close()
    bare, monitored = [t[0] * 1e3 for t in per_round], [t[1] * 1e3 for t in per_round]
    extra = statistics.median(m - b for m, b in zip(monitored, bare))
    return (statistics.median(bare), *paired_ratio(monitored, bare), extra, valid, err)


def run(args: argparse.Namespace) -> bool:
    import deepspeed
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    rows = [(stage, _time_stage(stage, args.size, args.rounds)) for stage in args.stages]
    if dist.get_rank() == 0:
        print(
            f"\nDeepSpeed {deepspeed.__version__}, {args.size} fp32, {dist.get_world_size()} gloo ranks, "
            f"torch {torch.__version__}, {args.rounds} interleaved rounds (medians)\n"
        )
        print("| ZeRO stage | bare step ms | distmon ratio | 95% CI | extra ms | distmon figures |")
        print("|---|---:|---:|---|---:|---|")
        for stage, (bare, ratio, lo, hi, extra, valid, err) in rows:
            figures = f"{'valid' if valid else 'INVALID'} ({err:.1e})"
            print(f"| {stage} | {bare:.1f} | {ratio:.3f} | {lo:.3f}-{hi:.3f} | {extra:.1f} | {figures} |")
    return all(valid and err < 1e-4 for _, (*_, valid, err) in rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:  # a plain script: become torchrun
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
        ]
        rest = argv if argv is not None else sys.argv[1:]
        return subprocess.call([*cmd, os.path.abspath(__file__), *rest])
    leave(0 if run(args) else 1)


if __name__ == "__main__":
    sys.exit(main())
