"""Clocks and the own-code timer: what the runner and the approaches time themselves with."""

import statistics
import time
from collections.abc import Callable
from typing import Any


def now_s() -> float:
    """Wall seconds (``time.perf_counter``)."""
    return time.perf_counter()


def cpu_s() -> float:
    """CPU seconds of the calling thread: own-code time that other jobs on the machine do not inflate."""
    return time.thread_time()


def median(xs: Any) -> float:
    """The median, NaN for no samples.

    Example:
        >>> median([3.0, 1.0, 2.0]), median([])
        (2.0, nan)
    """
    return statistics.median(xs) if xs else float("nan")


class SelfTimer:
    """Seconds spent inside an approach's own code, per site; safe across threads (list.append).

    Example:
        >>> t = SelfTimer()
        >>> t.add("hook", 0.5); t.add("hook", 0.25)
        >>> t.take(), t.take()
        ({'hook': 0.75}, {'hook': 0})
    """

    def __init__(self) -> None:
        self.sites: dict[str, list[float]] = {}

    def add(self, site: str, dt: float) -> None:
        self.sites.setdefault(site, []).append(dt)

    def take(self) -> dict[str, float]:
        out = {k: sum(v) for k, v in self.sites.items()}
        for v in self.sites.values():
            v.clear()
        return out


class Profiling:
    """Process-wide switch: wrap instrumented sites in ``record_function`` while profiling."""

    on = False


def timed(fn: Callable, timer: SelfTimer, site: str, samples: list[float] | None = None) -> Callable:
    """``fn`` timed into ``timer`` under ``site`` (CPU) and ``wall::site``; each call's CPU
    seconds also go to ``samples`` when given, except under the profiler (which inflates them).

    Example:
        >>> t, calls = SelfTimer(), []
        >>> timed(lambda x: 2 * x, t, "double", calls)(21)
        42
        >>> sorted(t.take()), len(calls)
        (['double', 'wall::double'], 1)
    """
    import torch

    def wrapper(*a, **kw):  # noqa: ANN002, ANN003
        t, w = cpu_s(), now_s()
        try:
            if Profiling.on:
                with torch.profiler.record_function(site):
                    return fn(*a, **kw)
            return fn(*a, **kw)
        finally:
            dt = cpu_s() - t
            timer.add(site, dt)
            timer.add("wall::" + site, now_s() - w)  # includes blocking waits (and preemption)
            if samples is not None and not Profiling.on:
                samples.append(dt)

    return wrapper
