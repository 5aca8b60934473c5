"""When a run diverged, from its own training loss alone (never from any monitor).

A run diverges at the first step whose cross-entropy is non-finite, or that starts a stretch
of ``window`` steps whose mean cross-entropy exceeds ``factor`` times the lowest mean of any
earlier stretch of ``window`` steps, its own cross-entropy exceeding that too (once ``after``
steps have passed, so the fall from ``ln 256`` at the start is not judged): a lasting rise of
the loss above its best, by 30% at the defaults, not one noisy batch. The definition looks
``window`` steps ahead: it is a verdict on a finished recording, not a detector.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FACTOR = 1.3
WINDOW = 20
AFTER = 50


def divergence_step(
    loss: Sequence[float], *, factor: float = FACTOR, window: int = WINDOW, after: int = AFTER
) -> int | None:
    """The step the run diverged at (index into ``loss``), or None.

    Example:
        >>> divergence_step([3.0, 2.0, 1.0, 1.1] + [2.0] * 10, window=2, after=0)
        4
        >>> divergence_step([3.0, 2.0, 1.0, 2.0, 1.0, 1.0], window=2, after=0) is None   # one bad batch
        True
        >>> divergence_step([3.0, 2.0, 1.0, float("nan")], window=2, after=0)
        3
    """
    x = np.asarray(loss, np.float64)
    bad = ~np.isfinite(x)
    first_bad = int(np.argmax(bad)) if bad.any() else len(x)
    n = first_bad - window + 1  # windows [t, t + window) of finite losses
    if n > 0:
        means = np.convolve(x[:first_bad], np.ones(window) / window, mode="valid")
        best = np.minimum.accumulate(means)  # best[s]: the lowest mean of windows starting at <= s
        t = np.arange(max(after, window), n)
        bar = factor * best[t - window]  # against windows that end before t
        hit = (means[t] > bar) & (x[t] > bar)  # the stretch starts with a loss over the bar itself
        if hit.any():
            return int(t[np.argmax(hit)])
    return first_bad if first_bad < len(x) else None
