"""One optimizer step's life on the device: bucket sums, the gather, the ring row, the export.

Called from the comm hook (per bucket) and the optimizer hooks (per step). Every method here
catches its own failures, counts them and degrades: the user's gradients, hook results and
collectives are never affected, and the monitor's collective is issued on every rank on
every step whatever failed locally.
"""

from __future__ import annotations

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
from .reduction import RankGather
from .ring import DeviceRing, RowLayout

__all__ = ["StepTracker"]


class StepTracker:
    """Device state of the monitor and the per-step schedule.

    ``step`` counts finished optimizer steps; the step in progress writes ring row
    ``step + 1``. Exports happen when ``step % export_every == 0`` (a rule on the step number
    alone, identical on every rank) and on :meth:`export` (flush/close).
    """

    def __init__(self, grouping: Grouping, group: Optional[dist.ProcessGroup], device: torch.device,
                 export_every: int, rank_layers: bool, errors: ErrorCounter,
                 detector_factory: Optional[Callable[[int], DeviceDetector]] = None) -> None:
        self.errors = errors
        self.stats = BucketStats(grouping, device)
        self.gather = RankGather(len(grouping.layers), rank_layers, group, device)
        self.detector = detector_factory(self.gather.n_layer_cols) if detector_factory else None
        self.layout = RowLayout(len(grouping.layers), dist.get_world_size(group), self.gather.width,
                                self.detector.n_outputs if self.detector else 0)
        self.ring = DeviceRing(export_every, self.layout, device)
        self.export_every = export_every
        self.publish: Callable[[ExportBatch], None] = lambda batch: batch.copy.release()
        self.active = True
        self.step = 0
        self._exported_through = 0
        self._timestamps = [0.0] * export_every
        self._skipped = [False] * export_every
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

        None when inactive or on failure (the hook then passes the user's future through).
        """
        if not self.active:
            return None
        try:
            layout, views = self.stats.layout(bucket)
            self.stats.record(layout, views, self.stats.local_sq)
            return self._after_reduce(layout, views, bucket.buffer())
        except Exception:
            self._fail("comm hook (local gradients)")
            return None

    def _after_reduce(self, layout: BucketLayout, views: list[torch.Tensor],
                      buffer: torch.Tensor) -> Callable[[torch.futures.Future], object]:
        def measure_reduced(fut: torch.futures.Future) -> object:
            result = fut.value()  # the user's hook failing is the user's error: let it raise
            try:
                flat = result[0] if isinstance(result, (list, tuple)) else result
                # an in-place hook (the default all-reduce) reduced DDP's own views: reuse them
                same = flat.data_ptr() == buffer.data_ptr() and flat.dtype == buffer.dtype
                self.stats.record(layout, views if same else layout.views(flat), self.stats.reduced_sq)
            except Exception:
                self._fail("comm hook (reduced gradients)")
            return result
        return measure_reduced

    def issue_gather(self) -> None:
        """After DDP's last bucket: pack this rank's figures, start the step's one collective."""
        if not self.active:
            return
        try:
            self.gather.pack(self.stats.local_sq, self.stats.param_layer, self.stats.layer_order,
                             self.errors.count, self._step_ok)
        except Exception:
            self._fail("rank gather (pack)")
            self.gather.invalidate(self.errors.count)
        try:
            self.gather.issue(self.ring.row(self.step + 1)[self.layout.gathered])
            self._gathered = True
        except Exception:
            self._fail("rank gather (collective)")

    # -- optimizer side ---------------------------------------------------------------------
    def finalize(self) -> torch.Tensor:
        """Complete the step's row on the device (idempotent); returns the row.

        Called before ``optimizer.step()`` when a guard or ``clip_grad_norm_`` needs the
        figures, else from the step post-hook.
        """
        row = self.ring.row(self.step + 1)
        if self._finalized:
            return row
        self._finalized = True
        lay = self.layout
        try:
            if not self.gather.wait():
                row[lay.gathered].zero_()  # no backward this step: every rank reads "invalid"
            norms.fold_layers(self.stats.reduced_sq, self.stats.param_layer, row[lay.layers])
            torch.sum(row[lay.layers], 0, keepdim=True, out=row[1:2])
            valid = self._step_ok and self._gathered
            if self.detector is not None:
                self.detector.update(row, lay, valid=valid)
            row[0].fill_(1.0 if valid else 0.0)
        except Exception:
            self._fail("step finalize")
            row[0].fill_(0.0)
        return row

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
        """Copy the ring to the host (non-blocking) and hand the new steps to the publisher."""
        if self.step == self._exported_through:
            return
        try:
            slots = ((s, self.ring.slot(s)) for s in range(self._exported_through + 1, self.step + 1))
            steps = tuple((s, i, self._timestamps[i], self._skipped[i]) for s, i in slots)
            self._exported_through = self.step
            self.publish(ExportBatch(self.ring.copy_to_host(), steps))
        except Exception:
            self._fail("export")
