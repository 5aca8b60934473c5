#!/usr/bin/env python3
"""Adam's edge when training on 256 sequences a step: do healthy runs stay at it, and does crossing it lead?

    python benchmarks/divergence/sharpness_large_batch.py --write   # 6 runs, ~20 min on 2 cores

At the benchmark's batch of 16 sequences healthy runs train on far past Adam's edge of
stability (``sharpness_probe.py``: the top eigenvalue of the preconditioned Hessian times the
rate up to 1,109 against an edge of 38), and the Hessian's batch is not why
(``sharpness_batch.py``). This trains the same model on 256 sequences a step (16 times the
tokens, still far from a large model's batch), warmed up in 100 steps to 0.3, 0.5 and 0.8, with
qk-layernorm, with and without z-loss, for 400 steps, and measures on the same runs:

- ``lr * lambda_max(D^-1 H)`` by the power iteration of
  ``sharpness_probe.PreconditionedSharpness`` (10 rounds every 25 steps, warm-started, on a fixed
  batch of 256 sequences);
- the secant ``s`` along the step of ``sharpness_probe.AdamSecant``, over 25-step windows (what a
  monitor that sees only gradients could compute).

Writes ``benchmarks/results/sharpness_large_batch.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.runs import BASE, MITIGATED, QKLN  # noqa: E402
from benchmarks.divergence.sharpness_probe import (  # noqa: E402
    EDGE,
    run_and_write,
    secant_and_power,
)
from benchmarks.divergence.train import RunSpec  # noqa: E402

BATCH, EVERY, ITERS, STEPS, WARMUP = 256, 25, 10, 400, 100
FIRST = 50  # the first sample shown: before it the rounds from a random start have not settled
RUNS = [
    (tag, replace(BASE, lr=lr, warmup=WARMUP, seed=16, model=model, steps=STEPS, batch=BATCH))
    for lr in (0.3, 0.5, 0.8)
    for tag, model in (("qk-layernorm", QKLN), ("qk-layernorm, z-loss", MITIGATED))
]


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step, the power iteration's ``(step, lr * lambda_max)`` samples and
    the secant ``s`` per ``EVERY``-step window."""
    rec, s, power = secant_and_power(spec, BATCH, EVERY, EVERY, ITERS)
    return {
        "name": spec.name,
        "lr": spec.lr,
        "diverged": rec["diverged"],
        "top": [(st, v) for st, v, _ in power.samples],
        "s": s,
    }


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    lines = [
        f"# Adam's edge when training on {BATCH} sequences a step",
        "",
        "`python benchmarks/divergence/sharpness_large_batch.py --write`. The benchmark's GPT trained "
        f"on {BATCH} sequences a step, warmed up in {WARMUP} steps, {STEPS} steps at most. "
        f"`lr * lambda_max(D^-1 H)` by power iteration ({ITERS} rounds every {EVERY} steps, "
        f"warm-started, a fixed batch of {BATCH} sequences; Adam's edge is {EDGE:g}) from step "
        f"{FIRST} to the divergence, the first sample past the edge, and the secant `s` along the "
        f"step over {EVERY}-step windows (window k holds steps {EVERY}k to {EVERY}(k+1)).",
        "",
        f"| run | model | peak rate | diverged at | lr * lambda_max, every {EVERY} steps "
        f"| first past {EDGE:g} (steps before the divergence) | s per window |",
        "|---|---|---|---|---|---|---|",
    ]
    held: list[str] = []  # runs that did not diverge: their range after the warm-up
    leads: list[int] = []
    for tag, r in results:
        div = r["diverged"]
        samples = [(st, v) for st, v in r["top"] if st >= FIRST and (div is None or st <= div)]
        past = next((st for st, v in samples if v > EDGE), None)
        if div is None:
            after = [v for st, v in samples if st >= WARMUP]
            held.append(f"at {r['lr']:g} with {tag} {min(after):.0f}-{max(after):.0f}")
            when = "-" if past is None else f"{past}"
        else:
            when = "never" if past is None else f"{past} ({div - past})"
            leads += [] if past is None else [div - past]
        end = len(r["s"]) if div is None else div // EVERY + 1
        lines.append(
            f"| {r['name']} | {tag} | {r['lr']:g} | {div} | {' '.join(f'{v:.0f}' for _, v in samples)} "
            f"| {when} | {' '.join(f'{v:.0f}' for v in r['s'][:end])} |"
        )
    diverged = sum(r["diverged"] is not None for _, r in results)
    lines += [
        "",
        f"{len(results) - diverged} runs did not diverge within {STEPS} steps; after the warm-up their "
        f"eigenvalue read (against the edge of {EDGE:g}): {'; '.join(held)}. {diverged} diverged; "
        f"{len(leads)} of them had a sample past the edge before the divergence, "
        + (f"{min(leads)}-{max(leads)} steps before it." if leads else "none before it."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("sharpness_large_batch", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
