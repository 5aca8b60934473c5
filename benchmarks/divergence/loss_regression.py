#!/usr/bin/env python3
"""The training loss's own regression on runs that diverge at a constant rate and runs that do not.

    python benchmarks/divergence/loss_regression.py --write   # 57 runs, ~20 min on 2 cores

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class). Those runs stop improving well before they diverge:
their loss settles 10-15% above its best for a hundred steps or more, then climbs past the 30%
that :mod:`.divergence` calls a divergence. The plainest live rule for that is on the loss
itself: every ``EVERY`` steps, the mean of the last ``window`` training losses over the lowest
such mean so far (the divergence's own statistic, read as it stands, without its look ahead),
past a bound for 2 samples in a row, from step ``FROM`` on. This script measures whether any
bound tells those runs from healthy ones that run close to their critical rate.

Runs: the constant class of the stress, validation and fast warm-up sets (11) and the healthy
runs of the same sets (26: peaks 0.01-0.4, warm-ups of 50-1,000 steps, 1,500 steps each, some
within 15% of the critical rate ~0.47). For two windows and a grid of bounds, the table gives
the constant-rate runs warned before their divergence, their median lead, and the healthy runs
warned. Per window, the bound fitted to those healthy runs (their largest held ratio: the most
favourable case, none of them warns) is then scored once on runs recorded after it was fitted
(:func:`.runs.late_holdout`: 9 diverging at a constant rate, 11 healthy, most close to the
critical rate).

Writes ``benchmarks/results/loss_regression.md``; the runs are not cached.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.runs import fast_warmups, late_holdout, stress, validation  # noqa: E402
from benchmarks.divergence.sharpness_probe import held, run_and_write  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

EVERY = 10
FROM = 100  # the first sample judged: the fastest warm-ups of the constant class end at 50-100
WINDOWS = (20, 50)
BOUNDS = (1.08, 1.1, 1.12, 1.15, 1.2)
SETS = stress() + validation() + fast_warmups()
FRESH = late_holdout()  # recorded after the bounds were fitted to SETS, scored once
RUNS = [r for r in SETS if r[0] in ("constant", "healthy")] + FRESH


def regression(loss: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, ratios)`` sampled every ``EVERY`` steps from ``FROM`` on: at step t, the mean of the
    losses of steps ``t - window + 1 .. t`` over the lowest such mean up to t (1: at its best).

    Example:
        >>> loss = np.array([4.0] * 100 + [2.0] * 30 + [3.0] * 30)
        >>> steps, ratios = regression(loss, window=10)
        >>> steps.tolist(), [round(float(r), 2) for r in ratios]   # the 3.0s begin at step 130
        ([100, 110, 120, 130, 140, 150], [1.0, 1.0, 1.0, 1.05, 1.5, 1.5])
    """
    csum = np.concatenate([[0.0], np.cumsum(np.asarray(loss, np.float64))])
    means = (csum[window:] - csum[:-window]) / window  # means[i]: the window ending at step i + window - 1
    best = np.minimum.accumulate(means)
    steps = np.arange(window - 1, len(loss))
    keep = (steps % EVERY == 0) & (steps >= FROM)
    return steps[keep], (means / best)[keep]


def first_warning(
    steps: np.ndarray, values: np.ndarray, bound: float, before: int | None, start: int = FROM
) -> int | None:
    """The first sampled step from ``start`` on whose value and the one before it both exceed
    ``bound``, before step ``before`` (None: any), or None.

    Example:
        >>> first_warning(np.array([100, 110, 120, 130]), np.array([1.2, 1.0, 1.2, 1.3]), 1.1, None)
        130
        >>> first_warning(np.array([100, 110, 120, 130]), np.array([1.2, 1.0, 1.2, 1.3]), 1.1, 130) is None
        True
    """
    past = (st for st, h in held(steps.tolist(), values.tolist(), False, start) if h > bound)
    first = next(past, None)
    return first if first is not None and (before is None or first < before) else None


def held_max(steps: np.ndarray, values: np.ndarray, start: int = FROM) -> float:
    """The largest value held 2 samples in a row from ``start`` on: the lowest bound that never warns
    (-inf where no value is held: a run too short to warn sets no bound, whatever the series' units).

    Example:
        >>> held_max(np.array([100, 110, 120]), np.array([1.3, 1.05, 1.1]))   # 1.3 held only once
        1.05
        >>> held_max(np.array([90, 100]), np.array([-0.5, -0.4]), start=110)
        -inf
    """
    return max((h for _, h in held(steps.tolist(), values.tolist(), False, start)), default=-math.inf)


def probed(spec: RunSpec, rec: dict[str, object], **series: object) -> dict[str, object]:
    """A run as the tables read it: its name, divergence step (None: healthy), peak rate and
    warm-up from ``spec`` and ``train``'s recording ``rec``, and the probe's ``series``."""
    return {"name": spec.name, "diverged": rec["diverged"], "lr": spec.lr, "warmup": spec.warmup, **series}


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step, its peak rate and warm-up, its training losses and gradient
    norms (before clipping)."""
    rec = train(spec, distmon_watch=False, record_every=10**9)
    return probed(spec, rec, loss=rec["loss"], grad_norm=rec["grad_norm"])


Series = Callable[[dict[str, object]], tuple[np.ndarray, np.ndarray]]  # a run -> (steps, values)


def warned(
    runs: list[dict[str, object]], series: Series, bound: float, start: int = FROM
) -> list[tuple[dict[str, object], int]]:
    """``(run, its first warning)`` for every run of ``runs`` that ``bound`` warns: a diverging run
    before its divergence, a healthy one at any step; ``series`` samples a run."""
    firsts = ((r, first_warning(*series(r), bound, r["diverged"], start)) for r in runs)
    return [(r, w) for r, w in firsts if w is not None]


def cells(runs: list[dict[str, object]], series: Series, bound: float, start: int = FROM) -> str:
    """The table cells of ``runs`` at ``bound``: constant-rate runs warned before their divergence,
    their median lead, healthy runs warned (and their peak rates)."""
    hits = warned(runs, series, bound, start)
    leads = [r["diverged"] - w for r, w in hits if r["diverged"] is not None]
    peaks = sorted({f"{r['lr']:g}" for r, _ in hits if r["diverged"] is None}, key=float)
    n_diverging = sum(r["diverged"] is not None for r in runs)
    n_warned = len(hits) - len(leads)
    median = f"{statistics.median(leads):g}" if leads else "-"
    return f"{len(leads)}/{n_diverging} | {median} | {n_warned}/{len(runs) - n_diverging}" + (
        f" (peaks {', '.join(peaks)})" if peaks else ""
    )


def fitted_bound(runs: list[dict[str, object]], series: Series, start: int = FROM) -> tuple[float, str]:
    """The bound fitted to the healthy runs of ``runs``: the largest value any of them held (none
    warns: the most favourable case), and the first run that held it."""
    edges = [(held_max(*series(r), start), r["name"]) for r in runs if r["diverged"] is None]
    return max(edges, key=lambda edge: edge[0])


def split(
    results: list[tuple[str, dict[str, object]]],
) -> tuple[list[dict[str, object]], list[dict[str, object]], list[str]]:
    """``(fitted, fresh, strays)``: the runs the bounds are fitted to, those of :data:`FRESH` (scored
    once), and the names of runs left out because they did not do what their class says (a
    constant-rate run that did not diverge, a healthy one that did)."""
    fresh_names = {spec.name for _, spec in FRESH}
    kept = [r for cls, r in results if (cls == "constant") == (r["diverged"] is not None)]
    strays = [r["name"] for cls, r in results if (cls == "constant") != (r["diverged"] is not None)]
    return (
        [r for r in kept if r["name"] not in fresh_names],
        [r for r in kept if r["name"] in fresh_names],
        strays,
    )


def fitted_runs(fit: list[dict[str, object]], strays: list[str]) -> str:
    """The sentence that counts the runs the bounds are fitted to, and names the ones left out."""
    n_constant = sum(r["diverged"] is not None for r in fit)
    return (
        f"Runs the bounds are fitted to (`runs.stress()`, `runs.validation()`, `runs.fast_warmups()`): "
        f"{n_constant} diverging at (or near) a constant rate, {len(fit) - n_constant} healthy"
        + (f"; not as their class says, left out: {', '.join(strays)}" if strays else "")
        + "."
    )


FITTED = (
    "The bound is fitted to the healthy runs of the sets named below (the most extreme value any of them "
    "held: none warns), then scored once on the later runs."
)  # how the probe scripts' bounds are set, in their pages' words


def scored_once(fit: list[dict[str, object]], fresh: list[dict[str, object]], strays: list[str]) -> str:
    """:func:`fitted_runs`' sentence and the one that counts the runs scored once (:data:`FRESH`)."""
    n_constant = sum(r["diverged"] is not None for r in fresh)
    return (
        fitted_runs(fit, strays)
        + f" Scored once: {n_constant} constant-rate and {len(fresh) - n_constant} healthy runs "
        "recorded after the loss's bounds were fitted (`runs.late_holdout()`)."
    )


SCORED = (
    "fitted: constant-rate runs warned",
    "median lead (steps)",
    "healthy runs warned",
    "late hold-out: constant-rate runs warned",
    "median lead (steps)",
    "healthy runs warned",
)  # the columns of fitted_and_scored's cells after the bound's


def page_head(
    title: str,
    intro: str,
    fit: list[dict[str, object]],
    fresh: list[dict[str, object]],
    strays: list[str],
    columns: tuple[str, ...],
) -> list[str]:
    """A probe script's page up to its table's first row: the title, what it measures (``intro``)
    and how its bounds are fitted (:data:`FITTED`), :func:`scored_once`'s runs, and the table's
    header: the row's own ``columns`` (the bound's last), then :data:`SCORED`.

    Example:
        >>> page_head("T", "Reads x.", [], [], [], ("signal", "bound"))[-1]
        '|---|---|---|---|---|---|---|---|'
    """
    names = (*columns, *SCORED)
    return [
        f"# {title}",
        "",
        f"{intro} {FITTED}",
        "",
        scored_once(fit, fresh, strays),
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
    ]


def fitted_and_scored(
    fit: list[dict[str, object]],
    fresh: list[dict[str, object]],
    series: Series,
    start: int,
    sign: float = 1.0,
    form: str = ".4g",
) -> tuple[str, float]:
    """A row's cells and its bound: the bound fitted to the healthy runs of ``fit`` (printed times
    ``sign``: -1 for a series negated so that it rises towards trouble, in the format ``form``)
    and the run that set it, then :func:`cells` of ``fit`` and of ``fresh`` at that bound."""
    edge, name = fitted_bound(fit, series, start)
    scored = " | ".join(cells(runs, series, edge, start) for runs in (fit, fresh))
    return f"{sign * edge:{form}} ({name}) | {scored}", edge


def timing(
    fit: list[dict[str, object]],
    fresh: list[dict[str, object]],
    rows: list[tuple[str, Series, float]],
    start: int,
) -> list[str]:
    """The lines that say when the row (``(label, series, bound)``) warning the most constant-rate
    runs of ``fit`` (the first of ties; none if no row warns one) warns them, over ``fit`` and
    ``fresh``, in steps from the end of their warm-up, and which healthy runs it warns: a signal
    that turns with the warm-up's shock warns near its end, in healthy runs warmed up as fast too."""
    counts = [
        sum(r["diverged"] is not None for r, _ in warned(fit, series, edge, start))
        for _, series, edge in rows
    ]
    if not any(counts):
        return []
    label, series, edge = rows[counts.index(max(counts))]
    hits = warned(fit + fresh, series, edge, start)
    after = [w - r["warmup"] for r, w in hits if r["diverged"] is not None]
    healthy = sorted({(r["warmup"], r["lr"]) for r, _ in hits if r["diverged"] is None})
    return [
        "",
        f"When the row that warns the most constant-rate runs it was fitted to ({label}) warns: "
        f"{min(after)} to {max(after)} steps (median {statistics.median(after):g}) from the end "
        "of their warm-up, both sets (negative: before it ended); "
        + (
            "the healthy runs it warns were warmed up in "
            + ", ".join(f"{wu} steps to {lr:g}" for wu, lr in healthy)
            if healthy
            else "it warns no healthy run"
        )
        + ".",
    ]


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    fit, fresh, strays = split(results)
    f_constant = sum(r["diverged"] is not None for r in fresh)
    lines = [
        "# The loss's regression: runs diverging at a constant rate against healthy ones",
        "",
        f"`python benchmarks/divergence/loss_regression.py --write`. Every {EVERY} steps from step "
        f"{FROM} on: the mean of the last `window` training losses over the lowest such mean so far; "
        "a warning once it exceeds the bound for 2 samples in a row (before the divergence, "
        "for the diverging runs). Divergence (`benchmarks/divergence/divergence.py`) is the same "
        "statistic over 20 steps past 1.3, read from the step its stretch starts.",
        "",
        fitted_runs(fit, strays),
        "",
        "| window | bound | constant-rate runs warned | median lead (steps) | healthy runs warned |",
        "|---|---|---|---|---|",
    ]
    fitted = []
    for window in WINDOWS:
        series = partial(_loss_series, window=window)
        lines += [f"| {window} | {bound:g} | {cells(fit, series, bound)} |" for bound in BOUNDS]
        fitted.append((window, series, *fitted_bound(fit, series)))
    lines += [
        "",
        "The bound fitted to these healthy runs (the largest ratio any of them held; none warns), on "
        f"the runs it was fitted to and, scored once, on {f_constant} constant-rate and "
        f"{len(fresh) - f_constant} healthy runs recorded after it was fitted (`runs.late_holdout()`):",
        "",
        "| window | fitted bound (set by) | runs | constant-rate runs warned | median lead (steps) "
        "| healthy runs warned |",
        "|---|---|---|---|---|---|",
    ]
    for window, series, edge, name in fitted:
        for label, runs in (("fitted to", fit), ("late hold-out", fresh)):
            lines.append(f"| {window} | {edge:.3f} ({name}) | {label} | {cells(runs, series, edge)} |")
    return "\n".join(lines) + "\n"


def _loss_series(run: dict[str, object], window: int) -> tuple[np.ndarray, np.ndarray]:
    return regression(run["loss"], window)


def main(argv: list[str] | None = None) -> int:
    return run_and_write("loss_regression", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
