"""The monitor's collectives: which ones each step sends, and where what they bring lands.

Reduced gradients are identical on every rank, so global norms need no collective; only the
per-rank (pre-reduction) figures do, and they are needed only when rows are exported. No
collective's size grows with the number of ranks:

- an ordinary step sends a SUM all-reduce of a few floats (rank 0's vote for a time-bounded
  export; a layout in parts' per-layer sums of every rank's counted shards, each distinct shard
  counted on one replica), or nothing at all when there is nothing to add up;
- an export step, in its place, sends three, over the rows of every step since the last export
  (kept in a ring of ``export_every`` rows): an all-gather of those rows over the ranks of this
  rank's node only (per-rank figures are served and logged by their own node), and the two
  fixed-size all-reduces of ``crossrank.py`` over the job (its counts, moments and packed
  (value, rank) keys: what the job-wide figures need from every rank), whose SUM carries the
  ordinary step's floats too.

Each is issued by the training thread when the optimizer step begins: on every rank,
whatever happened locally (a collective issued on some ranks only would hang the job), in the
same order on every rank, and after the gradient reduction and every collective a user's comm
hook issued from its callbacks have completed (a collective issued while those may still start
could be matched against one of them on another rank, and hang the job). Which steps export
must be the same on every rank, because it decides which collectives a step sends:
``export_every`` is a step count, and ``export_interval_s`` is rank 0's clock, whose vote rides
a step's collective.
"""

from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from ..compat import all_gather, profiler_enabled
from ..errors import ErrorCounter
from . import sums
from .backward import LayerOrder
from .crossrank import CrossRank
from .release import HandedViews
from .ring import DeviceRing
from .rows import Head, RowPlan

__all__ = ["Exchange", "InFlight", "RankBuffers", "LaggedVote"]


class RankBuffers:
    """This rank's row of each step, kept until an export, and the collectives that carry rows.

    ``node_ranks``: the ranks (of ``group``) whose rows the export gathers here, this rank's node's,
    over ``node_group`` (None: this rank alone on its node, or one process).

    :meth:`pack` fills the send row when the step begins (the schedule folds the local per-layer
    sums straight into :attr:`layer_sq`, its head with ``rank_layers``; ``errors`` and ``valid``
    are written only when they change), :meth:`keep` copies it into the ring of ``n_rows`` rows
    not yet gathered; then :meth:`reduce` (an ordinary step) or :meth:`gather` (an export: the
    kept rows of many steps at once) starts the step's collective, completed by :meth:`wait`.
    Without a process group (one process) nothing is ever issued: the rows are this process's own.

    Example:
        >>> plan = RowPlan.build(n_layers=2, world=1)
        >>> buf = RankBuffers(plan, n_rows=4, group=None, device=torch.device("cpu"))
        >>> _ = buf.layer_sq.copy_(torch.tensor([1.0, 4.0])); buf.pack(torch.zeros(2), errors=0, valid=1.0)
        >>> buf.keep(0); buf.rows[0].tolist()
        [1.0, 4.0, 0.0, 1.0]
    """

    def __init__(
        self,
        plan: RowPlan,
        *,
        n_rows: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        node_group: dist.ProcessGroup | None = None,
        node_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.fields = f = plan.rank
        self.group, self.node_group = group, node_group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.node_ranks = node_ranks if node_ranks is not None else tuple(range(self.world))
        self.node_place = self.node_ranks.index(self.rank)
        f32 = dict(dtype=torch.float32, device=device)
        n_layers = plan.step.n_layers
        self.send = torch.zeros(f.width, **f32)
        self.layer_sq = self.send[f.layers] if f.n_layer_cols else torch.zeros(n_layers, **f32)
        self.parts_sq = self.send[f.parts]  # the reduced sums of the parts this rank counts
        self.rows = torch.zeros(n_rows, f.width, **f32)  # kept rows, by ring slot
        self.summed = torch.zeros(f.reduced.stop - f.reduced.start, **f32)  # the all-reduce's buffer
        self._gathered = torch.zeros(len(self.node_ranks) * n_rows * f.width, **f32)
        # (errors, valid, reduced_ok, batch) as written in the send row
        self._sent_meta: tuple[int, float, bool, float] | None = None
        # each work with the views it was handed
        self._works: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        # gloo's thread drops the tensors it was handed under the GIL (release.py): on CPU each
        # collective gets a view that close() waits for it to let go of
        self._handed = HandedViews() if device.type == "cpu" and group is not None else None

    def pack(
        self,
        layer_order: torch.Tensor,
        *,
        errors: int,
        valid: float,
        reduced_ok: bool = True,
        batch: float = 0.0,
    ) -> None:
        """Fill the send row's per-rank fields (device ops only).

        ``valid``: 1.0 the local figures were measured, ``rows.LOCAL_NONFINITE_ONLY`` only whether
        they were finite, 0.0 not at all; ``reduced_ok``: this rank's shard sums were measured.
        """
        f = self.fields
        if f.total_sq is not None and f.first_nonfinite is not None:
            torch.sum(self.layer_sq, 0, keepdim=True, out=self.send[f.total_sq : f.total_sq + 1])
            sums.first_nonfinite(self.layer_sq, layer_order, self.send[f.first_nonfinite])
        if self._sent_meta != (errors, valid, reduced_ok, batch):
            self.send[f.errors].fill_(errors)
            self.send[f.valid].fill_(float(valid))
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
        self.send[self.fields.signals].fill_(-math.inf)  # no precursor sample
        self.send[self.fields.errors].fill_(errors)
        self._sent_meta = (errors, 0.0, False, 0.0)

    def keep(self, slot: int) -> None:
        """Keep the send row as ring row ``slot`` until its export's gather."""
        self.rows[slot].copy_(self.send)

    def reduce(self) -> None:
        """Start the SUM all-reduce of the send row's :attr:`RankRow.reduced` floats, in :attr:`summed`."""
        self.wait()
        self.summed.copy_(self.send[self.fields.reduced])
        summed = self._hand(self.summed)
        self._start(dist.all_reduce(summed, group=self.group, async_op=True), summed)

    def gather(self, first: int, last: int) -> torch.Tensor:
        """Start the all-gather of kept rows ``first..last`` (ring slots) over the node:
        ``(node_size, k, width)`` out (this rank's own rows when it is alone on its node)."""
        self.wait()
        k, width = last - first + 1, self.fields.width
        rows = self.rows[first : last + 1]
        if self.node_group is None:
            return rows.unsqueeze(0)
        out = self._gathered[: len(self.node_ranks) * k * width]
        into, sent = self._hand(out), self._hand(rows.reshape(-1))
        self._start(all_gather(into, sent, group=self.node_group, async_op=True), into, sent)
        return out.view(len(self.node_ranks), k, width)

    def summarize(self, sums: torch.Tensor, keys: torch.Tensor) -> None:
        """Start the job's SUM of ``sums`` and MAX of ``keys`` (``crossrank.py``), after the node's gather."""
        sums, keys = self._hand(sums), self._hand(keys)
        self._start(dist.all_reduce(sums, group=self.group, async_op=True), sums)
        self._start(dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=self.group, async_op=True), keys)

    def _hand(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a collective is handed for ``tensor``: on CPU (gloo) a view of it, its own to count
        (one host allocation, the view's metadata), else itself."""
        return tensor.view_as(tensor) if self._handed is not None else tensor

    def _start(self, work: dist.Work, *views: torch.Tensor) -> None:
        """Hold the work, with the ``views`` it was handed, for :meth:`wait`; under ``torch.profiler``
        complete it at once.

        A collective issued inside a profiler window and completed after the window closed
        crashes the process (SIGSEGV in torch 2.13 on gloo: the work's profiling callback runs
        on profiler state being torn down; 6 of 10 two-rank runs of 200 one-step windows
        crashed, 0 of 10 with the wait inside), and a user's profiler window may close at any
        step end.
        """
        self._works.append((work, views))
        if profiler_enabled():
            self.wait()

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete the pending collectives, if any (stream waits on NCCL); raise after ``timeout_s``."""
        works, self._works = self._works, []
        for work, views in works:
            work.wait(timedelta(seconds=timeout_s)) if timeout_s else work.wait()
            if self._handed is not None:  # not one that never completed: its views may stay held
                self._handed.landed(views)

    def let_go(self, timeout_s: float) -> bool:
        """Whether the backend's thread let go of every tensor of the completed collectives within
        ``timeout_s`` (on CPU; elsewhere at once): once it did, it has no GIL left to take for
        distmon's, and the interpreter may finalize."""
        return self._handed is None or self._handed.let_go(timeout_s)


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


@dataclass(frozen=True)
class InFlight:
    """The collective a step started; completed when the next one starts, or at an export."""

    # "reduce": an ordinary step's all-reduce; "export": an export step's gather and reductions;
    # "flush": those of rows not yet gathered, at flush() or close() (its steps had their own
    # collectives)
    kind: Literal["reduce", "export", "flush"]
    first: int  # the steps whose rows (a gather) or sums (the all-reduce) it carries
    last: int
    out: torch.Tensor | None = None  # a gather's ``(node_size, k, width)`` output


class Exchange:
    """The per-step collective's schedule: export votes, issue, completion, where the node's rows land.

    ``in_parts``: each rank holds a part of the reduced gradient (shards, a pipeline stage): the
    step's all-reduce adds up the per-layer sums of every rank's counted parts (``layout/``);
    otherwise every rank holds the whole reduced gradient and measures it alone. ``node_group``
    and ``node_ranks``: the ranks whose rows an export gathers here (:class:`RankBuffers`); ``order``
    the layers' backward order, for the first non-finite layer's key.

    Example:
        >>> plan = RowPlan.build(n_layers=1, world=1)
        >>> ex = Exchange(plan, ring=DeviceRing(4, plan.step, torch.device("cpu")), group=None,
        ...               export_every=4, export_interval_s=0.0, errors=ErrorCounter(),
        ...               order=LayerOrder(1, torch.device("cpu")))
        >>> [ex.exports(step) for step in (1, 4)]   # one process decides alone
        [False, True]
    """

    def __init__(
        self,
        plan: RowPlan,
        *,
        ring: DeviceRing,
        group: dist.ProcessGroup | None,
        export_every: int,
        export_interval_s: float,
        errors: ErrorCounter,
        order: LayerOrder,
        in_parts: bool = False,
        node_group: dist.ProcessGroup | None = None,
        node_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.plan, self.ring, self.errors, self.order = plan, ring, errors, order
        self.export_every, self.export_interval_s = export_every, export_interval_s
        # several ranks agree on export steps through their collectives; one process decides alone
        self.collective = group is not None
        device = ring.data.device
        self.buffers = RankBuffers(
            plan,
            n_rows=export_every,
            group=group,
            device=device,
            node_group=node_group,
            node_ranks=node_ranks,
        )
        self.rank = self.buffers.rank
        f = plan.rank
        self.cross = CrossRank(
            plan, rank=self.rank, n_rows=export_every, device=device, n_extra=f.reduced.stop - f.reduced.start
        )
        self.in_parts = in_parts
        self.votes = LaggedVote(ring.data.device) if f.vote is not None else None
        self._voter = self.votes is not None and self.rank == 0
        self._vote_sent = 0.0  # rank 0's vote as written in its send row
        self._quiet_until = 0  # rank 0 voted: no new vote before the export it asked for
        self._reduces = self.collective and f.reduced.stop > f.reduced.start
        self._in_flight: InFlight | None = None
        self.gathered_through = 0  # the steps up to here were exchanged: node rows, job-wide figures
        self._export_at = 0  # the step whose collective was its export's gather
        self.started = 0  # the latest step whose collective was issued (or is none)
        self.last_export = time.monotonic()

    def resume_at(self, step: int) -> None:
        """Go on after ``step`` (a resumed run): its rows and collectives were an earlier process's."""
        self.gathered_through = self._export_at = self.started = step

    # -- a step begins ----------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Rank 0's vote, this rank's row kept for the export, the step's collective issued."""
        self._vote(step)
        self.buffers.keep(self.ring.slot(step))
        self.started = step  # whatever raises below, never a second collective for this step
        if not self.collective:
            return
        voted = self.votes is not None and self.votes.read(step)  # the same on every rank
        if self.scheduled(step) or voted:
            first = self.gathered_through + 1
            self.gathered_through = self._export_at = step
            self._in_flight = self._gather("export", first, step)
        elif self._reduces:
            self._in_flight = InFlight("reduce", step, step)
            self.buffers.reduce()

    def _gather(self, kind: Literal["export", "flush"], first: int, last: int) -> InFlight:
        """Start the node's gather and the job's reductions of the kept rows of steps ``first..last``."""
        buf, a, b = self.buffers, self.ring.slot(first), self.ring.slot(last)
        out = buf.gather(a, b)
        sums, keys = self.cross.pack(buf.rows[a : b + 1], self.order.device)
        self.cross.extra(b - a + 1).copy_(buf.send[self.plan.rank.reduced])  # the last step's floats
        buf.summarize(sums, keys)
        return InFlight(kind, first, last, out)

    def invalidate(self) -> None:
        """This rank sends "no figures" this step (its row could not be packed)."""
        self.buffers.invalidate(self.errors.count)
        self._vote_sent = 0.0

    def _vote(self, step: int) -> None:
        """Rank 0: ask for an export once ``export_interval_s`` passed since the last one.

        Not on a step that exports anyway, nor before the export it already asked for.
        """
        if not self._voter:
            return
        due = time.monotonic() - self.last_export >= self.export_interval_s
        vote = 1.0 if due and step > self._quiet_until and not self.scheduled(step) else 0.0
        if vote:
            assert self.votes is not None
            self._quiet_until = step + self.votes.lag  # the step whose export this asks for
        if vote != self._vote_sent:
            self.buffers.send[self.plan.rank.vote].fill_(vote)
            self._vote_sent = vote

    # -- what the collective brings ---------------------------------------------------------
    def complete(self, timeout_s: float | None = None) -> None:
        """Wait for the collective in flight and put what it brought where it belongs.

        The node's rows into the ring rows of their steps, the job's reductions into their job
        columns; a layout in parts' reduced sums into the step's row and rank 0's vote on its way
        to the host (from the ordinary step's all-reduce, or the floats an export's SUM carried
        for its last step). ``timeout_s``: give up waiting (counted as a monitor error, what it
        would have brought stays "not measured").
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        buf, f = self.buffers, self.plan.rank
        try:
            buf.wait(timeout_s)
            summed = buf.summed
            if flight.out is not None:
                k = flight.last - flight.first + 1
                self._store(flight.first, flight.last, flight.out)
                self.cross.land(self.ring.span(flight.first, flight.last), self.ring.slot(flight.first))
                summed = self.cross.extra(k).float()
            if flight.kind != "flush":
                if self.in_parts:  # the regions by name: rows.py may order them as it likes
                    ok = f.summed("reduced_ok").start
                    self._land_parts(flight.last, summed[f.summed("parts")], summed[ok])
                if f.vote is not None and self.votes is not None:
                    self.votes.post(flight.last, summed[f.summed("vote")])
        except Exception:
            self.errors.record("rank exchange (wait)")

    def _land_parts(self, step: int, layer_sq: torch.Tensor, measured: torch.Tensor) -> None:
        """A layout in parts' reduced figures of ``step``: the job's sums, valid only if every rank
        measured its parts (``measured``, the sum of the ranks' ``reduced_ok``, is the world)."""
        self.ring.land_reduced(step, layer_sq)
        self.ring.row(step)[Head.VALID].mul_(measured == self.buffers.world)

    def _store(self, first: int, last: int, out: torch.Tensor, ranks: slice = slice(None)) -> None:
        """Write ``out`` (``(node_size, k, width)``: each node rank's rows of steps ``first..last``) into the
        ring."""
        self.plan.step.rank_rows(self.ring.span(first, last))[:, ranks].copy_(out.transpose(0, 1))

    # -- exports ----------------------------------------------------------------------------
    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is a *scheduled export step*, a multiple of ``export_every``: it exports,
        and every rank knows so before it begins (what the update ratio needs). An *export step* is
        a scheduled one or one that rank 0's ``export_interval_s`` vote chose, known only once the
        vote landed.

        Example:
            >>> ex = Exchange.__new__(Exchange); ex.export_every = 10
            >>> ex.scheduled(20), ex.scheduled(25)
            (True, False)
        """
        return step % self.export_every == 0

    def exports(self, step: int) -> bool:
        """Whether the finished ``step`` is an export step (the same answer on every rank)."""
        if self.collective:
            return self._export_at == step
        return self.scheduled(step) or bool(
            self.export_interval_s and time.monotonic() - self.last_export >= self.export_interval_s
        )

    def gather_rest(self, last: int, gather: bool, timeout_s: float | None = None) -> None:
        """The node ranks' rows and the job's reductions of the steps up to ``last`` not gathered
        yet, into the ring (collectives).

        ``gather=False`` (a rank closing on an exception, which the others may not share) stores
        this rank's own rows and figures only (its job columns say one rank reported); the other
        ranks' stay "not measured". ``timeout_s`` bounds the wait for the others (at interpreter
        exit they may never come).
        """
        # whatever is exported, no collective of distmon's is left in flight (bounded like the gather:
        # at exit, or after a failure, a peer that died mid-collective may never complete it)
        self.complete(timeout_s)
        if self.gathered_through >= last:
            return
        first, self.gathered_through = self.gathered_through + 1, last
        try:
            if gather and self.collective:
                self._in_flight = self._gather("flush", first, last)
                self.complete(timeout_s)
            else:
                s, r = self.ring.slot(first), self.buffers.node_place
                own = self.buffers.rows[s : s + last - first + 1]
                self._store(first, last, own.unsqueeze(0), slice(r, r + 1))
                self.cross.alone(self.ring.span(first, last), s, own, self.order.device)
        except Exception:
            self.errors.record("rank exchange (flush)")
