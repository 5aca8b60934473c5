"""One optimizer step's life on the device: the source's sums, the collective, the ring row, the publication.

A step goes through four points, each called on every rank in the same program order:

1. the source's hooks hand over each backward's local and reduced sums of squares
   (:meth:`StepTracker.add_local`, :meth:`StepTracker.add_reduced`);
2. :meth:`StepTracker.before_step`, when the optimizer step begins (or ``clip_grad_norm_``
   or the guard needs the step's figures): the local sums are folded into layers and the
   step's one collective starts;
3. :meth:`StepTracker.after_step`, when the optimizer step ends: the reduced sums are folded
   into the step's ring row, and every ``export_every`` steps (or once ``export_interval_s``
   seconds have passed since the last publication, checked at step ends) the rows are published;
4. :meth:`StepTracker.publish` (also on ``flush``): rows not yet judged are *judged* (totals
   and detector verdicts, in one batch), copied to the host and handed to the publisher.

Every method catches its own failures, counts them and degrades (the step's figures are
marked invalid); the collective is issued whatever failed locally (``collective.py`` says why).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .activations import ActivationWatch
from .collective import RankFields, RankGather
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
    (local and reduced), one fold of each into per-layer sums and the one all-gather, whose
    wait is left to the next step (or the next publication). Judging a row (its total and
    detector verdicts) waits for the publication, batched over the steps since the last one,
    unless a step's figures are needed before its ``optimizer.step()`` (guard,
    ``clip_grad_norm_``). Rows are published when ``step % export_every == 0``, at the first
    step end ``export_interval_s`` seconds after the last publication (this rank's clock:
    publication is local, no collective) and on :meth:`publish` (flush/close).

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
        # a sharded model: each rank measures its shard of the reduced gradient; the reduced
        # figures are the sum of those partial sums over the ranks of one shard group (replicas
        # hold identical shards and count once), taken from the gathered rows
        self.sharded = shard_ranks is not None
        fields = RankFields(
            n_layers,
            rank_layers,
            partial=self.sharded,
            batch=noise_factory is not None,
            act=activations is not None,
        )
        self._shard_ranks = torch.tensor(list(shard_ranks or ()), dtype=torch.int64, device=device)
        self.gather = RankGather(fields, n_layers, group, device)
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
        # host clock read per step end, no device work
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
        self._step_ok = True
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

    def fail(self, site: str) -> None:
        """Count a failure at ``site`` (logged once); the step's figures become invalid."""
        self.errors.record(site)
        self._step_ok = False

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
        """The step begins: fold this rank's local sums and start the step's collective (once per step).

        Called when the optimizer step begins, on every rank: the source's reduction has
        completed by then, so the collective cannot interleave with its collectives.
        """
        if not self.active or self._begun:
            return
        self._begun = True
        self._pull()
        ur = self.update_ratio
        if ur is not None and (self.step + 1) % self.export_every == 0:
            try:
                ur.begin()  # the parameters before this (export) step's update
            except Exception:
                self.errors.record("update ratio")
        try:
            self.gather.wait()  # the previous step's gather reads the send buffer
            self.fold(self._local, self.gather.layer_sq)
            self._unscale(self.gather.layer_sq, self._scaled)
            if self.sharded:  # this rank's shard of the reduced gradient travels in the gather
                if self._measured:
                    self.fold(self._reduced, self.gather.partial_sq)
                    self._unscale(self.gather.partial_sq, self._reduced_scaled)
                self._reduced.clear()
            self._local.clear()
            batch = float(self.batch_size()) if self.batch_size is not None else 0.0
            self.gather.pack(self.layer_order, self.errors.count, self._step_ok and self._measured, batch)
            watch = self.activations
            # this rank's first non-finite module travels in the gather; the send buffer keeps
            # "none" between activation steps, so those write nothing
            if watch is not None and (watch.active or self._act_sent):
                f = self.gather.fields
                self.gather.send[f.act_first].copy_(watch.first_module if watch.active else watch.none)
                self._act_sent = watch.active
        except Exception:
            self.fail("rank gather (pack)")
            self.gather.invalidate(self.errors.count)
        try:
            self.gather.issue(self.ring.gathered(self.step + 1))
        except Exception:
            self.fail("rank gather (collective)")

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
            # a sharded model's reduced sums ride the gather (before_step): added up when judged
            if not self.sharded:
                if self._measured:
                    self.fold(self._reduced, self.ring.layers(step))
                    self._unscale(self.ring.layers(step), self._reduced_scaled)
                self._reduced.clear()
            valid = self._step_ok and self._measured
        except Exception:
            self.fail("step row")
            valid = False
        if not valid:
            row[0].fill_(0.0)
        self._valid[self.ring.slot(step)] = valid
        return row

    def total_sq(self) -> torch.Tensor:
        """The step in progress's reduced sum of squares, as a 0-d device tensor (no collective)."""
        if self.sharded:
            self.before_step()
        row = self.row()
        if self.sharded:
            self.gather.wait()  # a stream wait on NCCL; the shards' sums are needed now
            self._reduce_rows(row.unsqueeze(0))
        torch.sum(row[self.layout.layers], 0, keepdim=True, out=row[1:2])
        return row[1]

    def judge_now(self) -> torch.Tensor:
        """Judge the step in progress now (a guard's verdict before ``optimizer.step()``); returns its row."""
        self.before_step()
        self.gather.wait()
        row = self.row()
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
        if watch is not None and watch.active:  # after the gather read the first bad module
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
        if self.step % self.export_every == 0 or (
            self.export_interval_s and time.monotonic() - self._last_publish >= self.export_interval_s
        ):
            self.publish()

    def _judge(self, through: int) -> None:
        """Totals and detector verdicts of the steps up to ``through``, in one batch, in step order.

        The steps since the last judgment never straddle a publication, so their rows are
        consecutive in the ring; the detectors see each run of valid rows at once.
        """
        first = self._judged_through + 1
        if through < first:
            return
        self._judged_through = through
        try:
            lay = self.layout
            a = self.ring.slot(first)
            rows = self.ring.data[a : a + through - first + 1]
            if self.sharded:
                self._reduce_rows(rows)
            rows[:, 1] = rows[:, lay.layers].sum(1)
            if self.detector is not None:
                start = 0
                for valid, run in itertools.groupby(self._valid[a : a + len(rows)]):
                    n = len(list(run))
                    if valid:
                        self.detector.update(rows[start : start + n], lay)
                    start += n
        except Exception:
            self.errors.record("detectors")
        if self.noise is not None:
            try:
                self.noise.update(rows, self.layout)
            except Exception:
                self.errors.record("gradient noise scale")

    def _reduce_rows(self, rows: torch.Tensor) -> None:
        """A sharded model's reduced per-layer sums: the gathered partial sums of one shard group, added."""
        lay, f = self.layout, self.gather.fields
        gathered = lay.ranks(rows)
        rows[:, lay.layers] = gathered[:, self._shard_ranks, f.partial].sum(1)

    def publish(self) -> None:
        """Judge the finished rows not yet published, copy them to the host (non-blocking), hand them over.

        The published rows are then reset to the blank row (ordered after the copy on the
        device), ready for the steps that reuse them. Fewer than ``export_every`` steps are ever
        pending, so the row of a step in progress is never among them.
        """
        first, last = self._published_through + 1, self.step
        if last < first:
            return
        try:
            self.gather.wait()  # the last finished step's gather lands in its row
        except Exception:
            self.errors.record("rank gather (wait)")
        self._judge(last)
        self._published_through = last
        self._last_publish = time.monotonic()
        try:
            steps = tuple(
                StepInfo(s, i, self._timestamps[i], self._skips[i])
                for s, i in ((s, self.ring.slot(s)) for s in range(first, last + 1))
            )
            copy = self.ring.copy_to_host()
            self.ring.reset(first, last, self._blank)
            self.publish_batch(ExportBatch(copy, steps))
        except Exception:
            self.errors.record("export")
