#!/usr/bin/env python3
"""Adam's own state, per layer group: runs diverging at a constant rate against healthy ones.

    python benchmarks/divergence/adam_moments.py --write   # 57 runs, ~15 min on 2 cores

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class). The signals measured against them so far read the
gradients, the loss, the curvature and the activations; none reads what Adam does with the
gradients. Molybog et al. 2023 ("A Theory on Adam Instability in Large-Scale Machine Learning",
arXiv 2304.09871) trace loss explosions to Adam's state: before a spike, the entries of the
update ``m_hat / (sqrt(v_hat) + eps)`` of some layers drift from a peak near 0 (gradients that
are noise to Adam, averaged out by its momentum) to near +-1 (every entry moved by the full rate:
sign descent, the gradient's time correlation gone), and a gradient larger than the second moment
remembers then moves those layers by far more than the rate intends. Three readings of that, per
layer group and over the whole model (:class:`AdamMoments`), each step:

- **update RMS**: the root mean square of ``m_hat / (sqrt(v_hat) + eps)`` over the group's entries
  (the step Adam took, in units of the rate);
- **sign-like share**: the share of those entries of magnitude 0.5 or more (the mode near +-1);
- **surprise**: the squared norm of the gradient Adam is about to see (clipped, as the optimizer
  sees it) over the sum of ``v_hat`` as the last step left it (1: a gradient as large as those it
  remembers; above: growing faster than its memory of 20 steps).

Each is sampled as the mean of the last 10 steps every 10 steps from step 50 on, held for 2
samples, and read both ways (a rise and a fall towards trouble). For every reading, the bound
fitted to the healthy runs of the stress, validation and fast warm-up sets (the most extreme value
any of them held: the most favourable case, none warns) is scored on the constant-rate runs of
those sets, then once on the runs recorded later (:func:`.runs.late_holdout`), as
``loss_regression.py`` and ``oscillation_lags.py`` do.

Writes ``benchmarks/results/adam_moments.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.loss_regression import (  # noqa: E402
    RUNS,
    fitted_and_scored,
    page_head,
    probed,
    split,
    timing,
)
from benchmarks.divergence.oscillation_lags import (  # noqa: E402
    EVERY,
    GROUPS,
    START,
    layer_group,
    trailing_means,
)
from benchmarks.divergence.sharpness_probe import run_and_write  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

SIGNALS = ("update RMS", "sign-like share", "surprise")
SIGN_LIKE = 0.5  # an update entry of this magnitude or more (in units of the rate) counts as sign-like


class AdamMoments:
    """A ``train`` probe: per step, a row of ``len(SIGNALS)`` x ``len(GROUPS)`` readings of AdamW's
    state (NaN on the first step, before it has any). Called after the backward and before the
    clipping and the optimizer's step: the state is the last step's, the gradient the next one's,
    clipped here as ``clip_grad_norm_(max_norm=clip)`` will clip it."""

    def __init__(self, clip: float) -> None:
        self.clip = clip
        self.member: torch.Tensor | None = None
        self.rows: list[np.ndarray] = []

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        pairs = [(p, group) for group in opt.param_groups for p in group["params"]]
        if self.member is None:
            names = {id(p): n for n, p in model.named_parameters()}
            self.member = torch.tensor([layer_group(names[id(p)]) for p, _ in pairs])
        if not opt.state:
            self.rows.append(np.full((len(SIGNALS), len(GROUPS)), np.nan))
            return
        grads = [p.grad.to(torch.float64) for p, _ in pairs]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = min(1.0, self.clip / (float(norm) + 1e-6))  # clip_grad_norm_'s coefficient
        sums = []
        for (p, group), g in zip(pairs, grads):
            state, (b1, b2) = opt.state[p], group["betas"]
            t = float(state["step"])
            m_hat = state["exp_avg"].to(torch.float64) / (1 - b1**t)
            v_hat = state["exp_avg_sq"].to(torch.float64) / (1 - b2**t)
            r = m_hat / (v_hat.sqrt() + group["eps"])
            sums.append(
                torch.stack(
                    [
                        r.square().sum(),
                        (r.abs() >= SIGN_LIKE).sum().to(torch.float64),
                        (g * scale).square().sum(),
                        v_hat.sum(),
                        torch.tensor(float(r.numel()), dtype=torch.float64),
                    ]
                )
            )
        per_step = torch.stack(sums)
        per_group = torch.zeros(len(GROUPS), 5, dtype=torch.float64).index_add_(0, self.member, per_step)
        per_group[-1] = per_step.sum(0)
        r2, sign_like, g2, v, n = per_group.T
        self.rows.append(torch.stack([(r2 / n).sqrt(), sign_like / n, g2 / v]).numpy())


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step, peak rate, warm-up, and :class:`AdamMoments`' rows."""
    moments = AdamMoments(spec.clip)
    rec = train(spec, distmon_watch=False, record_every=10**9, probe=moments)
    return probed(spec, rec, readings=np.stack(moments.rows))


def signed_series(
    run: dict[str, object], signal: int, group: int, sign: float
) -> tuple[np.ndarray, np.ndarray]:
    """A run's ``readings[:, signal, group]`` sampled by :func:`.oscillation_lags.trailing_means`,
    times ``sign`` (-1: a reading that falls towards trouble, read as a rise)."""
    steps, values = trailing_means(run["readings"][:, signal, group])
    return steps, sign * values


WAYS = ((1.0, "rises"), (-1.0, "falls"))  # (sign, its word): a reading read both ways


def both_ways(
    fit: list[dict[str, object]],
    fresh: list[dict[str, object]],
    signals: tuple[str, ...],
    groups: tuple[str, ...],
    ways: tuple[tuple[float, str], ...] = WAYS,
) -> tuple[list[str], list[tuple[str, object, float]]]:
    """The table's rows of every reading of ``run["readings"]`` (steps x ``signals`` x ``groups``),
    each way of ``ways``, per group: its bound fitted to the healthy runs of ``fit`` and scored on
    ``fit`` and ``fresh`` (:func:`.loss_regression.fitted_and_scored`); and ``(label, series,
    bound)`` per row, for :func:`.loss_regression.timing`."""
    lines, rows = [], []
    for s, signal in enumerate(signals):
        for sign, way in ways:
            for g, group in enumerate(groups):
                series = partial(signed_series, signal=s, group=g, sign=sign)
                scored, edge = fitted_and_scored(fit, fresh, series, START, sign)
                lines.append(f"| {signal} | {way} | {group} | {scored} |")
                rows.append((f"{signal} {way}, {group}", series, edge))
    return lines, rows


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    fit, fresh, strays = split(results)
    lines = page_head(
        "Adam's state per layer group: update RMS, sign-like share, surprise",
        "`python benchmarks/divergence/adam_moments.py --write`. Per step, per layer group: the RMS of "
        f"Adam's update m_hat / (sqrt(v_hat) + eps), the share of its entries of magnitude {SIGN_LIKE} "
        "or more, and the clipped gradient's squared norm over the sum of v_hat; sampled as the mean "
        f"of the last {EVERY} steps every {EVERY} steps from step {START} on, read as a rise and as a "
        "fall; a warning once past the bound for 2 samples in a row (before the divergence, for the "
        "diverging runs).",
        fit,
        fresh,
        strays,
        ("signal", "towards trouble", "layer group", "fitted bound (set by)"),
    )
    table, rows = both_ways(fit, fresh, SIGNALS, GROUPS)
    lines += table + timing(fit, fresh, rows, START)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("adam_moments", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
