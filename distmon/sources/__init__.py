"""Sources of measurements: where distmon reads each rank's local and reduced gradients.

A source (:class:`~distmon.sources.base.Source`) is built with the
:class:`~distmon.sources.base.Receiver` its hooks hand their sums to, and refuses in its
constructor what it cannot measure; nothing is installed until :meth:`install`. DDP is
measured in its comm hook (``ddp.py``), FSDP2 around its reduce-scatters and in its sharded
gradients (``fsdp.py``), a single process's module when the optimizer steps (``local.py``).

``fsdp.py`` imports FSDP2 and DTensor (about 2 s): it is imported only for a model that is an
FSDP2 model, which means the job imported FSDP2 itself already.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..grouping import Grouping
from .base import COMPILED_AUTOGRAD, Receiver, Source, compiled_autograd_on, first_device, uncompiled
from .ddp import CommHook, DDPSource
from .local import LocalSource

__all__ = [
    "Source",
    "Receiver",
    "CommHook",
    "source_for",
    "process_group",
    "trained_module",
    "is_fsdp",
    "first_device",
    "uncompiled",
]


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a submodule was passed to FSDP2's ``fully_shard`` (never imports FSDP).

    Example:
        >>> is_fsdp(torch.nn.Linear(2, 2))
        False
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be an FSDPModule
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def trained_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameters the optimizer steps: DDP's ``.module``, else the model itself
    (under ``torch.compile``'s wrapper).

    Example:
        >>> net = torch.nn.Linear(2, 2); trained_module(torch.compile(net)) is net
        True
    """
    model = uncompiled(model)
    if isinstance(model, DistributedDataParallel):
        return uncompiled(model.module)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"distmon: GradMonitor needs a torch.nn.Module, got {type(model).__name__}")
    return model


def process_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group the ranks of ``model``'s job agree over: DDP's own, else the job's (None in one process).

    Known from the model's type alone, before any option is read, so that a rank whose options
    fail still meets the others there.

    Example:
        >>> process_group(torch.nn.Linear(2, 2)) is None   # no torch.distributed here
        True
    """
    model = uncompiled(model)
    if isinstance(model, DistributedDataParallel):
        return model.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def source_for(
    model: torch.nn.Module,
    *,
    receiver: Receiver,
    grouping: Grouping,
    comm_hook: CommHook | None = None,
    comm_state: object = None,
) -> Source:
    """The source that measures ``model``, or a ``TypeError`` saying what is supported.

    A DDP model is measured in its comm hook, an FSDP2 model (``fully_shard``) around its
    reduce-scatters and in its sharded gradients; a plain module only in a single process (no
    ``torch.distributed``, or a world of one), where its gradients are the ones the optimizer
    sees.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from distmon.grouping import build_grouping
        >>> type(source_for(net, receiver=None, grouping=build_grouping(net, None, 8))).__name__
        'LocalSource'
    """
    model = uncompiled(model)  # torch.compile(model): the module it compiles is measured
    if compiled_autograd_on() or getattr(model, "_use_python_reducer", False):
        raise ValueError(f"distmon: {COMPILED_AUTOGRAD}")
    if isinstance(model, DistributedDataParallel):
        return DDPSource(
            model, receiver=receiver, grouping=grouping, comm_hook=comm_hook, comm_state=comm_state
        )
    trained_module(model)  # a TypeError for what is no module
    if is_fsdp(model):
        if comm_hook is not None:
            raise TypeError("distmon: comm_hook is a DDP option; an FSDP model has no DDP comm hook")
        from .fsdp import FSDPSource

        return FSDPSource(model, receiver=receiver, grouping=grouping)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        raise TypeError(
            f"distmon: GradMonitor on {world} ranks needs a DistributedDataParallel model, got "
            f"{type(model).__name__} (or an FSDP2 fully_shard model; a plain module is measured only "
            "in a single process)"
        )
    if comm_hook is not None:
        raise TypeError("distmon: comm_hook is a DDP option; a single-process module has no comm hook")
    return LocalSource(model, receiver=receiver, grouping=grouping)
