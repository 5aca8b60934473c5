"""One optimizer step's life on the device: the source's sums, the collective, the ring row, the publication.

A step goes through four points, each called on every rank in the same program order:

1. the source's hooks hand over each backward's local and reduced sums of squares
   (:meth:`StepTracker.add_local`, :meth:`StepTracker.add_reduced`);
2. :meth:`StepTracker.before_step`, when the optimizer step begins (or ``clip_grad_norm_``
   or the guard needs the step's figures): the local sums are folded into layers and the
   step's one collective starts;
3. :meth:`StepTracker.after_step`, when the optimizer step ends: the reduced sums are folded
   into the step's ring row, and every ``export_every`` steps the rows are published;
4. :meth:`StepTracker.publish` (also on ``flush``): rows not yet judged are *judged* (totals
   and detector verdicts, in one batch), copied to the host and handed to the publisher.

Every method catches its own failures, counts them and degrades (the step's figures are
marked invalid); the collective is issued whatever failed locally (``collective.py`` says why).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collective import RankFields, RankGather
from .detectors import DeviceDetector
from .errors import ErrorCounter
from .publisher import ExportBatch
from .ring import DeviceRing, RowLayout
from .sums import LayerFold, Runs

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
    ``clip_grad_norm_``). Rows are published when ``step % export_every == 0`` (a rule on the
    step number alone, identical on every rank) and on :meth:`publish` (flush/close).

    Example:
        >>> tracker = StepTracker(7, group, torch.device("cpu"), 10, True, ErrorCounter())  # doctest: +SKIP
        >>> tracker.before_step(); tracker.after_step()   # around an optimizer step  # doctest: +SKIP
    """

    def __init__(
        self,
        n_layers: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        export_every: int,
        rank_layers: bool,
        errors: ErrorCounter,
        detector_factory: Callable[[RankFields], DeviceDetector] | None = None,
    ) -> None:
        self.device = device
        self.errors = errors
        self.fold = LayerFold(n_layers, device)
        # each layer's position in backward order (first gradient ready = 0), told by the source;
        # layers not yet seen sort last
        self.layer_order = torch.full((n_layers,), float(n_layers), device=device)
        self.layer_order_host: list[float] = [float(n_layers)] * n_layers
        fields = RankFields(n_layers, rank_layers)
        self.gather = RankGather(fields, n_layers, group, device)
        self.detector = detector_factory(fields) if detector_factory else None
        self.layout = RowLayout(
            n_layers,
            dist.get_world_size(group),
            fields.width,
            self.detector.n_outputs if self.detector else 0,
        )
        self.ring = DeviceRing(export_every, self.layout, device)
        # a step's row before it is measured: valid, zero sums, the detectors' "no verdict";
        # rows are reset to it in bulk when published, so a step writes only what it measures
        self._blank = torch.zeros(self.layout.width, dtype=torch.float32, device=device)
        self._blank[0] = 1.0
        if self.detector is not None:
            self.detector.blank(self._blank[self.layout.detector])
        self.ring.reset(1, export_every, self._blank)
        self.export_every = export_every
        self.publish_batch: Callable[[ExportBatch], None] = lambda batch: batch.copy.release()
        self.active = True
        self.step = 0
        self._published_through = 0
        self._judged_through = 0
        self._timestamps = [0.0] * export_every
        self._skipped = [False] * export_every
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
        self._gathered = False
        self._row_done = False

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

    def end_backward(self) -> None:
        self._collecting = False
        self._measured = True

    # -- optimizer side ---------------------------------------------------------------------
    def before_step(self) -> None:
        """The step begins: fold this rank's local sums and start the step's collective (once per step).

        Called when the optimizer step begins, on every rank: the source's reduction has
        completed by then, so the collective cannot interleave with its collectives.
        """
        if not self.active or self._begun:
            return
        self._begun = True
        try:
            self.gather.wait()  # the previous step's gather reads the send buffer
            self.fold(self._local, self.gather.layer_sq)
            self._local.clear()
            self.gather.pack(self.layer_order, self.errors.count, self._step_ok and self._measured)
        except Exception:
            self.fail("rank gather (pack)")
            self.gather.invalidate(self.errors.count)
        try:
            self.gather.issue(self.ring.gathered(self.step + 1))
            self._gathered = True
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
        try:
            if self._measured:
                self.fold(self._reduced, self.ring.layers(step))
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
        row = self.row()
        torch.sum(row[self.layout.layers], 0, keepdim=True, out=row[1:2])
        return row[1]

    def judge_now(self) -> torch.Tensor:
        """Judge the step in progress now (a guard's verdict before ``optimizer.step()``); returns its row."""
        self.before_step()
        self.gather.wait()
        row = self.row()
        self._judge(self.step + 1)
        return row

    def after_step(self, skipped: bool = False) -> None:
        """The step ended (optimizer post-hook, or a skip): close its row, publish on schedule."""
        if not self.active:
            return
        self.before_step()  # a step whose start was not seen still sends its (invalid) row
        self.row()
        self.step += 1
        slot = self.ring.slot(self.step)
        self._timestamps[slot] = time.time()
        self._skipped[slot] = skipped
        self._new_step()
        if self.step % self.export_every == 0:
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
        try:
            steps = tuple(
                (s, i, self._timestamps[i], self._skipped[i])
                for s, i in ((s, self.ring.slot(s)) for s in range(first, last + 1))
            )
            copy = self.ring.copy_to_host()
            self.ring.reset(first, last, self._blank)
            self.publish_batch(ExportBatch(copy, steps))
        except Exception:
            self.errors.record("export")
