"""The early-warning benchmark's alternatives are the rules they claim to be (fast, in-process).

``lightning_spike_step`` against Lightning's own ``SpikeDetection`` (its ``_is_spike`` and
``_update_stats``, driven as ``on_train_batch_end`` drives them in one process), and the
loss-only divergence verdict on series whose answer is known.
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.divergence.detectors import lightning_spike_step  # noqa: E402
from benchmarks.divergence.divergence import divergence_step  # noqa: E402


def _lightning(loss):
    spike_mod = pytest.importorskip("lightning.fabric.utilities.spike")
    det = spike_mod.SpikeDetection()  # mode min, window 10, warmup 1, atol None, rtol 2, finite_only
    for batch_idx, val in enumerate(loss):
        t = torch.tensor(val)
        if batch_idx >= det.warmup and det._is_spike(t):
            return [batch_idx]  # on_train_batch_end raises TrainingSpikeException here
        det._update_stats(t)
    return []


def _series(seed, n=300):
    gen = torch.Generator().manual_seed(seed)
    base = 5.0 * torch.exp(-torch.arange(n) / 60.0) + 1.5 + 0.2 * torch.rand(n, generator=gen)
    if seed % 3 == 1:
        base[200:] *= torch.linspace(1, 8, n - 200)  # a divergence
    if seed % 3 == 2:
        base[150] = float("nan")
    return [float(v) for v in base]


@pytest.mark.parametrize("seed", range(6))
def test_lightning_rule_matches_lightning(seed):
    loss = _series(seed)
    assert lightning_spike_step(loss) == _lightning(loss)


def test_divergence_is_a_lasting_rise_or_a_non_finite_loss():
    flat = [5.0 * math.exp(-t / 60) + 1.5 for t in range(400)]
    assert divergence_step(flat) is None
    up = flat[:300] + [flat[299] * 2] * 100
    assert divergence_step(up) == 300
    blip = flat[:300] + [flat[299] * 3] * 3 + flat[303:]
    assert divergence_step(blip) is None  # 3 bad batches in a 20-step window: not 30% on the mean
    assert divergence_step(flat[:250] + [math.inf] + flat[251:]) == 250


@pytest.mark.parametrize("name", ["model", "data", "recorder", "divergence", "detectors"])
def test_the_benchmark_modules_examples_hold(name):
    """benchmarks/ is outside the suite's doctest paths: its modules' examples run here."""
    import doctest
    import importlib

    module = importlib.import_module(f"benchmarks.divergence.{name}")
    assert doctest.testmod(module).failed == 0
