"""Sources of measurements: where distmon reads each rank's local and reduced gradients.

A source (:class:`~distmon.sources.base.Source`) is built with the
:class:`~distmon.sources.base.Receiver` its hooks hand their sums to, and refuses in its
constructor what it cannot measure; nothing is installed until :meth:`install`. DDP is
measured in its comm hook (``ddp.py``), FSDP2 around its reduce-scatters and in its sharded
gradients (``fsdp.py``), a DeepSpeed engine where DeepSpeed holds each gradient
(``deepspeed.py``), a single process's module when the optimizer steps (``local.py``).
Lightning Fabric's module wrapper is seen through: its ``_forward_module`` is the model.

``fsdp.py`` imports FSDP2 and DTensor (about 2 s), ``deepspeed.py`` DeepSpeed (about 4 s): each
is imported only for a model of its kind, which means the job imported that library already.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..grouping import Grouping
from ..layout import counts, declared_group, spec_of
from .base import COMPILED_AUTOGRAD, Receiver, Source, compiled_autograd_on, first_device, uncompiled
from .ddp import CommHook, DDPSource, ddp_parameters
from .local import LocalSource

__all__ = [
    "Source",
    "Receiver",
    "CommHook",
    "source_for",
    "process_group",
    "trained_module",
    "is_fsdp",
    "is_deepspeed",
    "first_device",
    "uncompiled",
    "pipeline_stage",
    "CompositeSource",
    "PipelineSource",
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
    "Lightning's DDP and FSDP strategies are measured as usual"
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
    return _peeled(model)[0]


def _peeled(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
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


def _ddp_is_the_job(ddp: DistributedDataParallel, *, declared: bool) -> bool:
    """Whether DDP is the whole job, every rank holding the whole reduced gradient; not when it is
    one dimension of a larger one: tensor-parallel parameters it localized, parameters it leaves
    to the model's own code (experts), parameters the user ``declared`` replicated over a group."""
    ignored = bool(getattr(ddp, "parameters_to_ignore", None))
    return not (declared or ignored or any(map(spec_of, ddp.module.parameters())))


def process_group(model: torch.nn.Module, *, declared: bool = False) -> dist.ProcessGroup | None:
    """The group the ranks of ``model``'s job agree over: DDP's own when DDP is the whole job, else
    the job's (None in one process); ``declared``: ``replicated_over=`` was given.

    Known from the model's type alone, before any option is read, so that a rank whose options
    fail still meets the others there.

    Example:
        >>> process_group(torch.nn.Linear(2, 2)) is None   # no torch.distributed here
        True
    """
    if pipeline_stage(model) is None:
        model = unwrapped(model)
        if isinstance(model, DistributedDataParallel) and _ddp_is_the_job(model, declared=declared):
            return model.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def pipeline_stage(model: object) -> object | None:
    """The ``torch.distributed.pipelining`` stage ``model`` is (its ``.submod`` is measured), or None."""
    pipelining = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(pipelining, "_PipelineStageBase", None)
    return model if base is not None and isinstance(model, base) else None


class _Wrapping:
    """A source built around another: it reduces, groups and counts as ``inner`` does, and reads
    what ``inner`` reads (subclasses add to it)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.module, self.group, self.world_size = inner.module, inner.group, inner.world_size
        self.device, self.partial, self.counted = inner.device, inner.partial, inner.counted
        self.divide_factor_set = inner.divide_factor_set
        self.dp_rank, self.meshes = inner.dp_rank, inner.meshes

    def install(self) -> None:
        self.inner.install()

    def remove(self) -> None:
        self.inner.remove()

    def read_at_step(self) -> None:
        self.inner.read_at_step()

    def read_pending(self) -> None:
        self.inner.read_pending()


class CompositeSource(_Wrapping):
    """A data-parallel source and a reader of the parameters it does not reduce (``alongside``)."""

    def __init__(self, primary: Source, extra: Source) -> None:
        super().__init__(primary)
        self.extra = extra

    def install(self) -> None:
        super().install()
        try:
            self.extra.install()
        except BaseException:
            super().remove()
            raise

    def remove(self) -> None:
        self.extra.remove()
        super().remove()

    def read_at_step(self) -> None:
        super().read_at_step()
        self.extra.read_at_step()

    def read_pending(self) -> None:
        super().read_pending()
        self.extra.read_pending()


class PipelineSource(_Wrapping):
    """A pipeline stage's source: the gradients its schedule divides by the micro-batch count when
    the step's backwards are done (``stage.scale_grads``) are what the optimizer steps with, so the
    sums taken before are divided alike, and what is left to read is read after it."""

    def __init__(self, inner: Source, stage: object, receiver: Receiver) -> None:
        super().__init__(inner)
        self.stage, self.receiver = stage, receiver
        self._scale: Callable[[int], None] | None = None

    def install(self) -> None:
        super().install()
        inner_scale = self.stage.scale_grads

        def scale_grads(grad_scale_factor: int) -> None:
            inner_scale(grad_scale_factor)
            try:
                if grad_scale_factor != 1:
                    self.receiver.rescale(1.0 / grad_scale_factor)
                self.inner.read_pending()
            except Exception:
                self.receiver.fail("pipeline stage gradient scale")

        self.stage.scale_grads = self._scale = scale_grads

    def remove(self) -> None:
        if self._scale is not None and vars(self.stage).get("scale_grads") is self._scale:
            del self.stage.scale_grads
        super().remove()


def _undeclared(name: str, world: int) -> ValueError:
    return ValueError(
        f"distmon: parameter {name!r} is reduced by no DDP or FSDP wrapper and is no DTensor, on a "
        f"{world}-rank job: distmon cannot tell which ranks hold copies of its gradient. Declare the "
        f"group over which the model's own code makes it identical: GradMonitor(..., "
        f"replicated_over={{r'<name pattern>': process_group}}) (a group of one rank: its gradient "
        f"is this rank's own)"
    )


def _counted(
    grouping: Grouping,
    *,
    declared: dict[str, dist.ProcessGroup],
    covered: set[int] | None,
    replicated_rank: int | None,
    alone: bool,
    mesh: object | None = None,
) -> list[bool]:
    """Per tracked parameter: whether this rank's part of its reduced gradient counts in the job's.

    ``covered``: ids of the parameters a DDP wrapper replicates over its group (``replicated_rank``
    is this rank's rank there); a parameter outside it must be a DTensor or declared, unless
    this rank is ``alone`` with its parameters (a pipeline stage of one rank).
    """
    out = []
    for name, p in zip(grouping.param_names, grouping.params):
        match = declared_group(name, declared)
        if match is not None:
            out.append(counts(p, replicated_rank=match[1].rank()))
        elif covered is not None and id(p) in covered:
            out.append(counts(p, replicated_rank=replicated_rank, mesh=mesh))
        elif spec_of(p) is not None or alone:
            out.append(counts(p))
        else:
            raise _undeclared(name, dist.get_world_size())
    return out


def source_for(
    model: torch.nn.Module,
    *,
    receiver: Receiver,
    grouping: Grouping,
    comm_hook: CommHook | None = None,
    comm_state: object = None,
    replicated_over: dict[str, dist.ProcessGroup] | None = None,
    stage: object | None = None,
) -> Source:
    """The source that measures ``model``, or an error saying what is supported and the way out.

    A DDP model is measured in its comm hook, an FSDP2 model (``fully_shard``) around its
    reduce-scatters and in its sharded gradients, anything else when each backward ends: a
    single process's module; on several ranks, tensor-parallel DTensors, a pipeline ``stage``'s
    module, parameters declared ``replicated_over`` a group. Where a rank holds a part of the
    reduced gradient (shards, a stage, a copy counted elsewhere) the source is *partial*. A
    pipeline ``stage``'s source is wrapped in :class:`PipelineSource` by the caller.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from distmon.grouping import build_grouping
        >>> type(source_for(net, receiver=None, grouping=build_grouping(net, None, 8))).__name__
        'LocalSource'
    """
    fabric = type(model).__name__ == "_FabricModule"
    model, compiled = _peeled(model)  # torch.compile(model), Fabric: the module they wrap is measured
    if stage is not None:
        model = uncompiled(stage.submod)
    if compiled_autograd_on() or getattr(model, "_use_python_reducer", False):
        raise ValueError(f"distmon: {COMPILED_AUTOGRAD}")
    if is_deepspeed(model):
        if fabric:
            raise ValueError(f"distmon: {LIGHTNING_DEEPSPEED}")
        if comm_hook is not None or replicated_over:
            raise TypeError(
                "distmon: comm_hook= and replicated_over= are DDP and layout options; a DeepSpeed "
                "engine reduces its gradients itself (distmon reads DeepSpeed's own partitions)"
            )
        from .deepspeed import DeepSpeedSource

        return DeepSpeedSource(model, receiver=receiver, grouping=grouping)
    declared = dict(replicated_over or {})
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(model, DistributedDataParallel):
        reduced_by_ddp = {id(p) for p in ddp_parameters(model)}
        tracked = {id(p) for p in grouping.params}
        if not reduced_by_ddp <= tracked:
            raise ValueError(
                "distmon: some parameters DDP reduces are not the model's parameters any more: "
                "DDP(device_mesh=...) with tensor parallelism turns them into plain DTensor "
                "attributes on the first forward (torch's TP support in DDP). Build GradMonitor "
                "before the first forward"
            )
        outside = [p for p in grouping.params if id(p) not in reduced_by_ddp]
        if stage is None and not outside and _ddp_is_the_job(model, declared=bool(declared)):
            return DDPSource(
                model,
                receiver=receiver,
                grouping=grouping,
                comm_hook=comm_hook,
                comm_state=comm_state,
                compiled=compiled,
            )
        counted = _counted(
            grouping,
            declared=declared,
            covered=reduced_by_ddp,
            replicated_rank=model.process_group.rank(),
            alone=False,
            mesh=getattr(model, "device_mesh", None),
        )
        ddp = DDPSource(
            model,
            receiver=receiver,
            grouping=grouping,
            comm_hook=comm_hook,
            comm_state=comm_state,
            counted=counted,
        )
        if not outside:
            return ddp
        extra = LocalSource(
            model.module,
            receiver=receiver,
            grouping=grouping,
            counted=counted,
            params=outside,
            alongside=True,
        )
        return CompositeSource(ddp, extra)
    trained_module(model)  # a TypeError for what is no module
    if comm_hook is not None:
        raise TypeError("distmon: comm_hook is a DDP option; only a DDP model has a DDP comm hook")
    if is_fsdp(model):
        from .fsdp import FSDPSource

        counted = _counted(grouping, declared=declared, covered=None, replicated_rank=None, alone=False)
        return FSDPSource(model, receiver=receiver, grouping=grouping, counted=counted)
    if world == 1:
        return LocalSource(model, receiver=receiver, grouping=grouping)
    alone = stage is not None and getattr(stage, "group_size", 0) == world  # one rank per stage
    if stage is None and not declared and not any(map(spec_of, grouping.params)):
        raise TypeError(
            f"distmon: GradMonitor on {world} ranks got a plain {type(model).__name__}: nothing reduces "
            "its gradients over the ranks, so each rank would train, and be measured, alone. Wrap the "
            "model first (DistributedDataParallel(model), or fully_shard(model)) and build GradMonitor "
            "after wrapping, with the wrapped model. If a framework wraps it for you, it was not told to "
            "train distributed: on a machine without a GPU the Hugging Face Trainer and accelerate need "
            "--use_cpu (TrainingArguments(use_cpu=True)), Lightning strategy='ddp'. Tensor-parallel "
            "DTensor parameters and pipeline stages are measured as they are (docs/layouts.md)"
        )
    counted = _counted(grouping, declared=declared, covered=None, replicated_rank=None, alone=alone)
    return LocalSource(model, receiver=receiver, grouping=grouping, counted=counted)
