"""What the object handed to ``GradMonitor`` is: a DDP or FSDP2 model, a DeepSpeed engine, a pipeline
stage, under ``torch.compile``'s or Lightning Fabric's wrapper; the job's process group.

Never imports FSDP2, DeepSpeed or Lightning: a model of their kind means the job imported them.
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compat import pipeline_stage_base, uncompiled

if TYPE_CHECKING:  # for annotations only: imported where used
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ..compat import PipelineStage

__all__ = [
    "is_fsdp",
    "is_deepspeed",
    "unwrapped",
    "peeled",
    "trained_module",
    "process_group",
    "enclosing",
    "pipeline_stage",
    "LIGHTNING_DEEPSPEED",
]


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a submodule was passed to FSDP2's ``fully_shard`` (never imports FSDP).

    Example:
        >>> is_fsdp(torch.nn.Linear(2, 2))
        False
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be an FSDPModule
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


# Why a DeepSpeed engine that Lightning drives is refused (Lightning runs DeepSpeed on CUDA GPUs only)
LIGHTNING_DEEPSPEED = (
    "Lightning's DeepSpeed strategy (Trainer(strategy='deepspeed...'), Fabric(strategy='deepspeed')) "
    "runs only on CUDA GPUs (Lightning refuses the CPU), where distmon's DeepSpeed support has not been "
    "verified under Lightning yet. distmon measures DeepSpeed exactly on its own (GradMonitor(engine, "
    "optimizer) after deepspeed.initialize), under the Hugging Face Trainer and under accelerate; "
    "Lightning's DDP and FSDP strategies are measured as usual: use one of those, or DeepSpeed "
    "outside Lightning"
)


def is_deepspeed(model: object) -> bool:
    """Whether ``model`` is a DeepSpeed engine (``deepspeed.initialize``'s; never imports DeepSpeed).

    Example:
        >>> is_deepspeed(torch.nn.Linear(2, 2))
        False
    """
    engine = sys.modules.get("deepspeed.runtime.engine")  # not imported: no model can be an engine
    return engine is not None and isinstance(model, engine.DeepSpeedEngine)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under ``torch.compile``'s wrapper and Lightning Fabric's (``fabric.setup``'s
    ``_FabricModule``, whose ``_forward_module`` is the DDP or FSDP model); never imports Lightning.

    Example:
        >>> net = torch.nn.Linear(2, 2); unwrapped(torch.compile(net)) is net
        True
    """
    return peeled(model)[0]


def peeled(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """:func:`unwrapped`'s model, and whether a ``torch.compile`` wrapper was among those peeled."""
    compiled = False
    for _ in range(8):  # wrappers of wrappers, but never a cycle
        inner = uncompiled(model)
        compiled |= inner is not model
        forward = getattr(inner, "_forward_module", None)
        if type(inner).__name__ != "_FabricModule" or not isinstance(forward, torch.nn.Module):
            return inner, compiled
        model = forward
    return model, compiled


def trained_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameters the optimizer steps: DDP's or a DeepSpeed engine's ``.module``,
    else the model itself (under ``torch.compile``'s and Lightning Fabric's wrappers).

    Example:
        >>> net = torch.nn.Linear(2, 2); trained_module(torch.compile(net)) is net
        True
    """
    stage = pipeline_stage(model)
    model = unwrapped(stage.submod if stage is not None else model)
    if isinstance(model, DistributedDataParallel) or is_deepspeed(model):
        return uncompiled(model.module)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"distmon: GradMonitor needs a torch.nn.Module, got {type(model).__name__}")
    return model


def process_group(job: object = None) -> dist.ProcessGroup | None:
    """The group of the job the monitor measures, where its ranks agree: ``job`` (the ``job_group=``
    option, given as a process group), else the default group (None in one process).

    Whatever the model, the job is the default group: a DDP or FSDP model on some of its ranks is
    one part of it (a pipeline stage, a data-parallel slice). Known before any option is
    validated, so that a rank whose options fail still meets the others there.

    Example:
        >>> process_group() is None   # no torch.distributed here
        True
    """
    if isinstance(job, dist.ProcessGroup):
        return job if job.size() > 1 else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def enclosing(model: object) -> torch.nn.Module | PipelineStage | DeepSpeedEngine:
    """The ``PipelineStage``, DDP model or DeepSpeed engine that holds ``model``, when ``model`` is
    what such a wrapper holds (a stage's module, plain, DDP- or FSDP2-wrapped; DDP's or the
    engine's ``.module``); else ``model``.

    Users hand over what they have next to the optimizer (torchtitan's ``model_parts``, the
    unwrapped model a Hugging Face callback gets): distmon measures it as if the wrapper had been
    passed, found among the live objects (one pass over them, at construction: only while
    ``torch.distributed.pipelining`` is in use, or for a module that is no DDP or FSDP2 model or
    DeepSpeed engine on several ranks).

    Example:
        >>> net = torch.nn.Linear(2, 2); enclosing(net) is net   # nothing holds it
        True
    """
    if pipeline_stage(model) is not None or not isinstance(model, torch.nn.Module):
        return model
    inner = unwrapped(model)
    stages = pipeline_stage_base()
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    wrapped = isinstance(inner, DistributedDataParallel) or is_fsdp(inner) or is_deepspeed(inner)
    plain = several and not wrapped
    if stages is None and not plain:
        return model
    # DDP, DeepSpeed engines and PipelineStage objects are tracked by the collector: one pass over
    # every tracked object, comparing types only (a set lookup: ~0.1 s per million objects)
    engine = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    holders = [DistributedDataParallel] + ([engine] if engine is not None else [])
    kinds = _subclasses(stages) if stages is not None else set()
    for cls in holders if plain else ():
        kinds |= _subclasses(cls)
    found: list[object] = []
    for obj in [obj for obj in gc.get_objects() if type(obj) in kinds]:
        if pipeline_stage(obj) is not None:
            held = uncompiled(obj.submod)
            if held is inner or (
                isinstance(held, DistributedDataParallel) and uncompiled(held.module) is inner
            ):
                found.append(obj)
        elif uncompiled(obj.module) is inner:
            found.append(obj)
    staged = [obj for obj in found if pipeline_stage(obj) is not None]
    if len(staged) > 1 or (not staged and len(found) > 1):
        raise ValueError(
            f"distmon: {len(staged) or len(found)} {'PipelineStages' if staged else 'wrappers'} hold "
            "the module passed to GradMonitor: pass the one that trains it"
        )
    return (staged or found or [model])[0]


def _subclasses(cls: type) -> set[type]:
    """``cls`` and every class derived from it, as defined now."""
    out, todo = {cls}, [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def pipeline_stage(model: object) -> PipelineStage | None:
    """The ``torch.distributed.pipelining`` stage ``model`` is (its ``.submod`` is measured), or None."""
    base = pipeline_stage_base()  # None when pipelining was never imported
    return model if base is not None and isinstance(model, base) else None
