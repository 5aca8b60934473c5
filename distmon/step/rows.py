"""The row schema: where every figure of a step sits, declared once.

Each optimizer step leaves one row of float32 in the device ring (what an export copies to
the host), and each rank sends its own part of it in the step's collective (a *rank row*).
Both are laid out here, by name, from the options of one monitor; every other module reads
and writes them through these names:

    step row   head (valid, total_sq) | layers | ranks (node_size x rank row) | job | detector | noise
               | act | upd
    rank row   layers, or total_sq + first_nonfinite | errors | valid | reduced_ok | batch | act_first
               | vote | parts      (the last two: what the ordinary step's all-reduce adds up)

A region of size 0 is absent (its slice is empty, its index None): ``noise`` without
``batch_size``, ``in_parts`` when every rank holds the whole reduced gradient, and so on.

Example:
    >>> plan = RowPlan.build(n_layers=3, world=2, rank_layers=True)
    >>> plan.rank.width, plan.rank.layers, plan.step.layers, plan.step.ranks
    (5, slice(0, 3, None), slice(2, 5, None), slice(5, 15, None))

The ranks region holds the rows of the ranks this rank *holds*: its node's (``node_size`` of them, the
world on one node); the ``job`` columns what the whole job's ranks add up to
(``crossrank.py``), whatever the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

__all__ = [
    "Head",
    "Verdict",
    "Job",
    "Noise",
    "Early",
    "Oscillation",
    "Schema",
    "RankRow",
    "StepRow",
    "RowPlan",
    "RowWriter",
    "earliest_nonfinite",
    "LOCAL_NONFINITE_ONLY",
]

# A rank row's ``valid`` when the step's local gradient was split over several reduction inputs,
# every one read (ZeRO-2/3 reducing every micro-batch): the sums added up are no norm (NaN where
# served) but non-finite iff one micro-batch's gradient was, so the rank is still named. Every
# check of a measured local figure is ``valid == 1.0``.
LOCAL_NONFINITE_ONLY = 0.5


class Head(IntEnum):
    """The first two columns of a step row."""

    VALID = 0  # 1.0: this rank measured the step's reduced gradient
    TOTAL_SQ = 1  # the reduced sum of squares (the layers' sum, written when the row is judged)


class Job(IntEnum):
    """The job-wide columns of a step row, written by ``crossrank.py`` (then, with the noise scale,
    the ranks' mean local sum of squares per layer)."""

    REPORTED = 0  # ranks whose figures reached the reductions (the world, unless some closed alone)
    MEASURED = 1  # ranks whose local figures were measured
    ERRORS = 2  # monitor errors, summed over ranks
    NONFINITE_RANKS = 3  # ranks whose local gradient held a NaN/Inf
    FIRST_RANK = 4  # the first non-finite (rank, layer) in backward order (-1: none)
    FIRST_LAYER = 5
    ACT_RANK = 6  # the first non-finite activation (rank, module) in forward order (-1: none)
    ACT_MODULE = 7
    MEAN_SQ = 8  # noise scale: the ranks' mean local sum of squares (NaN without it)
    BATCH = 9  # noise scale: the per-rank batch, NaN unless every rank had the same


class Verdict(IntEnum):
    """The detector columns of a step row (then one rank-outlier score per node rank)."""

    ZSCORE = 0  # z-score of the log global norm
    MEDIAN_RATIO = 1  # global norm / running median
    LAYER_ZMAX = 2  # largest layer z-score
    SPIKE_GLOBAL = 3  # 1: the global norm spiked
    SPIKE_LAYER = 4  # index of the layer that spiked with the largest z, -1 if none
    SPIKE_LAYER_Z = 5  # its z-score
    VANISHING = 6  # 1: the vanishing run reached its length this step
    BLOCK = 7  # 1: a guard must not take this step (non-finite or spiking reduced gradient)
    # from here on: the per-rank verdicts, judged once the export's collectives are in (the node's
    # ranks' rows, the job-wide reductions of every rank's figures)
    OUTLIER = 8  # 1: a rank is an outlier
    OUTLIER_RANK = 9  # the rank with the largest outlier score
    OUTLIER_SCORE = 10  # its score


class Noise(IntEnum):
    """The noise columns of a step row (then B_simple per layer, then EMA |G_l|^2 per layer)."""

    SCALE = 0  # B_simple
    TRACE = 1  # bias-corrected EMA of tr(Sigma)
    SIGNAL = 2  # bias-corrected EMA of |G|^2


class Oscillation(IntEnum):
    """The oscillation rule's columns among the precursor's samples (after the blocks' bounds)."""

    ONE_MINUS_COS = 0  # 1 - the sampling interval's mean cosine of consecutive gradients (NaN: none)
    HEADROOM = 1  # PrecursorConfig.peak_lr over the rate at the sample while it rises (0 once it fell)


class Early(IntEnum):
    """The precursor's verdict columns of a step row (after the blocks' bounds), on sampled steps."""

    WARN = 0  # 1: the precursor warns at this sample
    FIRST = 1  # 1: its first warning of an episode (the sample before did not warn): an event
    BLOCK = 2  # the warning block with the largest margin (-1: none)
    SCORE = 3  # its margin over the rule, in log units (> 0: over)


class Schema:
    """Consecutive named regions of a row, from ``(name, size)`` pairs in row order.

    Example:
        >>> s = Schema([("a", 2), ("b", 0), ("c", 1)])
        >>> s["a"], s["b"], s.index("c"), s.index("b"), s.width
        (slice(0, 2, None), slice(2, 2, None), 2, None, 3)
    """

    def __init__(self, sizes: Sequence[tuple[str, int]]) -> None:
        self._slices: dict[str, slice] = {}
        cursor = 0
        for name, n in sizes:
            self._slices[name] = slice(cursor, cursor + n)
            cursor += n
        self.width = cursor

    def __getitem__(self, name: str) -> slice:
        return self._slices[name]

    def index(self, name: str) -> int | None:
        """The column of a one-float region, None if absent."""
        region = self._slices[name]
        return region.start if region.stop > region.start else None

    def span(self, names: Sequence[str]) -> slice:
        """The columns of consecutive regions ``names`` together (ValueError if they are not consecutive).

        Example:
            >>> Schema([("a", 2), ("b", 0), ("c", 1)]).span(("b", "c"))
            slice(2, 3, None)
        """
        regions = [self._slices[n] for n in names]
        if any(a.stop != b.start for a, b in zip(regions, regions[1:])):
            raise ValueError(f"regions {list(names)} are not consecutive")
        return slice(regions[0].start, regions[-1].stop)

    def within(self, outer: slice, name: str) -> slice:
        """Region ``name``'s columns counted from ``outer``'s start (a buffer holding ``outer`` alone).

        Example:
            >>> s = Schema([("a", 2), ("b", 0), ("c", 1)])
            >>> s.within(s.span(("b", "c")), "c")
            slice(0, 1, None)
        """
        region = self._slices[name]
        assert outer.start <= region.start and region.stop <= outer.stop, (name, outer)
        return slice(region.start - outer.start, region.stop - outer.start)


def earliest_nonfinite(values: Sequence[float], order: Sequence[float]) -> int:
    """Host side: index of the non-finite value earliest in backward ``order``, or -1.

    The host twin of :func:`distmon.step.sums.first_nonfinite`, for figures already on the host.

    Example:
        >>> earliest_nonfinite([1.0, float("nan"), float("inf")], [0.0, 2.0, 1.0])
        2
    """
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    return min(bad, key=order.__getitem__) if bad else -1


class RankRow:
    """One rank's floats in a step's row: what the step's collective carries for it.

    With ``rank_layers`` a rank sends its per-layer local sums of squares (its total and first
    non-finite layer follow from them where read); without, ``total_sq`` and
    ``first_nonfinite`` (layer index, -1 if none): two floats whatever the number of layers.
    Then ``errors`` (its monitor error count) and ``valid`` (its local figures were measured);
    ``batch`` (the noise scale: its batch this step), ``act_first`` (activations: its first
    non-finite module, -1 if none), ``signals`` (the precursor's samples on a sampled step, ``-inf``
    on others: each attention block's logit bound, then with the oscillation rule the interval's
    ``1 -`` mean consecutive-gradient cosine and the rate headroom, :class:`Oscillation`). The row
    ends with :attr:`reduced`, what an ordinary step's all-reduce adds up: ``vote`` (rank 0's
    "export now", with a time-bounded export) and, in a layout in parts, ``reduced_ok`` (its
    counted parts of the reduced gradient were measured: the sum is the world when every rank's
    were) and ``parts`` (the per-layer sums of squares of the parts it counts).

    Example:
        >>> r = RankRow(n_layers=3, rank_layers=True, vote=True)
        >>> r.width, r.valid, r.reduced, r.totals([[1.0, 4.0, 4.0, 0.0, 1.0, 0.0]])
        (6, 4, slice(5, 6, None), [9.0])
    """

    # the regions an ordinary step's all-reduce adds up (consecutive: one slice of the send row)
    REDUCED = ("vote", "reduced_ok", "parts")

    def __init__(
        self,
        *,
        n_layers: int,
        rank_layers: bool,
        in_parts: bool = False,
        batch: bool = False,
        activations: bool = False,
        vote: bool = False,
        attention: int = 0,
        oscillation: bool = False,
    ) -> None:
        self.n_layer_cols = n_layers if rank_layers else 0
        self.n_attention = attention
        self.n_signals = attention + (len(Oscillation) if oscillation else 0)
        self.n_parts = n_layers if in_parts else 0
        self.schema = s = Schema(
            [
                ("layers", self.n_layer_cols),
                ("total_sq", 0 if rank_layers else 1),
                ("first_nonfinite", 0 if rank_layers else 1),
                ("errors", 1),
                ("valid", 1),
                ("batch", 1 if batch else 0),
                ("act_first", 1 if activations else 0),
                ("signals", self.n_signals),
                ("vote", 1 if vote else 0),
                ("reduced_ok", 1 if in_parts else 0),
                ("parts", self.n_parts),
            ]
        )
        self.width = s.width
        self.layers, self.parts = s["layers"], s["parts"]
        self.total_sq, self.first_nonfinite = s.index("total_sq"), s.index("first_nonfinite")
        self.errors, self.valid = s["errors"].start, s["valid"].start
        self.reduced_ok, self.batch = s.index("reduced_ok"), s.index("batch")
        self.act_first, self.vote, self.signals = s.index("act_first"), s.index("vote"), s["signals"]
        self.reduced = s.span(self.REDUCED)
        # fixed with the row: looked up on every all-reduce step, computed once here
        self._summed = {name: s.within(self.reduced, name) for name in self.REDUCED}

    def summed(self, name: str) -> slice:
        """Where region ``name`` (one of :attr:`REDUCED`) sits in the all-reduce's buffer, by name.

        Example:
            >>> r = RankRow(n_layers=2, rank_layers=True, in_parts=True, vote=True)
            >>> r.summed("vote"), r.summed("reduced_ok"), r.summed("parts")
            (slice(0, 1, None), slice(1, 2, None), slice(2, 4, None))
        """
        return self._summed[name]

    def totals(self, ranks: Sequence[Sequence[float]]) -> list[float]:
        """Host side: each rank's local sum of squares from its floats."""
        if self.total_sq is not None:
            return [vals[self.total_sq] for vals in ranks]
        return [sum(vals[self.layers]) for vals in ranks]

    def device_totals(self, gathered: torch.Tensor) -> torch.Tensor:
        """Device side: ``(..., world, width)`` rank rows -> ``(..., world)`` local sums of squares."""
        if self.total_sq is not None:
            return gathered[..., self.total_sq]
        return gathered[..., self.layers].sum(-1)

    def first_nonfinite_layer(self, vals: Sequence[float], order: Sequence[float]) -> int:
        """Host side: the rank's non-finite layer earliest in backward ``order``, or -1."""
        if self.first_nonfinite is not None:
            return int(vals[self.first_nonfinite])
        return earliest_nonfinite(vals[self.layers], order)


class StepRow:
    """One step's row in the device ring: its head, reduced layers, the node ranks' rows, the job's
    cross-rank figures, derived figures.

    ``world``: the job's ranks; ``node_size``: how many ranks' rows this rank holds (its node's);
    ``job``: :class:`Job` columns, then with the noise scale the ranks' mean
    local sum of squares per layer; ``detector``: :class:`Verdict` columns then one outlier score
    per node rank; ``noise``:
    :class:`Noise` columns then B_simple and EMA |G_l|^2 per layer; ``act``: RMS per watched
    module, max-abs per module, the first non-finite module; ``upd``: the update ratio per layer;
    ``precursor``: its samples on a sampled step (the job's largest; NaN on other steps): each
    attention block's logit bound, then with the oscillation rule the :class:`Oscillation`
    columns; then :class:`Early` columns.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        world: int,
        rank: RankRow,
        node_size: int | None = None,
        detector: bool = False,
        noise: bool = False,
        watched: int = 0,
        update_ratio: bool = False,
    ) -> None:
        self.n_layers, self.world, self.rank = n_layers, world, rank
        self.n_attention, self.n_signals = rank.n_attention, rank.n_signals
        self.node_size = world if node_size is None else node_size
        self.n_watched = watched
        self.schema = s = Schema(
            [
                ("head", len(Head)),
                ("layers", n_layers),
                ("ranks", self.node_size * rank.width),
                ("job", len(Job) + (n_layers if noise else 0)),
                ("detector", len(Verdict) + self.node_size if detector else 0),
                ("noise", len(Noise) + 2 * n_layers if noise else 0),
                ("act", 2 * watched + 1 if watched else 0),
                ("upd", n_layers if update_ratio else 0),
                ("precursor", self.n_signals + len(Early) if self.n_signals else 0),
            ]
        )
        self.width = s.width
        self.layers, self.ranks, self.job = s["layers"], s["ranks"], s["job"]
        self.detector, self.noise, self.act, self.upd = s["detector"], s["noise"], s["act"], s["upd"]
        self.precursor = s["precursor"]
        self.signals = slice(self.precursor.start, self.precursor.start + self.n_signals)  # samples
        self.attn = slice(self.signals.start, self.signals.start + self.n_attention)  # the blocks' bounds
        self.oscillation = slice(self.attn.stop, self.signals.stop)  # Oscillation columns (or none)
        # the reduced log-norm's inputs: the total, then every layer
        self.total_and_layers = slice(Head.TOTAL_SQ, self.layers.stop)

    def rank_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The ranks region of ``rows`` ``(k, width)`` as ``(k, node_size, rank.width)``: each node rank's
        floats."""
        return rows[:, self.ranks].view(len(rows), self.node_size, self.rank.width)

    def blank(self, device: torch.device) -> torch.Tensor:
        """A step's row before it is measured: valid, zero sums, no verdict, NaN derived figures.

        Rows are reset to it in bulk when exported, so a step writes only what it measures.
        """
        row = torch.zeros(self.width, dtype=torch.float32, device=device)
        row[Head.VALID] = 1.0
        if self.detector.stop > self.detector.start:
            row[self.detector.start + Verdict.SPIKE_LAYER] = -1.0
            row[self.detector.start + Verdict.OUTLIER_RANK] = -1.0  # not judged: no worst rank
            row[self.detector.start + Verdict.OUTLIER_SCORE] = math.nan
        row[self.job] = math.nan  # no job-wide figure until the export's reductions landed
        row[self.noise] = math.nan  # no noise-scale figure until a row is judged
        row[self.act] = math.nan  # a step whose forwards were not watched
        row[self.upd] = math.nan  # not a scheduled export step (Exchange.scheduled)
        if self.n_signals:
            row[self.precursor] = math.nan  # not a sampled step, or not judged yet
            verdict = self.signals.stop
            row[verdict + Early.WARN] = row[verdict + Early.FIRST] = 0.0
            row[verdict + Early.BLOCK] = -1.0
        return row


@dataclass(frozen=True)
class RowPlan:
    """The rank row and the step row of one monitor, built before anything that reads or writes them."""

    rank: RankRow
    step: StepRow

    @classmethod
    def build(
        cls,
        *,
        n_layers: int,
        world: int,
        node_size: int | None = None,
        rank_layers: bool = True,
        in_parts: bool = False,
        vote: bool = False,
        batch: bool = False,
        watched: int = 0,
        detector: bool = False,
        update_ratio: bool = False,
        attention: int = 0,
        oscillation: bool = False,
    ) -> RowPlan:
        """The plan for these options; ``watched`` is the number of modules whose activations are
        watched, ``attention`` the attention blocks the precursor reads, ``oscillation`` whether it
        reads consecutive gradients' cosine, ``node_size`` how many ranks' rows this rank holds
        (its node's; the world by default)."""
        rank = RankRow(
            n_layers=n_layers,
            rank_layers=rank_layers,
            in_parts=in_parts,
            batch=batch,
            activations=watched > 0,
            vote=vote,
            attention=attention,
            oscillation=oscillation,
        )
        step = StepRow(
            n_layers=n_layers,
            world=world,
            node_size=node_size,
            rank=rank,
            detector=detector,
            noise=batch,
            watched=watched,
            update_ratio=update_ratio,
        )
        return cls(rank, step)

    @property
    def verdict_column(self) -> int:
        """The step row's column of the guard's verdict (1.0: do not take this step)."""
        return self.step.detector.start + Verdict.BLOCK


class RowWriter:
    """Writes figures into step rows by name, as the schedule does (tests and benchmarks fill rows so).

    Example:
        >>> plan = RowPlan.build(n_layers=2, world=2, rank_layers=False)
        >>> rows = torch.zeros(1, plan.step.width)
        >>> w = RowWriter(plan, rows)
        >>> w.reduced(0, [1.0, 4.0]); w.rank(0, 1, total_sq=9.0)
        >>> rows[0, Head.TOTAL_SQ].item(), plan.step.rank_rows(rows)[0, 1, plan.rank.total_sq].item()
        (5.0, 9.0)
    """

    def __init__(self, plan: RowPlan, rows: torch.Tensor) -> None:
        self.plan, self.rows = plan, rows

    def reduced(self, i: int, layer_sq: Sequence[float]) -> None:
        """Row ``i``: valid, with these reduced per-layer sums of squares and their total."""
        row, step = self.rows[i], self.plan.step
        sq = torch.tensor(layer_sq, dtype=torch.float64)
        row[Head.VALID] = 1.0
        row[step.layers] = sq.float()
        row[Head.TOTAL_SQ] = sq.sum().float()

    def rank(
        self,
        i: int,
        r: int,
        *,
        layer_sq: Sequence[float] | None = None,
        total_sq: float | None = None,
        valid: bool = True,
        errors: int = 0,
        batch: float | None = None,
    ) -> None:
        """Row ``i``, rank ``r``'s floats: its local sums (per layer, or total), validity, errors, batch."""
        f = self.plan.rank
        vals = self.plan.step.rank_rows(self.rows[i : i + 1])[0, r]
        if layer_sq is not None:
            vals[f.layers] = torch.tensor(layer_sq, dtype=torch.float32)
        if total_sq is not None and f.total_sq is not None:
            vals[f.total_sq] = total_sq
        if f.first_nonfinite is not None:
            vals[f.first_nonfinite] = -1.0
        vals[f.valid] = 1.0 if valid else 0.0
        vals[f.errors] = float(errors)
        if batch is not None and f.batch is not None:
            vals[f.batch] = batch
