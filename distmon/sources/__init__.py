"""Sources of measurements: where distmon reads each rank's local and reduced gradients.

A source (:class:`~distmon.sources.base.Source`) is built (and checked) before anything is
installed, bound to the step tracker that receives its sums (``begin_backward``,
``add_local``, ``add_reduced``, ``end_backward``, ``fail``), then installed and, at close,
removed. It names the process group its ranks
reduce over (None for a single process), which is where the monitor's own collective runs,
that group's size, ``shard_ranks`` (the ranks whose shards make up one reduced gradient, for
a sharded model; None when every rank holds all of it), ``reads_in_backward`` (whether
what it reads still carries a loss scale) and ``divide_factor_set`` (the reduction is not
the ranks' mean).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .ddp import DDPSource
from .fsdp import FSDPSource, is_fsdp
from .local import LocalSource

__all__ = ["DDPSource", "FSDPSource", "LocalSource", "source_for"]


def source_for(
    model: torch.nn.Module, comm_hook: Callable | None, comm_state: Any
) -> DDPSource | FSDPSource | LocalSource:
    """The source that measures ``model``, or a ``TypeError`` saying what is supported.

    A DDP model is measured in its comm hook, an FSDP2 model (``fully_shard``) around its
    reduce-scatters and in its sharded gradients; a plain module only in a single process (no
    ``torch.distributed``, or a world of one), where its gradients are the ones the optimizer
    sees.

    Example:
        >>> type(source_for(torch.nn.Linear(2, 2), None, None)).__name__
        'LocalSource'
    """
    if isinstance(model, DistributedDataParallel):
        return DDPSource(model, comm_hook, comm_state)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"distmon: GradMonitor needs a torch.nn.Module, got {type(model).__name__}")
    if is_fsdp(model):
        if comm_hook is not None:
            raise TypeError("distmon: comm_hook is a DDP option; an FSDP model has no DDP comm hook")
        return FSDPSource(model)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        raise TypeError(
            f"distmon: GradMonitor on {world} ranks needs a DistributedDataParallel model, got "
            f"{type(model).__name__} (or an FSDP2 fully_shard model; a plain module is measured only "
            "in a single process)"
        )
    if comm_hook is not None:
        raise TypeError("distmon: comm_hook is a DDP option; a single-process module has no comm hook")
    return LocalSource(model)
