"""Every private name of distmon the benchmark touches, in one place.

The benchmark times distmon's own code from outside (no distmon file is edited) by wrapping
its internal entry points, and reads a few internal objects (the state it keeps, its error
count, its export schedule). These are private names: when distmon's internals are renamed or
restructured, this module is the one to re-point. Where a name is gone, that site is not
timed and is reported so (``SizeInfo.uninstrumented``, asserted empty by
``tests/test_benchmark_smoke.py``); the end-to-end numbers do not depend on it.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from .measure import SelfTimer, timed


def instrument(mon: Any, timer: SelfTimer, export_times: list[float]) -> list[str]:
    """Time distmon's internal entry points into ``timer``; returns the sites that could not be.

    Instance attributes shadow the methods; the comm hook, the forward and tensor hooks, the
    autograd callbacks and the optimizer hooks look them up at call time. Sites:
    ``distmon::local_sums`` (with distmon's comm hook, its own work on each bucket: nothing on
    most, the local gradients' read on the last one, or a read of every bucket where ``p.grad``
    is the bucket; with DDP's own reduction, the forward hook, the tensor hook where backward
    begins and the local read where it ends), ``distmon::reduced_sums`` (the read of the reduced
    gradients after DDP's backward), ``distmon::before_step`` /
    ``distmon::after_step`` (the optimizer step hooks), ``periodic::distmon::export`` (the
    export, nested in ``after_step``; each call's CPU seconds also go to ``export_times``),
    ``background::publisher`` (the export thread).
    """
    uninstrumented: list[str] = []
    tr = getattr(mon, "_schedule", None)
    source = getattr(tr, "source", None)
    local = ("on_bucket", "_arm", "_backward_begins", "_before_ddp_finalize")
    sites = [(a, "distmon::local_sums") for a in local] + [("_read_reduced", "distmon::reduced_sums")]
    for attr, site in sites:
        if hasattr(source, attr):
            setattr(source, attr, timed(getattr(source, attr), timer, site))
        else:
            uninstrumented.append(attr)
    # The export (every export_every steps: totals and detectors over the rows since the last
    # one, host copy) runs inside after_step on few of the timed steps, so a median step hides
    # it: every export outside the profiler is timed here, and its mean is amortized.
    if hasattr(tr, "export"):
        tr.export = timed(tr.export, timer, "periodic::distmon::export", export_times)
    for attr, site in (("before_step", "distmon::before_step"), ("after_step", "distmon::after_step")):
        if hasattr(tr, attr):
            setattr(tr, attr, timed(getattr(tr, attr), timer, site))
        else:
            uninstrumented.append(site.split("::")[1])
    # host thread: decode + exporters (not on the training thread; reported apart)
    thread = getattr(mon, "_export", None)
    if hasattr(thread, "_export"):
        thread._export = timed(thread._export, timer, "background::publisher")
    else:
        uninstrumented.append("publisher")
    return uninstrumented


def kept_state(mon: Any) -> Any:
    """What distmon keeps between steps (walked for the kept-state column): its step schedule."""
    return getattr(mon, "_schedule", None)


def error_count(mon: Any) -> int:
    """Errors distmon caught and counted (an AttributeError here means the counter moved: update
    this file rather than report no errors)."""
    return mon._run.errors.count


def exports_next_step(mon: Any) -> bool:
    """Whether distmon's next step is an export step (which copies to the host by design)."""
    tr = mon._schedule
    return (tr.step + 1) % tr.export_every == 0


def activation_watch(mon: Any) -> Any:
    """distmon's forward activation hooks (``activations=True``), switched on and off by hand in
    ``benchmarks/activation_overhead.py``."""
    return mon._schedule.activations


@contextlib.contextmanager
def own_reduction() -> Iterator[None]:
    """Monitors built inside leave DDP's own reduction alone on gloo too (no comm hook: distmon's
    path on NCCL), so that a CPU run can time it."""
    from distmon.sources import ddp

    added = "gloo" not in ddp.HOOKLESS_BACKENDS
    ddp.HOOKLESS_BACKENDS.add("gloo")
    try:
        yield
    finally:
        if added:
            ddp.HOOKLESS_BACKENDS.discard("gloo")
