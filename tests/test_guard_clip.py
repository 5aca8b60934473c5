"""guard="skip"/"raise" and mon.clip_grad_norm_, on 2 real gloo ranks.

The skip reference is a second run of the same seeded training in which the bad step is
never taken (its batch is not even run); the models must end bit-identical on every rank.
The clip reference is torch.nn.utils.clip_grad_norm_ on copies of the same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_harness import run_ranks

import distmon

STEPS, BAD = 30, 20
WARMUP = 5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(rank: int, fault: str, guarded: bool, skip_bad_batch: bool) -> dict:
    net = _net()
    model = DDP(net, bucket_cap_mb=0.0005)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    mon = None
    if guarded:
        mon = distmon.GradMonitor(model, opt, serve="none", guard="skip", lr_scheduler=sched,
                                  detect=distmon.DetectorConfig(warmup_steps=WARMUP))
    else:  # the same all-reduce arithmetic as the monitor's wrapped default hook
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    target = net[2].weight
    for step in range(1, STEPS + 1):
        if skip_bad_batch and step == BAD:
            continue
        handle = None
        if step == BAD and rank == 1:
            value = float("nan") if fault == "nan" else 1e4
            handle = target.register_hook(lambda g, v=value: g * v)
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if handle:
            handle.remove()
        opt.step()
        sched.step()
    out = {"params": [p.detach().clone() for p in net.parameters()],
           "state": copy.deepcopy(opt.state_dict()["state"]),
           "lr": sched.get_last_lr(), "sched_epoch": sched.last_epoch}
    if mon is not None:
        snap = mon.flush()
        out["last_step"] = snap.step
        mon.close()
    return out


def _guard_job(rank: int, world: int, fault: str) -> tuple[dict, dict]:
    return _train(rank, fault, guarded=True, skip_bad_batch=False), \
        _train(rank, fault, guarded=False, skip_bad_batch=True)


def _bit_identical(a: dict, b: dict) -> None:
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, va in a["state"][k].items():
            assert torch.equal(va, b["state"][k][name]), (k, name)
    assert a["lr"] == b["lr"] and a["sched_epoch"] == b["sched_epoch"]


@pytest.mark.parametrize("fault", ["nan", "spike"])
def test_guard_skip_leaves_everything_as_if_the_step_was_never_taken(fault):
    for guarded, reference in run_ranks(_guard_job, 2, fault, timeout=180):
        _bit_identical(guarded, reference)
        assert guarded["last_step"] == STEPS  # the skipped step is still a monitored step


def _raise_job(rank: int, world: int) -> list[int]:
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = distmon.GradMonitor(model, opt, serve="none", guard="raise",
                              detect=distmon.DetectorConfig(warmup_steps=WARMUP))
    raised = []
    for step in range(1, 12):
        x, y = _batch(step, rank)
        if step == 9 and rank == 0:
            x = x * float("nan")
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except distmon.GradientAnomalyError:
            raised.append(step)
    mon.close()
    return raised


def test_guard_raise_raises_on_every_rank_at_the_same_step():
    assert run_ranks(_raise_job, 2) == [[9], [9]]


def _clip_job(rank: int, world: int) -> list[tuple[float, float, float]]:
    model = DDP(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = distmon.GradMonitor(model, opt, serve="none")
    results = []
    for step, max_norm in enumerate([0.05, 0.5, 1e6], start=1):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        copies = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for c, p in zip(copies, model.parameters()):
            c.grad = p.grad.detach().clone()
        ref_total = torch.nn.utils.clip_grad_norm_(copies, max_norm)
        total = mon.clip_grad_norm_(max_norm)
        worst = max(((p.grad - c.grad).abs().max() / c.grad.abs().max()).item()
                    for p, c in zip(model.parameters(), copies))
        results.append((abs(total.item() - ref_total.item()) / ref_total.item(), worst, max_norm))
        opt.step()
    mon.close()
    return results


def test_clip_grad_norm_matches_torch():
    for per_rank in run_ranks(_clip_job, 2):
        for norm_err, grad_err, max_norm in per_rank:
            assert norm_err <= 1e-6, max_norm
            assert grad_err <= 1e-6, max_norm


def test_clip_rejects_bad_max_norm_before_touching_gradients():
    with pytest.raises(ValueError, match="max_norm"):
        distmon.GradMonitor.clip_grad_norm_(object.__new__(distmon.GradMonitor), -1.0)
