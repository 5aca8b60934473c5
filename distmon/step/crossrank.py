"""What the job learns from every rank, in reductions whose size never depends on the number of ranks.

Per-rank rows stay on their node (``exchange.py`` gathers them over the node's ranks only);
what the job-wide figures need from every rank comes from two all-reduces per export, over
the rows of every step since the last one (device math only, no host sync):

- a SUM (float64) of counts and moments: ranks reporting, ranks measured, monitor errors,
  ranks with a non-finite gradient; per group of peer ranks (those holding the same shards)
  the number of ranks measured and the sums of ``x`` and ``x**2`` (``x``: a rank's log local
  norm); with the noise scale the ranks' local sums of squares (total and per layer);
- a MAX (int64) of keys that carry a rank with a value (c10d has no MAXLOC): the first
  non-finite gradient in backward order (its position, rank and layer), the first non-finite
  activation, per peer group the largest and the smallest ``x`` with their rank, and with the
  noise scale the largest and smallest batch.

From these every rank writes the same job-wide figures into each step row's ``job`` columns
(:class:`Job`) and the peer groups' statistics (:class:`GroupStat`) for the rank-outlier
detector. From 5 ranks on, a group's center is the mean of its ``x`` leaving out the largest
and the smallest, its spread the mean squared deviation from it of the ranks between the two
extremes: neither moved by the one rank, at either end, that is judged. Up to 4 ranks the
sums and the extremes give back every value: the center is the (lower) median and the spread
the mean squared deviation from it leaving out the largest, as when the rows were gathered.
All exact, with no histogram to bin.

Example:
    >>> from distmon.step.rows import RowPlan
    >>> plan = RowPlan.build(n_layers=1, world=3, rank_layers=False)
    >>> cr = CrossRank(plan, rank=0, n_rows=1, device=torch.device("cpu"))
    >>> own = torch.zeros(1, plan.rank.width); own[0, plan.rank.total_sq] = 4.0
    >>> own[0, plan.rank.valid] = 1.0; own[0, plan.rank.first_nonfinite] = -1.0
    >>> _ = cr.pack(own, order=torch.zeros(1))
    >>> cr.sums(1)[0, :4].tolist(), cr.stat_width
    ([1.0, 1.0, 0.0, 0.0], 5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum

import torch

from .rows import Job, RowPlan

__all__ = ["CrossRank", "GroupStat", "KEY_TOP", "MAX_RANKS", "MAX_LAYERS"]

# Packed keys: (position, rank, layer) in 62 bits, (value, rank) in 56: field widths
RANK_BITS, LAYER_BITS = 21, 21
MAX_RANKS = 1 << RANK_BITS  # ranks per job a key can name
MAX_LAYERS = 1 << (62 - RANK_BITS - LAYER_BITS)  # layers (backward positions) a key can name
KEY_TOP = 1 << 62  # keys are sent as KEY_TOP - key: the MAX picks the smallest key
NONE = -(1 << 62)  # "nothing to report" in the MAX block
COUNTS = Job.NONFINITE_RANKS + 1  # the SUM's first columns: Job's counts, added up as they are


class GroupStat(IntEnum):
    """Per step and peer group, what the rank-outlier detector reads (``CrossRank.stats``)."""

    N = 0  # ranks of the group whose log-norm was measured and finite
    CENTER = 1  # the mean of their log-norms leaving out the largest and smallest (n <= 4: lower median)
    SPREAD = 2  # the middle ranks' mean squared deviation from it (n <= 4: the closest n - 1's; NaN: n < 2)
    WORST = 3  # the largest absolute deviation from the center
    WORST_RANK = 4  # its rank (the lowest on a tie)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in the same order (-0.0 and 0.0 alike): a MAX over it is a MAX over ``x``."""
    bits = x.float().view(torch.int32).long()
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _unordered(key: torch.Tensor) -> torch.Tensor:
    """The float32 values back from :func:`_ordered` keys."""
    bits = torch.where(key >= 0, key, (-key) | (1 << 31)).to(torch.int64)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


class CrossRank:
    """The cross-rank reductions of one monitor: packs this rank's part, lands what the job sent.

    ``groups`` (:meth:`compare_within`): the peer groups' ranks, one group of every rank by
    default. The buffers hold ``n_rows`` steps (an export's most); nothing is allocated per step.
    The SUM travels with ``n_extra`` more floats after the steps' (the exchange's: the last
    step's all-reduced region).
    """

    def __init__(
        self, plan: RowPlan, *, rank: int, n_rows: int, device: torch.device, n_extra: int = 0
    ) -> None:
        self.plan, self.rank, self.n_rows, self.device = plan, rank, n_rows, device
        self.n_extra = n_extra
        self.world = plan.step.world
        self.f, step = plan.rank, plan.step
        if self.world > MAX_RANKS or step.n_layers >= MAX_LAYERS or step.n_watched >= MAX_LAYERS:
            raise ValueError(
                f"distmon: a job of {self.world} ranks and {step.n_layers} layers is beyond what the "
                f"cross-rank keys hold ({MAX_RANKS} ranks, {MAX_LAYERS} layers): lower max_layers"
            )
        self.noise = step.noise.stop > step.noise.start
        self.layer_noise = self.noise and self.f.n_layer_cols > 0
        self.stat_width = len(GroupStat)
        self.compare_within([list(range(self.world))])

    def compare_within(self, groups: Sequence[Sequence[int]]) -> None:
        """Compare ranks only within each group (lists of ranks covering the job); before any step."""
        self.groups = [list(g) for g in groups]
        self.my_group = next(i for i, g in enumerate(groups) if self.rank in g)
        g, n = len(groups), self.n_rows
        # SUM columns: the COUNTS (as the job columns they become), 3 per group, then the noise
        # scale's sums (total, per layer)
        self.n_noise = (1 + (self.f.n_layer_cols if self.layer_noise else 0)) if self.noise else 0
        self.sum_width = COUNTS + 3 * g + self.n_noise
        # MAX columns: first non-finite (, first non-finite activation), 2 per group (, each
        # precursor sample) (, batch max, -min)
        self._ext = 1 + (self.f.act_first is not None)  # the groups' first column
        self._signals = self._ext + 2 * g  # the precursor's first column
        self.n_signals = self.f.n_signals
        self.max_width = self._signals + self.n_signals + (2 if self.noise else 0)
        self._flat = torch.zeros(n * self.sum_width + self.n_extra, dtype=torch.float64, device=self.device)
        self.keys = torch.full((n, self.max_width), NONE, dtype=torch.int64, device=self.device)
        # per ring slot (the step rows' order) and group: GroupStat columns
        self.stats = torch.zeros(n, g, self.stat_width, dtype=torch.float32, device=self.device)

    # -- this rank's part -------------------------------------------------------------------
    def sums(self, k: int) -> torch.Tensor:
        """The SUM buffer's rows of ``k`` steps ``(k, sum_width)``."""
        return self._flat[: k * self.sum_width].view(k, self.sum_width)

    def extra(self, k: int) -> torch.Tensor:
        """The ``n_extra`` floats that follow ``k`` steps' SUM rows."""
        return self._flat[k * self.sum_width : k * self.sum_width + self.n_extra]

    def pack(self, own: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's SUM and MAX buffers for its kept rows ``own`` ``(k, rank width)``: the
        tensors to all-reduce (the SUM's :meth:`extra` floats still to be written by the caller).

        ``order``: each layer's position in backward order (the same on every rank).
        """
        f, k, r = self.f, len(own), self.rank
        sums, keys = self.sums(k), self.keys[:k]
        sums.zero_()
        keys.fill_(NONE)
        valid = own[:, f.valid]
        measured = valid == 1.0
        total = own[:, f.total_sq] if f.total_sq is not None else own[:, f.layers].sum(1)
        x = 0.5 * torch.log(total)
        counted = measured & torch.isfinite(x)
        layer, pos = self._first_bad(own, order)
        bad = (valid > 0.0) & (layer >= 0)  # LOCAL_NONFINITE_ONLY still names the rank
        sums[:, Job.REPORTED] = 1.0
        sums[:, Job.MEASURED] = measured.double()
        sums[:, Job.ERRORS] = own[:, f.errors].double()
        sums[:, Job.NONFINITE_RANKS] = bad.double()
        g = COUNTS + 3 * self.my_group
        xd = torch.where(counted, x, 0.0).double()
        sums[:, g] = counted.double()
        sums[:, g + 1] = xd
        sums[:, g + 2] = xd * xd
        key = (pos.long() << (RANK_BITS + LAYER_BITS)) + (r << LAYER_BITS) + layer.clamp(min=0).long()
        keys[:, 0] = torch.where(bad, KEY_TOP - key, NONE)
        if f.act_first is not None:
            module = own[:, f.act_first]
            keys[:, 1] = torch.where(module >= 0, KEY_TOP - ((module.long() << RANK_BITS) + r), NONE)
        tie = MAX_RANKS - 1 - r  # the lowest rank wins a tie
        h = self._ext + 2 * self.my_group
        keys[:, h] = torch.where(counted, (_ordered(x) << RANK_BITS) + tie, NONE)
        keys[:, h + 1] = torch.where(counted, (_ordered(-x) << RANK_BITS) + tie, NONE)
        if self.n_signals:  # the largest sample of each signal over the ranks (NaN: an overflow, wins)
            bounds = own[:, f.signals]
            # a positive NaN's bits order above +Inf's: the MAX keeps it (a -NaN would sort below all)
            keys[:, self._signals : self._signals + self.n_signals] = _ordered(
                torch.where(torch.isnan(bounds), math.nan, bounds)
            )
        if self.noise:
            s = COUNTS + 3 * len(self.groups)
            sums[:, s] = torch.where(measured, total, 0.0).double()
            if self.layer_noise:
                sums[:, s + 1 :] = torch.where(measured[:, None], own[:, f.layers], 0.0).double()
            batch = own[:, f.batch]
            keys[:, -2] = _ordered(batch)
            keys[:, -1] = _ordered(-batch)
        return self._flat[: k * self.sum_width + self.n_extra], keys

    def _first_bad(self, own: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per kept row: the rank's first non-finite layer in backward order (-1: none) and its position."""
        f = self.f
        if f.first_nonfinite is not None:
            layer = own[:, f.first_nonfinite].long()
            return layer, order[layer.clamp(min=0)]
        bad = ~torch.isfinite(own[:, f.layers])
        pos = torch.where(bad, order.to(own.dtype), math.inf)
        first, layer = pos.min(1)
        return torch.where(torch.isfinite(first), layer, -1), first.nan_to_num(0.0, posinf=0.0)

    # -- what the job sent ------------------------------------------------------------------
    def land(self, rows: torch.Tensor, slot: int) -> None:
        """Write the reduced SUM and MAX rows of ``len(rows)`` steps into their step ``rows`` ``(k, width)``
        (the job columns) and :attr:`stats` from ring slot ``slot`` on (the peer groups')."""
        k = len(rows)
        sums, keys = self.sums(k), self.keys[:k]
        job = rows[:, self.plan.step.job]
        job[:, :COUNTS] = sums[:, :COUNTS].float()
        job[:, Job.FIRST_RANK : Job.FIRST_LAYER + 1] = self._located(keys[:, 0], LAYER_BITS)
        if self.f.act_first is not None:
            job[:, Job.ACT_RANK : Job.ACT_MODULE + 1] = self._located(keys[:, 1], 0)
        else:
            job[:, Job.ACT_RANK : Job.ACT_MODULE + 1] = -1.0
        job[:, Job.MEAN_SQ :] = math.nan
        if self.n_signals:  # -inf: no rank sampled the step (not a sampled step)
            bounds = _unordered(keys[:, self._signals : self._signals + self.n_signals])
            rows[:, self.plan.step.signals] = torch.where(bounds == -math.inf, math.nan, bounds)
        if self.noise:
            s = COUNTS + 3 * len(self.groups)
            job[:, Job.MEAN_SQ] = (sums[:, s] / self.world).float()
            if self.layer_noise:
                job[:, len(Job) :] = (sums[:, s + 1 :] / self.world).float()
            hi, lo = _unordered(keys[:, -2]), -_unordered(keys[:, -1])
            job[:, Job.BATCH] = torch.where(hi == lo, hi, math.nan)
        self._group_stats(sums, keys, self.stats[slot : slot + k])

    @staticmethod
    def _located(keys: torch.Tensor, low_bits: int) -> torch.Tensor:
        """``(k,)`` MAX keys -> ``(k, 2)`` (rank, item): position (the high bits) then rank, then item."""
        key = KEY_TOP - keys
        rank = (key >> low_bits) & (MAX_RANKS - 1)
        item = key & ((1 << low_bits) - 1) if low_bits else key >> RANK_BITS
        found = keys != NONE
        return torch.stack([torch.where(found, rank, -1), torch.where(found, item, -1)], 1).float()

    def _group_stats(self, sums: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> None:
        k, g = len(sums), len(self.groups)
        moments = sums[:, COUNTS : COUNTS + 3 * g].view(k, g, 3)
        n, sx, sxx = moments.unbind(2)
        ext = keys[:, self._ext : self._ext + 2 * g].view(k, g, 2)
        present = ext[..., 0] != NONE
        hi = _unordered(ext[..., 0] >> RANK_BITS).double()
        lo = -_unordered(ext[..., 1] >> RANK_BITS).double()
        hi_rank = MAX_RANKS - 1 - (ext[..., 0] & (MAX_RANKS - 1))
        lo_rank = MAX_RANKS - 1 - (ext[..., 1] & (MAX_RANKS - 1))
        trim = n >= 3
        # the center: the mean leaving out the largest and the smallest (n >= 5), the median (3),
        # the lower median (4, 2: as torch.median; with n <= 4 the moments and the extremes
        # give back every value, the middle two of 4 as their mean -/+ half their gap)
        center = torch.where(trim, (sx - hi - lo) / (n - 2).clamp(min=1), sx / n.clamp(min=1))
        # the middle ranks' mean squared deviation from their own mean (from the moments,
        # float64: no cancellation worth a score at any world size)
        middle = (sxx - hi * hi - lo * lo - (n - 2) * center * center).clamp(min=0.0) / (n - 2).clamp(min=1)
        center = torch.where(n == 4, center - middle.sqrt(), torch.where(n == 2, lo, center))
        center = torch.where(present, center, math.nan)
        up, down = hi - center, center - lo
        worst = torch.maximum(up, down)
        # the spread: from 5 ranks on, the middle ranks' (neither extreme, the outlier to be
        # judged, moves the scale it is judged by); up to 4, the mean squared deviation from
        # the center leaving out the largest (with 2, both)
        d2 = (sxx - 2 * center * sx + n * center * center).clamp(min=0.0)
        trimmed = (d2 - torch.where(trim, worst * worst, 0.0)).clamp(min=0.0) / (n - trim.double()).clamp(
            min=1
        )
        spread = torch.where(n >= 5, middle, trimmed)
        spread = torch.where(n >= 2, spread, math.nan)
        # the lower rank on a tie between the largest and the smallest
        pick_up = (up > down) | ((up == down) & (hi_rank <= lo_rank))
        worst_rank = torch.where(pick_up, hi_rank, lo_rank)
        out[..., GroupStat.N] = n.float()
        out[..., GroupStat.CENTER] = center.float()
        out[..., GroupStat.SPREAD] = spread.float()
        out[..., GroupStat.WORST] = torch.where(present, worst, math.nan).float()
        out[..., GroupStat.WORST_RANK] = torch.where(present, worst_rank, -1).float()

    def alone(self, rows: torch.Tensor, slot: int, own: torch.Tensor, order: torch.Tensor) -> None:
        """Land this rank's own part as if it were the job's (one process; a rank closing without
        the others: ``REPORTED`` 1 says the job-wide figures are this rank's alone)."""
        self.pack(own, order)
        self.land(rows, slot)
