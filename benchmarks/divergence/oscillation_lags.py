#!/usr/bin/env python3
"""Oscillation two steps apart, and Adam's update directions, per layer group: runs diverging at a
constant rate against healthy ones.

    python benchmarks/divergence/oscillation_lags.py --write   # 57 runs, ~25 min on 2 cores

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class): they oscillate as healthy runs at the edge of
stability do, consecutive gradients pointing against each other. The oscillation rule reads that
cosine over the whole model, one step apart. Two readings it leaves out, each a hypothesis:

- **two steps apart.** An optimizer held at the edge of stability oscillates with period 2:
  gradients one step apart point against each other, two steps apart along each other. A map
  pushed past its flip bifurcation leaves that orbit (period doubling, then no period at all)
  before it runs away; if these runs diverge that way, the cosine two steps apart falls before
  they do, and in healthy runs it stays high;
- **per layer group, and Adam's updates.** One group (the output head, the norms' gains) may
  oscillate while the whole-model cosine, dominated by the largest matrices, does not; and Adam
  moves the parameters along its momentum, whose direction turns only when the gradients
  overwhelm it.

Per step, per layer group and over the whole model (:class:`LagCosines`): the cosine of the
gradients (as computed, before clipping) 1 and 2 steps apart, and of the parameter updates 1 and
2 steps apart. Sampled as ``1 - cosine`` (rising with trouble, the oscillation rule's units), the
mean of the last 10 steps every 10 steps from step 50 on, held for 2 samples. For every signal,
the bound fitted to the healthy runs of the stress, validation and fast warm-up sets (the largest
value any of them held: the most favourable case, none warns) is scored on the constant-rate runs
of those sets, then once on the runs recorded later (:func:`.runs.late_holdout`), as
``loss_regression.py`` does for the loss.

Writes ``benchmarks/results/oscillation_lags.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import sys
from collections import deque
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
from benchmarks.divergence.sharpness_probe import run_and_write  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

EVERY = 10  # a sample: the mean of the last EVERY steps, every EVERY steps
START = 50  # the first sample judged: the fastest warm-ups end at 50
SIGNALS = tuple(
    f"{kind}, {lag}" for kind in ("gradients", "updates") for lag in ("1 step apart", "2 steps apart")
)
# (part of a parameter's name, its layer group), first match wins; the last group is the whole model
NAMED = (
    ("_emb.", "embeddings"),
    (".qkv.", "attention qkv"),
    (".proj.", "attention output"),
    (".fc1.", "mlp fc1"),
    (".fc2.", "mlp fc2"),
    ("norm.", "norms"),
    ("ln", "norms"),
    ("lm_head.", "output head"),
)
GROUPS = tuple(dict.fromkeys(group for _, group in NAMED)) + ("whole model",)


def layer_group(name: str) -> int:
    """The index in :data:`GROUPS` of the parameter ``name`` of :class:`.model.TinyGPT`.

    Example:
        >>> [GROUPS[layer_group(n)] for n in ("blocks.1.attn.k_norm.bias", "lm_head.weight")]
        ['norms', 'output head']
    """
    group = next((g for part, g in NAMED if part in name), None)
    if group is None:
        raise ValueError(f"oscillation_lags: no layer group for parameter {name!r}: add it to NAMED")
    return GROUPS.index(group)


def group_cosines(xs: list[torch.Tensor], ys: list[torch.Tensor], member: torch.Tensor) -> np.ndarray:
    """The cosine of ``xs`` and ``ys`` (two lists of tensors, parameter by parameter) within each
    layer group (``member[i]``: parameter i's group) and over all of them: one per :data:`GROUPS`.

    Example:
        >>> xs = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)]
        >>> ys = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)]
        >>> group_cosines(xs, ys, torch.tensor([0, 1]))[[0, 1, -1]].round(4).tolist()  # -3 / sqrt(5 * 6)
        [0.7071, -1.0, -0.5477]
    """
    sums = torch.stack(
        [torch.stack([x @ y, x @ x, y @ y]) for x, y in zip(map(torch.ravel, xs), map(torch.ravel, ys))]
    )
    per_group = torch.zeros(len(GROUPS), 3, dtype=sums.dtype).index_add_(0, member, sums)
    per_group[-1] = sums.sum(0)
    return (per_group[:, 0] / (per_group[:, 1] * per_group[:, 2]).sqrt()).numpy()


class LagCosines:
    """A ``train`` probe: per step, a row of ``len(SIGNALS)`` x ``len(GROUPS)`` cosines (NaN until the
    steps it needs exist). Called after the backward and before the optimizer's step, it reads the
    parameters as the last step left them: the update of step t-1 is theta_t - theta_{t-1}."""

    def __init__(self) -> None:
        self.member: torch.Tensor | None = None
        self.grads: deque[list[torch.Tensor]] = deque(maxlen=3)
        self.thetas: deque[list[torch.Tensor]] = deque(maxlen=4)
        self.rows: list[np.ndarray] = []

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        if self.member is None:
            names = {id(p): n for n, p in model.named_parameters()}
            self.member = torch.tensor([layer_group(names[id(p)]) for p in params])
        self.grads.append([p.grad.to(torch.float64, copy=True) for p in params])
        self.thetas.append([p.detach().to(torch.float64, copy=True) for p in params])
        row = np.full((len(SIGNALS), len(GROUPS)), np.nan)
        g, th = self.grads, self.thetas
        for lag in (1, 2):  # SIGNALS' rows: the gradients' lags 1 and 2, then the updates'
            if len(g) > lag:
                row[lag - 1] = group_cosines(g[-1], g[-1 - lag], self.member)
            if len(th) > lag + 1:
                last = [a - b for a, b in zip(th[-1], th[-2])]
                before = [a - b for a, b in zip(th[-1 - lag], th[-2 - lag])]
                row[1 + lag] = group_cosines(last, before, self.member)
        self.rows.append(row)


def trailing_means(readings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, mean of the last EVERY readings)`` at every EVERY-th step from :data:`START` on
    (``readings``: one per step, from step 0).

    Example:
        >>> steps, values = trailing_means(np.array([1.0] * 51 + [3.0] * 10))
        >>> steps.tolist(), values.round(2).tolist()
        ([50, 60], [1.0, 3.0])
    """
    steps = np.arange(START, len(readings), EVERY)
    return steps, np.array([readings[t - EVERY + 1 : t + 1].mean() for t in steps])


def samples(cosines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, 1 - mean cosine of the last EVERY steps)`` (:func:`trailing_means`), rising with
    trouble, in the oscillation rule's units.

    Example:
        >>> steps, values = samples(np.array([1.0] * 51 + [-1.0] * 10))
        >>> steps.tolist(), values.round(2).tolist()
        ([50, 60], [0.0, 2.0])
    """
    steps, means = trailing_means(cosines)
    return steps, 1.0 - means


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step, peak rate, warm-up, and :class:`LagCosines`' rows."""
    lags = LagCosines()
    rec = train(spec, distmon_watch=False, record_every=10**9, probe=lags)
    return probed(spec, rec, cosines=np.stack(lags.rows))


def _series(run: dict[str, object], signal: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    return samples(run["cosines"][:, signal, group])


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    fit, fresh, strays = split(results)
    lines = page_head(
        "Oscillation two steps apart and Adam's update directions, per layer group",
        f"`python benchmarks/divergence/oscillation_lags.py --write`. Per step, per layer group: the "
        "cosine of the gradients (before clipping) and of the parameter updates, 1 and 2 steps apart; "
        f"sampled as 1 - cosine, the mean of the last {EVERY} steps every {EVERY} steps from step "
        f"{START} on; a warning once past the bound for 2 samples in a row (before the divergence, for "
        "the diverging runs).",
        fit,
        fresh,
        strays,
        ("signal", "layer group", "fitted bound on 1 - cosine (set by)"),
    )
    rows = []  # (label, series, bound) per row, for the timing line
    for s, signal in enumerate(SIGNALS):
        for g, group in enumerate(GROUPS):
            series = partial(_series, signal=s, group=g)
            scored, edge = fitted_and_scored(fit, fresh, series, START, form=".3f")
            lines.append(f"| {signal} | {group} | {scored} |")
            rows.append((f"{signal}, {group}", series, edge))
    lines += timing(fit, fresh, rows, START)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("oscillation_lags", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
