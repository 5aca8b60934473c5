#!/usr/bin/env python3
"""Critical slowing down in the loss and the gradient norm: runs diverging at a constant rate
against healthy ones.

    python benchmarks/divergence/slowing_down.py --write   # 57 runs, ~11 min on 2 cores

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class). A system drifting towards a tipping point recovers
ever more slowly from small perturbations, and its fluctuations grow in size and in memory before
it tips: rising variance and lag-1 autocorrelation are the generic early warnings of a critical
transition (Scheffer et al. 2009, "Early-warning signals for critical transitions", Nature 461;
Dakos et al. 2012, PLoS ONE 7(7): e41010, for the method). A run at a constant rate just past
the one its curvature allows is such a system, if its divergence builds up. The signals measured
against this class so far read levels (the loss's regression, the gradient norm's jump) and one
lag of the gradients' direction; these read the fluctuations of the two series every training
loop already has, step by step:

- over a trailing window of ``window`` steps, each series' residuals from its own least-squares
  line (the trend taken out: the loss falls, the norm drifts);
- **size**: their standard deviation, of the loss over its window's mean, of the gradient norm
  in log units (both scale-free);
- **memory**: their sample autocorrelation at lag 1 (towards +1: slowing down; towards -1: a
  period-2 flip, the edge of stability's oscillation).

Sampled every 10 steps from step 50 on (once a window fits), held for 2 samples, read both ways
(a rise and a fall towards trouble). For every reading, the bound fitted to the healthy runs of
the stress, validation and fast warm-up sets (the most extreme value any of them held: the most
favourable case, none warns) is scored on the constant-rate runs of those sets, then once on the
runs recorded later (:func:`.runs.late_holdout`), as ``loss_regression.py`` does.

Writes ``benchmarks/results/slowing_down.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.loss_regression import (  # noqa: E402
    RUNS,
    fitted_and_scored,
    page_head,
    probe,
    split,
)
from benchmarks.divergence.oscillation_lags import EVERY, START  # noqa: E402
from benchmarks.divergence.sharpness_probe import run_and_write  # noqa: E402

WINDOWS = (50, 100)
SERIES = ("loss", "gradient norm")
STATISTICS = ("size", "memory")


def residuals(values: np.ndarray) -> np.ndarray:
    """``values`` less their least-squares line over their own index.

    Example:
        >>> residuals(np.array([1.0, 3.0, 2.0, 4.0])).round(2).tolist()   # the line 1.3 + 0.8 i
        [-0.3, 0.9, -0.9, 0.3]
    """
    i = np.arange(len(values), dtype=np.float64)
    slope, intercept = np.polyfit(i, values, 1)
    return values - (intercept + slope * i)


def fluctuations(values: np.ndarray, relative: bool) -> tuple[float, float]:
    """``(size, memory)`` of one window: the residuals' standard deviation (over the window's mean
    if ``relative``) and their sample autocorrelation at lag 1 (NaN for residuals all 0).

    Example:
        >>> size, memory = fluctuations(np.array([2.0, 4.0, 2.0, 4.0, 2.0, 4.0]), relative=True)
        >>> round(size, 3), round(memory, 3)   # a period-2 flip: memory towards -1
        (0.319, -0.833)
    """
    res = residuals(values)
    size = res.std() / values.mean() if relative else res.std()
    squares = res @ res  # the sample autocorrelation at lag 1 (the residuals' mean is 0)
    return float(size), float(res[:-1] @ res[1:] / squares) if squares > 0 else float("nan")


def sampled(values: np.ndarray, window: int, relative: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, [size, memory] per step)`` every EVERY steps from :data:`START` on, each of the
    ``window`` steps ending there (from step ``window - 1`` on, where a window fits)."""
    first = -(-max(START, window - 1) // EVERY) * EVERY  # the first multiple of EVERY a window fits at
    steps = np.arange(first, len(values), EVERY)
    read = [fluctuations(values[t - window + 1 : t + 1], relative) for t in steps]
    return steps, np.array(read).reshape(-1, 2)


def _readings(run: dict[str, object]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """A run's :func:`sampled` fluctuations per ``(series, window)``: once per run, not per row."""
    loss = (run["loss"].astype(np.float64), True)
    log_norm = (np.log(run["grad_norm"].astype(np.float64)), False)
    return {(s, w): sampled(x, w, rel) for s, (x, rel) in enumerate((loss, log_norm)) for w in WINDOWS}


def _series(
    run: dict[str, object],
    readings: dict[str, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]],
    series: int,
    window: int,
    statistic: int,
    sign: float,
) -> tuple[np.ndarray, np.ndarray]:
    steps, values = readings[run["name"]][(series, window)]
    return steps, sign * values[:, statistic]


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    fit, fresh, strays = split(results)
    lines = page_head(
        "Critical slowing down: the fluctuations of the loss and the gradient norm",
        "`python benchmarks/divergence/slowing_down.py --write`. Over a trailing window, the residuals "
        "of the training loss and of the log gradient norm (before clipping) from their own "
        "least-squares line: their size (the standard deviation; the loss's over its window's mean) "
        f"and their memory (lag-1 autocorrelation). Sampled every {EVERY} steps from step {START} on "
        "(once the window fits), read as a rise and as a fall; a warning once past the bound for 2 "
        "samples in a row (before the divergence, for the diverging runs).",
        fit,
        fresh,
        strays,
        ("series", "statistic", "window (steps)", "towards trouble", "fitted bound (set by)"),
    )
    readings = {r["name"]: _readings(r) for r in fit + fresh}
    for s, series in enumerate(SERIES):
        for k, statistic in enumerate(STATISTICS):
            for window in WINDOWS:
                for sign, way in ((1.0, "rises"), (-1.0, "falls")):
                    read = partial(
                        _series, readings=readings, series=s, window=window, statistic=k, sign=sign
                    )
                    scored, _ = fitted_and_scored(fit, fresh, read, START, sign)
                    lines.append(f"| {series} | {statistic} | {window} | {way} | {scored} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("slowing_down", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
