"""Forward activation statistics: against float64 references from captured outputs, NaN origin,
checkpointing, hooks removed by close(), and the origin found on another rank."""

import math

import pytest
import torch
from ddp_harness import run_ranks
from torch.utils.checkpoint import checkpoint

import distmon

BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


class Net(torch.nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 12)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU()) for _ in range(3)
        )
        self.out = torch.nn.Linear(12, 2)
        self.ckpt = ckpt
        self.poison = None  # index of a block whose output gets a NaN

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant") if self.ckpt else block(h)
            if i == self.poison:
                h = h * math.nan
        return self.out(h)


def _train(net, steps=6, accum=1, every=2, before_step=lambda step: None):
    """Train with activations on; returns every step's snapshot (via flush) and the hook counts
    while the monitor was open and after it closed."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    snaps = []
    with distmon.GradMonitor(
        net, opt, serve="none", export_every=1, activations=True, activation_every=every
    ) as mon:
        for step in range(1, steps + 1):
            before_step(step)
            for micro in range(accum):
                g = torch.Generator().manual_seed(100 * step + micro)
                net(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            snaps.append(mon.flush())
        hooks_open = {name: len(m._forward_hooks) for name, m in net.named_modules() if name in BLOCKS}
    hooks_after = {name: len(m._forward_hooks) for name, m in net.named_modules() if name in BLOCKS}
    return snaps, hooks_open, hooks_after


def _capture(net, captured, step_of):
    def make(name):
        def hook(m, i, out):
            captured[step_of()][name].append(out.detach().double())

        return hook

    return [m.register_forward_hook(make(n)) for n, m in net.named_modules() if n in BLOCKS]


@pytest.mark.parametrize("accum", [1, 2])
def test_rms_and_absmax_equal_float64_references_on_activation_steps_only(accum):
    net = Net()
    captured = {}
    step = {"now": 1}
    handles = _capture(net, captured, lambda: step["now"])

    def before_step(s):
        step["now"] = s
        captured[s] = {name: [] for name in BLOCKS}

    snaps, _, _ = _train(net, steps=6, accum=accum, every=2, before_step=before_step)
    for h in handles:
        h.remove()
    for s, snap in enumerate(snaps, 1):
        assert snap.first_nonfinite_activation is None and not snap.events, (s, snap.events)  # a clean run
        if s % 2:
            assert snap.activation_rms == {} and snap.activation_absmax == {}, s
            continue
        for name in BLOCKS:
            outs = captured[s][name]
            rms = math.sqrt(sum(float(o.pow(2).sum()) for o in outs) / sum(o.numel() for o in outs))
            peak = max(float(o.abs().max()) for o in outs)
            assert snap.activation_rms[name] == pytest.approx(rms, rel=1e-5), (s, name)
            assert snap.activation_absmax[name] == pytest.approx(peak, rel=1e-6), (s, name)


def test_a_nan_in_a_block_s_forward_is_attributed_to_that_block_and_hooks_go_at_close():
    net = Net()
    net.poison = 1  # blocks.1's output (as the next block sees it) is NaN from step 1 on
    snaps, hooks_open, hooks_after = _train(net, steps=2, every=1)
    # the NaN is multiplied in after blocks.1 returns: blocks.2 is the first watched output that is NaN
    assert snaps[0].first_nonfinite_activation == (0, "blocks.2")
    assert ("activation_nonfinite", 1, 0, "blocks.2") in [
        (e.kind, e.step, e.rank, e.layer) for e in snaps[0].events
    ]
    assert math.isinf(snaps[0].activation_absmax["blocks.2"]) and math.isfinite(
        snaps[0].activation_absmax["blocks.1"]
    )
    assert all(n == 1 for n in hooks_open.values()) and all(n == 0 for n in hooks_after.values())


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_model_gives_the_same_figures(monkeypatch, mode):
    import distmon.step.activations as act

    reads = []
    real = act.sq_sums
    monkeypatch.setattr(act, "sq_sums", lambda tensors: reads.append(len(tensors)) or real(tensors))
    plain, _, _ = _train(Net(ckpt=False), every=1)
    n_plain = len(reads)
    ckpt, _, _ = _train(Net(ckpt=mode), every=1)  # forwards recomputed in backward: not counted again
    assert n_plain == 6 * 3 and len(reads) - n_plain == n_plain, (n_plain, len(reads))
    for a, b in zip(plain, ckpt):
        assert a.activation_rms == pytest.approx(b.activation_rms, rel=1e-6)
        assert a.activation_absmax == pytest.approx(b.activation_absmax, rel=1e-6)


def test_bad_activation_options_are_refused_at_construction():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="activations"):
        distmon.GradMonitor(net, opt, serve="none", activations=[3])
    with pytest.raises(ValueError, match="selects no module"):
        distmon.GradMonitor(net, opt, serve="none", activations=[r"^nothing$"])
    with pytest.raises(ValueError, match="activation_every"):
        distmon.GradMonitor(net, opt, serve="none", activations=True, activation_every=0)


def _rank_nan(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = Net()
    net.poison = 0 if rank == 1 else None  # only rank 1's forward goes bad
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    with distmon.GradMonitor(
        ddp, opt, serve="none", export_every=1, activations=True, activation_every=1
    ) as mon:
        ddp(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
        snap = mon.flush()
    return snap.first_nonfinite_activation, [e.kind for e in snap.events]


@pytest.mark.slow
def test_a_nan_in_another_rank_s_forward_names_that_rank():
    first, kinds = run_ranks(_rank_nan, 2)[0]
    assert first == (1, "blocks.1"), first
    assert "activation_nonfinite" in kinds
