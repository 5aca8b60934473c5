"""The gradient noise scale against ground truth, on real gloo ranks.

Linear regression with Gaussian inputs, y = x.w* + e (x ~ N(0, I_d), e ~ N(0, s^2)), loss
0.5 (x.w - y)^2, trained with lr=0 so the weights, and the truth, stay put. With
delta = w - w*, the per-example gradient (x.delta - e) x has mean G = delta and covariance
Sigma = (|delta|^2 + s^2) I + delta delta^T (Isserlis), so

    tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2,   |G|^2 = |delta|^2,   B_simple = tr(Sigma) / |G|^2.

d = 16, |delta|^2 = 1, s^2 = 1: B_simple = 33 examples, whatever the number of ranks. The
weights are two layers of 8 inputs each (``a`` and ``b``, their outputs added), with half of
|delta|^2 each: per layer tr(Sigma_l) = 8 (|delta|^2 + s^2) + |delta_l|^2 = 16.5 and
|G_l|^2 = 0.5, so B_l = 33 too; and since both estimates are linear in the sums of squares,
the layers' EMA terms add up to the global ones exactly.
"""

import math

import pytest
import torch
from ddp_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow

D, NOISE_SQ, BATCH, STEPS = 16, 1.0, 32, 600
TRUE_TRACE = D * (1.0 + NOISE_SQ) + 1.0
TRUE_SIGNAL = 1.0


class Split(torch.nn.Module):
    """x.w as two layers: a(x[:, :8]) + b(x[:, 8:])."""

    def __init__(self, w):
        super().__init__()
        self.a = torch.nn.Linear(D // 2, 1, bias=False)
        self.b = torch.nn.Linear(D // 2, 1, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(w[: D // 2])
            self.b.weight.copy_(w[D // 2 :])

    def forward(self, x):
        return self.a(x[:, : D // 2]) + self.b(x[:, D // 2 :])


def _job(rank, world):
    import distmon

    torch.manual_seed(0)
    w_star = torch.randn(D)
    delta = torch.randn(D)
    half = D // 2
    delta[:half] *= math.sqrt(0.5) / delta[:half].norm()  # |delta_a|^2 = |delta_b|^2 = 0.5
    delta[half:] *= math.sqrt(0.5) / delta[half:].norm()
    net = Split(w_star + delta)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1000 + rank)
    mon = distmon.GradMonitor(ddp, opt, serve="none", export_every=50, batch_size=BATCH, gns_alpha=0.01)
    early = None
    for step in range(1, STEPS + 1):
        x = torch.randn(BATCH, D, generator=g)
        y = x @ w_star + math.sqrt(NOISE_SQ) * torch.randn(BATCH, generator=g)
        (0.5 * (ddp(x).squeeze(1) - y).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
        if step == 50:
            early = mon.flush()
    snap = mon.flush()
    mon.close()
    return {
        "early": early.gradient_noise_scale,
        "gns": snap.gradient_noise_scale,
        "trace": snap.noise_trace,
        "signal": snap.noise_signal,
        "layer": snap.layer_gradient_noise_scale,
        "layer_signal": snap.layer_noise_signal,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_b_simple_is_within_10_percent_of_the_closed_form(world):
    out = run_ranks(_job, world)
    truth = TRUE_TRACE / TRUE_SIGNAL
    for r in out:
        assert math.isnan(r["early"])  # 50 updates < 1/alpha: not meaningful yet, so NaN
        assert abs(r["gns"] / truth - 1) < 0.10, (world, r, truth)
        assert abs(r["trace"] / TRUE_TRACE - 1) < 0.10, (world, r)
        assert abs(r["signal"] / TRUE_SIGNAL - 1) < 0.15, (world, r)
        for layer in ("a", "b"):
            assert abs(r["layer"][layer] / truth - 1) < 0.15, (world, layer, r)
        # the exact relation: the layers' terms add up to the global ones
        assert sum(r["layer_signal"].values()) == pytest.approx(r["signal"], rel=1e-5)
        traces = sum(r["layer"][la] * r["layer_signal"][la] for la in ("a", "b"))
        assert traces == pytest.approx(r["trace"], rel=1e-5)
    assert len({r["gns"] for r in out}) == 1  # every rank computes the same figure
