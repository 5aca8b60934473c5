"""One optimizer step's life on the device: bucket sums, the gather, the ring row, the export.

Called from the comm hook (per bucket) and the optimizer hooks (per step). Every method here
catches its own failures, counts them and degrades: the user's gradients, hook results and
collectives are never affected, and the monitor's collective is issued on every rank on
every step whatever failed locally.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import norms
from .bucket_stats import BucketLayout, BucketStats
from .detectors import DeviceDetector
from .errors import ErrorCounter
from .grouping import Grouping
from .publisher import ExportBatch
from .reduction import RankFields, RankGather
from .ring import DeviceRing, RowLayout

__all__ = ["StepTracker"]


class StepTracker:
    """Device state of the monitor and the per-step schedule.

    ``step`` counts finished optimizer steps; the step in progress writes ring row
    ``step + 1``. An ordinary step costs the two fused passes over the gradients (local and
    reduced), one fold of each into per-layer sums (before the gather, and when the step
    closes) and the one all-gather. Everything that only reads a finished row (totals,
    detectors) is *completed* in one batch over the steps since the last export, when the
    ring is exported, or at once for a step whose figures are needed before its
    ``optimizer.step()`` (guard, ``clip_grad_norm_``). Exports happen when
    ``step % export_every == 0`` (a rule on the step number alone, identical on every rank)
    and on :meth:`export` (flush/close).
    """

    def __init__(self, grouping: Grouping, group: Optional[dist.ProcessGroup], device: torch.device,
                 export_every: int, rank_layers: bool, errors: ErrorCounter,
                 detector_factory: Optional[Callable[[RankFields], DeviceDetector]] = None) -> None:
        n_layers = len(grouping.layers)
        self.errors = errors
        self.stats = BucketStats(grouping, device)
        fields = RankFields(n_layers, rank_layers)
        self.gather = RankGather(fields, n_layers, group, device)
        self.detector = detector_factory(fields) if detector_factory else None
        self.layout = RowLayout(n_layers, dist.get_world_size(group), fields.width,
                                self.detector.n_outputs if self.detector else 0)
        self.ring = DeviceRing(export_every, self.layout, device)
        # a step's row before its buckets arrive: valid, zero sums, the detectors' "no verdict";
        # rows are reset to it in bulk when exported, so a step writes only what it measures
        self._blank = torch.zeros(self.layout.width, dtype=torch.float32, device=device)
        self._blank[0] = 1.0
        if self.detector is not None:
            self.detector.blank(self._blank[self.layout.detector])
        self.ring.reset(1, export_every, self._blank)
        self.export_every = export_every
        self.publish: Callable[[ExportBatch], None] = lambda batch: batch.copy.release()
        self.active = True
        self.step = 0
        self._exported_through = 0
        self._completed_through = 0
        self._timestamps = [0.0] * export_every
        self._skipped = [False] * export_every
        self._valid = [False] * export_every
        self._collecting = False  # between a backward's first bucket and its last
        # (layout, per-run sums) of this backward's buckets, folded into layers later:
        # the local ones before the gather, the reduced ones (appended by gloo/NCCL callback
        # threads; DDP waits for them before backward returns) when the step closes
        self._local: list[tuple[BucketLayout, list[torch.Tensor]]] = []
        self._reduced: list[tuple[BucketLayout, list[torch.Tensor]]] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._step_ok = True
        self._gathered = False
        self._finalized = False

    def _fail(self, site: str) -> None:
        self.errors.record(site)
        self._step_ok = False

    # -- comm hook side ---------------------------------------------------------------------
    def before_reduce(self, bucket: dist.GradBucket) -> Optional[Callable[[torch.futures.Future], object]]:
        """Measure the bucket's local gradients; returns the callback that measures the reduced ones.

        None when inactive, on failure or for a bucket with nothing tracked (the hook then passes
        the user's future through).
        """
        if not self.active:
            return None
        try:
            if not self._collecting:
                self._begin_backward()
            layout, views, buffer = self.stats.layout(bucket)
            if not views:
                return None  # no tracked parameter in this bucket: nothing to measure either side
            self._local.append((layout, norms.sq_sums(views)))
            return self._after_reduce(layout, views, buffer)
        except Exception:
            self._fail("comm hook (local gradients)")
            return None

    def _begin_backward(self) -> None:
        # Per backward, not per step: a second backward before the step replaces the first
        # one's figures, as DDP's buckets do.
        self._collecting = True
        self.gather.wait()  # a gather still reading the send buffer (a second backward)
        self._local.clear()
        self._reduced.clear()

    def _after_reduce(self, layout: BucketLayout, views: list[torch.Tensor],
                      buffer: torch.Tensor) -> Callable[[torch.futures.Future], object]:
        def measure_reduced(fut: torch.futures.Future) -> object:
            result = fut.value()  # the user's hook failing is the user's error: let it raise
            try:
                flat = result[0] if isinstance(result, (list, tuple)) else result
                # an in-place hook (the default all-reduce) reduced DDP's own views: reuse them
                same = flat.data_ptr() == buffer.data_ptr() and flat.dtype == buffer.dtype
                self._reduced.append((layout, norms.sq_sums(views if same else layout.views(flat))))
            except Exception:
                self._fail("comm hook (reduced gradients)")
            return result
        return measure_reduced

    def issue_gather(self) -> None:
        """After DDP's last bucket: pack this rank's figures, start the step's one collective."""
        if not self.active:
            return
        self._collecting = False
        try:
            self.stats.fold(self._local, self.gather.layer_sq)
            self._local.clear()
            self.gather.pack(self.stats.layer_order, self.errors.count, self._step_ok)
        except Exception:
            self._fail("rank gather (pack)")
            self.gather.invalidate(self.errors.count)
        try:
            self.gather.issue(self.ring.gathered(self.step + 1))
            self._gathered = True
        except Exception:
            self._fail("rank gather (collective)")

    # -- optimizer side ---------------------------------------------------------------------
    def finalize(self, complete: bool = False) -> torch.Tensor:
        """Close the step's row on the device (idempotent); returns the row.

        ``complete=True`` also fills what is derived from the row (total, detector verdicts)
        now instead of at the next export: for a guard or ``clip_grad_norm_``, before
        ``optimizer.step()``.
        """
        step = self.step + 1
        row = self.ring.row(step)
        if not self._finalized:
            self._finalized = True
            try:
                # without a backward this step the row stays blank: zero sums, every rank "invalid"
                if self.gather.wait():
                    self.stats.fold(self._reduced, self.ring.layers(step))
                    self._reduced.clear()
                valid = self._step_ok and self._gathered
                if not valid:
                    row[0].fill_(0.0)
            except Exception:
                self._fail("step finalize")
                valid = False
                row[0].fill_(0.0)
            self._valid[self.ring.slot(step)] = valid
        if complete:
            self._complete(step)
        return row

    def _complete(self, through: int) -> None:
        """Totals and detector verdicts of steps up to ``through``, in one batch, in step order.

        The steps since the last completion never straddle an export, so their rows are
        consecutive in the ring; the detectors see each run of valid rows at once.
        """
        first = self._completed_through + 1
        if through < first:
            return
        self._completed_through = through
        try:
            lay = self.layout
            a = self.ring.slot(first)
            rows = self.ring.data[a:a + through - first + 1]
            rows[:, 1] = rows[:, lay.layers].sum(1)
            if self.detector is not None:
                start = 0
                for valid, run in itertools.groupby(self._valid[a:a + len(rows)]):
                    n = len(list(run))
                    if valid:
                        self.detector.update(rows[start:start + n], lay)
                    start += n
        except Exception:
            self.errors.record("detectors")

    def end_step(self, skipped: bool = False) -> None:
        """Close the step (optimizer post-hook, or the guard skipping it): finalize, export on schedule."""
        if not self.active:
            return
        self.finalize()
        self.step += 1
        slot = self.ring.slot(self.step)
        self._timestamps[slot] = time.time()
        self._skipped[slot] = skipped
        self._reset_step()
        if self.step % self.export_every == 0:
            self.export()

    def export(self) -> None:
        """Complete the new rows, copy the ring to the host (non-blocking), hand them to the publisher.

        The exported rows are then reset to the blank row (ordered after the copy on the device),
        ready for the steps that reuse them. Fewer than ``export_every`` steps are ever pending,
        so the row of a step in progress is never among them.
        """
        first, last = self._exported_through + 1, self.step
        if last < first:
            return
        self._complete(last)
        self._exported_through = last
        try:
            steps = tuple((s, i, self._timestamps[i], self._skipped[i])
                          for s, i in ((s, self.ring.slot(s)) for s in range(first, last + 1)))
            copy = self.ring.copy_to_host()
            self.ring.reset(first, last, self._blank)
            self.publish(ExportBatch(copy, steps))
        except Exception:
            self.errors.record("export")
