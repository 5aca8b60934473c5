#!/usr/bin/env python3
"""Adam's curvature along its own step, on runs that diverge at a constant rate and runs that do not.

    python benchmarks/divergence/sharpness_probe.py --write   # 8 runs, ~4 min on 2 cores

A probe for what the precursor misses (``docs/detection.md``, "Where it is blind"): runs warmed
up to 0.5 in 100 steps diverge ~100 steps later at a constant rate, oscillating as healthy
runs at the edge of stability do. Adam is stable while the sharpness of its preconditioned
loss stays under ``(2 + 2 beta1) / ((1 - beta1) lr)`` (38 / lr at beta1 0.9: Cohen et al.
2022, "Adaptive gradient methods at the edge of stability", arXiv 2207.14484). Each step, from
two consecutive steps' parameters and gradients (as computed, before clipping) and the
optimizer's second moments (bias-corrected, ``D = sqrt(v) + eps``), this measures the secant
estimate of that sharpness along the step, times the rate::

    s = lr * (dtheta . dg) / (dtheta . D dtheta)

(38 on the top direction at the edge; the step mixes directions, so it reads lower), summed
over 50-step windows (numerator and denominator apart, which averages out the batches' noise).
Writes ``benchmarks/results/sharpness_probe.md``; the runs are not cached.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.runs import BASE, MITIGATED, QKLN  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

WINDOW = 50
RUNS = [  # (class, spec): the constant class of the stress and fast warm-up sets, healthy ones near it
    ("constant", replace(BASE, lr=0.5, warmup=100, seed=10, model=QKLN)),
    ("constant", replace(BASE, lr=0.5, warmup=100, seed=16, model=QKLN)),
    ("constant", replace(BASE, lr=0.5, warmup=100, seed=16, model=MITIGATED)),
    ("qkln", replace(BASE, lr=0.5, seed=0, model=QKLN)),  # a sweep run the oscillation rule misses
    ("healthy", replace(BASE, lr=0.3, warmup=100, seed=16, model=MITIGATED)),
    ("healthy", replace(BASE, lr=0.4, warmup=200, seed=16, model=MITIGATED)),
    ("healthy", replace(BASE, lr=0.4, seed=10, model=MITIGATED)),
    ("healthy", replace(BASE, lr=0.35, seed=13, model=QKLN)),
]


class AdamSecant:
    """Per step: ``lr * dtheta . dg`` and ``dtheta . D dtheta`` (the previous step's rate), NaN at first."""

    def __init__(self) -> None:
        self.prev: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.num: list[float] = []
        self.den: list[float] = []

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        theta = torch.cat([p.reshape(-1) for p in params])
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        num = den = math.nan
        if self.prev is not None:
            beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
            steps = float(opt.state[params[0]]["step"])
            v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]) / (1 - beta2**steps)
            d_theta, d_grad = theta - self.prev[0], grad - self.prev[1]
            num = self.prev[2] * float(d_theta @ d_grad)
            den = float(d_theta @ ((v.sqrt() + eps) * d_theta))
        self.prev = (theta.clone(), grad.clone(), opt.param_groups[0]["lr"])
        self.num.append(num)
        self.den.append(den)


def probe(spec: RunSpec) -> dict[str, object]:
    """One run with the probe: its divergence step and ``s`` per ``WINDOW``-step window."""
    sec = AdamSecant()
    rec = train(spec, distmon_watch=False, record_every=10**9, probe=sec)
    num, den = np.asarray(sec.num), np.asarray(sec.den)
    s = [
        float(np.nansum(num[a : a + WINDOW]) / np.nansum(den[a : a + WINDOW]))
        for a in range(0, len(num), WINDOW)
    ]
    return {"name": spec.name, "diverged": rec["diverged"], "warmup": spec.warmup, "s": s}


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    lines = [
        "# Adam's curvature along its step: runs diverging at a constant rate against healthy ones",
        "",
        "`python benchmarks/divergence/sharpness_probe.py --write`. Per run, the secant estimate "
        "`s = lr * (dtheta . dg) / (dtheta . D dtheta)` of the preconditioned sharpness times the rate "
        f"(Adam's edge: 38 on the top direction), over {WINDOW}-step windows: every second window up to "
        "the divergence's, and the largest `s` after the warm-up ended, before the window in which the "
        "run diverged (healthy runs: to their end).",
        "",
        "| run | class | diverged at | s, every 100 steps | largest s after the warm-up |",
        "|---|---|---|---|---|",
    ]
    largest: dict[str, list[float]] = {}
    for cls, r in results:
        s, div, wu = r["s"], r["diverged"], r["warmup"]
        end = len(s) if div is None else div // WINDOW
        after = [v for i, v in enumerate(s[:end]) if i * WINDOW >= wu]
        row = " ".join(f"{v:.0f}" for v in s[: end + 1 : 2])
        big = f"{max(after):.1f}" if after else "-"
        lines.append(f"| {r['name']} | {cls} | {div} | {row} | {big} |")
        largest.setdefault(cls, []).extend([max(after)] if after else [])
    (c_lo, c_hi), (h_lo, h_hi) = ((min(largest[k]), max(largest[k])) for k in ("constant", "healthy"))
    lines += [
        "",
        f"The runs diverging at a constant rate reach {c_lo:.0f}-{c_hi:.0f} before the window of their "
        f"divergence; healthy runs settle at their own level, {h_lo:.0f}-{h_hi:.0f} here"
        + (
            ": the levels overlap, so no bound on `s` separates them."
            if c_lo <= h_hi
            else f": a bound between {h_hi:.0f} and {c_lo:.0f} would separate these runs."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--write", action="store_true", help="write benchmarks/results/sharpness_probe.md")
    args = p.parse_args(argv)
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(zip([c for c, _ in RUNS], pool.map(probe, [s for _, s in RUNS])))
    text = markdown(results)
    print(text)
    if args.write:
        with open(
            os.path.join(
                os.path.dirname(os.path.dirname(HERE)), "benchmarks", "results", "sharpness_probe.md"
            ),
            "w",
        ) as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
