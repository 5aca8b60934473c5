"""One fused read of many parameters' gradients as they are now (:class:`GradSums`): every source's reads."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..compat import rank_part
from ..step.sums import Runs, sparse_sq_sum, sq_sums

__all__ = ["GradSums"]


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
    plans afresh, looking at every gradient again). ``part`` maps a gradient to the tensor to
    read (the part this rank holds: a DTensor's shard, say; None: the gradient itself);
    ``attr`` is the attribute that holds it (``grad``; DeepSpeed's ``BF16_Optimizer``
    accumulates in ``_hp_grad``).

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
        part: Callable[[torch.Tensor], torch.Tensor] | None = rank_part,
        seqs: Iterator[int] | None = None,
        attr: str = "grad",
    ) -> None:
        self.params = params
        self.attr = attr
        self.layer_of = layer_of
        self.device = device
        self.part = part
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
        if self.part is not None:
            present = [self.part(g) for g in present]
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
            runs=Runs(ids, seq=next(self._seqs), device=self.device),
            sparse=tuple(k for k, g in enumerate(present) if g.is_sparse),
            complex_=tuple(k for k, i in enumerate(slots) if self._complex[i]),
        )
