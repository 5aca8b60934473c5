#!/usr/bin/env python3
"""Adam's sharpness, on runs that diverge at a constant rate and runs that do not.

    python benchmarks/divergence/sharpness_probe.py --write   # 8 runs, ~10-15 min on 2 cores

A probe for what the precursor misses (``docs/detection.md``, "Where it is blind"): runs warmed
up to 0.5 in 100 steps diverge ~100 steps later at a constant rate, oscillating as healthy
runs at the edge of stability do. Adam is stable while the sharpness of its preconditioned
loss, the top eigenvalue of ``D^-1 H`` (``D = sqrt(v) + eps``, the optimizer's bias-corrected
second moments), stays under ``(2 + 2 beta1) / ((1 - beta1) lr)``: 38 / lr at beta1 0.9
(Cohen et al. 2022, "Adaptive gradient methods at the edge of stability", arXiv 2207.14484).
Two measurements of it times the rate, on the same runs:

- **the secant along the step** (what a monitor that sees only gradients could compute), from
  two consecutive steps' parameters and gradients (as computed, before clipping)::

      s = lr * (dtheta . dg) / (dtheta . D dtheta)

  summed over 50-step windows (numerator and denominator apart, which averages out the
  batches' noise); the step mixes directions, so it reads below the top eigenvalue;
- **the top eigenvalue** by power iteration on ``D^-1/2 H D^-1/2`` (same eigenvalues): 20
  Hessian-vector products (40 when the largest in magnitude is negative) of the loss on one
  fixed batch of 32 sequences every 50 steps, warm-started from the last sample's vector; it
  needs the model, the loss and a double backward, which a monitor that sees only gradients
  does not have.

Writes ``benchmarks/results/sharpness_probe.md``; the runs are not cached.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.data import Batches  # noqa: E402
from benchmarks.divergence.runs import BASE, MITIGATED, QKLN  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

WINDOW = 50
EVERY, ITERS = 50, 20  # the power iteration's samples
EVAL_BATCH, EVAL_SEED = 32, 4242  # its fixed batch (the training batches' seeds are 1000 + seed)
EDGE = 38.0  # (2 + 2 beta1) / (1 - beta1) at beta1 0.9
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


def _adam_scale(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor | None:
    """``D = sqrt(v / (1 - beta2^t)) + eps`` of every parameter, flat; None before Adam's first step."""
    if not all("exp_avg_sq" in opt.state[p] for p in params):
        return None
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    steps = float(opt.state[params[0]]["step"])
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]) / (1 - beta2**steps)
    return v.sqrt() + eps


class AdamSecant:
    """Per step: ``lr * dtheta . dg`` and ``dtheta . D dtheta`` (the previous step's rate), NaN at first."""

    def __init__(self) -> None:
        self.prev: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.num: list[float] = []
        self.den: list[float] = []

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        theta = torch.cat([p.reshape(-1) for p in params])
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        num = den = math.nan
        scale = _adam_scale(opt, params)
        if self.prev is not None and scale is not None:
            d_theta, d_grad = theta - self.prev[0], grad - self.prev[1]
            num = self.prev[2] * float(d_theta @ d_grad)
            den = float(d_theta @ (scale * d_theta))
        self.prev = (theta.clone(), grad.clone(), opt.param_groups[0]["lr"])
        self.num.append(num)
        self.den.append(den)


class PreconditionedSharpness:
    """Every ``every`` steps: ``lr * lambda_max(D^-1 H)``, the largest (most positive) eigenvalue, of
    the loss on a fixed ``batch`` ``(x, y)``, and the seconds it took: ``iters`` rounds of power
    iteration (Hessian-vector products by double backward); when they settle on a negative
    eigenvalue ``mu``, ``iters`` more on ``D^-1/2 H D^-1/2 - mu`` (whose top is the most positive)."""

    def __init__(
        self, batch: tuple[torch.Tensor, torch.Tensor], every: int = EVERY, iters: int = ITERS
    ) -> None:
        self.batch, self.every, self.iters = batch, every, iters
        self.step = 0
        self.vector: torch.Tensor | None = None  # the last sample's top vector (a warm start)
        self.gen = torch.Generator().manual_seed(0)  # not the training's random stream
        self.samples: list[tuple[int, float, float]] = []  # (step, lr * lambda, seconds)

    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        step, self.step = self.step, self.step + 1
        if step % self.every:
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        scale = _adam_scale(opt, params)
        if scale is None:
            return
        t0 = time.perf_counter()
        inv = scale.rsqrt()
        sizes = [p.numel() for p in params]
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no double backward
            grads = torch.autograd.grad(model(*self.batch)[1], params, create_graph=True)

            def apply(x: torch.Tensor) -> torch.Tensor:  # D^-1/2 H D^-1/2 x
                parts = [u.view_as(p) for u, p in zip((x * inv).split(sizes), params)]
                hv = torch.autograd.grad(grads, params, parts, retain_graph=True)
                return torch.cat([h.reshape(-1) for h in hv]).detach() * inv

            start = self.vector
            if start is None:
                start = torch.randn(len(scale), generator=self.gen, dtype=scale.dtype)
            value, self.vector = top_eigenvalue(apply, start, self.iters)
        self.samples.append((step, opt.param_groups[0]["lr"] * value, time.perf_counter() - t0))


def top_eigenvalue(
    apply: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, iters: int
) -> tuple[float, torch.Tensor]:
    """The most positive eigenvalue of the symmetric operator ``apply`` and its unit vector:
    ``iters`` rounds of power iteration from ``start``; when they settle on a negative eigenvalue
    ``mu`` (the largest in magnitude), ``iters`` more on ``apply - mu``, whose largest is the
    most positive one shifted by ``-mu``.

    Example:
        >>> value, _ = top_eigenvalue(lambda x: torch.tensor([-5.0, 2.0]) * x, torch.ones(2), 60)
        >>> round(value, 4)
        2.0
    """
    value, vector = _power(apply, start, iters)
    if value < 0:
        shifted, vector = _power(lambda x: apply(x) - value * x, start, iters)
        value += shifted
    return value, vector


def _power(
    apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int
) -> tuple[float, torch.Tensor]:
    """``iters`` rounds of power iteration from ``x``: the Rayleigh quotient and the unit vector."""
    x = x / x.norm()
    value = math.nan
    for _ in range(iters):
        y = apply(x)
        value = float(x @ y)
        x = y / y.norm()
    return value, x


def secant_and_power(
    spec: RunSpec, batch: int, window: int, every: int = EVERY, iters: int = ITERS
) -> tuple[dict[str, object], list[float], PreconditionedSharpness]:
    """Train ``spec`` with both probes: its recording, the secant ``s`` per ``window``-step window,
    and the power iteration (``iters`` rounds every ``every`` steps on a fixed ``batch`` of sequences)."""
    fixed = Batches(seq_len=spec.model.seq_len, batch=batch, seed=EVAL_SEED).next()
    sec, power = AdamSecant(), PreconditionedSharpness(fixed, every, iters)

    def both(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        sec(opt)
        power(opt, model)

    rec = train(spec, distmon_watch=False, record_every=10**9, probe=both)
    num, den = np.asarray(sec.num), np.asarray(sec.den)
    s = [
        float(np.nansum(num[a : a + window]) / np.nansum(den[a : a + window]))
        for a in range(0, len(num), window)
    ]
    return rec, s, power


def probe(spec: RunSpec) -> dict[str, object]:
    """One run with both probes: its divergence step, ``s`` per ``WINDOW``-step window, the power
    iteration's samples and their seconds, and the run's seconds per step without them."""
    rec, s, power = secant_and_power(spec, EVAL_BATCH, WINDOW)
    probe_s = sum(t for _, _, t in power.samples)
    return {
        "name": spec.name,
        "diverged": rec["diverged"],
        "warmup": spec.warmup,
        "s": s,
        "power": [(st, v) for st, v, _ in power.samples],
        "sample_s": probe_s / max(1, len(power.samples)),
        "step_s": (rec["seconds"] - probe_s) / rec["steps_run"],  # with the secant's cheap reads
    }


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    lines = [
        "# Adam's sharpness: runs diverging at a constant rate against healthy ones",
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
    lines += [
        "",
        f"The top eigenvalue of `D^-1 H` times the rate, by power iteration ({ITERS} Hessian-vector "
        f"products, {2 * ITERS} where the largest in magnitude is negative, every {EVERY} steps, on a "
        f"fixed batch of {EVAL_BATCH} sequences): every second sample up to the divergence, "
        "the largest after the warm-up (before the divergence), the first step past Adam's edge of "
        f"{EDGE:g}, and what a sample costs in steps of the run.",
        "",
        "| run | class | diverged at | lr * lambda_max, every 100 steps | largest after the warm-up | "
        f"first past {EDGE:g} (steps before the divergence) | a sample costs |",
        "|---|---|---|---|---|---|---|",
    ]
    top: dict[str, list[float]] = {}
    for cls, r in results:
        div, wu = r["diverged"], r["warmup"]
        samples = [(st, v) for st, v in r["power"] if div is None or st <= div]
        row = " ".join(f"{v:.0f}" for st, v in samples if st % 100 == 0)  # every 100 steps
        after = [v for st, v in samples if st >= wu]
        past = next((st for st, v in samples if v > EDGE), None)
        when = "-" if past is None else f"{past}" + ("" if div is None else f" ({div - past})")
        big = f"{max(after):.1f}" if after else "-"
        cost = f"{r['sample_s'] / r['step_s']:.0f} steps"
        lines.append(f"| {r['name']} | {cls} | {div} | {row} | {big} | {when} | {cost} |")
        top.setdefault(cls, []).extend([max(after)] if after else [])
    (c_lo, c_hi), (h_lo, h_hi) = ((min(top[k]), max(top[k])) for k in ("constant", "healthy"))
    healthy = [r for cls, r in results if cls == "healthy"]
    past = sum(any(v > EDGE for _, v in r["power"]) for r in healthy)
    lines += [
        "",
        f"Largest after the warm-up: the constant class {c_lo:.0f}-{c_hi:.0f}, healthy runs "
        f"{h_lo:.0f}-{h_hi:.0f}"
        + (
            ": the levels overlap."
            if c_lo <= h_hi
            else f": a bound between {h_hi:.0f} and {c_lo:.0f} separates these runs."
        )
        + f" {past} of {len(healthy)} healthy runs pass Adam's edge of {EDGE:g} and train on.",
    ]
    return "\n".join(lines) + "\n"


def held(steps: Sequence[int], values: Sequence[float], falls: bool, start: int) -> list[tuple[int, float]]:
    """``(step, value held for 2 samples)`` from step ``start`` on: a sample is past a bound in the
    direction of trouble (down if ``falls``, else up) only if the sample before it is too.

    Example:
        >>> held([90, 100, 110, 120], [0.9, 0.1, 0.5, 0.2], falls=True, start=100)
        [(100, 0.9), (110, 0.5), (120, 0.5)]
    """
    pick = max if falls else min
    return [(st, pick(a, b)) for st, a, b in zip(steps[1:], values, values[1:]) if st >= start]


def run_and_write(
    name: str,
    doc: str,
    runs: list[tuple[str, RunSpec]],
    probe: Callable[[RunSpec], dict[str, object]],
    markdown: Callable[[list[tuple[str, dict[str, object]]]], str],
    argv: list[str] | None,
) -> int:
    """The command line of a probe script: ``probe`` every run of ``runs`` (``--jobs`` at once), print
    their ``markdown``, and with ``--write`` save it as ``benchmarks/results/{name}.md``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--write", action="store_true", help=f"write benchmarks/results/{name}.md")
    args = p.parse_args(argv)
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(zip([c for c, _ in runs], pool.map(probe, [s for _, s in runs])))
    text = markdown(results)
    print(text)
    if args.write:
        with open(os.path.join(os.path.dirname(HERE), "results", f"{name}.md"), "w") as f:
            f.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_and_write("sharpness_probe", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
