"""Sources of measurements: where distmon reads each rank's local and reduced gradients.

A source is built (and checked) before anything is installed, bound to the step tracker
that receives its sums (``begin_backward``, ``add_local``, ``add_reduced``, ``end_backward``,
``fail``), then installed and, at close, removed. It names the process group its ranks
reduce over, which is where the monitor's own collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .ddp import DDPSource

__all__ = ["DDPSource", "source_for"]


def source_for(model: torch.nn.Module, comm_hook: Callable | None, comm_state: Any) -> DDPSource:
    """The source that measures ``model``, or a ``TypeError`` saying what is supported.

    Example:
        >>> source_for(torch.nn.Linear(2, 2), None, None)
        Traceback (most recent call last):
        ...
        TypeError: distmon: GradMonitor needs a DistributedDataParallel model, got Linear ...
    """
    if isinstance(model, DistributedDataParallel):
        return DDPSource(model, comm_hook, comm_state)
    raise TypeError(
        f"distmon: GradMonitor needs a DistributedDataParallel model, got {type(model).__name__} "
        "(FSDP and single-process training are not supported yet)"
    )
