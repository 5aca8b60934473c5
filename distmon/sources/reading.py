"""How the object handed over reads the layout: per parameter, whether this rank's part of its
reduced gradient counts in the job's figures (:func:`read_layout`), before the job confirms it
(:mod:`distmon.layout.census`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compat import compiled_autograd_on, ddp_python_reducer, spec_of
from ..layout.grouping import Grouping
from ..layout.placements import copy_reason, declared_group
from .base import COMPILED_AUTOGRAD
from .ddp import ddp_parameters
from .models import LIGHTNING_DEEPSPEED, is_deepspeed, is_fsdp, trained_module, unwrapped

if TYPE_CHECKING:  # for annotations only: imported where used
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ..compat import PipelineStage

__all__ = ["LayoutReading", "read_layout"]


def _ddp_is_the_job(ddp: DistributedDataParallel, *, declared: bool, job_size: int) -> bool:
    """Whether DDP is the whole job, every rank holding the whole reduced gradient: its group has
    every rank of the job; not when it is one dimension of a larger one: a pipeline stage's
    data-parallel ranks, tensor-parallel parameters it localized, parameters it leaves to the
    model's own code (experts), parameters the user ``declared`` (replicated or distinct) over a
    group."""
    ignored = bool(getattr(ddp, "parameters_to_ignore", None))
    return ddp.process_group.size() == job_size and not (
        declared or ignored or any(map(spec_of, ddp.module.parameters()))
    )


@dataclass(frozen=True)
class LayoutReading:
    """How the object passed reads the layout: per tracked parameter (the grouping's order), whether
    this rank's part of its reduced gradient counts in the job's figures, before the job confirms
    it (:mod:`distmon.layout.census`).

    ``why``: "" where it counts, else why it is taken for a copy counted on another rank;
    ``declared``: matched by ``replicated_over=`` or ``distinct_over=``; ``undeclared``: reduced by no
    wrapper, no DTensor, not declared (counted here: this rank's own, unless other ranks hold it
    too); ``whole``: DDP over the whole job, on whose every rank the reduced gradient is whole;
    ``plain``: the refusal of a plain module on several ranks, should other ranks hold its
    parameters.
    """

    counted: tuple[bool, ...]
    why: tuple[str, ...]
    declared: tuple[bool, ...]
    undeclared: tuple[bool, ...]
    whole: bool = False
    plain: str | None = None


def _plain_module(model: torch.nn.Module, world: int) -> str:
    return (
        f"distmon: GradMonitor on {world} ranks got a plain {type(model).__name__}: nothing reduces "
        "its gradients over the ranks, so each rank would train, and be measured, alone. Wrap the "
        "model first (DistributedDataParallel(model), or fully_shard(model)) and build GradMonitor "
        "after wrapping, with the wrapped model. If a framework wraps it for you, it was not told to "
        "train distributed: on a machine without a GPU the Hugging Face Trainer and accelerate need "
        "--use_cpu (TrainingArguments(use_cpu=True)), Lightning strategy='ddp'. Tensor-parallel "
        "DTensor parameters and pipeline stages are measured as they are (docs/layouts.md)"
    )


def _parts(
    grouping: Grouping,
    *,
    replicated_over: dict[str, dist.ProcessGroup],
    distinct_over: dict[str, dist.ProcessGroup],
    ddp: DistributedDataParallel | None,
    covered: set[int],
) -> list[tuple[bool, str, bool, bool]]:
    """Per tracked parameter: (counted, why it is a copy, declared, undeclared).

    ``covered``: ids of the parameters ``ddp`` replicates over its group; a parameter outside it
    that is no DTensor and not declared is ``undeclared``.
    """
    out = []
    for name, p in zip(grouping.param_names, grouping.params):
        match = declared_group(name, replicated_over)
        apart = declared_group(name, distinct_over)
        distinct = dist.get_process_group_ranks(apart[1]) if apart is not None else ()
        # a part counts on the first of its copies by every account: its placements, its
        # wrapper's group (DDP's), the group declared over which the model's code copies it
        reasons = []
        if match is not None:
            group = (match[1].rank(), f"the replicated_over group of {match[0]!r}")
            reasons.append(copy_reason(p, replicated=group, distinct=distinct))
        if ddp is not None and id(p) in covered:
            mesh = getattr(ddp, "device_mesh", None)
            group = (ddp.process_group.rank(), "DDP's process group")
            reasons.append(copy_reason(p, replicated=group, mesh=mesh, distinct=distinct))
        elif match is None and (spec_of(p) is not None or apart is not None):
            reasons.append(copy_reason(p, distinct=distinct))
        if not reasons:
            out.append((True, "", False, True))
            continue
        why = next((r for r in reasons if r), "")
        out.append((not why, why, match is not None or apart is not None, False))
    return out


def _engine_reading(
    engine: DeepSpeedEngine,
    grouping: Grouping,
    *,
    fabric: bool,
    declared: bool,
    job: dist.ProcessGroup | None,
) -> LayoutReading:
    """A DeepSpeed engine's reading: its data-parallel group is the job (DeepSpeed's tensor and
    pipeline parallelism are refused), so every rank holds each dense parameter, counted on rank
    0, and DeepSpeed MoE declares its experts distinct over their expert-parallel group itself."""
    if fabric:
        raise ValueError(f"distmon: {LIGHTNING_DEEPSPEED}")
    if declared or (job is not None and job is not dist.group.WORLD):
        raise TypeError(
            "distmon: replicated_over=, distinct_over= and job_group= are layout options; a DeepSpeed "
            "engine says its layout itself (its data-parallel group is the job, its MoE experts carry "
            "their expert-parallel group): leave them out"
        )
    from .deepspeed import engine_counts

    counted, why, experts = (tuple(c) for c in zip(*engine_counts(engine, grouping.params)))
    return LayoutReading(counted, why, experts, (False,) * len(counted))


def read_layout(
    model: torch.nn.Module,
    *,
    grouping: Grouping,
    replicated_over: dict[str, dist.ProcessGroup] | None = None,
    distinct_over: dict[str, dist.ProcessGroup] | None = None,
    stage: PipelineStage | None = None,
    job: dist.ProcessGroup | None = None,
) -> LayoutReading:
    """What ``model`` (or the pipeline ``stage``'s module) says about where each of its gradients
    lives, or an error saying what cannot be measured and the way out (``job``: the job's group,
    ``job_group=``; None: the default group).

    Example:
        >>> from distmon.layout.grouping import build_grouping
        >>> net = torch.nn.Linear(2, 2)
        >>> read_layout(net, grouping=build_grouping(net, None, 8)).counted
        (True, True)
    """
    fabric = type(model).__name__ == "_FabricModule"
    model = unwrapped(stage.submod if stage is not None else model)
    if compiled_autograd_on() or ddp_python_reducer(model):
        raise ValueError(f"distmon: {COMPILED_AUTOGRAD}")
    replicated_over, distinct_over = dict(replicated_over or {}), dict(distinct_over or {})
    declared = bool(replicated_over or distinct_over)
    if is_deepspeed(model):
        return _engine_reading(model, grouping, fabric=fabric, declared=declared, job=job)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    job_size = job.size() if job is not None else world
    n = len(grouping.params)
    ddp = model if isinstance(model, DistributedDataParallel) else None
    if job is not None and job is not dist.group.WORLD and job_size < world:
        if ddp is None or stage is not None or not _ddp_is_the_job(ddp, declared=declared, job_size=job_size):
            raise ValueError(
                "distmon: job_group= makes a group of some ranks a job of its own (several independent "
                "jobs sharing one default process group); distmon measures such a job when it is one "
                "DistributedDataParallel model over exactly that group: pass that DDP model, or leave "
                "job_group out to measure the whole job"
            )
    if ddp is not None:
        covered = {id(p) for p in ddp_parameters(ddp)}
        if not covered <= {id(p) for p in grouping.params}:
            raise ValueError(
                "distmon: some parameters DDP reduces are not the model's parameters any more: "
                "DDP(device_mesh=...) with tensor parallelism turns them into plain DTensor "
                "attributes on the first forward (torch's TP support in DDP). Build GradMonitor "
                "before the first forward"
            )
        inside = all(id(p) in covered for p in grouping.params)
        if stage is None and inside and _ddp_is_the_job(ddp, declared=declared, job_size=job_size):
            rank = ddp.process_group.rank()
            why = f"rank {rank} of DDP's process group (its rank 0 counts it)" if rank else ""
            return LayoutReading((not why,) * n, (why,) * n, (False,) * n, (False,) * n, whole=True)
        parts = _parts(
            grouping, replicated_over=replicated_over, distinct_over=distinct_over, ddp=ddp, covered=covered
        )
    else:
        trained_module(model)  # a TypeError for what is no module
        if world == 1 and not is_fsdp(model):
            return LayoutReading((True,) * n, ("",) * n, (False,) * n, (False,) * n)
        parts = _parts(
            grouping, replicated_over=replicated_over, distinct_over=distinct_over, ddp=None, covered=set()
        )
    plain = None
    if (
        ddp is None
        and stage is None
        and not declared
        and not is_fsdp(model)
        and not any(map(spec_of, grouping.params))
    ):
        plain = _plain_module(model, world)
    counted, why, decl, undeclared = (tuple(column) for column in zip(*parts)) if parts else ((),) * 4
    return LayoutReading(counted, why, decl, undeclared, plain=plain)
