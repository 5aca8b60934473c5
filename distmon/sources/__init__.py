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

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compat import compiled_autograd_on, ddp_python_reducer, pipeline_stage_base, spec_of, uncompiled
from ..grouping import Grouping
from ..layout import copy_reason, declared_group
from .base import COMPILED_AUTOGRAD, Receiver, Source, first_device
from .ddp import CommHook, DDPSource, ddp_parameters
from .local import LocalSource

__all__ = [
    "Source",
    "Receiver",
    "CommHook",
    "source_for",
    "read_layout",
    "Reading",
    "process_group",
    "enclosing",
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


def enclosing(model: object) -> object:
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


def pipeline_stage(model: object) -> object | None:
    """The ``torch.distributed.pipelining`` stage ``model`` is (its ``.submod`` is measured), or None."""
    base = pipeline_stage_base()  # None when pipelining was never imported
    return model if base is not None and isinstance(model, base) else None


class _Wrapping:
    """A source built around another: it reduces, groups and counts as ``inner`` does, and reads
    what ``inner`` reads (subclasses add to it)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.module, self.group, self.world_size = inner.module, inner.group, inner.world_size
        self.device, self.partial, self.counted = inner.device, inner.partial, inner.counted
        self.divide_factor_set, self.local_figures = inner.divide_factor_set, inner.local_figures
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
    """A data-parallel source (DDP, FSDP2) and a reader of the parameters it does not reduce
    (``alongside``: parameters the model's own code reduces after backward)."""

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


@dataclass(frozen=True)
class Reading:
    """How the object passed reads the layout: per tracked parameter (the grouping's order), whether
    this rank's part of its reduced gradient counts in the job's figures, before the job confirms
    it (:mod:`distmon.census`).

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
    engine: object, grouping: Grouping, *, fabric: bool, declared: bool, job: dist.ProcessGroup | None
) -> Reading:
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
    return Reading(counted, why, experts, (False,) * len(counted))


def read_layout(
    model: torch.nn.Module,
    *,
    grouping: Grouping,
    replicated_over: dict[str, dist.ProcessGroup] | None = None,
    distinct_over: dict[str, dist.ProcessGroup] | None = None,
    stage: object | None = None,
    job: dist.ProcessGroup | None = None,
) -> Reading:
    """What ``model`` (or the pipeline ``stage``'s module) says about where each of its gradients
    lives, or an error saying what cannot be measured and the way out (``job``: the job's group,
    ``job_group=``; None: the default group).

    Example:
        >>> from distmon.grouping import build_grouping
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
            return Reading((not why,) * n, (why,) * n, (False,) * n, (False,) * n, whole=True)
        parts = _parts(
            grouping, replicated_over=replicated_over, distinct_over=distinct_over, ddp=ddp, covered=covered
        )
    else:
        trained_module(model)  # a TypeError for what is no module
        if world == 1 and not is_fsdp(model):
            return Reading((True,) * n, ("",) * n, (False,) * n, (False,) * n)
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
    return Reading(counted, why, decl, undeclared, plain=plain)


def source_for(
    model: torch.nn.Module,
    *,
    receiver: Receiver,
    grouping: Grouping,
    comm_hook: CommHook | None = None,
    comm_state: object = None,
    replicated_over: dict[str, dist.ProcessGroup] | None = None,
    distinct_over: dict[str, dist.ProcessGroup] | None = None,
    stage: object | None = None,
    reading: Reading | None = None,
    counted: tuple[bool, ...] | None = None,
) -> Source:
    """The source that measures ``model``, or an error saying what is supported and the way out.

    A DDP model is measured in its comm hook, an FSDP2 model (``fully_shard``) around its
    reduce-scatters and in its sharded gradients, anything else when each backward ends: a
    single process's module (an FSDP2 model in a world of one among them: FSDP2 reduce-scatters
    nothing there and hands each gradient whole to its post-accumulate-grad hooks); on several
    ranks, tensor-parallel DTensors, a pipeline ``stage``'s module, parameters declared
    ``replicated_over`` or ``distinct_over`` a group. Which parts count are the model's
    ``reading`` (:func:`read_layout`), or ``counted``, the job's (:mod:`distmon.census`). Where a
    rank holds a part of the reduced gradient (shards, a stage, a copy counted elsewhere) the
    source is *partial*. A pipeline ``stage``'s source is wrapped in :class:`PipelineSource` by
    the caller.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from distmon.grouping import build_grouping
        >>> type(source_for(net, receiver=None, grouping=build_grouping(net, None, 8))).__name__
        'LocalSource'
    """
    if reading is None:
        reading = read_layout(
            model,
            grouping=grouping,
            replicated_over=replicated_over,
            distinct_over=distinct_over,
            stage=stage,
        )
    counted = reading.counted if counted is None else counted
    model, compiled = _peeled(model)  # torch.compile(model), Fabric: the module they wrap is measured
    if stage is not None:
        model = uncompiled(stage.submod)
    if is_deepspeed(model):
        if comm_hook is not None:
            raise TypeError(
                "distmon: comm_hook= is a DDP option; a DeepSpeed engine reduces its gradients itself "
                "(distmon reads DeepSpeed's own partitions)"
            )
        from .deepspeed import DeepSpeedSource

        return DeepSpeedSource(model, receiver=receiver, grouping=grouping)
    if isinstance(model, DistributedDataParallel):
        if reading.whole and counted == reading.counted:
            return DDPSource(
                model,
                receiver=receiver,
                grouping=grouping,
                comm_hook=comm_hook,
                comm_state=comm_state,
                compiled=compiled,
            )
        ddp = DDPSource(
            model,
            receiver=receiver,
            grouping=grouping,
            comm_hook=comm_hook,
            comm_state=comm_state,
            counted=counted,
        )
        reduced = {id(p) for p in ddp_parameters(model)}
        outside = [p for p in grouping.params if id(p) not in reduced]
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
    if comm_hook is not None:
        raise TypeError("distmon: comm_hook is a DDP option; only a DDP model has a DDP comm hook")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if is_fsdp(model) and world > 1:  # in a world of one FSDP2 reduce-scatters nothing: one process
        from .fsdp import FSDPSource

        fsdp = FSDPSource(model, receiver=receiver, grouping=grouping, counted=counted)
        if not fsdp.outside:
            return fsdp
        # parameters FSDP2 was told to ignore: the model's own code reduces them after backward
        extra = LocalSource(
            model, receiver=receiver, grouping=grouping, counted=counted, params=fsdp.outside, alongside=True
        )
        return CompositeSource(fsdp, extra)
    if world == 1:
        return LocalSource(model, receiver=receiver, grouping=grouping)
    return LocalSource(model, receiver=receiver, grouping=grouping, counted=counted)
