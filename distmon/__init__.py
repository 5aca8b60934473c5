"""distmon: an always-on gradient monitor for distributed PyTorch training.

Three lines in a DDP training script::

    import distmon
    model = DDP(net, ...)
    mon = distmon.GradMonitor(model, optimizer)   # reads DDP's gradients, hooks optimizer.step
    ...                                            # the training loop is unchanged
    snap = mon.latest()   # newest Snapshot (None before the first export)
    mon.flush()           # export every finished step now (may sync; tests, end of training)
    mon.close()           # or: with distmon.GradMonitor(model, optimizer) as mon: ...

Metrics are served to Prometheus at ``http://127.0.0.1:9290/metrics`` by global rank 0 by
default. Public names: :class:`GradMonitor`, :class:`Snapshot`, :class:`AnomalyEvent`,
:class:`DetectorConfig` (detector thresholds), :class:`PrecursorConfig` (the divergence
precursor's settings), :class:`GradientAnomalyError` (``guard="raise"``).

The names are imported on first use, so ``import distmon`` and ``python -m distmon report``
do not import torch. distmon runs on torch 2.6 and newer (complete from 2.9,
:mod:`distmon.compat`); the first use of a public name refuses an older torch with an ImportError.
``DISTMON_DISABLE=1`` makes every ``GradMonitor(...)`` a no-op (docs/options.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:
    from .monitor import GradientAnomalyError, GradMonitor
    from .snapshot import AnomalyEvent, Snapshot
    from .verdicts.detectors import DetectorConfig
    from .verdicts.precursor import PrecursorConfig

__all__ = [
    "GradMonitor",
    "Snapshot",
    "AnomalyEvent",
    "DetectorConfig",
    "PrecursorConfig",
    "GradientAnomalyError",
    "__version__",
]

# public name -> the module that defines it
_LAZY = {
    "GradMonitor": ".monitor",
    "GradientAnomalyError": ".monitor",
    "DetectorConfig": ".verdicts.detectors",
    "PrecursorConfig": ".verdicts.precursor",
    "Snapshot": ".snapshot",
    "AnomalyEvent": ".snapshot",
}


def __getattr__(name: str) -> object:
    """Import a public name's module on first use (PEP 562) and keep the name here."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(".compat", __name__)  # first: refuses an unsupported torch by name
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
