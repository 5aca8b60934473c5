#!/usr/bin/env python3
"""Is the Hessian's batch why healthy runs pass Adam's edge? The top eigenvalue on two batches.

    python benchmarks/divergence/sharpness_batch.py --write   # 6 runs of 500 steps, ~22 min on 2 cores

``sharpness_probe.py`` found healthy runs far past Adam's edge of stability (the top eigenvalue
of the preconditioned Hessian ``D^-1 H`` times the rate above 38) that train on, measured on a
fixed batch of 32 sequences. A small batch's Hessian could read sharper than the loss itself
is; if so, a larger one would put healthy runs back under the edge and leave the runs that
diverge above it. This measures both on the same runs, at the same steps: the power iteration
of ``sharpness_probe.PreconditionedSharpness`` (10 rounds every 25 steps, warm-started) on a
fixed batch of 32 and one of 256 sequences, on the runs warmed up in 100-200 steps of the
constant-rate class and of the healthy fast warm-ups, over their first 500 steps.

Writes ``benchmarks/results/sharpness_batch.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.data import Batches  # noqa: E402
from benchmarks.divergence.runs import BASE, MITIGATED, QKLN  # noqa: E402
from benchmarks.divergence.sharpness_probe import (  # noqa: E402
    EDGE,
    EVAL_SEED,
    PreconditionedSharpness,
    run_and_write,
)
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

BATCHES = (32, 256)  # the power iteration's fixed batches, in sequences
EVERY, ITERS, STEPS = 25, 10, 500
RUNS = [  # (class, spec): warmed up in 100-200 steps; the constant class diverges by step 300
    (cls, replace(BASE, lr=lr, warmup=wu, seed=seed, model=model, steps=STEPS))
    for cls, lr, wu, seed, model in (
        ("constant", 0.5, 100, 10, QKLN),
        ("constant", 0.5, 100, 16, QKLN),
        ("constant", 0.5, 100, 16, MITIGATED),
        ("healthy", 0.3, 100, 16, MITIGATED),
        ("healthy", 0.4, 200, 16, MITIGATED),
        ("healthy", 0.3, 100, 16, QKLN),
    )
]


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step and ``(step, lr * lambda_max)`` samples on each batch."""
    probes = {
        b: PreconditionedSharpness(
            Batches(seq_len=spec.model.seq_len, batch=b, seed=EVAL_SEED).next(), EVERY, ITERS
        )
        for b in BATCHES
    }

    def each(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        for p in probes.values():
            p(opt, model)

    rec = train(spec, distmon_watch=False, record_every=10**9, probe=each)
    return {
        "name": spec.name,
        "diverged": rec["diverged"],
        "warmup": spec.warmup,
        "top": {b: [(st, v) for st, v, _ in p.samples] for b, p in probes.items()},
    }


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    small, large = BATCHES
    lines = [
        "# Adam's top eigenvalue on a batch of 32 and of 256 sequences",
        "",
        f"`python benchmarks/divergence/sharpness_batch.py --write`. `lr * lambda_max(D^-1 H)` by power "
        f"iteration ({ITERS} rounds every {EVERY} steps, warm-started) on a fixed batch of {small} and "
        f"one of {large} sequences, at the same steps of the same runs (their first {STEPS} steps). "
        f"Samples from step 100 on (before it the {ITERS} rounds from a random start have not "
        "settled) up to the divergence: every second one, "
        f"`{small} / {large}`; the ratio of the two; the largest after the warm-up.",
        "",
        f"| run | class | diverged at | lr * lambda_max, every {2 * EVERY} steps ({small} / {large}) "
        f"| ratio {large}/{small}: median (range) | largest after the warm-up ({small} / {large}) |",
        "|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    largest: dict[str, list[float]] = {}
    for cls, r in results:
        div, wu = r["diverged"], r["warmup"]
        a, b = (dict(r["top"][n]) for n in BATCHES)
        steps = [st for st in a if st >= 100 and st in b and (div is None or st <= div)]
        row = " ".join(f"{a[st]:.0f}/{b[st]:.0f}" for st in steps if st % (2 * EVERY) == 0)
        mine = [b[st] / a[st] for st in steps]
        ratios += mine
        after = [st for st in steps if st >= wu]
        big = [max(d[st] for st in after) for d in (a, b)]
        largest.setdefault(cls, []).append(big[1])
        lines.append(
            f"| {r['name']} | {cls} | {div} | {row} | {statistics.median(mine):.2f} "
            f"({min(mine):.2f}-{max(mine):.2f}) | {big[0]:.0f} / {big[1]:.0f} |"
        )
    healthy = largest["healthy"]
    past = sum(v > EDGE for v in healthy)
    tenth = sorted(ratios)[len(ratios) // 10], sorted(ratios)[-(len(ratios) // 10) - 1]
    lines += [
        "",
        f"Over all {len(ratios)} samples the batch of {large} reads {statistics.median(ratios):.2f} "
        f"times the batch of {small} (median; {tenth[0]:.2f}-{tenth[1]:.2f} between the 10th and "
        "90th percentiles)"
        + (": the larger batch does not move healthy runs under the edge. " if past else ". ")
        + f"{past} of {len(healthy)} healthy runs pass Adam's edge of {EDGE:g} on the batch of {large}; "
        f"after the warm-up the constant class reaches {min(largest['constant']):.0f}-"
        f"{max(largest['constant']):.0f} on it, the healthy runs {min(healthy):.0f}-{max(healthy):.0f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("sharpness_batch", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
