"""One process, no data parallelism: the gradients the optimizer would step with, before clipping.

Without a reduction the local gradient *is* the reduced one. The source reads every tracked
``p.grad`` in one fused pass on the device when a backward ends (an autograd callback queued
by the first gradient accumulated in that backward), and hands the sums over as both local
and reduced. Read then, not when the optimizer steps, because frameworks clip between the two
(Lightning, the HF Trainer, accelerate's ``clip_grad_norm_``): the global norm means the same
in one process as on many ranks, the gradient before clipping. With gradient accumulation
each backward reads the gradients accumulated so far, and the last one before the step is
what the step reports (one pass per micro-batch). The read is in loss-scaled units (before
``scaler.unscale_``); a fixed ``loss_scale`` is refused for a single process.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..compat import local_tensor, queue_callback
from ..grouping import Grouping
from ..sums import Runs, sparse_sq_sum, sq_sums
from .base import COMPILED_AUTOGRAD, OrderLearner, Receiver, first_device, in_compiled_autograd

__all__ = ["LocalSource", "GradSums"]


def _refuse_partial(params: Sequence[torch.nn.Parameter]) -> None:
    """Raise for a gradient placed as a partial sum (tensor parallelism's ``SequenceParallel``
    norms without FSDP): its local sum of squares is not its own, and torch reduces it only
    inside the optimizer step, where distmon does not look."""
    for p in params:
        placements = getattr(p.grad, "placements", ())
        if any(pl.is_partial() for pl in placements):
            raise ValueError(
                "distmon: a gradient is a partial sum over a tensor-parallel dimension (a replicated "
                "parameter under SequenceParallel, without FSDP): its local sum of squares is not its "
                "own, and torch reduces it only inside the optimizer step. Shard the model with "
                "fully_shard over the data-parallel dimension (which reduces it), as torchtitan does"
            )


@dataclass(frozen=True)
class _ReadPlan:
    """How the gradients of one combination of present parameters are read (made once)."""

    runs: Runs  # the layer of each present gradient, in order
    sparse: tuple[int, ...]  # positions (among the present) of sparse gradients: coalesced apart
    complex_: tuple[int, ...]  # positions of complex gradients: read as their real views


class GradSums:
    """Sums of squares of the tracked parameters' ``.grad`` as they are now: one fused pass.

    Parameters without a gradient are left out (their layers get 0). What each combination of
    present gradients needs (its run set, which gradients are sparse or complex) is planned once
    and cached, so an ordinary read is the list of gradients and one fused call: nothing per
    parameter but fetching its ``.grad``. A read that raises drops its plan (the next read
    plans afresh, looking at every gradient again). ``local`` maps a gradient to the tensor to
    read (a DTensor's local shard, say; None: the gradient itself); ``attr`` is the attribute
    that holds it (``grad``; DeepSpeed's ``BF16_Optimizer`` accumulates in ``_hp_grad``).

    Example:
        >>> net = torch.nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward()
        >>> runs, sums = GradSums(list(net.parameters()), [0, 0], torch.device("cpu")).read()
        >>> runs.layer_ids, [round(float(s), 5) for s in sums]   # fp32 (one ulp apart before torch 2.11)
        ((0, 0), [2.0, 1.0])
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layer_of: list[int],
        device: torch.device,
        local: Callable[[torch.Tensor], torch.Tensor] | None = local_tensor,
        seqs: Iterator[int] | None = None,
        attr: str = "grad",
    ) -> None:
        self.params = params
        self.attr = attr
        self.layer_of = layer_of
        self.device = device
        self.local = local
        self._complex = [p.is_complex() for p in params]  # a gradient has its parameter's dtype
        self._plans: dict[tuple[int, ...] | None, _ReadPlan] = {}  # None: every parameter present
        self._placements_checked = False
        # run sets folded together must not share a seq: a source with run sets of its own shares its count
        self._seqs = seqs if seqs is not None else itertools.count()

    def read(self) -> tuple[Runs, list[torch.Tensor]] | None:
        """The runs and sums of the gradients present now, or None when no parameter has one."""
        attr = self.attr  # .grad read as such: the common case stays one attribute fetch per parameter
        if attr == "grad":
            grads = [p.grad for p in self.params]
        else:
            grads = [getattr(p, attr, None) for p in self.params]
        present = [g for g in grads if g is not None]
        if not present:
            return None
        key = None if len(present) == len(grads) else tuple(i for i, g in enumerate(grads) if g is not None)
        if self.local is not None:
            present = [self.local(g) for g in present]
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(key, present)
        try:
            return plan.runs, self._sums(plan, present)
        except Exception:
            del self._plans[key]  # a gradient's layout changed (dense to sparse?): plan afresh next time
            raise

    @staticmethod
    def _sums(plan: _ReadPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for i in plan.complex_:
            grads[i] = torch.view_as_real(grads[i])
        sparse = plan.sparse
        if not sparse:
            return sq_sums(grads)
        dense = [g for i, g in enumerate(grads) if i not in sparse]
        dense_sums = iter(sq_sums(dense) if dense else ())
        return [sparse_sq_sum(g) if i in sparse else next(dense_sums) for i, g in enumerate(grads)]

    def _plan(self, key: tuple[int, ...] | None, present: list[torch.Tensor]) -> _ReadPlan:
        slots = range(len(self.params)) if key is None else key
        if not self._placements_checked:
            self._placements_checked = True
            _refuse_partial([self.params[i] for i in slots])
        ids = tuple(self.layer_of[i] for i in slots)
        return _ReadPlan(
            runs=Runs(ids, torch.tensor(ids, dtype=torch.int64, device=self.device), seq=next(self._seqs)),
            sparse=tuple(k for k, g in enumerate(present) if g.is_sparse),
            complex_=tuple(k for k, i in enumerate(slots) if self._complex[i]),
        )


class LocalSource:
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
        >>> from distmon.grouping import build_grouping
        >>> net = torch.nn.Linear(2, 2)
        >>> source = LocalSource(net, receiver=None, grouping=build_grouping(net, None, 8))
        >>> source.world_size, source.group, source.partial
        (1, None, False)
    """

    divide_factor_set = False
    local_figures = True

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        receiver: Receiver,
        grouping: Grouping,
        counted: Sequence[bool] | None = None,
        params: Sequence[torch.nn.Parameter] | None = None,
        alongside: bool = False,
    ) -> None:
        self.module = module
        self.partial, self.counted = counted is not None, counted
        # one process: no collective; several: the job's default group, where every rank is
        self.group = dist.group.WORLD if self.partial else None
        self.world_size = dist.get_world_size() if self.partial else 1
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
        self._n_layers = len(grouping.layers)
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
