"""One optimizer step's life on the device: the source's sums, the collective, the ring row, the publication.

A step goes through four points, each called on every rank in the same program order:

1. the source's hooks hand over each backward's local and reduced sums of squares
   (:meth:`StepTracker.add_local`, :meth:`StepTracker.add_reduced`);
2. :meth:`StepTracker.before_step`, when the optimizer step begins (or ``clip_grad_norm_``
   or the guard needs the step's figures): the local sums are folded into layers, this
   rank's row is kept for the next export, and the step's one collective starts: the rows
   of every step since the last export, all-gathered, on an export step; otherwise a
   fixed-size all-reduce (or nothing) (``collective.py``);
3. :meth:`StepTracker.after_step`, when the optimizer step ends: the reduced sums are folded
   into the step's ring row; an export step's rows are published;
4. :meth:`StepTracker.publish` (also on ``flush``): rows not yet judged are *judged* (totals
   and detector verdicts, in one batch; the per-rank verdicts once every rank's rows are
   there), copied to the host and handed to the publisher.

A step exports every ``export_every`` steps and, with ``export_interval_s``, when rank 0's
clock says so: its vote travels in a step's collective and is read on every rank a step
later (two on a GPU), so every rank agrees which steps gather. Every method catches its own
failures, counts them and degrades (the step's figures are marked invalid); the collective is
issued whatever failed locally (``collective.py`` says why).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .activations import ActivationWatch
from .collective import LaggedVote, RankExchange, RankFields
from .detectors import DeviceDetector
from .errors import ErrorCounter
from .loss_scale import LossScale
from .noise_scale import NoiseScale
from .publisher import ExportBatch, StepInfo
from .ring import DeviceRing, RowLayout
from .sums import LayerFold, Runs
from .update_ratio import UpdateRatio

__all__ = ["StepTracker"]

Pending = list[tuple[Runs, list[torch.Tensor]]]


class StepTracker:
    """Device state of the monitor and the per-step schedule.

    ``step`` counts finished optimizer steps; the step in progress writes ring row
    ``step + 1``. An ordinary step costs the source's two fused passes over the gradients
    (local and reduced), one fold of each into per-layer sums, the copy of this rank's row
    into the ring of rows kept for the next export and a fixed-size all-reduce (rank 0's
    export vote, a sharded model's shard sums; none when there is neither), whose wait is
    left to the next step. Judging a row (its total and detector verdicts) waits for the
    publication, batched over the steps since the last one, unless a step's figures are
    needed before its ``optimizer.step()`` (guard, ``clip_grad_norm_``); the per-rank
    verdicts (rank outliers, noise scale) always wait for the export's gather. Rows are
    published when ``step % export_every == 0``, on the step after rank 0 voted (two on a
    GPU) once ``export_interval_s`` seconds passed since its last publication, and on
    :meth:`publish` (flush/close). In one process (no group) nothing is issued, and the time
    rule reads the clock at step ends.

    Example:
        >>> tracker = StepTracker(2, None, 1, torch.device("cpu"), 10, True, ErrorCounter())
        >>> tracker.before_step(); tracker.row_valid()   # an optimizer step with no backward before it
        False
        >>> tracker.after_step(); tracker.step
        1
    """

    def __init__(
        self,
        n_layers: int,
        group: dist.ProcessGroup | None,
        world: int,
        device: torch.device,
        export_every: int,
        rank_layers: bool,
        errors: ErrorCounter,
        detector_factory: Callable[[RankFields], DeviceDetector] | None = None,
        loss_scale: LossScale | None = None,
        shard_ranks: Sequence[int] | None = None,
        export_interval_s: float = 0.0,
        noise_factory: Callable[[RankFields], NoiseScale] | None = None,
        batch_size: Callable[[], float] | None = None,
        activations: ActivationWatch | None = None,
        activation_every: int = 0,
        update_ratio: UpdateRatio | None = None,
    ) -> None:
        self.device = device
        self.errors = errors
        self.fold = LayerFold(n_layers, device)
        # each layer's position in backward order (first gradient ready = 0), told by the source;
        # layers not yet seen sort last
        self.layer_order = torch.full((n_layers,), float(n_layers), device=device)
        self.layer_order_host: list[float] = [float(n_layers)] * n_layers
        # several ranks agree on export steps through their collectives; one process decides alone
        self.collective = group is not None
        # a sharded model: each rank measures its shard of the reduced gradient; the reduced
        # figures are the sum of those partial sums over one shard group. The shard groups
        # partition the ranks: the one holding rank 0 adds up every shard once, the others
        # send zeros (replicas hold identical shards)
        self.sharded = shard_ranks is not None
        self._adds_shard = self.sharded and 0 in list(shard_ranks or ())
        fields = RankFields(
            n_layers,
            rank_layers,
            partial=self.sharded,
            batch=noise_factory is not None,
            act=activations is not None,
            vote=self.collective and export_interval_s > 0,
        )
        self.exchange = RankExchange(fields, n_layers, export_every, group, device)
        self.votes = LaggedVote(device) if fields.vote is not None else None
        self._voter = self.votes is not None and self.exchange.rank == 0
        self._vote_sent = 0.0  # rank 0's vote in its send row
        self._quiet_until = 0  # rank 0 voted: no new vote before the export it asked for
        self._reduces = self.collective and fields.reduced.stop > fields.reduced.start
        # the collective in flight: (kind, first step, last step, gathered view or None)
        self._pending: tuple[str, int, int, torch.Tensor | None] | None = None
        self._gathered_through = 0  # every rank's rows of the steps up to here are in the ring
        self._export_at = 0  # the step whose collective was its export's gather
        self.detector = detector_factory(fields) if detector_factory else None
        self.noise = noise_factory(fields) if noise_factory else None
        self.batch_size = batch_size  # this rank's batch this step, for the gradient noise scale
        self.layout = RowLayout(
            n_layers,
            world,
            fields.width,
            self.detector.n_outputs if self.detector else 0,
            self.noise.n_outputs if self.noise else 0,
            activations.columns if activations else 0,
            update_ratio.columns if update_ratio else 0,
        )
        self.update_ratio = update_ratio
        self.activations = activations
        # the send buffer may hold something other than "none" (it starts zeroed): write it once
        self._act_sent = True
        self.activation_every = activation_every
        if activations is not None:
            activations.active = 1 % activation_every == 0  # step 1's forwards
        self.ring = DeviceRing(export_every, self.layout, device)
        # a step's row before it is measured: valid, zero sums, the detectors' "no verdict";
        # rows are reset to it in bulk when published, so a step writes only what it measures
        self._blank = torch.zeros(self.layout.width, dtype=torch.float32, device=device)
        self._blank[0] = 1.0
        if self.detector is not None:
            self.detector.blank(self._blank[self.layout.detector])
        self._blank[self.layout.noise] = math.nan  # no noise-scale figure until a row is judged
        self._blank[self.layout.act] = math.nan  # a step whose forwards were not watched
        self._blank[self.layout.upd] = math.nan  # not an export step
        self.ring.reset(1, export_every, self._blank)
        self.export_every = export_every
        # slow steps must not hold a bad step back from Prometheus for export_every steps: a
        # host clock read per step, no device work
        self.export_interval_s = export_interval_s
        self._last_publish = time.monotonic()
        self.loss_scale = loss_scale or LossScale()
        # a source that reads the gradients when the step's figures are needed (one process)
        # instead of handing them over from backward hooks
        self.pull: Callable[[], None] | None = None
        self.publish_batch: Callable[[ExportBatch], None] = lambda batch: batch.copy.release()
        self.active = True
        self.step = 0
        self._published_through = 0
        self._judged_through = 0
        self._timestamps = [0.0] * export_every
        self._skips = [""] * export_every
        self._valid = [False] * export_every
        self._collecting = False  # between a backward's first bucket and its last
        # (runs, sums) of this backward, folded into layers later: the local ones when the step
        # begins, the reduced ones (added by gloo/NCCL callback threads; the source's reduction
        # waits for them before backward returns) when it ends
        self._local: Pending = []
        self._reduced: Pending = []
        self._new_step()

    def _new_step(self) -> None:
        self._local_ok = True  # this rank's local (pre-reduction) figures of the step
        self._reduced_ok = True  # its reduced figures (a sharded model: its shard's)
        self._measured = False  # a backward handed this step its sums
        self._begun = False
        self._row_done = False
        self._pulled = False
        self._scaled = True
        self._reduced_scaled = True
        self._inv_sq: torch.Tensor | None = None

    def _pull(self) -> None:
        if self.pull is not None and not self._pulled:
            self._pulled = True
            self.pull()

    def _unscale(self, sq: torch.Tensor, scaled: bool) -> None:
        """Divide sums of squares of loss-scaled gradients by the scale squared (the step's scale)."""
        if not scaled:
            return
        if self._inv_sq is None:
            self._inv_sq = self.loss_scale.inv_sq()
        if self._inv_sq is not None:
            sq.mul_(self._inv_sq)

    def fail(self, site: str, local: bool = True, reduced: bool = True) -> None:
        """Count a failure at ``site`` (logged once); the step's ``local`` and/or ``reduced`` figures
        on this rank become invalid (NaN where reported)."""
        self.errors.record(site)
        self._local_ok &= not local
        self._reduced_ok &= not reduced

    def local_unmeasured(self) -> None:
        """This step's local figures cannot be measured (no failure: e.g. FSDP reduce-scattering
        every micro-batch, whose local gradient no single reduce-scatter input holds)."""
        self._local_ok = False

    def set_layer_order(self, positions: list[float]) -> None:
        """Each layer's position in backward order, as the source learned it (rare: new layouts)."""
        self.layer_order_host = positions
        self.layer_order.copy_(torch.tensor(positions))

    # -- source side ------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """The source saw a gradient of a backward; the first of a backward starts it afresh.

        Per backward, not per step: a second backward before the step replaces the first one's
        figures, as DDP's buckets do.
        """
        if not self._collecting:
            self._collecting = True
            self._local.clear()
            self._reduced.clear()

    def add_local(self, runs: Runs, sums: list[torch.Tensor]) -> None:
        self._local.append((runs, sums))

    def add_reduced(self, runs: Runs, sums: list[torch.Tensor]) -> None:
        self._reduced.append((runs, sums))

    def end_backward(self, scaled: bool = True, reduced_scaled: bool | None = None) -> None:
        """The backward's sums are all handed over.

        ``scaled``: they were read before the loss scale was divided out (``reduced_scaled``: the
        same for the reduced ones, when they were read at another time).
        """
        self._collecting = False
        self._measured = True
        self._scaled = scaled
        self._reduced_scaled = scaled if reduced_scaled is None else reduced_scaled

    # -- optimizer side ---------------------------------------------------------------------
    def before_step(self) -> None:
        """The step begins: fold this rank's local sums, keep its row, start the step's collective.

        Once per step, called when the optimizer step begins, on every rank: the source's
        reduction has completed by then, so the collective cannot interleave with its
        collectives.
        """
        if not self.active or self._begun:
            return
        self._begun = True
        self._pull()
        step = self.step + 1
        ur = self.update_ratio
        if ur is not None and step % self.export_every == 0:
            try:
                ur.begin()  # the parameters before this (export) step's update
            except Exception:
                self.errors.record("update ratio")
        self._complete()  # the previous step's collective, before its buffers are written again
        ex = self.exchange
        try:
            self.fold(self._local, ex.layer_sq)
            self._unscale(ex.layer_sq, self._scaled)
            if self._adds_shard and self._measured:  # this rank's shard of the reduced gradient
                self.fold(self._reduced, ex.partial_sq)
                self._unscale(ex.partial_sq, self._reduced_scaled)
            if self.sharded:
                self._reduced.clear()
            self._local.clear()
            batch = float(self.batch_size()) if self.batch_size is not None else 0.0
            ex.pack(
                self.layer_order,
                self.errors.count,
                self._local_ok and self._measured,
                self._reduced_ok and self._measured,
                batch,
            )
            watch = self.activations
            # this rank's first non-finite module travels in its row; the send row keeps
            # "none" between activation steps, so those write nothing
            if watch is not None and (watch.active or self._act_sent):
                ex.send[ex.fields.act_first].copy_(watch.first_module if watch.active else watch.none)
                self._act_sent = watch.active
        except Exception:
            self.fail("rank exchange (pack)")
            ex.invalidate(self.errors.count)  # its vote and first bad module: none
            self._vote_sent, self._act_sent = 0.0, False
        try:
            self._vote(step)
            ex.keep(self.ring.slot(step))
            self._issue(step)
        except Exception:
            self.fail("rank exchange (collective)")

    def _vote(self, step: int) -> None:
        """Rank 0: ask for an export once ``export_interval_s`` passed since its last publication.

        Not on a step that exports anyway, nor before the export it already asked for.
        """
        if not self._voter:
            return
        due = time.monotonic() - self._last_publish >= self.export_interval_s
        vote = 1.0 if due and step > self._quiet_until and step % self.export_every else 0.0
        if vote:
            assert self.votes is not None
            self._quiet_until = step + self.votes.lag  # the step whose export this asks for
        if vote != self._vote_sent:
            self.exchange.send[self.exchange.fields.vote].fill_(vote)
            self._vote_sent = vote

    def _issue(self, step: int) -> None:
        """Start step ``step``'s collective: its export's gather, or the all-reduce, or none."""
        if not self.collective:
            return
        voted = self.votes is not None and self.votes.read(step)  # the same on every rank
        if step % self.export_every == 0 or voted:
            first = self._gathered_through + 1
            self._gathered_through = self._export_at = step
            out = self.exchange.gather(self.ring.slot(first), self.ring.slot(step))
            self._pending = ("export", first, step, out)
        elif self._reduces:
            self._pending = ("reduce", step, step, None)
            self.exchange.reduce()

    def _complete(self) -> None:
        """Wait for the collective in flight and put what it brought where it belongs.

        Every rank's rows into the ring rows of their steps; a sharded model's reduced sums
        into the step's row (from the all-reduce, or added up from the export's gathered
        shard sums); rank 0's vote on its way to the host.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        kind, first, last, out = pending
        ex, f = self.exchange, self.exchange.fields
        try:
            ex.wait()
            vote = None
            if out is None:  # the all-reduce
                if self.sharded:
                    self.ring.layers(last).copy_(ex.summed[len(ex.summed) - f.n_partial :])
                if f.vote is not None:
                    vote = ex.summed[:1]
            else:
                self._land(first, last, out)
                if kind == "export" and self.sharded:
                    self.ring.layers(last).copy_(out[:, -1, f.partial].sum(0))
                if kind == "export" and f.vote is not None:
                    vote = out[0, -1, f.vote : f.vote + 1]
            if vote is not None and self.votes is not None:
                self.votes.post(last, vote)
        except Exception:
            self.errors.record("rank exchange (wait)")

    def _land(self, first: int, last: int, out: torch.Tensor, ranks: slice = slice(None)) -> None:
        """Write ``out`` (``(ranks, k, width)``: each rank's rows of steps ``first..last``) into the ring."""
        self.layout.ranks(self.ring.span(first, last))[:, ranks].copy_(out.transpose(0, 1))

    def row(self) -> torch.Tensor:
        """The row of the step in progress, its reduced sums folded in (once per step).

        Without a backward this step (an ``optimizer.step()`` alone) the row is marked invalid:
        nothing was measured, and nothing real-looking must be reported.
        """
        step = self.step + 1
        row = self.ring.row(step)
        if self._row_done:
            return row
        self._row_done = True
        self._pull()
        try:
            # a sharded model's reduced sums come with the step's collective (_complete)
            if not self.sharded:
                if self._measured:
                    self.fold(self._reduced, self.ring.layers(step))
                    self._unscale(self.ring.layers(step), self._reduced_scaled)
                self._reduced.clear()
            valid = self._reduced_ok and self._measured
        except Exception:
            self.fail("step row", local=False)
            valid = False
        if not valid:
            row[0].fill_(0.0)
        self._valid[self.ring.slot(step)] = valid
        return row

    def _reduced_now(self) -> torch.Tensor:
        """The step in progress's row with its reduced sums in (a sharded model's need its collective)."""
        if self.sharded:
            self.before_step()
            self._complete()  # a stream wait on NCCL; the shards' sums are needed now
        return self.row()

    def total_sq(self) -> torch.Tensor:
        """The step in progress's reduced sum of squares, as a 0-d device tensor (no collective)."""
        row = self._reduced_now()
        torch.sum(row[self.layout.layers], 0, keepdim=True, out=row[1:2])
        return row[1]

    def judge_now(self) -> torch.Tensor:
        """Judge the step in progress now (a guard's verdict before ``optimizer.step()``); returns its row."""
        self.before_step()
        row = self._reduced_now()
        self._judge(self.step + 1)
        return row

    def row_valid(self) -> bool:
        """Whether the step in progress was measured (host state: no sync)."""
        self.row()
        return self._valid[self.ring.slot(self.step + 1)]

    def after_step(self, skip: str = "") -> None:
        """The step ended (optimizer post-hook, or a skip and why: ``"guard"``, ``"scaler"``).

        Closes its row and publishes on schedule.
        """
        if not self.active:
            return
        self.before_step()  # a step whose start was not seen still sends its (invalid) row
        row = self.row()
        watch = self.activations
        if watch is not None and watch.active:  # after its row took the first bad module
            try:
                watch.close_step(row[self.layout.act])
            except Exception:
                self.errors.record("activation statistics")
        if self.update_ratio is not None and self.update_ratio.taken:
            try:
                self.update_ratio.end(row[self.layout.upd])
            except Exception:
                self.errors.record("update ratio")
        self.step += 1
        slot = self.ring.slot(self.step)
        self._timestamps[slot] = time.time()
        self._skips[slot] = skip
        self._new_step()
        if self.activations is not None:  # the next step's forwards: watched or not
            self.activations.active = (self.step + 1) % self.activation_every == 0
        if self.collective:
            due = self._export_at == self.step
        else:
            due = self.step % self.export_every == 0 or bool(
                self.export_interval_s and time.monotonic() - self._last_publish >= self.export_interval_s
            )
        if due:
            self.publish()

    def _valid_runs(self, first: int, last: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The ring rows of steps ``first..last`` (consecutive: never across a publication) and
        the ``(start, stop)`` row ranges of their runs of valid steps, in step order."""
        a, rows = self.ring.slot(first), self.ring.span(first, last)
        runs, start = [], 0
        for valid, run in itertools.groupby(self._valid[a : a + len(rows)]):
            n = len(list(run))
            if valid:
                runs.append((start, start + n))
            start += n
        return rows, runs

    def _judge(self, through: int) -> None:
        """Totals and reduced-figure verdicts of the steps up to ``through``, in one batch."""
        first = self._judged_through + 1
        if through < first:
            return
        self._judged_through = through
        try:
            rows, runs = self._valid_runs(first, through)
            rows[:, 1] = rows[:, self.layout.layers].sum(1)
            if self.detector is not None:
                for start, stop in runs:
                    self.detector.update(rows[start:stop], self.layout)
        except Exception:
            self.errors.record("detectors")

    def _judge_ranks(self, first: int, last: int) -> None:
        """The verdicts that need every rank's rows (rank outliers, noise scale), once they are in."""
        rows, runs = self._valid_runs(first, last)
        if self.detector is not None:
            try:
                for start, stop in runs:
                    self.detector.update_ranks(rows[start:stop], self.layout)
            except Exception:
                self.errors.record("detectors")
        if self.noise is not None:
            try:
                self.noise.update(rows, self.layout)
            except Exception:
                self.errors.record("gradient noise scale")

    def publish(self, gather: bool = True) -> None:
        """Judge the finished rows not yet published, copy them to the host (non-blocking), hand them over.

        Every rank's rows of steps not yet gathered are all-gathered first: a collective, so
        with several ranks call it on every rank at the same point. ``gather=False`` (a rank
        closing on an exception, which the others may not share) publishes what this rank
        has: its own figures, the other ranks' as not measured. The published rows are then
        reset to the blank row (ordered after the copy on the device), ready for the steps
        that reuse them. Fewer than ``export_every`` steps are ever pending, so the row of a
        step in progress is never among them.
        """
        self._complete()  # whatever is published, no collective of distmon's is left in flight
        first, last = self._published_through + 1, self.step
        if last < first:
            return
        if self._gathered_through < last:
            a = self._gathered_through + 1
            self._gathered_through = last
            try:
                if gather and self.collective:
                    out = self.exchange.gather(self.ring.slot(a), self.ring.slot(last))
                    self._pending = ("flush", a, last, out)
                    self._complete()
                else:  # this rank's own rows only
                    s, r = self.ring.slot(a), self.exchange.rank
                    own = self.exchange.rows[s : s + last - a + 1].unsqueeze(0)
                    self._land(a, last, own, slice(r, r + 1))
            except Exception:
                self.errors.record("rank exchange (flush)")
        self._judge(last)
        self._judge_ranks(first, last)
        self._published_through = last
        self._last_publish = time.monotonic()
        try:
            steps = tuple(
                StepInfo(s, i, self._timestamps[i], self._skips[i])
                for s, i in ((s, self.ring.slot(s)) for s in range(first, last + 1))
            )
            copy = self.ring.copy_to_host()
            self.ring.reset(first, last, self._blank)
            if copy is None:
                self.errors.note(
                    "export dropped",
                    len(steps),
                    "distmon: the publisher thread is two exports behind; this export's steps are "
                    "dropped (counted in distmon_monitor_errors_total) rather than hold training",
                )
            else:
                self.publish_batch(ExportBatch(copy, steps))
        except Exception:
            self.errors.record("export")
