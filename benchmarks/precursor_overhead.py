#!/usr/bin/env python3
"""What does the divergence precursor cost a training step? distmon's defaults with and without it.

    python benchmarks/precursor_overhead.py             # 5M GPT of benchmarks/overhead.py, 30 rounds
    python benchmarks/precursor_overhead.py --write     # and benchmarks/results/precursor_overhead.md

One process, three copies of the same model and batch, each under a monitor with distmon's
defaults: one alone, one with ``precursor=True`` (every attention block's logit bound on every
10th step's forwards, the detector at each export), one with
``precursor=PrecursorConfig(peak_lr=...)`` (the oscillation rule too: the gradients' copy and
dot product every step). A round trains 10 steps (one sampled step, one export) on each, in a
balanced order, timed in the thread's CPU time (robust to other processes on a shared machine;
torch on one thread); the median of the rounds' ratios to the defaults alone is the cost per step.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from overheadbench.paths import use_checkout
from overheadbench.runner import round_order
from overheadbench.sizes import SIZES

use_checkout()  # this checkout's distmon and launch/model.py

STEPS = 10  # a round: one sampled step (PrecursorConfig.every) and one export (export_every)


def main(argv=None) -> int:  # noqa: ANN001
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="5M", choices=[s for s in SIZES if s != "2k-tensors"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--write", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from model import GPT, GPTConfig

    import distmon

    torch.set_num_threads(1)
    shape = dict(SIZES[args.size])
    batch = shape.pop("batch")
    runs = []
    for precursor in (False, True, distmon.PrecursorConfig(peak_lr=1e-4)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mon = distmon.GradMonitor(model, opt, serve="none", export_interval_s=0, precursor=precursor)
        runs.append((model, opt, mon))
    x = torch.randint(0, shape["vocab"], (batch, shape["seq_len"] + 1))
    times: list[list[float]] = [[], [], []]
    for r in range(args.rounds + 2):
        for which in round_order(r, 3):
            model, opt, _ = runs[which]
            t = time.thread_time()
            for _ in range(STEPS):
                logits = model(x[:, :-1])
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
            times[which].append(time.thread_time() - t)
    blocks = len(runs[1][2]._schedule.attention.names)
    for _, _, mon in runs:
        mon.close()
    off = times[0][2:]
    cells = []
    for on in (times[1][2:], times[2][2:]):
        ratios = sorted(b / a for a, b in zip(off, on))
        q = statistics.quantiles(ratios, n=4)
        cells.append(f"{statistics.median(ratios):.4f} [{q[0]:.4f}, {q[2]:.4f}]")
    step_ms = 1e3 * statistics.median(off) / STEPS
    line = (
        f"| {args.size} GPT, {blocks} attention blocks, batch {batch}x{shape['seq_len']} | "
        f"{step_ms:.1f} | {cells[0]} | {cells[1]} |"
    )
    out = (
        "# Divergence precursor: cost per training step\n\n"
        f"`python benchmarks/precursor_overhead.py --size {args.size} --rounds {args.rounds} --write`: "
        "distmon's defaults with `precursor=True`, and with `precursor=PrecursorConfig(peak_lr=...)`, "
        f"against the defaults alone, {args.rounds} rounds of {STEPS} steps (one sampled step, one "
        f"export), interleaved, thread CPU time, torch {torch.__version__} on one thread.\n\n"
        "| model | step, defaults (ms CPU) | `precursor=True` / defaults, median [quartiles] "
        "| `peak_lr=` / defaults, median [quartiles] |\n"
        "|---|---:|---:|---:|\n" + line + "\n"
    )
    print(out)
    if args.write:
        Path(__file__).with_name("results").joinpath("precursor_overhead.md").write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
