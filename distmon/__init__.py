"""distmon: an always-on gradient monitor for distributed PyTorch training.

Three lines in a DDP training script::

    import distmon
    model = DDP(net, ...)
    mon = distmon.GradMonitor(model, optimizer)   # wraps DDP's comm hook, hooks optimizer.step
    ...                                            # the training loop is unchanged
    snap = mon.latest()   # newest Snapshot (None before the first export)
    mon.flush()           # publish every finished step now (may sync; tests, end of training)
    mon.close()           # or: with distmon.GradMonitor(model, optimizer) as mon: ...

Metrics are served to Prometheus at ``http://127.0.0.1:9290/metrics`` by global rank 0 by
default. Public names: :class:`GradMonitor`, :class:`Snapshot`, :class:`AnomalyEvent`,
:class:`DetectorConfig` (detector thresholds), :class:`GradientAnomalyError` (``guard="raise"``).
"""

from ._version import __version__
from .detectors import DetectorConfig
from .monitor import GradientAnomalyError, GradMonitor
from .snapshot import AnomalyEvent, Snapshot

__all__ = ["GradMonitor", "Snapshot", "AnomalyEvent", "DetectorConfig", "GradientAnomalyError", "__version__"]
