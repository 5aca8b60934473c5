"""distmon.verdicts.precursor: the early-warning rule as pure tensor math (fast, in-process).

The rule's behaviour on the trajectories it was chosen on (an attention logit that settles at
tens in a stable run, one that grows geometrically before a divergence), batching (any split
of the samples into calls gives the step-by-step verdicts), non-finite samples, the state's
round trip, and that an update needs no data on the host (it runs on the meta device).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from distmon.verdicts.precursor import PrecursorConfig, PrecursorDetector


def _settling(n: int) -> torch.Tensor:
    """A stable run's largest attention logit, one sample per 10 steps: 0.1 rising to ~50, noisy."""
    t = torch.arange(n, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    return (0.1 + 50 * (1 - torch.exp(-t / 30))) * (1 + 0.1 * torch.randn(n, generator=gen)).abs()


def _growing(n: int, start: int, rate: float = 0.25) -> torch.Tensor:
    """Settles like a stable run, then from sample ``start`` grows by e^rate per sample."""
    x = _settling(n)
    t = torch.arange(n, dtype=torch.float32)
    return x * torch.exp(rate * (t - start).clamp(min=0))


def _verdicts(det: PrecursorDetector, x: torch.Tensor, chunk: int) -> tuple[list[bool], list[float]]:
    warn, score = [], []
    for i in range(0, len(x), chunk):
        v = det.update(x[i : i + chunk])
        warn += v.warn.tolist()
        score += v.score.tolist()
    return warn, score


def test_bound_rule_warns_once_held_and_names_the_column():
    det = PrecursorDetector(3, PrecursorConfig(hold=2), bounds=[100.0, 100.0, 100.0])
    x = torch.tensor([[5.0, 20.0, 1.0], [150.0, 30.0, 1.0], [99.0, 400.0, 1.0], [50.0, 500.0, 1.0]])
    v = det.update(x)
    assert v.warn.tolist() == [False, False, False, True]  # each column over for 1, 1, then 2 in a row
    assert v.column.tolist() == [-1, -1, -1, 1]
    assert v.score[3].item() == pytest.approx(math.log(5.0), rel=1e-5)  # 500 / 100, in log units
    assert v.score[0].item() == pytest.approx(math.log(20.0 / 100.0), rel=1e-5)  # below: negative margin


def test_one_sample_over_the_bound_is_not_a_warning():
    """hold=2 exists because a single sample can be a batch's outlier; break it and this fails."""
    det = PrecursorDetector(1, PrecursorConfig(hold=2), bounds=[100.0])
    x = torch.tensor([[40.0], [300.0], [40.0], [300.0], [40.0]])
    assert det.update(x).warn.tolist() == [False] * 5


def test_a_stable_runs_attention_logit_never_warns_and_a_growing_one_does_in_time():
    cfg = PrecursorConfig()
    n = 150
    det = PrecursorDetector(1, cfg, bounds=[100.0])
    assert not any(_verdicts(det, _settling(n).unsqueeze(1), 10)[0])
    det = PrecursorDetector(1, cfg, bounds=[100.0])
    warn, _ = _verdicts(det, _growing(n, start=60).unsqueeze(1), 10)
    first = warn.index(True)
    # ~50 * e^(0.25 (t - 60)) crosses 100 near t = 63; held 2 samples: the warning at 64 +- 2
    assert 62 <= first <= 66
    assert all(warn[first:])  # a lasting growth keeps warning


def test_defaults_leave_ten_times_the_stable_runs_peak_and_catch_growth_beyond_it():
    """The default bound (1000) sits 10x above the largest attention logit a stable run reached in
    benchmarks/early_warning.py (~100): twice a stable trajectory never warns; growth past it does."""
    det = PrecursorDetector(1)
    assert not any(_verdicts(det, 2 * _settling(150).unsqueeze(1), 10)[0])  # peaks ~100-120
    det = PrecursorDetector(1)
    warn, _ = _verdicts(det, 2 * _growing(150, start=60).unsqueeze(1), 10)
    # ~100 e^(0.25 (t - 60)) crosses 1000 near t = 69; held 2 samples: warns at 70 +- 2
    assert 68 <= warn.index(True) <= 72


def test_rise_rule_ignores_the_warmup_rise_and_catches_later_growth():
    cfg = PrecursorConfig(warmup=20)
    det = PrecursorDetector(1, cfg, bounds=[None])  # no bound: the rise rule
    assert not any(_verdicts(det, _settling(150).unsqueeze(1), 10)[0])  # x500 in warm-up, then flat
    det = PrecursorDetector(1, cfg, bounds=[None])
    warn, _ = _verdicts(det, _growing(150, start=60).unsqueeze(1), 10)
    # a tenfold rise of the EMA (alpha 0.3 lags ~2 samples) over the floor: ~60 + ln(10)/0.25 + lag
    assert 66 <= warn.index(True) <= 74
    falling = PrecursorDetector(1, cfg, bounds=[None])
    assert not any(_verdicts(falling, torch.logspace(2, -3, 100).unsqueeze(1), 10)[0])


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
def test_any_split_into_calls_gives_the_same_verdicts(chunk):
    x = torch.stack([_growing(120, 70), _settling(120), _growing(120, 40, 0.1)], 1)
    cfg = PrecursorConfig(hold=3, warmup=5)
    whole = PrecursorDetector(3, cfg, bounds=[100.0, None, None])
    ref_warn, ref_score = _verdicts(whole, x, len(x))
    det = PrecursorDetector(3, cfg, bounds=[100.0, None, None])
    warn, score = _verdicts(det, x, chunk)
    assert warn == ref_warn and any(warn)
    assert score == pytest.approx(ref_score, rel=1e-4, abs=1e-4)


def test_non_finite_sample_warns_at_once_and_leaves_the_state_finite():
    det = PrecursorDetector(2, PrecursorConfig(hold=5), bounds=[100.0, None])
    v = det.update(torch.tensor([[1.0, 1.0], [math.nan, 1.0], [1.0, math.inf], [1.0, 1.0]]))
    assert v.warn.tolist() == [False, True, True, False]
    assert v.column.tolist() == [-1, 0, 1, -1]
    assert torch.isfinite(det.ema).all()


def test_state_round_trips_through_json_and_resumes_exactly():
    x = _growing(100, 50).unsqueeze(1).repeat(1, 2)
    cfg = PrecursorConfig(warmup=10)
    ref = PrecursorDetector(2, cfg, bounds=[100.0, None])
    ref_warn, ref_score = _verdicts(ref, x, 7)
    first = PrecursorDetector(2, cfg, bounds=[100.0, None])
    warn, score = _verdicts(first, x[:45], 7)
    state = json.loads(json.dumps(first.state_dict()))
    assert all(isinstance(v, (list, int)) for v in state.values())
    resumed = PrecursorDetector(2, cfg, bounds=[100.0, None])
    resumed.load_state_dict(state)
    w2, s2 = _verdicts(resumed, x[45:], 7)
    assert warn + w2 == _verdicts(PrecursorDetector(2, cfg, bounds=[100.0, None]), x, 7)[0] == ref_warn
    assert score + s2 == pytest.approx(ref_score, rel=1e-4, abs=1e-4)
    with pytest.raises(ValueError):
        PrecursorDetector(3, cfg).load_state_dict(state)


def test_update_needs_no_data_on_the_host():
    """On the meta device a tensor has no data: any .item(), .tolist() or branch on a value raises."""
    det = PrecursorDetector(4, PrecursorConfig(), bounds=[100.0, 100.0, None, None], device="meta")
    v = det.update(torch.empty(25, 4, device="meta"))
    assert v.warn.shape == (25,) and v.warn.device.type == "meta" and det.samples == 25


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        PrecursorConfig(hold=0)
    with pytest.raises(ValueError):
        PrecursorConfig(ema_alpha=1.0)
    with pytest.raises(ValueError):
        PrecursorDetector(2, bounds=[1.0])
    with pytest.raises(ValueError):
        PrecursorDetector(2).update(torch.ones(3, 3))


def test_a_sample_of_zero_was_not_measured_it_neither_warns_nor_moves_the_state():
    """A block that no forward called on a sampled step reads 0: not a sample, unlike NaN/Inf."""
    det = PrecursorDetector(1, PrecursorConfig(hold=2), bounds=[100.0])
    v = det.update(torch.tensor([[300.0], [0.0], [300.0], [0.0], [0.0]]))
    assert v.warn.tolist() == [False, False, False, False, False]  # the zeros break the run of 2
    assert det.run.tolist() == [0.0]
    assert det.update(torch.tensor([[math.nan]])).warn.tolist() == [True]
