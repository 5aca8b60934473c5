"""Which source measures the object handed over (:func:`source_for`), and the sources built around
another: a data-parallel source with a reader of what it does not reduce (:class:`CompositeSource`),
a pipeline stage's (:class:`PipelineSource`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compat import uncompiled
from ..layout.grouping import Grouping
from ..step.backward import BackwardSums
from .base import Source
from .ddp import CommHook, DDPSource, ddp_parameters
from .models import is_deepspeed, is_fsdp, peeled
from .plain import PlainSource
from .reading import LayoutReading

if TYPE_CHECKING:  # for annotations only: imported where used
    from ..compat import PipelineStage

__all__ = ["source_for", "CompositeSource", "PipelineSource"]


class _Wrapping:
    """A source built around another: it reduces, groups and counts as ``inner`` does, and reads
    what ``inner`` reads (subclasses add to it)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.module, self.group, self.world_size = inner.module, inner.group, inner.world_size
        self.device, self.in_parts, self.counted = inner.device, inner.in_parts, inner.counted
        self.divide_factor_set, self.local_figures = inner.divide_factor_set, inner.local_figures
        self.whole_grads = inner.whole_grads
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

    def __init__(self, inner: Source, stage: PipelineStage, receiver: BackwardSums) -> None:
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


def source_for(
    model: torch.nn.Module,
    *,
    receiver: BackwardSums,
    grouping: Grouping,
    reading: LayoutReading,
    comm_hook: CommHook | None = None,
    comm_state: object = None,
    stage: PipelineStage | None = None,
    counted: tuple[bool, ...] | None = None,
) -> Source:
    """The source that measures ``model``, or an error saying what is supported and the way out.

    A DDP model is measured in its comm hook, an FSDP2 model (``fully_shard``) around its
    reduce-scatters and in its sharded gradients, anything else when each backward ends: a
    single process's module (an FSDP2 model in a world of one among them: FSDP2 reduce-scatters
    nothing there and hands each gradient whole to its post-accumulate-grad hooks); on several
    ranks, tensor-parallel DTensors, a pipeline ``stage``'s module, parameters declared
    ``replicated_over`` or ``distinct_over`` a group. Which parts count are the model's
    ``reading`` (:func:`read_layout`), or ``counted``, the job's (:mod:`distmon.layout.census`).
    Where a rank holds a part of the reduced gradient (shards, a stage, a copy counted elsewhere)
    the source measures a layout *in parts*. A pipeline ``stage``'s source is wrapped in
    :class:`PipelineSource` by the caller.

    Example:
        >>> from distmon.layout.grouping import build_grouping
        >>> net = torch.nn.Linear(2, 2); grouping = build_grouping(net, None, 8)
        >>> from distmon.sources.reading import read_layout
        >>> reading = read_layout(net, grouping=grouping)
        >>> type(source_for(net, receiver=None, grouping=grouping, reading=reading)).__name__
        'PlainSource'
    """
    counted = reading.counted if counted is None else counted
    model, compiled = peeled(model)  # torch.compile(model), Fabric: the module they wrap is measured
    if stage is not None:
        model = uncompiled(stage.submod)
    if is_deepspeed(model):
        if comm_hook is not None:
            raise TypeError(
                "distmon: comm_hook= is a DDP option; a DeepSpeed engine reduces its gradients itself "
                "(distmon reads DeepSpeed's own partitions): leave comm_hook= out"
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
        extra = PlainSource(
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
        extra = PlainSource(
            model, receiver=receiver, grouping=grouping, counted=counted, params=fsdp.outside, alongside=True
        )
        return CompositeSource(fsdp, extra)
    if world == 1:
        return PlainSource(model, receiver=receiver, grouping=grouping)
    return PlainSource(model, receiver=receiver, grouping=grouping, counted=counted)
