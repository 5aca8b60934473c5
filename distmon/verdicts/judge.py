"""Judging finished rows: totals, detector verdicts, the noise scale, batched over many steps.

A row is *judged* once its figures are final: its reduced total and the detectors' verdicts
on the reduced figures as soon as they are needed (at the export, in one batch over the steps
since the last one; before the optimizer step when a guard or ``clip_grad_norm_`` needs the
step's figures), and the verdicts that compare ranks (rank outliers, the noise scale) once
the export's collectives are in: the node's ranks' rows (gathered within the node) and the
job-wide figures of every rank (two fixed-size reductions over the job, ``step/crossrank.py``).
Only runs of valid steps are judged: an invalid row keeps the blank row's "no verdict".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..errors import ErrorCounter
from ..step.crossrank import CrossRank
from ..step.rows import Early, Oscillation, StepRow
from .detectors import DeviceDetector
from .noise_scale import NoiseScale
from .precursor import PrecursorDetector

__all__ = ["Judge", "valid_runs"]


def valid_runs(valid: Sequence[bool]) -> list[tuple[int, int]]:
    """The ``(start, stop)`` ranges of consecutive True entries, in order.

    Example:
        >>> valid_runs([True, True, False, True])
        [(0, 2), (3, 4)]
    """
    runs, start = [], 0
    for ok, run in itertools.groupby(valid):
        n = len(list(run))
        if ok:
            runs.append((start, start + n))
        start += n
    return runs


class Judge:
    """The verdicts of finished step rows: reduced ones (:meth:`judge_reduced`), cross-rank ones
    (:meth:`judge_ranks`).

    Example:
        >>> from distmon.step.rows import Head, RowPlan
        >>> from distmon.verdicts.detectors import DetectorConfig, DeviceDetector
        >>> plan = RowPlan.build(n_layers=1, world=1, detector=True)
        >>> detector = DeviceDetector(DetectorConfig(), plan, torch.device("cpu"))
        >>> rows = plan.step.blank(torch.device("cpu")).repeat(3, 1)
        >>> rows[:, Head.TOTAL_SQ] = rows[:, plan.step.layers.start] = 4.0   # a norm of 2, three steps
        >>> judge = Judge(plan.step, detector=detector, noise=None, errors=ErrorCounter())
        >>> judge.judge_reduced(rows, [True] * 3)
        >>> detector.updates
        3
    """

    def __init__(
        self,
        step_row: StepRow,
        *,
        detector: DeviceDetector | None,
        noise: NoiseScale | None,
        errors: ErrorCounter,
        cross: CrossRank | None = None,
        precursor: PrecursorDetector | None = None,
    ) -> None:
        self.step_row, self.detector, self.noise, self.errors = step_row, detector, noise, errors
        self.cross = cross  # the job's cross-rank figures per ring slot (the rank outliers read them)
        self.precursor = precursor
        if precursor is not None:
            start = step_row.signals.stop  # the Early columns follow the samples
            self._early = slice(start, start + len(Early))
            # the detector's columns: each block's bound, then the oscillation rule's 1 - cosine
            osc = step_row.oscillation
            self._columns = slice(step_row.attn.start, osc.start + (1 if osc.stop > osc.start else 0))
            self._headroom = osc.start + Oscillation.HEADROOM if osc.stop > osc.start else None
            self._warned = torch.zeros((), dtype=torch.bool, device=precursor.ema.device)  # the last sample'

    def judge_reduced(self, rows: torch.Tensor, valid: Sequence[bool]) -> None:
        """Update the reduced-figure detectors with consecutive ``rows`` (``valid``: which rows were
        measured; their totals landed with their reduced sums, ``DeviceRing.land_reduced``)."""
        try:
            if self.detector is not None:
                for start, stop in valid_runs(valid):
                    self.detector.update(rows[start:stop])
        except Exception:
            self.errors.record("detectors")

    def judge_ranks(self, rows: torch.Tensor, valid: Sequence[bool], slot: int = 0, first: int = 1) -> None:
        """Update the verdicts that compare ranks (rank outliers, noise scale, the precursor's
        samples), once the export's reductions of every rank's figures landed (``slot``: the ring
        slot of ``rows[0]``, ``first``: its step)."""
        if self.detector is not None and self.cross is not None:
            try:
                for start, stop in valid_runs(valid):
                    stats = self.cross.stats[slot + start : slot + stop]
                    self.detector.update_ranks(rows[start:stop], stats)
            except Exception:
                self.errors.record("detectors")
        if self.noise is not None:
            try:
                self.noise.update(rows)
            except Exception:
                self.errors.record("gradient noise scale")
        if self.precursor is not None:
            try:
                self._judge_samples(rows, first)
            except Exception:
                self.errors.record("divergence precursor")

    def _judge_samples(self, rows: torch.Tensor, first: int) -> None:
        """The precursor's verdicts on the sampled steps among ``rows`` (every ``every``-th step: a
        strided view), written into their :class:`~distmon.step.rows.Early` columns."""
        every = self.precursor.cfg.every
        sampled = rows[(-first) % every :: every]
        if not len(sampled):
            return
        samples = sampled[:, self._columns]
        if self._headroom is not None:
            # the oscillation column counts only while the schedule will still raise the rate by
            # rate_headroom or more (a headroom of 0: it fell from its highest), and where a pair
            # was measured (NaN is no overflow here):
            # elsewhere it reads 0, the detector's "not measured"
            cos = samples[:, -1]
            keep = (sampled[:, self._headroom] >= self.precursor.cfg.rate_headroom) & torch.isfinite(cos)
            samples = torch.cat([samples[:, :-1], torch.where(keep, cos, 0.0).unsqueeze(1)], 1)
        verdict = self.precursor.update(samples)
        before = torch.cat([self._warned.view(1), verdict.warn[:-1]])
        self._warned.copy_(verdict.warn[-1])
        columns = (verdict.warn, verdict.warn & ~before, verdict.column, verdict.score)
        sampled[:, self._early] = torch.stack([c.to(rows.dtype) for c in columns], 1)
