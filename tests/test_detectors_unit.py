"""Detector math on long synthetic norm series, single process (no DDP needed).

Series are generated here from closed-form curves with log-normal noise; each step's row is
filled the way the tracker fills it (sums of squares, gathered per-rank totals) and the real
DeviceDetector + DetectorDecoder turn it into events. Thresholds are the defaults of
DetectorConfig, stated below, unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from distmon.detectors import DetectorConfig, DetectorDecoder, DeviceDetector
from distmon.reduction import RANK_FIELDS
from distmon.ring import RowLayout
from distmon.snapshot import Snapshot

DEFAULTS = DetectorConfig()
LAYERS = ("embed", "block0", "block1", "head")


class Feeder:
    """Feeds (global norm, layer norms, rank norms) per step through the device detector."""

    def __init__(self, world: int = 4, cfg: DetectorConfig = DEFAULTS) -> None:
        self.det = DeviceDetector(cfg, len(LAYERS), world, 0, torch.device("cpu"))
        self.layout = RowLayout(len(LAYERS), world, len(RANK_FIELDS), self.det.n_outputs)
        self.dec = DetectorDecoder(cfg, LAYERS)
        self.world = world
        self.step = 0

    def __call__(self, layer_norms: list[float], rank_norms: list[float]) -> list:
        self.step += 1
        row = torch.zeros(self.layout.width)
        sq = torch.tensor(layer_norms, dtype=torch.float64) ** 2
        row[self.layout.layers] = sq.float()
        row[1] = sq.sum().float()
        g = row[self.layout.gathered].view(self.world, len(RANK_FIELDS))
        for r, n in enumerate(rank_norms):
            g[r, 0] = n * n
            g[r, 3] = 1.0  # valid
        self.det.update(row, self.layout, valid=True)
        vals = row.tolist()
        norm = math.sqrt(vals[1]) if math.isfinite(vals[1]) else math.nan
        snap = Snapshot(self.step, 0.0, norm, {}, list(rank_norms), None, not math.isfinite(norm), [], None)
        return list(self.dec(self.step, vals[self.layout.detector], snap).events)


def series(seed: int, steps: int, start: float, end: float, tau: float, noise: float):
    """Decaying norm curve with log-normal noise, per layer and per rank."""
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        level = end + (start - end) * math.exp(-t / tau)
        layers = [level * w * math.exp(noise * torch.randn(1, generator=g).item())
                  for w in (0.3, 1.0, 0.8, 0.5)]
        ranks = [level * 1.2 * math.exp(noise * torch.randn(1, generator=g).item()) for _ in range(4)]
        yield layers, ranks


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("start,tau,noise", [(50.0, 300.0, 0.15), (200.0, 60.0, 0.3), (5.0, 2000.0, 0.4)])
def test_no_false_positives_on_decaying_noisy_series(seed, start, tau, noise):
    """Zero events over 2,000 steps of decay + log-normal noise up to sigma 0.4 (defaults:
    warmup 50, z > 6 and ratio > 3, outlier score > 8)."""
    feed = Feeder()
    events = [e for layers, ranks in series(seed, 2000, start, 1.0, tau, noise) for e in feed(layers, ranks)]
    assert events == []


def test_spike_on_one_layer_is_reported_at_that_step_and_layer():
    feed = Feeder()
    for t, (layers, ranks) in enumerate(series(0, 400, 20.0, 1.0, 200.0, 0.15), start=1):
        if t == 300:
            layers[2] *= 20.0  # block1 only
        events = feed(layers, ranks)
        spikes = [e for e in events if e.kind == "spike"]
        if t == 300:
            assert [(e.step, e.layer) for e in spikes] == [(300, "block1")]
            assert spikes[0].value > DEFAULTS.spike_zscore
        else:
            assert spikes == [], t


def test_global_spike_fires_but_not_during_warmup():
    feed = Feeder()
    seen = []
    for t, (layers, ranks) in enumerate(series(1, 200, 10.0, 1.0, 100.0, 0.1), start=1):
        if t in (10, 150):  # step 10 is inside the 50-step warm-up
            layers = [v * 30 for v in layers]
        seen += [(e.step, e.kind) for e in feed(layers, ranks)]
    assert (150, "spike") in seen and all(step != 10 for step, _ in seen)


def test_spike_below_ratio_threshold_is_ignored():
    """A very steady norm: a 2x bump has a huge z-score but is under the 3x ratio rule."""
    feed = Feeder()
    events = []
    for t in range(1, 300):
        level = 2.0 if t == 250 else 1.0
        events += feed([level * 0.5] * 4, [1.0] * 4)
    assert events == []


def test_vanishing_fires_once_after_n_steps_under_floor():
    cfg = DetectorConfig(vanishing_norm=1e-6, vanishing_steps=20)
    feed = Feeder(cfg=cfg)
    kinds = []
    for t in range(1, 200):
        level = 1e-9 if t > 100 else 1.0
        kinds += [(e.step, e.kind) for e in feed([level] * 4, [level] * 4)]
    assert kinds == [(120, "vanishing")]


def test_rank_outlier_names_the_bad_rank():
    feed = Feeder()
    found = []
    for t, (layers, ranks) in enumerate(series(2, 300, 10.0, 1.0, 100.0, 0.1), start=1):
        if t >= 200:
            ranks[2] *= 8.0  # rank 2's data shard went bad
        found += [(e.step, e.rank) for e in feed(layers, ranks) if e.kind == "rank_outlier"]
    assert found and found[0] == (200, 2) and {r for _, r in found} == {2}


@pytest.mark.parametrize("onset", [1, 200])
def test_a_rank_that_stays_bad_stays_flagged(onset):
    """Corrupted from the start or from mid-run, a rank x4 is flagged from the first armed
    step and at >= 90% of the steps after (the scale must not learn the outlier as normal
    spread: with the old mean-based scale it was flagged for a few steps, then never)."""
    feed = Feeder()
    flagged, others = [], []
    for t, (layers, ranks) in enumerate(series(4, 600, 10.0, 1.0, 100.0, 0.1), start=1):
        if t >= onset:
            ranks[3] *= 4.0
        for e in feed(layers, ranks):
            (flagged if e.kind == "rank_outlier" and e.rank == 3 else others).append(t)
    first = max(onset, DEFAULTS.warmup_steps + 1)
    assert others == []
    assert flagged[0] == first
    assert len(flagged) >= 0.9 * (600 - first + 1)
    assert len([t for t in flagged if t > 500]) >= 90  # still flagged late in the run


def test_nonfinite_is_an_event_and_does_not_poison_the_state():
    feed = Feeder()
    for t, (layers, ranks) in enumerate(series(3, 300, 10.0, 1.0, 100.0, 0.1), start=1):
        if t == 100:
            layers[1] = math.nan
        events = feed(layers, ranks)
        if t == 100:
            assert [e.kind for e in events] == ["nonfinite"]
        else:
            assert events == [], (t, events)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="spike_ratio"):
        DetectorConfig(spike_ratio=1.0)
    with pytest.raises(ValueError, match="ema_alpha"):
        DetectorConfig(ema_alpha=1.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        DetectorConfig(warmup_steps=2.5)
