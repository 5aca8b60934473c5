"""Gradients no data-parallel wrapper reduces (a plain module): read when each backward ends.

One process, and on several ranks tensor-parallel DTensors, a pipeline stage's module,
parameters the model's own code reduces: the gradients the optimizer would step with, before
clipping.

Without a reduction the local gradient *is* the reduced one. The source reads every tracked
``p.grad`` in one fused pass on the device when a backward ends (an autograd callback queued
by the first gradient accumulated in that backward), and hands the sums over as both local
and reduced. Read then, not when the optimizer steps, because frameworks clip between the two
(Lightning, the HF Trainer, accelerate's ``clip_grad_norm_``): the global norm means the same
in one process as on many ranks, the gradient before clipping. With gradient accumulation
each backward reads the gradients accumulated so far, and the last one before the step is
what the step reports (one pass per micro-batch). The read is in loss-scaled units (before
``scaler.unscale_``), divided by the loss scale in force (``scaler=``, ``loss_scale=``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..compat import queue_callback
from ..layout.grouping import Grouping
from ..step.backward import BackwardSums
from ..step.sums import Runs
from .base import COMPILED_AUTOGRAD, OrderLearner, first_device, in_compiled_autograd
from .grad_sums import GradSums

__all__ = ["PlainSource"]


class PlainSource:
    """Gradients no data-parallel wrapper reduces, read when each backward ends.

    A single process's module (no ``torch.distributed`` needed): local and reduced are the same
    gradient. On several ranks (``counted`` given: tensor parallelism without a data-parallel
    wrapper, a pipeline stage of its own, parameters the model's own code reduces over a group
    the user declared), each rank's gradient is its part: its local figures are all of it, and
    the job's reduced figures add up the parts it counts (the rest are copies counted elsewhere).
    ``alongside`` a DDP source (parameters DDP leaves to the model's own code, experts say), it
    reads their local gradients when each backward ends, before that code reduces them after
    backward (Megatron's and DeepSpeed's way; a reduction inside backward is read as local), and
    their reduced ones when the optimizer step begins, after it (no later clipping is known to
    it); both are added to the DDP backward's sums at the step.

    Example:
        >>> from distmon.layout.grouping import build_grouping
        >>> net = torch.nn.Linear(2, 2)
        >>> source = PlainSource(net, receiver=None, grouping=build_grouping(net, None, 8))
        >>> source.world_size, source.group, source.in_parts
        (1, None, False)
    """

    divide_factor_set = False
    local_figures = True

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        receiver: BackwardSums,
        grouping: Grouping,
        counted: Sequence[bool] | None = None,
        params: Sequence[torch.nn.Parameter] | None = None,
        alongside: bool = False,
    ) -> None:
        self.module = module
        self.in_parts, self.counted = counted is not None, counted
        self.whole_grads = not self.in_parts
        # one process: no collective; several: the job's default group, where every rank is
        self.group = dist.group.WORLD if self.in_parts else None
        self.world_size = dist.get_world_size() if self.in_parts else 1
        self.device = first_device(module)
        self.receiver = receiver
        self.alongside = alongside
        self.dp_rank, self.meshes = 0, ()
        chosen = {id(p) for p in params} if params is not None else None
        slots = [i for i, p in enumerate(grouping.params) if chosen is None or id(p) in chosen]
        self._params = [grouping.params[i] for i in slots]
        layer_of, seqs = list(grouping.param_layer), itertools.count()  # one fold: distinct seqs
        self._grads = GradSums(self._params, [layer_of[i] for i in slots], self.device, seqs=seqs)
        kept = [i for i in slots if counted is None or counted[i]]
        # the reduced side: the parts this rank counts (all of them in one process)
        self._counted = (
            None
            if len(kept) == len(slots)
            else GradSums(
                [grouping.params[i] for i in kept], [layer_of[i] for i in kept], self.device, seqs=seqs
            )
        )
        self._order = OrderLearner(
            self._params,
            [layer_of[i] for i in slots],
            len(grouping.layers),
            lambda order: self.receiver.set_layer_order(order),
        )
        self._handles: list[RemovableHandle] = []
        self._queued = False  # this backward's end is awaited
        self._local_read: tuple[Runs, list[torch.Tensor]] | None = None  # alongside: the last backward's

    def install(self) -> None:
        if not self.alongside:  # alongside DDP, DDP's source learns the order of every layer
            self._order.install()  # NaN attribution names the first non-finite layer in backward order
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def remove(self) -> None:
        self._order.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def read_at_step(self) -> None:
        """Alongside DDP: hand over the local sums the step's last backward left, and read the
        reduced gradients the model's own code made (else nothing: the gradients were read when
        the step's last backward ended)."""
        if not (self.alongside and self.receiver.active):
            return
        receiver, local, self._local_read = self.receiver, self._local_read, None
        try:
            counted = (self._counted or self._grads).read()
            if local is not None:
                receiver.add_local(*local)
            elif counted is not None:  # gradients no backward accumulated: no local figure
                receiver.local_unmeasured()
            if counted is not None:
                receiver.add_reduced(*counted)
        except Exception:
            receiver.fail("gradient read (parameters the model reduces)")

    def read_pending(self) -> None:
        """Nothing is left: every backward's end was awaited in autograd."""

    def _accumulated(self, param: torch.Tensor) -> None:
        """A gradient was accumulated: the first of a backward asks to read them all at its end."""
        if self._queued or not self.receiver.active:
            return
        try:
            if in_compiled_autograd():
                raise RuntimeError(f"distmon: {COMPILED_AUTOGRAD}")
            queue_callback(self._backward_done)
            self._queued = True
        except Exception:
            self.receiver.fail("gradient read (single process)")

    def _backward_done(self) -> None:
        """One fused pass over the tracked gradients: the local sums, and the counted ones as reduced."""
        self._queued = False
        receiver = self.receiver
        try:
            read = self._grads.read()
            if self.alongside:  # before the model's own reduction; handed over at the step
                self._local_read = read
                return
            if read is None:
                return  # no gradient at all: nothing measured, the step is invalid
            counted = read if self._counted is None else self._counted.read()
            receiver.begin_backward()
            receiver.add_local(*read)
            if counted is not None:
                receiver.add_reduced(*counted)
            receiver.end_backward(scaled=True)  # before scaler.unscale_: in loss-scaled units
        except Exception:
            receiver.fail("gradient read (single process)")
