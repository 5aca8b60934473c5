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
    ``errors``, ``valid``: four floats whatever the number of layers.

    Example:
        >>> f = RankFields(3, rank_layers=True)
        >>> f.width, f.valid, f.totals([[1.0, 4.0, 4.0, 0.0, 1.0]])
        (5, 4, [9.0])
    """

    def __init__(self, n_layers: int, rank_layers: bool) -> None:
        self.n_layer_cols = n_layers if rank_layers else 0
        names = ("errors", "valid") if rank_layers else ("total_sq", "first_nonfinite", "errors", "valid")
        col = {name: self.n_layer_cols + i for i, name in enumerate(names)}
        self.total_sq: int | None = col.get("total_sq")
        self.first_nonfinite: int | None = col.get("first_nonfinite")
        self.errors, self.valid = col["errors"], col["valid"]
        self.width = self.n_layer_cols + len(names)

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
        self._sent_meta: tuple[int, bool] | None = None  # (errors, valid) now in the send buffer
        self._work: dist.Work | None = None

    def pack(self, layer_order: torch.Tensor, errors: int, valid: bool) -> None:
        """Fill the send buffer's per-rank fields after the last bucket (device ops only)."""
        f = self.fields
        if f.total_sq is not None and f.first_nonfinite is not None:
            torch.sum(self.layer_sq, 0, keepdim=True, out=self.send[f.total_sq : f.total_sq + 1])
            sums.first_nonfinite(self.layer_sq, layer_order, self.send[f.first_nonfinite])
        if self._sent_meta != (errors, valid):
            self.send[f.errors].fill_(errors)
            self.send[f.valid].fill_(1.0 if valid else 0.0)
            self._sent_meta = (errors, valid)

    def invalidate(self, errors: int) -> None:
        """Send a row that says "no figures from this rank this step" (after a local failure)."""
        self.send.zero_()
        if self.fields.first_nonfinite is not None:
            self.send[self.fields.first_nonfinite].fill_(-1.0)
        self.send[self.fields.errors].fill_(errors)
        self._sent_meta = (errors, False)

    def issue(self, out: torch.Tensor) -> None:
        """Start the all-gather into ``out`` (world x width floats, flat); waits any earlier one."""
        self.wait()
        self._work = dist.all_gather_single(out, self.send, group=self.group, async_op=True)

    def wait(self) -> bool:
        """Complete the pending gather (a stream wait on NCCL); True if there was one."""
        work, self._work = self._work, None
        if work is None:
            return False
        work.wait()
        return True
