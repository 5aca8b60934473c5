"""Detector math on long synthetic norm series, single process (no DDP needed).

Series are generated here from closed-form curves with log-normal noise; each step's row is
filled the way the tracker fills it (sums of squares, gathered per-rank totals) and the real
DeviceDetector + EventFinder turn it into events. Thresholds are the defaults of
DetectorConfig, stated below, unless a test says otherwise.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from distmon.snapshot import Snapshot
from distmon.step.crossrank import CrossRank
from distmon.step.rows import Head, RowPlan, RowWriter
from distmon.verdicts.detectors import DetectorConfig, DeviceDetector, EventFinder

DEFAULTS = DetectorConfig()
LAYERS = ("embed", "block0", "block1", "head")
BLOCKS = [1, 10]  # a guard judges every step alone; without one, a run of export_every steps


class Feeder:
    """Feeds (layer norms, rank norms) per step through the device detector, ``block`` steps at a time.

    Rows are filled by name (``RowWriter``), as the tracker fills them; every ``block`` steps the
    buffered rows go to the detector as one run and are decoded. Returns each step's events once
    its block has been judged (``flush`` judges a partial block).
    """

    def __init__(self, world: int = 4, cfg: DetectorConfig = DEFAULTS, block: int = 1) -> None:
        self.plan = RowPlan.build(n_layers=len(LAYERS), world=world, rank_layers=False, detector=True)
        self.det = DeviceDetector(cfg, self.plan, torch.device("cpu"))
        self.dec = EventFinder(cfg, LAYERS)
        self.world = world
        self.block = block
        self.step = 0
        self.rows = torch.zeros(block, self.plan.step.width)
        self.write = RowWriter(self.plan, self.rows)
        self.pending: list[tuple[int, list[float]]] = []
        self.scores: list[tuple[dict, list[float]]] = []  # per step, once judged
        self.reduce = RankReductions(self.plan, block)

    def __call__(self, layer_norms: list[float], rank_norms: list[float]) -> list:
        self.step += 1
        i = len(self.pending)
        self.rows[i].zero_()
        self.write.reduced(i, [n * n for n in layer_norms])
        for r, n in enumerate(rank_norms):
            self.write.rank(i, r, total_sq=n * n)
        self.pending.append((self.step, list(rank_norms)))
        return self.flush() if len(self.pending) == self.block else []

    def flush(self) -> list:
        k = len(self.pending)
        if not k:
            return []
        self.det.update(self.rows[:k])
        self.det.update_ranks(self.rows[:k], self.reduce(self.rows[:k]))  # the export
        events = []
        for (step, ranks), vals in zip(self.pending, self.rows[:k].tolist()):
            total = vals[Head.TOTAL_SQ]
            norm = math.sqrt(total) if math.isfinite(total) else math.nan
            snap = Snapshot(
                step=step,
                timestamp=0.0,
                grad_norm=norm,
                rank_grad_norms=ranks,
                nonfinite=not math.isfinite(norm),
            )
            judged = self.dec(step, vals[self.plan.step.detector], snap)
            self.scores.append((judged.scores, judged.rank_outlier_scores))
            events += judged.events
        self.pending = []
        return events


class RankReductions:
    """What an export's two all-reduces bring for rows holding every rank's row: each rank's part
    packed as on that rank (``CrossRank.pack``), added up (SUM) and maxed (MAX) here as the
    collectives would, landed as on every rank."""

    def __init__(self, plan: RowPlan, n_rows: int) -> None:
        cpu = torch.device("cpu")
        self.plan = plan
        self.ranks = [CrossRank(plan, rank=r, n_rows=n_rows, device=cpu) for r in range(plan.step.world)]
        self.order = torch.zeros(plan.step.n_layers)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        k, own = len(rows), self.plan.step.rank_rows(rows)
        parts = [cross.pack(own[:, r], self.order) for r, cross in enumerate(self.ranks)]
        sums = torch.stack([s for s, _ in parts]).sum(0)
        keys = torch.stack([m for _, m in parts]).amax(0)
        cross = self.ranks[0]
        cross.sums(k).view(-1).copy_(sums)
        cross.keys[:k].copy_(keys)
        cross.land(rows, 0)
        return cross.stats[:k]


def series(seed: int, steps: int, start: float, end: float, tau: float, noise: float, ranks: int = 4):
    """Decaying norm curve with log-normal noise, per layer and per rank."""
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        level = end + (start - end) * math.exp(-t / tau)
        layers = [
            level * w * math.exp(noise * torch.randn(1, generator=g).item()) for w in (0.3, 1.0, 0.8, 0.5)
        ]
        per_rank = [level * 1.2 * math.exp(noise * torch.randn(1, generator=g).item()) for _ in range(ranks)]
        yield layers, per_rank


def run(feed: Feeder, steps) -> list:
    """Every event of a whole series (``steps`` yields (layer norms, rank norms))."""
    events = [e for layers, ranks in steps for e in feed(layers, ranks)]
    return events + feed.flush()


# Every seed and curve is judged in runs of 10 steps; a guard's step-by-step judging (block 1)
# only on seed 0 of each curve: 2,000 steps of it take 10-20 s each under CI's load, and
# test_runs_of_steps_give_the_step_by_step_scores holds the two paths to the same events and
# scores. The fast tier keeps seed 0 in runs of 10; the rest is the slow tier's.
@pytest.mark.parametrize(
    "seed,block",
    [
        (0, 10),
        pytest.param(0, 1, marks=pytest.mark.slow),
        pytest.param(1, 10, marks=pytest.mark.slow),
        pytest.param(2, 10, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("start,tau,noise", [(50.0, 300.0, 0.15), (200.0, 60.0, 0.3), (5.0, 2000.0, 0.4)])
def test_no_false_positives_on_decaying_noisy_series(seed, start, tau, noise, block):
    """Zero events over 2,000 steps of decay + log-normal noise up to sigma 0.4 (defaults:
    warmup 50, z > 6 and ratio > 3, outlier score > 8)."""
    assert run(Feeder(block=block), series(seed, 2000, start, 1.0, tau, noise)) == []


def with_changes(steps, change):
    """``steps`` with ``change(t, layers, ranks)`` applied at each 1-based step t."""
    for t, (layers, ranks) in enumerate(steps, start=1):
        change(t, layers, ranks)
        yield layers, ranks


@pytest.mark.parametrize("block", BLOCKS)
def test_spike_on_one_layer_is_reported_at_that_step_and_layer(block):
    def spike(t, layers, ranks):
        if t == 300:
            layers[2] *= 20.0  # block1 only

    events = run(Feeder(block=block), with_changes(series(0, 400, 20.0, 1.0, 200.0, 0.15), spike))
    assert [(e.kind, e.step, e.layer) for e in events] == [("spike", 300, "block1")]
    assert events[0].value > DEFAULTS.spike_zscore


@pytest.mark.parametrize("block", BLOCKS)
def test_global_spike_fires_but_not_during_warmup(block):
    def spike(t, layers, ranks):
        if t in (10, 150):  # step 10 is inside the 50-step warm-up
            layers[:] = [v * 30 for v in layers]

    seen = [
        (e.step, e.kind)
        for e in run(Feeder(block=block), with_changes(series(1, 200, 10.0, 1.0, 100.0, 0.1), spike))
    ]
    assert (150, "spike") in seen and all(step != 10 for step, _ in seen)


@pytest.mark.parametrize("block", BLOCKS)
def test_a_lasting_explosion_is_reported_until_the_adapt_horizon_then_becomes_normal(block):
    """x1e4 from step 200 on: a spike on every step (the guard's verdict too) through
    ``spike_adapt_steps``; a baseline that learned the anomaly stopped after 3 steps."""
    cfg = DetectorConfig(spike_adapt_steps=60)

    def explode(t, layers, ranks):
        if t >= 200:
            layers[:] = [v * 1e4 for v in layers]
            ranks[:] = [v * 1e4 for v in ranks]

    events = run(Feeder(cfg=cfg, block=block), with_changes(series(2, 400, 10.0, 1.0, 100.0, 0.1), explode))
    steps = sorted({e.step for e in events if e.kind == "spike"})
    assert steps[: cfg.spike_adapt_steps] == list(range(200, 200 + cfg.spike_adapt_steps)), steps[:70]
    assert max(steps) < 200 + cfg.spike_adapt_steps + 30, steps[-10:]  # then the new level is normal
    assert not [e for e in events if e.step < 200]


@pytest.mark.parametrize("block", BLOCKS)
def test_spike_below_ratio_threshold_is_ignored(block):
    """A very steady norm: a 2x bump has a huge z-score but is under the 3x ratio rule."""
    steps = (([2.0 * 0.5 if t == 250 else 0.5] * 4, [1.0] * 4) for t in range(1, 300))
    assert run(Feeder(block=block), steps) == []


@pytest.mark.parametrize("block", BLOCKS + [7])
def test_vanishing_fires_once_after_n_steps_under_floor(block):
    """The count of steps under the floor carries across runs of any length (7 does not divide 100)."""
    cfg = DetectorConfig(vanishing_norm=1e-6, vanishing_steps=20)
    steps = (([1e-9 if t > 100 else 1.0] * 4, [1e-9 if t > 100 else 1.0] * 4) for t in range(1, 200))
    assert [(e.step, e.kind) for e in run(Feeder(cfg=cfg, block=block), steps)] == [(120, "vanishing")]


@pytest.mark.parametrize("block", BLOCKS)
def test_rank_outlier_names_the_bad_rank(block):
    def bad_shard(t, layers, ranks):
        if t >= 200:
            ranks[2] *= 8.0  # rank 2's data shard went bad

    events = run(Feeder(block=block), with_changes(series(2, 300, 10.0, 1.0, 100.0, 0.1), bad_shard))
    found = [(e.step, e.rank) for e in events if e.kind == "rank_outlier"]
    assert found and found[0] == (200, 2) and {r for _, r in found} == {2}


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("onset", [1, 200])
def test_a_rank_that_stays_bad_stays_flagged(onset, block):
    """Corrupted from the start or from mid-run, a rank x4 is flagged from the first armed
    step and at >= 90% of the steps after (the scale must not learn the outlier as normal
    spread: with the old mean-based scale it was flagged for a few steps, then never)."""

    def bad_rank(t, layers, ranks):
        if t >= onset:
            ranks[3] *= 4.0

    events = run(Feeder(block=block), with_changes(series(4, 600, 10.0, 1.0, 100.0, 0.1), bad_rank))
    flagged = [e.step for e in events if e.kind == "rank_outlier" and e.rank == 3]
    assert [e for e in events if not (e.kind == "rank_outlier" and e.rank == 3)] == []
    first = max(onset, DEFAULTS.warmup_steps + 1)
    assert flagged[0] == first
    assert len(flagged) >= 0.9 * (600 - first + 1)
    # still flagged late in the run (the failure mode was ~0 here; seeds give 84-100 of 100)
    assert len([t for t in flagged if t > 500]) >= 80


@pytest.mark.parametrize("world,bad", [(5, {1: 4.0}), (16, {1: 4.0, 14: 0.25}), (64, {1: 4.0, 62: 0.25})])
def test_among_many_ranks_bad_ones_at_either_end_are_flagged_and_no_other(world, bad):
    """From 5 ranks on the center and spread are those of the ranks between the extremes
    (``crossrank.py``): a rank x4 (and, among 16 or 64, another /4) from step 100 on, flagged at
    >= 90% of the steps from 150 on (the farthest of each end is an extreme), no other rank
    ever, nothing before the onset, over 600 steps of noisy decay."""

    def bad_ranks(t, layers, ranks):
        if t >= 100:
            for r, factor in bad.items():
                ranks[r] *= factor

    feed = Feeder(world=world, block=10)
    events = run(feed, with_changes(series(5, 600, 10.0, 1.0, 100.0, 0.1, ranks=world), bad_ranks))
    assert {e.kind for e in events} == {"rank_outlier"} and {e.rank for e in events} <= set(bad)
    assert min(e.step for e in events) >= 100
    scores = [dict(zip(range(world), s)) for _, s in feed.scores[150:]]  # every held rank's score
    for r in bad:
        assert sum(s[r] > DEFAULTS.outlier_score for s in scores) >= 0.9 * len(scores), r
    good = [v for s in scores for r, v in s.items() if r not in bad]
    assert max(good) < DEFAULTS.outlier_score


@pytest.mark.parametrize("block", BLOCKS)
def test_nonfinite_is_an_event_and_does_not_poison_the_state(block):
    def nan(t, layers, ranks):
        if t == 100:
            layers[1] = math.nan

    events = run(Feeder(block=block), with_changes(series(3, 300, 10.0, 1.0, 100.0, 0.1), nan))
    assert [(e.step, e.kind) for e in events] == [(100, "nonfinite")]


@pytest.mark.parametrize("block", [10, 64])
def test_runs_of_steps_give_the_step_by_step_scores(block):
    """Judging a run of steps at once reproduces the step-by-step recurrence (the running
    mean and variance before each step in closed form): every step's scores agree, through
    the warm-up, a x20 layer spike (the variance it inflates damps the following steps in
    both), a level shift and a bad rank. Only the winsorizing bound (from the run's start)
    and the median reference may differ: no z-score moves by more than 0.25, against
    thresholds of 6; rank scores agree to float rounding."""

    def faults(t, layers, ranks):
        if t == 150:
            layers[2] *= 20.0
        if t >= 300:
            layers[1] *= 4.0  # lasting change of level
        if t >= 200:
            ranks[1] *= 20.0

    steps = list(with_changes(series(6, 400, 10.0, 1.0, 100.0, 0.2), faults))
    one, many = Feeder(block=1), Feeder(block=block)
    e1, ek = run(one, iter(steps)), run(many, iter(steps))
    assert [(e.kind, e.step, e.rank, e.layer) for e in ek] == [(e.kind, e.step, e.rank, e.layer) for e in e1]
    assert [e.value for e in ek] == pytest.approx([e.value for e in e1], rel=0.05)
    assert {e.kind for e in e1} == {"spike", "rank_outlier"}  # the faults are seen at all
    for t, ((s1, r1), (sk, rk)) in enumerate(zip(one.scores, many.scores), start=1):
        for name in ("zscore", "layer_zmax"):
            assert sk[name] == pytest.approx(s1[name], abs=0.25), (t, name)
        assert rk == pytest.approx(r1, rel=1e-4, abs=1e-4), t
    assert torch.allclose(one.det.mean, many.det.mean, atol=1e-3)
    assert torch.allclose(one.det.var, many.det.var, rtol=1e-2)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="spike_ratio"):
        DetectorConfig(spike_ratio=1.0)
    with pytest.raises(ValueError, match="ema_alpha"):
        DetectorConfig(ema_alpha=1.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        DetectorConfig(warmup_steps=2.5)


def test_the_rank_outlier_constant_is_monte_carlo_s_at_any_world_size():
    """The table and the large-world formula against an independent seeded Monte Carlo."""
    import sys

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    )
    from consistency_table import consistency

    from distmon.verdicts.detectors import _trimmed_consistency

    for world in (2, 3, 5, 17, 100, 128):  # the table (regenerated with another seed)
        assert abs(_trimmed_consistency(world) / consistency(world, 1_000_000, seed=7) - 1) < 0.01, world
    for world in (129, 300, 2048):  # the formula
        assert abs(_trimmed_consistency(world) / consistency(world, 1_000_000, seed=7) - 1) < 0.01, world
