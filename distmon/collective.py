"""The monitor's one collective per step: every rank's packed local figures, all-gathered.

Reduced gradients are identical on every rank, so global norms need no collective; only the
per-rank (pre-reduction) figures do. They travel in ONE small tensor per step on the
source's process group, issued by the training thread when the optimizer step begins: on
every rank, whatever happened locally (a collective issued on some ranks only would hang the
job), and after the gradient reduction and every collective a user's comm hook issued from
its callbacks have completed (a collective issued while those may still start could be
matched against one of them on another rank, and hang the job).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import sums

__all__ = ["RankGather", "RankFields", "earliest_nonfinite"]


def earliest_nonfinite(values: Sequence[float], order: Sequence[float]) -> int:
    """Host side: index of the non-finite value earliest in backward ``order``, or -1.

    The host twin of :func:`distmon.sums.first_nonfinite`, for figures already on the host.

    Example:
        >>> earliest_nonfinite([1.0, float("nan"), float("inf")], [0.0, 2.0, 1.0])
        2
    """
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    return min(bad, key=order.__getitem__) if bad else -1


class RankFields:
    """Where each per-rank figure sits in one rank's ``width`` floats of the gathered row.

    With ``rank_layers`` a rank sends its per-layer local sums of squares, then ``errors`` and
    ``valid``: its total and first non-finite layer follow from the layer sums, so they are
    derived where read (the detectors at export, the host decoder) instead of computed on every
    step. Without, it sends ``total_sq``, ``first_nonfinite`` (layer index, -1 if none),
    ``errors``, ``valid``: four floats whatever the number of layers. With ``partial`` (a
    sharded model: each rank holds a shard of the reduced gradient) the per-layer sums of
    squares of its shard travel too, right before ``errors``: the reduced figures are their sum
    over a shard group, taken from the same one collective.

    Example:
        >>> f = RankFields(3, rank_layers=True)
        >>> f.width, f.valid, f.totals([[1.0, 4.0, 4.0, 0.0, 1.0]])
        (5, 4, [9.0])
    """

    def __init__(
        self, n_layers: int, rank_layers: bool, partial: bool = False, batch: bool = False, act: bool = False
    ) -> None:
        self.n_layer_cols = n_layers if rank_layers else 0
        self.n_partial = n_layers if partial else 0
        # (name, floats) in send-buffer order; fields of 0 floats are absent (None)
        spec = [
            ("layers", self.n_layer_cols),
            ("total_sq", 0 if rank_layers else 1),
            ("first_nonfinite", 0 if rank_layers else 1),
            ("partial", self.n_partial),
            ("errors", 1),
            ("valid", 1),
            ("batch", 1 if batch else 0),  # the gradient noise scale: this rank's batch this step
            ("act_first", 1 if act else 0),  # activations: the first non-finite module, -1 if none
        ]
        cursor, col = 0, {}
        for name, n in spec:
            col[name] = cursor if n else None
            cursor += n
        first = col["partial"] if col["partial"] is not None else col["errors"]
        self.partial = slice(first, first + self.n_partial)
        self.total_sq: int | None = col["total_sq"]
        self.first_nonfinite: int | None = col["first_nonfinite"]
        self.errors, self.valid = col["errors"], col["valid"]
        self.batch: int | None = col["batch"]
        self.act_first: int | None = col["act_first"]
        self.width = cursor

    def totals(self, ranks: Sequence[Sequence[float]]) -> list[float]:
        """Host side: each rank's local sum of squares from its gathered floats."""
        if self.total_sq is not None:
            return [vals[self.total_sq] for vals in ranks]
        return [sum(vals[: self.n_layer_cols]) for vals in ranks]

    def device_totals(self, gathered: torch.Tensor) -> torch.Tensor:
        """Device side: ``(..., world, width)`` gathered floats -> ``(..., world)`` local sums of squares."""
        if self.total_sq is not None:
            return gathered[..., self.total_sq]
        return gathered[..., : self.n_layer_cols].sum(-1)

    def first_nonfinite_layer(self, vals: Sequence[float], order: Sequence[float]) -> int:
        """Host side: the rank's non-finite layer earliest in backward ``order``, or -1."""
        if self.first_nonfinite is not None:
            return int(vals[self.first_nonfinite])
        return earliest_nonfinite(vals[: self.n_layer_cols], order)


class RankGather:
    """This rank's send buffer and the all-gather of it into a caller-given flat view.

    The tracker folds the local per-layer sums of squares straight into :attr:`layer_sq` (the
    head of the send buffer with ``rank_layers``), so an ordinary step packs nothing else:
    :meth:`pack` writes ``errors``/``valid`` only when they change, plus, without
    ``rank_layers``, the total and first non-finite layer.
    """

    def __init__(
        self, fields: RankFields, n_layers: int, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self.fields = fields
        self.group = group
        self.send = torch.zeros(fields.width, dtype=torch.float32, device=device)
        self.layer_sq = (
            self.send[:n_layers]
            if fields.n_layer_cols
            else torch.zeros(n_layers, dtype=torch.float32, device=device)
        )
        self.partial_sq = self.send[fields.partial]  # a sharded model's reduced sums of its shard
        self._sent_meta: tuple[int, bool, float] | None = None  # (errors, valid, batch) in the buffer
        self._work: dist.Work | None = None

    def pack(self, layer_order: torch.Tensor, errors: int, valid: bool, batch: float = 0.0) -> None:
        """Fill the send buffer's per-rank fields after the last bucket (device ops only)."""
        f = self.fields
        if f.total_sq is not None and f.first_nonfinite is not None:
            torch.sum(self.layer_sq, 0, keepdim=True, out=self.send[f.total_sq : f.total_sq + 1])
            sums.first_nonfinite(self.layer_sq, layer_order, self.send[f.first_nonfinite])
        if self._sent_meta != (errors, valid, batch):
            self.send[f.errors].fill_(errors)
            self.send[f.valid].fill_(1.0 if valid else 0.0)
            if f.batch is not None:
                self.send[f.batch].fill_(batch)
            self._sent_meta = (errors, valid, batch)

    def invalidate(self, errors: int) -> None:
        """Send a row that says "no figures from this rank this step" (after a local failure)."""
        self.send.zero_()
        for index in (self.fields.first_nonfinite, self.fields.act_first):  # -1: none
            if index is not None:
                self.send[index].fill_(-1.0)
        self.send[self.fields.errors].fill_(errors)
        self._sent_meta = (errors, False, 0.0)

    def issue(self, out: torch.Tensor) -> None:
        """Start the all-gather into ``out`` (world x width floats, flat); waits any earlier one.

        Without a process group (one process) the "gather" is a copy of the send buffer. Under
        ``torch.profiler`` the gather is completed before returning: a collective issued inside a
        profiler window and completed after the window closed crashes the process (SIGSEGV in
        torch 2.13 on gloo: the work's profiling callback runs on profiler state being torn down;
        6 of 10 two-rank runs of 200 one-step windows crashed, 0 of 10 with the wait inside), and
        a user's profiler window may close at any step end.
        """
        self.wait()
        if self.group is None:
            out.copy_(self.send)
            return
        self._work = dist.all_gather_single(out, self.send, group=self.group, async_op=True)
        if torch._C._autograd._profiler_enabled():
            self.wait()

    def wait(self) -> bool:
        """Complete the pending gather (a stream wait on NCCL); True if there was one."""
        work, self._work = self._work, None
        if work is None:
            return False
        work.wait()
        return True
