"""The monitor's collectives: a small fixed-size all-reduce per step, every rank's rows at exports.

Reduced gradients are identical on every rank, so global norms need no collective; only the
per-rank (pre-reduction) figures do, and they are needed only when rows are published. So a
step sends at most one collective, on the source's process group:

- an ordinary step, a SUM all-reduce of a few floats whatever the world size (rank 0's vote
  for a time-bounded export; a sharded model's per-layer sums of its shard, from one replica
  of each shard), or nothing at all when there is nothing to add up;
- an export step, in its place, one all-gather of this rank's rows of every step since the
  last export (kept in a ring of ``export_every`` rows): the same bytes as a gather per step,
  one latency term per export instead of one per step.

Each is issued by the training thread when the optimizer step begins: on every rank,
whatever happened locally (a collective issued on some ranks only would hang the job), and
after the gradient reduction and every collective a user's comm hook issued from its
callbacks have completed (a collective issued while those may still start could be matched
against one of them on another rank, and hang the job).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import sums

__all__ = ["RankExchange", "RankFields", "LaggedVote", "earliest_nonfinite"]


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
    """Where each per-rank figure sits in one rank's ``width`` floats of a step's row.

    With ``rank_layers`` a rank sends its per-layer local sums of squares, then ``errors`` and
    ``valid``: its total and first non-finite layer follow from the layer sums, so they are
    derived where read (the detectors at export, the host decoder) instead of computed on every
    step. Without, it sends ``total_sq``, ``first_nonfinite`` (layer index, -1 if none),
    ``errors``, ``valid``: four floats whatever the number of layers. The row ends with the
    floats the per-step all-reduce adds up (:attr:`reduced`): ``vote`` (rank 0's "export now",
    with a time-bounded export) and, with ``partial`` (a sharded model: each rank holds a shard
    of the reduced gradient), the per-layer sums of squares of its shard, whose sum over one
    shard group is the reduced figures.

    Example:
        >>> f = RankFields(3, rank_layers=True, vote=True)
        >>> f.width, f.valid, f.reduced, f.totals([[1.0, 4.0, 4.0, 0.0, 1.0, 0.0]])
        (6, 4, slice(5, 6, None), [9.0])
    """

    def __init__(
        self,
        n_layers: int,
        rank_layers: bool,
        partial: bool = False,
        batch: bool = False,
        act: bool = False,
        vote: bool = False,
    ) -> None:
        self.n_layer_cols = n_layers if rank_layers else 0
        self.n_partial = n_layers if partial else 0
        # (name, floats) in row order; fields of 0 floats are absent (None)
        spec = [
            ("layers", self.n_layer_cols),
            ("total_sq", 0 if rank_layers else 1),
            ("first_nonfinite", 0 if rank_layers else 1),
            ("errors", 1),
            ("valid", 1),  # this rank's local figures were measured
            ("reduced_ok", 1 if partial else 0),  # its shard of the reduced gradient was measured
            ("batch", 1 if batch else 0),  # the gradient noise scale: this rank's batch this step
            ("act_first", 1 if act else 0),  # activations: the first non-finite module, -1 if none
            ("vote", 1 if vote else 0),  # from here on: what the per-step all-reduce adds up
            ("partial", self.n_partial),
        ]
        cursor, col = 0, {}
        for name, n in spec:
            col[name] = cursor if n else None
            cursor += n
        self.width = cursor
        self.partial = slice(self.width - self.n_partial, self.width)
        self.total_sq: int | None = col["total_sq"]
        self.first_nonfinite: int | None = col["first_nonfinite"]
        self.errors, self.valid = col["errors"], col["valid"]
        self.reduced_ok: int | None = col["reduced_ok"]
        self.batch: int | None = col["batch"]
        self.act_first: int | None = col["act_first"]
        self.vote: int | None = col["vote"]
        self.reduced = slice(self.width - self.n_partial - (1 if vote else 0), self.width)

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


class RankExchange:
    """This rank's row of each step, kept until an export, and the collectives that carry rows.

    :meth:`pack` fills the send row after the last bucket (the tracker folds the local
    per-layer sums straight into :attr:`layer_sq`, its head with ``rank_layers``; ``errors``
    and ``valid`` are written only when they change), :meth:`keep` copies it into the ring of
    ``n_rows`` rows not yet gathered; then :meth:`reduce` (an ordinary step) or :meth:`gather`
    (an export: the kept rows of many steps at once) starts the step's collective, completed
    by :meth:`wait`. Without a process group (one process) nothing is ever issued: the rows are
    this process's own.

    Example:
        >>> ex = RankExchange(RankFields(2, True), 2, n_rows=4, group=None, device=torch.device("cpu"))
        >>> _ = ex.layer_sq.copy_(torch.tensor([1.0, 4.0])); ex.pack(torch.zeros(2), 0, True)
        >>> ex.keep(0); ex.rows[0].tolist()
        [1.0, 4.0, 0.0, 1.0]
    """

    def __init__(
        self,
        fields: RankFields,
        n_layers: int,
        n_rows: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.fields = fields
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        f32 = dict(dtype=torch.float32, device=device)
        self.send = torch.zeros(fields.width, **f32)
        self.layer_sq = self.send[:n_layers] if fields.n_layer_cols else torch.zeros(n_layers, **f32)
        self.partial_sq = self.send[fields.partial]  # a sharded model's reduced sums of its shard
        self.rows = torch.zeros(n_rows, fields.width, **f32)  # kept rows, by ring slot
        self.summed = torch.zeros(fields.reduced.stop - fields.reduced.start, **f32)  # all-reduce buffer
        self._gathered = torch.zeros(self.world * n_rows * fields.width, **f32)
        # (errors, valid, reduced_ok, batch) in the buffer
        self._sent_meta: tuple[int, bool, bool, float] | None = None
        self._work: dist.Work | None = None

    def pack(
        self, layer_order: torch.Tensor, errors: int, valid: bool, reduced_ok: bool = True, batch: float = 0.0
    ) -> None:
        """Fill the send row's per-rank fields after the last bucket (device ops only).

        ``valid``: the local figures were measured; ``reduced_ok``: this rank's shard sums were.
        """
        f = self.fields
        if f.total_sq is not None and f.first_nonfinite is not None:
            torch.sum(self.layer_sq, 0, keepdim=True, out=self.send[f.total_sq : f.total_sq + 1])
            sums.first_nonfinite(self.layer_sq, layer_order, self.send[f.first_nonfinite])
        if self._sent_meta != (errors, valid, reduced_ok, batch):
            self.send[f.errors].fill_(errors)
            self.send[f.valid].fill_(1.0 if valid else 0.0)
            if f.reduced_ok is not None:
                self.send[f.reduced_ok].fill_(1.0 if reduced_ok else 0.0)
            if f.batch is not None:
                self.send[f.batch].fill_(batch)
            self._sent_meta = (errors, valid, reduced_ok, batch)

    def invalidate(self, errors: int) -> None:
        """Send a row that says "no figures from this rank this step" (after a local failure)."""
        self.send.zero_()
        for index in (self.fields.first_nonfinite, self.fields.act_first):  # -1: none
            if index is not None:
                self.send[index].fill_(-1.0)
        self.send[self.fields.errors].fill_(errors)
        self._sent_meta = (errors, False, False, 0.0)

    def keep(self, slot: int) -> None:
        """Keep the send row as ring row ``slot`` until its export's gather."""
        self.rows[slot].copy_(self.send)

    def reduce(self) -> None:
        """Start the SUM all-reduce of the send row's :attr:`RankFields.reduced` floats, in :attr:`summed`."""
        self.summed.copy_(self.send[self.fields.reduced])
        self._start(dist.all_reduce(self.summed, group=self.group, async_op=True))

    def gather(self, first: int, last: int) -> torch.Tensor:
        """Start the all-gather of kept rows ``first..last`` (ring slots); ``(world, k, width)`` out."""
        k, width = last - first + 1, self.fields.width
        out = self._gathered[: self.world * k * width]
        rows = self.rows[first : last + 1].view(-1)
        self._start(dist.all_gather_single(out, rows, group=self.group, async_op=True))
        return out.view(self.world, k, width)

    def _start(self, work: dist.Work) -> None:
        """Hold the work for :meth:`wait`; under ``torch.profiler`` complete it at once.

        A collective issued inside a profiler window and completed after the window closed
        crashes the process (SIGSEGV in torch 2.13 on gloo: the work's profiling callback runs
        on profiler state being torn down; 6 of 10 two-rank runs of 200 one-step windows
        crashed, 0 of 10 with the wait inside), and a user's profiler window may close at any
        step end.
        """
        self.wait()
        self._work = work
        if torch._C._autograd._profiler_enabled():
            self.wait()

    def wait(self) -> None:
        """Complete the pending collective, if any (a stream wait on NCCL)."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()


class LaggedVote:
    """Rank 0's vote, agreed by a collective, read on the host ``lag`` steps later without a sync.

    Every rank must decide alike whether a step exports (its collective is then a gather, not
    the all-reduce). The vote travels in the step's collective, so its sum is the same on
    every rank; on a CPU device it is readable once the collective completed (``lag`` 1: the
    next step reads it), on a GPU it reaches the host through a non-blocking copy into pinned
    memory with an event behind it, read two steps later: the host waits for that event only
    if the GPU is more than a step behind it.

    Example:
        >>> vote = LaggedVote(torch.device("cpu"))
        >>> vote.post(7, torch.tensor([1.0])); vote.read(7 + vote.lag), vote.read(8 + vote.lag)
        (True, False)
    """

    def __init__(self, device: torch.device) -> None:
        self.lag = 2 if device.type == "cuda" else 1
        self._host = torch.zeros(self.lag, dtype=torch.float32, pin_memory=device.type == "cuda")
        # read through ctypes: plain host memory once its event completed, not a tensor read
        self._values = (ctypes.c_float * self.lag).from_address(self._host.data_ptr())
        self._events = [torch.cuda.Event() if device.type == "cuda" else None for _ in range(self.lag)]
        self._posted = [0] * self.lag  # the step whose vote each slot holds (0: none)

    def post(self, step: int, value: torch.Tensor) -> None:
        """Start the copy of ``step``'s agreed vote (a 1-element device tensor) to the host."""
        i = step % self.lag
        self._host[i : i + 1].copy_(value.view(1), non_blocking=True)
        event = self._events[i]
        if event is not None:
            event.record()
        self._posted[i] = step

    def read(self, step: int) -> bool:
        """Whether the vote ``lag`` steps before ``step`` said "export at ``step``" (False if none)."""
        i = (step - self.lag) % self.lag
        if self._posted[i] != step - self.lag:
            return False
        self._posted[i] = 0
        event = self._events[i]
        if event is not None and not event.query():
            event.synchronize()  # the GPU is more than a step behind the host
        return self._values[i] > 0
