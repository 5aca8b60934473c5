"""One process, no data parallelism: the gradients the optimizer sees, read when it steps.

Without a reduction there is nothing to hook in backward: the local gradient *is* the
reduced one. The source reads every tracked ``p.grad`` once, when the step's figures are
first needed (the optimizer's step pre-hook, ``clip_grad_norm_`` or a guard), in one fused
pass on the device, after any gradient accumulation, and hands the sums to the tracker on
both sides. One pass per step instead of DDP's two, and no hook inside backward at all.
With a ``GradScaler`` the read may come before or after ``scaler.unscale_``: the scaler's
own record of that tells the tracker whether to divide the scale out. A fixed
``loss_scale`` has no such record, so it is refused for a single process.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from ..grouping import Grouping
from ..sums import Runs, sparse_sq_sum, sq_sums
from .base import Receiver, first_device

__all__ = ["LocalSource", "GradSums"]


class GradSums:
    """Sums of squares of the tracked parameters' ``.grad`` as they are now: one fused pass.

    Parameters without a gradient are left out (their layers get 0); the run set of each
    combination of parameters with a gradient is made once. ``local`` maps a gradient to the
    tensor to read (a DTensor's local shard, say).

    Example:
        >>> net = torch.nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward()
        >>> runs, sums = GradSums(list(net.parameters()), [0, 0], torch.device("cpu")).read()
        >>> runs.layer_ids, [float(s) for s in sums]
        ((0, 0), [2.0, 1.0])
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layer_of: list[int],
        device: torch.device,
        local: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
        seqs: Iterator[int] | None = None,
    ) -> None:
        self.params = params
        self.layer_of = layer_of
        self.device = device
        self.local = local
        self._runs: dict[tuple[int, ...], Runs] = {}
        # run sets folded together must not share a seq: a source with run sets of its own shares its count
        self._seqs = seqs if seqs is not None else itertools.count()

    def read(self) -> tuple[Runs, list[torch.Tensor]] | None:
        """The runs and sums of the gradients present now, or None when no parameter has one."""
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not present:
            return None
        grads = [self.local(self.params[i].grad) for i in present]
        dense = [torch.view_as_real(g) if g.is_complex() else g for g in grads if not g.is_sparse]
        dense_sums = iter(sq_sums(dense) if dense else ())
        sums = [sparse_sq_sum(g) if g.is_sparse else next(dense_sums) for g in grads]
        key = tuple(present)
        runs = self._runs.get(key)
        if runs is None:
            ids = tuple(self.layer_of[i] for i in present)
            runs = self._runs[key] = Runs(
                ids,
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                seq=next(self._seqs),
            )
        return runs, sums


class LocalSource:
    """Measurements of a plain ``nn.Module`` trained by one process (no ``torch.distributed`` needed).

    Example:
        >>> from distmon.grouping import build_grouping
        >>> net = torch.nn.Linear(2, 2)
        >>> source = LocalSource(net, receiver=None, grouping=build_grouping(net, None, 8))
        >>> source.world_size, source.group
        (1, None)
    """

    reads_in_backward = False  # gradients are read at the step, possibly already unscaled
    shard_ranks = None
    divide_factor_set = False

    def __init__(self, module: torch.nn.Module, *, receiver: Receiver, grouping: Grouping) -> None:
        self.module = module
        self.group = None  # one process: the monitor's "collective" is a local copy
        self.world_size = 1
        self.device = first_device(module)
        self.receiver = receiver
        self._grads = GradSums(list(grouping.params), list(grouping.param_layer), self.device)
        self._n_layers = len(grouping.layers)

    def install(self) -> None:
        # model order is the only order there is without a backward hook: NaN attribution
        # names the first non-finite layer in model order
        self.receiver.set_layer_order([float(i) for i in range(self._n_layers)])

    def remove(self) -> None:
        """Nothing was registered: the gradients are read when the step begins."""

    def read_at_step(self) -> None:
        """One fused pass over the tracked gradients, handed over as both local and reduced sums."""
        receiver = self.receiver
        try:
            read = self._grads.read()
            if read is None:
                return  # no gradient at all: nothing measured, the step is invalid
            runs, sums = read
            receiver.begin_backward()
            receiver.add_local(runs, sums)
            receiver.add_reduced(runs, sums)
            receiver.end_backward(scaled=receiver.grads_unscaled() is not True)
        except Exception:
            receiver.fail("gradient read (single process)")
