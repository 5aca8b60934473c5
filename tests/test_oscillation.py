"""The precursor's oscillation rule (#42): ``PrecursorConfig(peak_lr=...)``.

The cosine between consecutive steps' gradients equals a float64 reference over generated
parameter sets (dtypes, missing gradients, a non-finite step); in a monitor, each sampled
step's ``gradient_cosine`` is the mean of the interval's pairs from the gradients the optimizer
saw. On a quadratic whose warm-up takes SGD's rate past its stability edge the rule warns
once, at the second sample past the edge while the schedule still has headroom, with the
cosine as the event's value; at a constant rate that oscillates but converges it stays quiet.
No host sync on ordinary steps, training bit-identical; refusals at construction. On 2 gloo
ranks (slow): DDP ranks hold the same cosine, the reduced gradient's, and FSDP2 is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from ddp_harness import SyncRecorder, run_ranks

import distmon
from distmon import PrecursorConfig
from distmon.step.grad_cosine import GradientCosine

EVERY = 5


def _reference_cosine(prev: list[torch.Tensor], now: list[torch.Tensor]) -> float:
    """float64, parameter by parameter; NaN where a gradient is all zeros."""
    dot = sq_a = sq_b = 0.0
    for a, b in zip(prev, now):
        a, b = a.double().flatten(), b.double().flatten()
        dot += float(a @ b)
        sq_a += float(a @ a)
        sq_b += float(b @ b)
    return dot / math.sqrt(sq_a * sq_b) if sq_a * sq_b > 0 else math.nan


@pytest.mark.parametrize("seed", range(40))
def test_the_cosine_equals_a_float64_reference_over_generated_parameter_sets(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 6, (), generator=g))
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    params = []
    for _ in range(n):
        shape = tuple(
            int(s) for s in torch.randint(1, 7, (int(torch.randint(1, 4, (), generator=g)),), generator=g)
        )
        dtype = dtypes[int(torch.randint(0, len(dtypes), (), generator=g))]
        params.append(torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
    cos = GradientCosine(params, torch.device("cpu"))
    steps = int(torch.randint(2, 8, (), generator=g))
    bad = int(torch.randint(0, steps + 3, (), generator=g))  # a step with a non-finite gradient (or none)
    expected, prev = [], None
    for step in range(steps):
        grads = []
        for p in params:
            missing = torch.rand((), generator=g) < 0.15
            grads.append(None if missing else torch.randn(p.shape, generator=g).to(p.dtype))
        if step == bad and grads[0] is not None:
            grads[0].view(-1)[0] = math.inf
        for p, gr in zip(params, grads):
            p.grad = gr
        cos.step()
        now = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        if prev is not None:
            ref = _reference_cosine(prev, now)
            if math.isfinite(ref):
                expected.append(ref)
        prev = now
    got = float(cos.take())
    if not expected:
        assert math.isnan(got)
        return
    want = 1.0 - sum(expected) / len(expected)
    tol = 2e-2 if any(p.dtype in (torch.bfloat16, torch.float16) for p in params) else 1e-5
    assert abs(got - want) <= tol, (seed, got, want)


class Quadratic(torch.nn.Module):
    """``0.5 * sum(curvature * w**2)``: SGD at rate lr oscillates along a weight once lr > 1/its
    curvature (each step overshoots the floor: the gradient flips sign) and diverges past 2/it."""

    def __init__(self, curvature: list[float] | None = None) -> None:
        super().__init__()
        c = torch.tensor(curvature) if curvature is not None else torch.linspace(1.0, 10.0, 8)
        self.w = torch.nn.Parameter(torch.ones(len(c)))
        self.register_buffer("curvature", c)

    def forward(self) -> torch.Tensor:
        return 0.5 * (self.curvature * self.w**2).sum()


def _quadratic_run(
    rates: list[float], peak_lr: float, monitored: bool = True, curvature: list[float] | None = None
) -> dict:
    net = Quadratic(curvature)
    opt = torch.optim.SGD(net.parameters(), lr=rates[0])
    cfg = PrecursorConfig(every=EVERY, peak_lr=peak_lr)
    mon = (
        distmon.GradMonitor(net, opt, serve="none", export_every=EVERY, precursor=cfg) if monitored else None
    )
    events, cosines, grads = [], {}, []
    if mon is not None:
        mon.on_anomaly(lambda e, s: events.append(e))
    for step, lr in enumerate(rates, start=1):
        opt.param_groups[0]["lr"] = lr
        net().backward()
        grads.append(net.w.grad.detach().double().clone())
        opt.step()
        opt.zero_grad()
        if mon is not None and step % EVERY == 0:
            cosines[step] = mon.flush().gradient_cosine
    if mon is not None:
        mon.close()
    return {"events": events, "cosines": cosines, "grads": grads, "w": net.w.detach().clone()}


def test_each_sample_is_the_mean_cosine_of_the_intervals_pairs():
    rates = [0.02 + 0.01 * i for i in range(30)]  # from calm to past 1/curvature for the stiffest weights
    run = _quadratic_run(rates, peak_lr=0.3)
    g = run["grads"]
    pair = [float(g[i] @ g[i - 1] / (g[i].norm() * g[i - 1].norm())) for i in range(1, len(g))]
    for step, got in run["cosines"].items():
        # the pairs ending at steps step-EVERY+1 .. step (the first sample has one pair fewer)
        mine = pair[max(0, step - EVERY - 1) : step - 1]
        assert abs(got - sum(mine) / len(mine)) <= 1e-5, (step, got, mine)


def test_a_warmup_past_the_stability_edge_warns_once_while_the_rate_still_rises():
    # curvature 10: the weight overshoots from lr 0.1 on and diverges past 0.2; the warm-up heads
    # for 0.3 (headroom 1.2 up to lr 0.25)
    rates = [0.052 + 0.005 * i for i in range(50)]
    run = _quadratic_run(rates, peak_lr=0.3, curvature=[10.0])
    warnings = [e for e in run["events"] if e.kind == "divergence_warning"]
    over = [s for s, c in sorted(run["cosines"].items()) if c < -0.2 and 0.3 >= 1.2 * rates[s - 1]]
    assert len(warnings) == 1 and warnings[0].step == over[1], (warnings, over)
    assert warnings[0].layer == "" and warnings[0].value < -0.2 and warnings[0].threshold == -0.2
    assert rates[warnings[0].step - 1] < 0.2  # before the rate reached the edge of divergence


def test_a_constant_rate_that_oscillates_and_converges_does_not_warn():
    rates = [0.15] * 60  # the weight overshoots every step (cosine -1) and still converges
    run = _quadratic_run(rates, peak_lr=0.15, curvature=[10.0])
    assert min(run["cosines"].values()) < -0.2  # it oscillates
    assert [e for e in run["events"] if e.kind == "divergence_warning"] == []
    assert float(run["w"].abs().max()) < 1.0  # and converges


def test_a_decaying_rate_that_still_oscillates_does_not_warn():
    # past the peak the schedule no longer raises the rate, though the peak is 1.2 times it or more
    rates = [0.19 - 0.0025 * i for i in range(60)]  # from 0.19 (converging) down through 0.1
    run = _quadratic_run(rates, peak_lr=0.19, curvature=[10.0])
    falling = [s for s, c in run["cosines"].items() if c < -0.2 and 0.19 >= 1.2 * rates[s - 1]]
    assert len(falling) >= 2  # oscillating samples with headroom, twice and more: the old gate's warning
    assert [e for e in run["events"] if e.kind == "divergence_warning"] == []


def test_a_rate_of_zero_at_a_sample_is_read_as_rising_headroom():
    # a warm-up from 0 (or a schedule that rests at 0) samples lr 0: no error, no figure lost
    rates = [0.0] * EVERY + [0.01] * EVERY
    net = Quadratic()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    cfg = PrecursorConfig(every=EVERY, peak_lr=0.3)
    with distmon.GradMonitor(net, opt, serve="none", export_every=EVERY, precursor=cfg) as mon:
        for lr in rates:
            opt.param_groups[0]["lr"] = lr
            net().backward()
            opt.step()
            opt.zero_grad()
        snap = mon.flush()
    assert snap.monitor_errors == 0 and snap.valid


@pytest.mark.parametrize("on_device", [False, True])  # a host float, or a capturable optimizer's tensor
def test_the_headroom_is_peak_over_rate_while_the_rate_rises_and_0_once_it_fell(on_device):
    rates = [0.0, 0.1, 0.2, 0.2, 0.3, 0.25, 0.3, 0.1]
    want = [math.inf, 3.0, 1.5, 1.5, 1.0, 0.0, 1.0, 0.0]  # peak 0.3; falls at 0.25 and 0.1
    w = torch.nn.Parameter(torch.zeros(1))
    now = {"lr": 0.0}
    rate = (lambda: torch.tensor(now["lr"])) if on_device else (lambda: now["lr"])
    cos = GradientCosine([w], torch.device("cpu"), peak_lr=0.3, rate=rate)
    out = torch.zeros(2)
    got = []
    for lr in rates:
        now["lr"] = lr
        cos.sample(out)
        got.append(float(out[1]))
    assert got == pytest.approx(want)


def test_no_host_sync_on_ordinary_steps_and_training_bit_identical():
    rates = [0.003 * i for i in range(1, 41)]
    net = Quadratic()
    opt = torch.optim.SGD(net.parameters(), lr=rates[0])
    cfg = PrecursorConfig(every=EVERY, peak_lr=0.3)
    with distmon.GradMonitor(net, opt, serve="none", export_every=50, export_interval_s=0, precursor=cfg):
        for lr in rates:
            opt.param_groups[0]["lr"] = lr
            with SyncRecorder() as rec:
                net().backward()
                opt.step()
            trained = [s for s in rec.syncs if s[1] == "MainThread"]
            assert not trained, rec.describe(trained)
            opt.zero_grad()
    bare = _quadratic_run(rates, peak_lr=0.3, monitored=False)
    assert torch.equal(net.w.detach(), bare["w"])


def test_what_the_rule_needs_is_checked_at_construction():
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="peak_lr must be the schedule's highest learning rate"):
            PrecursorConfig(peak_lr=bad)
    with pytest.raises(ValueError, match="cosine_below must be in"):
        PrecursorConfig(peak_lr=1.0, cosine_below=-1.0)
    with pytest.raises(ValueError, match="rate_headroom >= 1"):
        PrecursorConfig(peak_lr=1.0, rate_headroom=0.9)
    # a model without attention blocks: the oscillation rule alone is fine, the bound alone is refused
    net = Quadratic()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match="or PrecursorConfig\\(peak_lr=...\\) for the oscillation rule alone"
    ):
        distmon.GradMonitor(net, opt, serve="none", precursor=True)
    distmon.GradMonitor(net, opt, serve="none", precursor=PrecursorConfig(peak_lr=0.1)).close()


def _ranks_job(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    cfg = PrecursorConfig(every=EVERY, peak_lr=1.0)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        try:
            distmon.GradMonitor(net, opt, serve="none", precursor=cfg)
        except ValueError as e:
            torch.distributed.barrier()
            return {"refused": str(e)}
        raise AssertionError("FSDP2 was not refused")
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = distmon.GradMonitor(model, opt, serve="none", export_every=EVERY, precursor=cfg)
    grads, cosines = [], {}
    for step in range(1, 21):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.double().flatten() for p in net.parameters()]))  # the reduced one
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            cosines[step] = mon.flush().gradient_cosine
    mon.close()
    pair = [float(grads[i] @ grads[i - 1] / (grads[i].norm() * grads[i - 1].norm())) for i in range(1, 20)]
    own = {
        s: sum(pair[max(0, s - EVERY - 1) : s - 1]) / len(pair[max(0, s - EVERY - 1) : s - 1])
        for s in cosines
    }
    return {"cosines": cosines, "own": own}


@pytest.mark.slow
def test_ddp_ranks_hold_the_reduced_gradients_cosine_and_fsdp_is_refused():
    ranks = run_ranks(_ranks_job, 2, "ddp", timeout=180)
    for step, got in ranks[0]["cosines"].items():
        assert ranks[1]["cosines"][step] == got, step
        assert abs(got - ranks[0]["own"][step]) <= 1e-5, (step, got, ranks[0]["own"][step])
    refused = run_ranks(_ranks_job, 2, "fsdp", timeout=180)
    assert all("needs every rank to hold each parameter's whole gradient" in r["refused"] for r in refused)
    assert all("FSDP" in r["refused"] and "leave peak_lr out" in r["refused"] for r in refused)
