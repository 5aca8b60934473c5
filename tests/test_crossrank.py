"""The job's cross-rank figures from fixed-size reductions equal the same figures computed from
every rank's row (issue #28), over many generated jobs.

Each generated job has 1-40 ranks in 1-4 peer groups, some ranks not measured, some with a
non-finite layer (the first in backward order named), errors, ties. Every rank packs its own row
(``CrossRank.pack``), the SUMs are added and the MAXes taken here as the two all-reduces would,
and ``CrossRank.land`` writes the job's figures. The reference sorts the ranks' values in plain
Python: the first non-finite (position, rank, layer), the counts, per group the center (lower
median up to 4 ranks, else the mean without the largest and the smallest), the spread, the
largest deviation and its rank (lowest on a tie).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from distmon.step.crossrank import CrossRank, GroupStat
from distmon.step.rows import Job, RowPlan, RowWriter

CPU = torch.device("cpu")


def reduce_job(plan: RowPlan, rows: torch.Tensor, groups: list[list[int]], order: torch.Tensor) -> CrossRank:
    """What each rank's two all-reduces bring, for one step row holding every rank's row."""
    parts = []
    for r in range(plan.step.world):
        cross = CrossRank(plan, rank=r, n_rows=1, device=CPU)
        cross.compare_within(groups)
        sums, keys = cross.pack(plan.step.rank_rows(rows)[:, r], order)
        parts.append((sums.clone(), keys.clone()))
    cross = CrossRank(plan, rank=0, n_rows=1, device=CPU)
    cross.compare_within(groups)
    cross.sums(1).view(-1).copy_(torch.stack([s for s, _ in parts]).sum(0))
    cross.keys.copy_(torch.stack([k for _, k in parts]).amax(0))
    cross.land(rows, 0)
    return cross


def reference_group(values: list[tuple[float, int]]) -> tuple[float, float, float, int]:
    """(center, spread, largest deviation, its rank) of (x, rank) pairs, by sorting."""
    xs = sorted(x for x, _ in values)
    n = len(xs)
    if n <= 4:
        center = xs[(n - 1) // 2]  # torch's lower median
        d2 = sorted((x - center) ** 2 for x in xs)
        spread = (sum(d2) - (d2[-1] if n >= 3 else 0.0)) / (n - (1 if n >= 3 else 0)) if n >= 2 else math.nan
    else:
        middle = xs[1:-1]
        center = sum(middle) / len(middle)
        spread = sum((x - center) ** 2 for x in middle) / len(middle)
    worst = max(abs(x - center) for x in xs)
    rank = min(r for x, r in values if math.isclose(abs(x - center), worst, rel_tol=0, abs_tol=1e-6))
    return center, spread, worst, rank


@pytest.mark.parametrize("seed", range(60))
def test_reductions_give_what_every_rank_s_row_gives(seed):
    rnd = random.Random(seed)
    world, n_layers = rnd.randint(1, 40), rnd.randint(1, 6)
    plan = RowPlan.build(n_layers=n_layers, world=world, rank_layers=True, detector=True)
    rows = torch.zeros(1, plan.step.width)
    write = RowWriter(plan, rows)
    order = torch.tensor(rnd.sample(range(n_layers), n_layers), dtype=torch.float32)
    n_groups = rnd.randint(1, min(4, world))
    ranks = list(range(world))
    rnd.shuffle(ranks)
    groups = [sorted(ranks[g::n_groups]) for g in range(n_groups)]
    levels = [rnd.choice([0.5, 1.0, 1.0, 2.0]) for _ in range(world)]  # ties on purpose
    bad, measured, errors = [], [], 0
    for r in range(world):
        sq = [levels[r] * rnd.choice([1.0, 1.0, 3.0]) for _ in range(n_layers)]
        if rnd.random() < 0.15:
            layer = rnd.randrange(n_layers)
            sq[layer] = rnd.choice([math.nan, math.inf])
            bad.append((int(order[layer]), r, layer))
        valid = rnd.random() > 0.1
        e = rnd.randint(0, 2)
        errors += e
        write.rank(0, r, layer_sq=sq, valid=valid, errors=e)
        if valid:
            measured.append(r)
    bad = [b for b in bad if b[1] in measured]  # an unmeasured rank names no layer
    cross = reduce_job(plan, rows, groups, order)
    job = rows[0, plan.step.job].tolist()
    assert job[Job.REPORTED] == world and job[Job.MEASURED] == len(measured)
    assert job[Job.ERRORS] == errors and job[Job.NONFINITE_RANKS] == len(bad)
    first = min(bad) if bad else (None, -1, -1)
    assert (job[Job.FIRST_RANK], job[Job.FIRST_LAYER]) == (first[1], first[2])
    gathered = plan.step.rank_rows(rows)[0]
    for g, members in enumerate(groups):
        values = []
        for r in members:
            total = float(gathered[r, plan.rank.layers].sum())
            if r in measured and math.isfinite(total):
                values.append((0.5 * math.log(total), r))
        stat = cross.stats[0, g].tolist()
        assert stat[GroupStat.N] == len(values)
        if not values:
            assert math.isnan(stat[GroupStat.CENTER]) and stat[GroupStat.WORST_RANK] == -1
            continue
        center, spread, worst, rank = reference_group(values)
        assert stat[GroupStat.CENTER] == pytest.approx(center, abs=1e-5)
        if math.isnan(spread):
            assert math.isnan(stat[GroupStat.SPREAD])
        else:
            assert stat[GroupStat.SPREAD] == pytest.approx(spread, abs=1e-5)
        assert stat[GroupStat.WORST] == pytest.approx(worst, abs=1e-5)
        assert stat[GroupStat.WORST_RANK] == rank
