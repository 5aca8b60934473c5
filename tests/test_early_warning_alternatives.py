"""The early-warning benchmark's alternatives and signals are what they claim to be (fast, in-process).

``lightning_spike_step`` against Lightning's own ``SpikeDetection`` (its ``_is_spike`` and
``_update_stats``, driven as ``on_train_batch_end`` drives them in one process); the
loss-only divergence verdict on series whose answer is known; the consecutive gradients'
cosine against ``F.cosine_similarity``, and its first, pairless sample read as not measured.
"""

import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import flat  # noqa: E402

from benchmarks.divergence.detectors import lightning_spike_step, precursor_steps  # noqa: E402
from benchmarks.divergence.divergence import divergence_step  # noqa: E402
from benchmarks.divergence.recorder import ConsecutiveCosine  # noqa: E402
from distmon.verdicts.precursor import PrecursorConfig  # noqa: E402


def probe_run(
    shape: tuple[int, int],
    name: str,
    diverged: int | None,
    turn: tuple[tuple[int, int], tuple[int, int], float] | None = None,
    *,
    fill: float = 1.0,
    n: int = 400,
) -> dict[str, object]:
    """A generated run as the benchmark probe scripts' tables read it: ``n`` steps of ``readings``
    (``shape``: signals x groups) all ``fill``, but ``turn = ((signal, group), (from, to), value)``.

    Example:
        >>> run = probe_run((2, 3), "h1", None, ((1, 2), (5, 7), 9.0), n=8)
        >>> run["readings"][:, 1, 2].tolist(), run["diverged"]
        ([1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 1.0], None)
    """
    readings = np.full((n, *shape), fill)
    if turn is not None:
        (signal, group), (a, b), value = turn
        readings[a:b, signal, group] = value
    return {"name": name, "diverged": diverged, "lr": 0.5, "warmup": 100, "readings": readings}


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


@pytest.mark.parametrize(
    "name",
    [
        "model",
        "data",
        "recorder",
        "divergence",
        "detectors",
        "runs",
        "sharpness_probe",
        "spectral_alignment",
        "loss_regression",
        "oscillation_lags",
        "adam_moments",
        "slowing_down",
        "update_spectrum",
    ],
)
def test_the_benchmark_modules_examples_hold(name):
    """benchmarks/ is outside the suite's doctest paths: its modules' examples run here."""
    import doctest
    import importlib

    module = importlib.import_module(f"benchmarks.divergence.{name}")
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("seed", range(5))
def test_consecutive_cosine_is_the_mean_of_the_last_pairs_cosines(seed):
    """Against ``F.cosine_similarity`` of the flattened gradients, pair by pair, on generated
    gradients of growing scale and random sign (a parameter without a gradient is left out)."""
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    frozen = net[2].weight
    window = 1 + seed % 4
    cos = ConsecutiveCosine(net, window=window)
    flats, pairs = [], []
    for step in range(15):
        for p in net.parameters():
            p.grad = None if p is frozen else torch.randn(p.shape, generator=gen) * (1 + step)
        flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None]).double()
        if flats:
            pairs.append(float(F.cosine_similarity(flat, flats[-1], dim=0)))
        flats.append(flat)
        cos.step()
        if not pairs:
            assert math.isnan(cos.mean())
        else:
            assert cos.mean() == pytest.approx(np.mean(pairs[-window:]), abs=1e-12), step


def test_the_cosine_signal_reads_the_pairless_first_sample_as_not_measured():
    """A run's first step has no pair (NaN): the detector must read it as not measured, not as a
    non-finite sample (which warns at once); a cosine held under the bound warns after the hold."""
    steps = np.arange(0, 200, 5)
    cos = np.where(steps >= 100, -0.5, 0.3).astype(np.float32)
    cos[0] = np.nan
    rec = {"arrays": {"step": steps, "grad_cos": cos[:, None]}}
    assert precursor_steps(rec, [("1-grad_cos", 1.2)], PrecursorConfig(hold=2))[0] == 110


def test_the_oscillation_rule_counts_only_while_the_schedule_has_headroom():
    """``schedule=True``: the cosine column counts only where the run's peak rate is
    ``rate_headroom`` times its rate at the sample or more (warm-up 1,000 steps to 1.0: up to
    step ~832); the same held cosine warns during the warm-up, not after."""
    steps = np.arange(0, 1500, 5)
    cos = np.where((steps >= 600) & (steps < 700) | (steps >= 1100), -0.5, 0.3).astype(np.float32)
    spec = {"lr": 1.0, "seed": 0, "steps": 1500, "warmup": 1000, "schedule": "constant", "batch": 16}
    spec |= {"weight_decay": 0.0, "clip": 1.0, "tail": 40, "model": {}}
    rec = {"arrays": {"step": steps, "grad_cos": cos[:, None]}, "spec": spec}
    cfg = PrecursorConfig(peak_lr=1.0)
    warned = precursor_steps(rec, [("1-grad_cos", cfg.oscillation_bound)], cfg, schedule=True)
    assert warned and warned[0] == 610 and max(warned) < 700, warned  # none from step 1,100 on
    assert max(precursor_steps(rec, [("1-grad_cos", cfg.oscillation_bound)], cfg)) > 1100  # ungated


def test_the_recorded_cosine_is_what_the_monitor_computes():
    """The benchmark scores the rule on the recorder's cosine (float64, ``torch.cat``); distmon
    computes it with :class:`~distmon.step.grad_cosine.GradientCosine` (fp32, fused): the same
    interval means on a real training run of the benchmark's model."""
    from benchmarks.divergence.data import Batches
    from benchmarks.divergence.model import ModelConfig, TinyGPT
    from distmon.step.grad_cosine import GradientCosine

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(qk_layernorm=True))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.95))
    data = Batches(seq_len=64, batch=4, seed=0, n_bytes=200_000)
    recorded = ConsecutiveCosine(model, window=10)
    mine = GradientCosine(list(model.parameters()), torch.device("cpu"))
    for step in range(1, 41):
        x, y = data.next()
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        recorded.step()
        mine.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 and step > 10:  # a full interval of 10 pairs
            assert 1.0 - float(mine.take()) == pytest.approx(recorded.mean(), abs=1e-5), step
        elif step % 10 == 0:
            mine.take()


@pytest.mark.parametrize("seed", range(20))
def test_the_gradient_norm_jump_is_the_largest_ratio_of_interval_means_within_the_window(seed):
    """``gradnorm_jump`` against every pair of 10-step intervals at most 100 steps apart."""
    from benchmarks.divergence.detectors import gradnorm_jump

    gen = np.random.default_rng(seed)
    n = int(gen.integers(80, 400))
    norms = np.exp(np.cumsum(gen.normal(0, 0.2, n)))
    until = None if seed % 2 else int(gen.integers(60, n))
    series = norms[: until if until is not None else None]
    means = [series[i : i + 10].mean() for i in range(0, len(series) - 9, 10)]
    best = max(means[j] / means[i] for j in range(5, len(means)) for i in range(max(0, j - 10), j + 1))
    assert gradnorm_jump({"grad_norm": list(norms)}, until) == pytest.approx(best, rel=1e-9)


def test_the_sharpness_probe_reads_adams_curvature_along_its_step():
    """On a quadratic, full batch, the probe's ``s`` equals ``lr * dtheta.H dtheta / dtheta.D dtheta``
    with ``H dtheta`` from autograd's Hessian-vector product and ``D`` from Adam's state."""
    from benchmarks.divergence.sharpness_probe import AdamSecant

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    hess = a @ a.T + torch.eye(6, dtype=torch.float64)
    w = torch.nn.Parameter(torch.randn(6, generator=gen, dtype=torch.float64))
    opt = torch.optim.AdamW([w], lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    probe, before = AdamSecant(), []
    for steps in range(8):
        opt.zero_grad()
        (0.5 * w @ hess @ w).backward()
        probe(opt)
        before.append(w.detach().clone())
        if steps:  # the second moments the probe read, bias-corrected after `steps` steps
            v = opt.state[w]["exp_avg_sq"].clone() / (1 - 0.95**steps)
        opt.step()
    d = before[-1] - before[-2]
    _, h_d = torch.autograd.functional.hvp(lambda x: 0.5 * x @ hess @ x, before[-1], d)
    assert probe.num[-1] == pytest.approx(0.05 * float(d @ h_d), rel=1e-9)
    assert probe.den[-1] == pytest.approx(float(d @ ((v.sqrt() + 1e-8) * d)), rel=1e-12)


class _Quadratic(torch.nn.Module):
    """``0.5 w.H w`` as the benchmark's model returns its loss: ``model(x, y)[1]``."""

    def __init__(self, hess, w):
        super().__init__()
        self.hess, self.w = hess, torch.nn.Parameter(w)

    def forward(self, x, y):
        return None, 0.5 * self.w @ self.hess @ self.w, None


def test_the_power_iteration_finds_the_top_eigenvalue_of_adams_preconditioned_hessian():
    """On a quadratic, ``lr * lambda_max(D^-1 H)`` against ``eigvalsh`` of ``D^-1/2 H D^-1/2``."""
    from benchmarks.divergence.sharpness_probe import PreconditionedSharpness

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    hess = a @ a.T + torch.diag(torch.arange(8, dtype=torch.float64) * 3)
    model = _Quadratic(hess, torch.randn(8, generator=gen, dtype=torch.float64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    power = PreconditionedSharpness((None, None), every=3, iters=400)
    for steps in range(7):
        opt.zero_grad()
        model(None, None)[1].backward()
        power(opt, model)
        if steps % 3 == 0 and steps:
            v = opt.state[model.w]["exp_avg_sq"] / (1 - 0.95**steps)
            inv = (v.sqrt() + 1e-8).rsqrt()
            want = 0.05 * float(torch.linalg.eigvalsh(inv[:, None] * hess * inv[None, :]).max())
            assert power.samples[-1][1] == pytest.approx(want, rel=1e-6)
        opt.step()
    assert [s for s, _, _ in power.samples] == [3, 6]


@pytest.mark.parametrize("seed", range(10))
def test_the_top_eigenvalue_is_the_most_positive_also_behind_a_larger_negative_one(seed):
    """``top_eigenvalue`` against ``eigvalsh`` on symmetric matrices, half of them with a negative
    eigenvalue larger in magnitude than every positive one."""
    from benchmarks.divergence.sharpness_probe import top_eigenvalue

    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=torch.float64))
    spectrum = torch.linspace(-3.0, 10.0, 12, dtype=torch.float64)
    if seed % 2:
        spectrum[0] = -25.0
    m = q @ torch.diag(spectrum) @ q.T
    value, vector = top_eigenvalue(lambda x: m @ x, torch.randn(12, generator=gen, dtype=torch.float64), 300)
    assert value == pytest.approx(float(torch.linalg.eigvalsh(m).max()), rel=1e-6)
    assert float(vector @ m @ vector) == pytest.approx(value, rel=1e-6)


def test_the_hessian_batch_table_compares_the_same_steps_before_the_divergence():
    """``sharpness_batch.markdown`` on generated samples whose ratio is known: samples before
    step 100 or past the divergence are left out, the largest is taken after the warm-up."""
    from benchmarks.divergence.sharpness_batch import markdown

    def run(
        name: str, diverged: int | None, ratio: float, warmup: int, falls: bool = False
    ) -> dict[str, object]:
        steps = range(25, 501, 25)
        small = [(st, float(1000 - st if falls else st)) for st in steps]
        large = [(st, v * (ratio if st >= 100 else 50.0)) for st, v in small]  # early: unsettled
        return {"name": name, "diverged": diverged, "warmup": warmup, "top": {32: small, 256: large}}

    text = markdown(
        [
            ("constant", run("c", 200, 1.5, 100)),
            ("healthy", run("h", None, 1.5, 200)),
            ("healthy", run("g", None, 0.5, 300, falls=True)),  # its largest is before its warm-up ends
        ]
    )
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1.50 (1.50-1.50) | 200 / 300 |" in rows["c"], rows["c"]  # steps 100..200
    assert "100/150 150/225 200/300 |" in rows["c"], rows["c"]
    assert "| 500 / 750 |" in rows["h"] and "| 700 / 350 |" in rows["g"], rows
    assert "2 of 2 healthy runs pass" in text and "constant class reaches 300-300" in text, text
    assert "the healthy runs 350-750" in text, text


def test_the_large_batch_table_finds_the_first_sample_past_the_edge_and_its_lead():
    """``sharpness_large_batch.markdown`` on generated samples: the first sample past Adam's edge
    from step 50 on (an unsettled one at 25 is left out), its lead over the divergence, and the
    range after the warm-up of a run that did not diverge."""
    from benchmarks.divergence.sharpness_large_batch import markdown

    def run(lr: float, diverged: int | None, top: list[float]) -> dict[str, object]:
        samples = list(zip(range(25, 25 * len(top) + 1, 25), top))
        return {"name": f"r{lr:g}", "lr": lr, "diverged": diverged, "top": samples, "s": [1.0] * 20}

    text = markdown(
        [
            ("a", run(0.5, 160, [900.0, 20.0, 30.0, 37.0, 45.0, 60.0, 80.0, 500.0])),  # past at 125
            ("b", run(0.3, None, [900.0, 50.0, 20.0, 33.0, 41.0, 35.0])),  # after the warm-up: 33-41
            ("c", run(0.8, 60, [10.0, 30.0, 36.0])),  # never past before step 60
        ]
    )
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 20 30 37 45 60 | 125 (35) |" in rows["r0.5"], rows["r0.5"]  # to the divergence
    assert "| 50 20 33 41 35 | 50 |" in rows["r0.3"], rows["r0.3"]
    assert "| 30 | never |" in rows["r0.8"], rows["r0.8"]
    assert "at 0.3 with b 33-41." in text and "1 of them had a sample past the edge" in text, text
    assert "35-35 steps before it" in text, text


def test_the_spectral_alignment_probe_reads_each_linears_inputs_against_its_top_singular_vector():
    """``SpectralAlignment`` on a two-layer net: at step 10 its pair per layer equals one computed
    another way (the top eigenvector of ``W^T W`` by numpy's ``eigh``, the inputs recomputed from
    the batch), and no sample is taken at other steps."""
    from benchmarks.divergence.spectral_alignment import SpectralAlignment

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = SpectralAlignment(every=10)
    for step in range(12):
        x = torch.randn(4, 7, 6)
        net(x).square().mean().backward()
        probe(opt, net)
        if step == 10:
            inputs = {"0": x.reshape(-1, 6), "2": torch.tanh(net[0](x)).detach().reshape(-1, 5)}
            weights = {name: net.get_submodule(name).weight.detach().double().numpy() for name in inputs}
        opt.step()
        opt.zero_grad()
    assert [step for step, _ in probe.samples] == [10]
    for name, x in inputs.items():
        v1 = np.linalg.eigh(weights[name].T @ weights[name])[1][:, -1]
        a = x.double().numpy() @ v1 / np.linalg.norm(x.double().numpy(), axis=1)
        share = float(np.mean(a > 0))
        diversity, magnitude = probe.samples[0][1][name]
        assert diversity == pytest.approx(1 - abs(2 * share - 1)) and 0 < share < 1, (name, share)
        assert magnitude == pytest.approx(float(np.abs(a).mean()), rel=1e-9), name


def test_the_spectral_alignment_table_holds_two_samples_from_step_100_up_to_the_divergence():
    """``spectral_alignment.markdown`` on generated samples: the bound is the healthy runs' extreme
    from step 100 on (a healthy dip at 80-90 does not count), and a constant-rate run warns only when
    two samples in a row pass it before its divergence (a single sample, or one after the
    divergence, does not)."""
    from benchmarks.divergence.spectral_alignment import markdown

    def run(name, diverged, diversity, magnitude, out=0.9):  # noqa: ANN001, ANN202
        samples = [  # "out": inputs at right angles to the weight's top direction (magnitude 0)
            (st, {"fc": (diversity.get(st, 0.8), magnitude.get(st, 0.3)), "out": (out, 0.0)})
            for st in range(10, 301, 10)
        ]
        return {"name": name, "diverged": diverged, "samples": samples}

    text = markdown(
        [
            ("healthy", run("h1", None, {80: 0.0, 90: 0.0, 200: 0.3, 210: 0.25}, {150: 0.7, 160: 0.6})),
            ("healthy", run("h2", None, {}, {}, out=0.0)),  # "out" collapsed all along
            ("constant", run("c1", 250, {150: 0.2, 160: 0.1}, {})),  # warned at 160: lead 90
            ("constant", run("c2", 250, {150: 0.1}, {140: 0.9, 150: 0.95})),  # one sample; magnitude at 150
            ("constant", run("c3", 200, {200: 0.1, 210: 0.1}, {})),  # at and past its divergence
        ]
    )
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["h1"].endswith("| None | 0.25 | 0.90 |"), rows["h1"]
    assert rows["c3"].endswith("| 200 | 0.80 | 0.90 |"), rows["c3"]  # step 200 is not before 200
    assert rows["fc"] == "| fc | 0.3 | 1/3, median lead 90 | 0.6 | 1/3, median lead 100 |", rows["fc"]
    assert rows["out"] == "| out | 0 | 0/3 | 0 | 0/3 |", rows["out"]
    assert "sign diversity, fc: 1 of 3; magnitude, fc: 1 of 3." in text, text
    assert "healthy runs collapses to 0 in 1 of 2 layers" in text, text  # a magnitude of 0 is none


@pytest.mark.parametrize("seed", range(20))
def test_the_loss_regression_is_the_trailing_mean_over_its_best_and_warns_after_two_samples(seed):
    """``loss_regression``'s samples against a plain loop over generated loss series (a fall, noise
    and a late rise), its first warning and held maximum against brute force over every bound."""
    from benchmarks.divergence import loss_regression as lr

    rng = np.random.default_rng(seed)
    n, window = int(rng.integers(150, 400)), int(rng.choice([5, 20, 50]))
    t = np.arange(n)
    loss = 3.0 * np.exp(-t / rng.uniform(20, 200)) + 1.0 + rng.uniform(0, 0.3) * rng.random(n)
    loss[int(rng.integers(120, n)) :] *= rng.uniform(1.0, 1.5)
    best, want = math.inf, []
    for step in range(window - 1, n):
        m = sum(loss[step - window + 1 : step + 1]) / window
        best = min(best, m)
        if step % 10 == 0 and step >= 100:
            want.append((step, m / best))
    steps, ratios = lr.regression(loss, window)
    assert steps.tolist() == [s for s, _ in want]
    assert np.allclose(ratios, [r for _, r in want], rtol=1e-12)
    held = [min(ratios[i], ratios[i + 1]) for i in range(len(ratios) - 1)]
    assert lr.held_max(steps, ratios) == pytest.approx(max(held))
    assert lr.first_warning(steps, ratios, lr.held_max(steps, ratios), None) is None  # the edge is silent
    for bound in sorted(set(np.round(ratios, 3))):
        hits = [steps[i + 1] for i in range(len(held)) if held[i] > bound]
        assert lr.first_warning(steps, ratios, bound, None) == (hits[0] if hits else None), bound
        cut = int(steps[len(steps) // 2])
        early = [h for h in hits if h < cut]
        assert lr.first_warning(steps, ratios, bound, cut) == (early[0] if early else None), bound


def test_the_loss_regression_table_counts_warnings_before_the_divergence_and_fits_the_healthy_edge():
    """``loss_regression.markdown`` on generated runs whose answers are known: a run that stalls 14%
    above its best from step 150 and diverges at 300 is warned at 180 (its 20-step mean is all
    stall at 170, held at 180: lead 120) by bounds up to 1.12, not by 1.15; a healthy run 11% above
    its best for 60 steps warns at 1.08 and 1.1 and sets the fitted bound (1.11, not a flat
    healthy run's 1.0), which still warns the stalling run; a run that jumps past every bound at
    its divergence is warned by none; a run of the wrong class is named and left out."""
    from benchmarks.divergence import loss_regression as lr

    def flat_then(level_at, n=400):  # noqa: ANN001, ANN202
        return np.array([level_at(step) for step in range(n)], np.float32)

    stall = flat_then(lambda st: 2.0 if st < 100 else (1.0 if st < 150 else (1.14 if st < 300 else 3.0)))
    jump = flat_then(lambda st: 2.0 if st < 100 else (1.0 if st < 250 else 3.0))
    bump = flat_then(lambda st: 2.0 if st < 100 else (1.11 if 200 <= st < 260 else 1.0))
    fresh = lr.FRESH[0][1].name  # a run of runs.late_holdout(): scored at the fitted bound only
    text = lr.markdown(
        [
            ("constant", {"name": "c1", "diverged": 300, "lr": 0.5, "warmup": 100, "loss": stall}),
            ("constant", {"name": "c2", "diverged": 250, "lr": 0.5, "warmup": 100, "loss": jump}),
            ("constant", {"name": "c3", "diverged": None, "lr": 0.5, "warmup": 100, "loss": jump}),
            ("healthy", {"name": "h1", "diverged": None, "lr": 0.4, "warmup": 200, "loss": bump}),
            ("healthy", {"name": "h2", "diverged": None, "lr": 0.2, "warmup": 200, "loss": jump[:240]}),
            ("constant", {"name": fresh, "diverged": 300, "lr": 0.5, "warmup": 100, "loss": bump}),
        ]
    )
    rows = [line for line in text.splitlines() if line.startswith("| 20 | 1.") and line.count(" | ") == 4]
    assert rows == [
        "| 20 | 1.08 | 1/2 | 120 | 1/2 (peaks 0.4) |",
        "| 20 | 1.1 | 1/2 | 120 | 1/2 (peaks 0.4) |",
        "| 20 | 1.12 | 1/2 | 120 | 0/2 |",
        "| 20 | 1.15 | 0/2 | - | 0/2 |",
        "| 20 | 1.2 | 0/2 | - | 0/2 |",
    ], text
    assert (
        "2 diverging at (or near) a constant rate, 2 healthy; not as their class says, left out: c3." in text
    )
    assert "| 20 | 1.110 (h1) | fitted to | 1/2 | 120 | 0/2 |" in text, text
    # the hold-out run's 1.11 bump from step 200 is not past the bound it set: 1.110 is not > 1.110
    assert "| 20 | 1.110 (h1) | late hold-out | 0/1 | - | 0/0 |" in text, text
    assert "on 1 constant-rate and 0 healthy runs recorded after it was fitted" in text, text


def _group_by_module(model: torch.nn.Module) -> dict[str, str]:
    """TinyGPT's parameters by the type and name of the module that holds them (the reference's own
    rule, apart from ``oscillation_lags``'s names)."""
    by_module = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            group = "embeddings"
        elif isinstance(module, torch.nn.LayerNorm):
            group = "norms"
        elif isinstance(module, torch.nn.Linear):
            leaf = mod_name.rsplit(".", 1)[-1]
            group = {"qkv": "attention qkv", "proj": "attention output", "fc1": "mlp fc1"}.get(leaf)
            group = group or {"fc2": "mlp fc2", "lm_head": "output head"}[leaf]
        else:
            continue
        by_module.update({f"{mod_name}.{n}": group for n, _ in module.named_parameters(recurse=False)})
    return by_module


@pytest.mark.parametrize("seed", range(3))
def test_the_lag_cosines_are_each_groups_cosines_1_and_2_steps_apart(seed):
    """``LagCosines`` on a real TinyGPT (qk-layernorm) trained by AdamW at a high rate: every step's
    row equals ``F.cosine_similarity`` of the gradients and of the updates 1 and 2 steps apart,
    concatenated per layer group (groups from the modules' types, not the probe's names) and over
    the whole model; NaN where the steps do not exist yet."""
    from benchmarks.divergence.model import ModelConfig, TinyGPT
    from benchmarks.divergence.oscillation_lags import GROUPS, SIGNALS, LagCosines

    torch.manual_seed(seed)
    model = TinyGPT(ModelConfig(d_model=16, n_heads=2, seq_len=8, qk_layernorm=True))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.95))
    groups = _group_by_module(model)
    assert set(groups) == {n for n, _ in model.named_parameters()} and set(groups.values()) == set(
        GROUPS[:-1]
    )
    probe, grads, thetas = LagCosines(), [], []
    for _ in range(7):
        x = torch.randint(0, 256, (4, 8))
        model(x, x.roll(-1, 1))[1].backward()
        probe(opt, model)
        grads.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
        thetas.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()

    def joined(values, group):  # noqa: ANN001, ANN202
        return flat(v for n, v in values.items() if group in ("whole model", groups[n]))

    def update(t):  # noqa: ANN001, ANN202  # the update of step t - 1, as read at step t
        return {n: thetas[t][n] - thetas[t - 1][n] for n in thetas[t]}

    for t, row in enumerate(probe.rows):
        assert row.shape == (len(SIGNALS), len(GROUPS))
        for g, group in enumerate(GROUPS):
            want = [
                (1, grads[t], grads[t - 1]),
                (2, grads[t], grads[t - 2]),
                (2, update(t), update(t - 1)),
                (3, update(t), update(t - 2)),
            ]
            for s, (first, a, b) in enumerate(want):
                if t < first:
                    assert math.isnan(row[s, g]), (t, s, group)
                else:
                    ref = F.cosine_similarity(joined(a, group), joined(b, group), dim=0)
                    assert row[s, g] == pytest.approx(float(ref), abs=1e-12), (t, SIGNALS[s], group)


def test_a_parameter_without_a_layer_group_is_refused_by_name():
    from benchmarks.divergence.oscillation_lags import layer_group

    with pytest.raises(ValueError, match="'blocks.0.gate.weight'.*NAMED"):
        layer_group("blocks.0.gate.weight")


@pytest.mark.parametrize("seed", range(10))
def test_the_lag_samples_are_one_minus_the_trailing_mean_every_10_steps_from_step_50(seed):
    from benchmarks.divergence.oscillation_lags import samples

    rng = np.random.default_rng(seed)
    cosines = rng.uniform(-1, 1, int(rng.integers(51, 400)))
    want = [(t, 1 - sum(cosines[t - 9 : t + 1]) / 10) for t in range(len(cosines)) if t % 10 == 0 and t >= 50]
    steps, values = samples(cosines)
    assert steps.tolist() == [t for t, _ in want]
    assert np.allclose(values, [v for _, v in want], rtol=0, atol=1e-12)


def test_the_lag_table_fits_each_signals_bound_to_the_healthy_runs_and_scores_the_hold_out_once():
    """``oscillation_lags.markdown`` on generated runs whose answers are known: every cosine 0.5
    (1 - cosine 0.5) but where a run turns; a constant-rate run whose output head's gradients two
    steps apart turn to -1 at step 150 (samples 0.65 at 150, 2.0 from 160: held past 0.5 at 160)
    and which diverges at 300 is warned with a lead of 140 on that row alone; a healthy run whose
    updates one step apart dip to cosine 0.2 over steps 200-229 sets that row's bound to 0.8 (not
    the other healthy runs' 0.5) and is not warned by it; a hold-out run that turns at step 60 is
    warned at 70 (judged from step 50, not 100), in its own columns; a healthy run's dip to -0.5 over
    steps 60-89 sets its row's bound to 1.5, one before step 50 sets none. The row warning the most
    fitted constant-rate runs is the one whose warnings are timed against the warm-ups, with the
    warm-ups of the healthy runs it warns."""
    from benchmarks.divergence import oscillation_lags as ol

    def run(name, diverged, turn=None, n=400, warmup=100):  # noqa: ANN001, ANN202
        cosines = np.full((n, len(ol.SIGNALS), len(ol.GROUPS)), 0.5)
        if turn is not None:
            (signal, group), (a, b), value = turn
            cosines[a:b, signal, group] = value
        return {"name": name, "diverged": diverged, "lr": 0.5, "warmup": warmup, "cosines": cosines}

    head, whole = ol.GROUPS.index("output head"), ol.GROUPS.index("whole model")
    fresh = ol.RUNS[-1][1].name  # a run of runs.late_holdout()
    text = ol.markdown(
        [
            ("constant", run("c1", 300, ((1, head), (150, 400), -1.0))),
            ("healthy", run("h1", None, ((2, whole), (200, 230), 0.2))),
            ("healthy", run("h2", None, ((0, 0), (0, 49), -1.0))),  # before step 50: not judged
            ("healthy", run("h3", None, ((0, 1), (60, 90), -0.5))),
            ("constant", run(fresh, 250, ((1, head), (60, 400), -1.0), warmup=50)),
        ]
    )
    rows = {tuple(line.split(" | ")[:2]): line for line in text.splitlines() if line.startswith("| ")}
    assert rows[("| gradients, 2 steps apart", "output head")].endswith(
        "| 0.500 (h1) | 1/1 | 140 | 0/3 | 1/1 | 180 | 0/0 |"
    ), text
    for row, bound in [
        (("| gradients, 2 steps apart", "whole model"), "0.500 (h1)"),
        (("| updates, 1 step apart", "whole model"), "0.800 (h1)"),
        (("| gradients, 1 step apart", "embeddings"), "0.500 (h1)"),
        (("| gradients, 1 step apart", "attention qkv"), "1.500 (h3)"),
    ]:
        assert rows[row].endswith(f"| {bound} | 0/1 | - | 0/3 | 0/1 | - | 0/0 |"), (row, text)
    assert len(rows) == 1 + len(ol.SIGNALS) * len(ol.GROUPS), text  # and the header
    # warned at 160 (warm-up 100) and 70 (warm-up 50): 60 and 20 steps after it
    when = "(gradients, 2 steps apart, output head) warns: 20 to 60 steps (median 40) from the end"
    assert when in text and text.endswith("it warns no healthy run.\n"), text
    healthy_turn = ol.markdown(
        [
            ("constant", run("c1", 300, ((3, 2), (150, 400), -1.0))),
            ("healthy", run("h1", None, warmup=200)),
            ("constant", run(fresh, None, ((3, 2), (60, 400), -1.0), warmup=50)),  # a stray
            ("healthy", run(ol.RUNS[-2][1].name, None, ((3, 2), (300, 400), -1.0), warmup=1000)),
        ]
    )
    assert "(updates, 2 steps apart, attention output) warns: 60 to 60 steps (median 60)" in healthy_turn
    assert healthy_turn.endswith("the healthy runs it warns were warmed up in 1000 steps to 0.5.\n")
    assert (
        "1 diverging at (or near) a constant rate, 3 healthy. Scored once: 1 constant-rate and 0 healthy"
        in text
    )


@pytest.mark.parametrize("seed", range(3))
def test_adams_moments_are_its_steps_over_the_rate_and_a_gradient_over_its_own_memory(seed):
    """``AdamMoments`` on a real TinyGPT (qk-layernorm) trained by AdamW (no weight decay) at a high
    rate, clipped at 1 as ``train`` clips, against a reference that never reads the optimizer's
    state: Adam's update of step t - 1 is ``-(theta_t - theta_{t-1}) / lr``, so its RMS per layer
    group (from the modules' types) and its share of entries of magnitude 0.5 or more come from the
    parameters; the surprise is the clipped gradient's squared norm over the sum of the reference's
    own bias-corrected running mean of the clipped gradients' squares. The first step reads NaN."""
    from benchmarks.divergence.adam_moments import GROUPS, SIGNALS, AdamMoments
    from benchmarks.divergence.model import ModelConfig, TinyGPT

    torch.manual_seed(seed)
    lr, b2 = 0.05, 0.95
    model = TinyGPT(ModelConfig(d_model=16, n_heads=2, seq_len=8, qk_layernorm=True))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, b2), weight_decay=0.0)
    groups = _group_by_module(model)
    probe, thetas, clipped = AdamMoments(clip=1.0), [], []
    for _ in range(8):
        x = torch.randint(0, 256, (4, 8))
        model(x, x.roll(-1, 1))[1].backward()
        probe(opt, model)
        thetas.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        clipped.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()

    def joined(values, group):  # noqa: ANN001, ANN202
        return flat(v for n, v in values.items() if group in ("whole model", groups[n]))

    v = {n: torch.zeros_like(g) for n, g in clipped[0].items()}
    for t, row in enumerate(probe.rows):
        assert row.shape == (len(SIGNALS), len(GROUPS))
        if t == 0:
            assert np.isnan(row).all()
        else:
            for g, group in enumerate(GROUPS):
                r = joined({n: (thetas[t - 1][n] - thetas[t][n]) / lr for n in thetas[t]}, group)
                v_hat = joined({n: x / (1 - b2**t) for n, x in v.items()}, group)
                surprise = joined(clipped[t], group).square().sum() / v_hat.sum()
                assert row[0, g] == pytest.approx(float(r.square().mean().sqrt()), rel=1e-3), (t, group)
                assert abs(row[1, g] - float((r.abs() >= 0.5).double().mean())) <= 2 / r.numel(), (t, group)
                assert row[2, g] == pytest.approx(float(surprise), rel=1e-6), (t, group)
        v = {n: b2 * v[n] + (1 - b2) * clipped[t][n].square() for n in v}


def test_the_adam_table_reads_each_signal_both_ways_and_fits_the_healthy_extreme():
    """``adam_moments.markdown`` on generated runs whose answers are known: every reading 1 but where
    a run departs; a constant-rate run whose output head's surprise rises to 5 at step 150 (samples
    1.4 at 150, 5 from 160: held past 1 at 160) and which diverges at 300 is warned with a lead of
    140 on that row's rise alone; a healthy run whose whole-model update RMS falls to 0.2 over steps
    200-229 sets the bound of that fall to 0.2 (not the others' 1) and is not warned by it; a
    hold-out run whose output-head surprise rises from step 60 is warned at 70 (judged from step 50),
    in its own columns. Another constant-rate run whose whole-model surprise rises from step 200
    ties that row with its own (one fitted run each): the timing line names the first, output
    head's (warned at 160 and 70 after warm-ups of 100 steps: 60 steps after and 30 before their
    end)."""
    from benchmarks.divergence import adam_moments as am

    def run(name, diverged, turn=None):  # noqa: ANN001, ANN202
        return probe_run((len(am.SIGNALS), len(am.GROUPS)), name, diverged, turn, fill=1.0)

    head, whole = am.GROUPS.index("output head"), am.GROUPS.index("whole model")
    text = am.markdown(
        [
            ("constant", run("c1", 300, ((2, head), (150, 400), 5.0))),
            ("constant", run("c2", 350, ((2, whole), (200, 400), 5.0))),
            ("healthy", run("h1", None, ((0, whole), (200, 230), 0.2))),
            ("healthy", run("h2", None, ((1, 0), (0, 49), 9.0))),  # before step 50: not judged
            ("constant", run(am.RUNS[-1][1].name, 250, ((2, head), (60, 400), 5.0))),
        ]
    )
    rows = {tuple(line.split(" | ")[:3]): line for line in text.splitlines() if line.startswith("| ")}
    assert len(rows) == 1 + 2 * len(am.SIGNALS) * len(am.GROUPS), text  # and the header
    assert rows[("| surprise", "rises", "output head")].endswith(
        "| 1 (h1) | 1/2 | 140 | 0/2 | 1/1 | 180 | 0/0 |"
    ), text
    assert rows[("| surprise", "falls", "output head")].endswith("| 1 (h1) | 0/2 | - | 0/2 | 0/1 | - | 0/0 |")
    assert rows[("| update RMS", "falls", "whole model")].endswith(
        "| 0.2 (h1) | 0/2 | - | 0/2 | 0/1 | - | 0/0 |"
    )
    assert rows[("| update RMS", "rises", "whole model")].endswith(
        "| 1 (h1) | 0/2 | - | 0/2 | 0/1 | - | 0/0 |"
    )
    assert rows[("| sign-like share", "rises", "embeddings")].endswith(
        "| 1 (h1) | 0/2 | - | 0/2 | 0/1 | - | 0/0 |"
    )
    when = "(surprise rises, output head) warns: -30 to 60 steps (median 15) from the end of their warm-up"
    assert when in text and text.endswith("it warns no healthy run.\n"), text


@pytest.mark.parametrize("seed", range(20))
def test_the_fluctuations_are_the_detrended_windows_size_and_lag_1_autocorrelation(seed):
    """``slowing_down.sampled`` against a reference in plain Python: each window's line by the
    closed-form least squares (covariance over variance), the residuals' standard deviation (over
    the window's mean for the loss) and their sample autocorrelation at lag 1 (sum of r_t r_t+1
    over sum of r_t^2), every 10 steps from step 50 (100 for a 100-step window)."""
    from benchmarks.divergence.slowing_down import sampled

    rng = np.random.default_rng(seed)
    n, window = int(rng.integers(101, 260)), int(rng.choice([50, 100]))
    values = 2.0 + np.cumsum(rng.normal(0, 0.05, n)) + rng.normal(0, rng.uniform(0.01, 0.5), n)
    relative = bool(seed % 2)

    def reference(xs):  # noqa: ANN001, ANN202
        idx = list(range(len(xs)))
        mi, mx = sum(idx) / len(xs), sum(xs) / len(xs)
        slope = sum((i - mi) * (x - mx) for i, x in zip(idx, xs)) / sum((i - mi) ** 2 for i in idx)
        res = [x - (mx + slope * (i - mi)) for i, x in zip(idx, xs)]
        sd = math.sqrt(sum(r * r for r in res) / len(res))
        ac1 = sum(a * b for a, b in zip(res, res[1:])) / sum(r * r for r in res)
        return (sd / mx if relative else sd), ac1

    steps, got = sampled(values, window, relative)
    want_steps = [t for t in range(max(50, window), n) if t % 10 == 0]
    assert steps.tolist() == want_steps
    for t, (size, memory) in zip(want_steps, got):
        ref_size, ref_memory = reference(values[t - window + 1 : t + 1].tolist())
        assert size == pytest.approx(ref_size, rel=1e-9) and memory == pytest.approx(ref_memory, abs=1e-9), t


def test_the_slowing_down_table_reads_each_series_both_ways_and_fits_the_healthy_extreme():
    """``slowing_down.markdown`` on generated runs whose answers are known: losses alternating
    2 +- 0.01 (size ~0.005), the healthy run's +- 0.02 from step 200 (~0.01): the loss's size rises
    to a bound of ~0.01 and falls to one of ~0.005; a constant-rate run's loss alternating +- 0.2
    from step 150 (its 50-step size past the healthy run's from the sample at 150, held at 160) and
    diverging at 300 is warned with a lead of 140 on the rise alone; gradient norms 10 x e^(+-0.01)
    (a size of ~0.01 in log units, ~0.1 without the log); a hold-out run's alternating x1.5 from
    step 100 and diverging at 250 is warned at 110 on the gradient norm's 50-step size, in its own
    columns."""
    from benchmarks.divergence import slowing_down as sd

    def run(name, diverged, loss_from=None, norm_from=None, loss_size=0.2, n=400):  # noqa: ANN001, ANN202
        flip = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
        loss = 2.0 + 0.01 * flip
        norm = 10 * np.exp(0.01 * flip)
        if loss_from is not None:
            loss[loss_from:] = 2.0 + loss_size * flip[loss_from:]
        if norm_from is not None:
            norm[norm_from:] = 10 * np.exp(np.log(1.5) * flip[norm_from:])
        return {"name": name, "diverged": diverged, "lr": 0.5, "warmup": 100, "loss": loss, "grad_norm": norm}

    text = sd.markdown(
        [
            ("constant", run("c1", 300, loss_from=150)),
            ("healthy", run("h1", None, loss_from=200, loss_size=0.02)),
            ("constant", run(sd.RUNS[-1][1].name, 250, norm_from=100)),
        ]
    )
    rows = {tuple(line.split(" | ")[:4]): line for line in text.splitlines() if line.startswith("| ")}
    assert len(rows) == 1 + 2 * len(sd.SERIES) * len(sd.STATISTICS) * len(sd.WINDOWS), text  # and the header
    assert rows[("| loss", "size", "50", "rises")].endswith("| 1/1 | 140 | 0/1 | 0/1 | - | 0/0 |"), text
    assert rows[("| gradient norm", "size", "50", "rises")].endswith("| 0/1 | - | 0/1 | 1/1 | 140 | 0/0 |"), (
        text
    )
    assert rows[("| loss", "size", "50", "falls")].endswith("| 0/1 | - | 0/1 | 0/1 | - | 0/0 |"), text

    def bound(row):  # noqa: ANN001, ANN202
        value, setter = rows[row].split(" | ")[4].split()
        assert setter == "(h1)", text
        return float(value)

    assert bound(("| loss", "size", "50", "rises")) == pytest.approx(0.01, rel=0.05)
    assert bound(("| loss", "size", "50", "falls")) == pytest.approx(0.005, rel=0.05)
    assert bound(("| gradient norm", "size", "50", "rises")) == pytest.approx(0.01, rel=0.05)  # log units
