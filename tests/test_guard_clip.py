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
from ddp_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import distmon

pytestmark = pytest.mark.slow  # real ranks or servers: not in the fast tier

STEPS, BAD = 30, 20
WARMUP = 5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(rank: int, fault: str, guarded: bool, skip_bad_batch: bool, n_opts: int = 1) -> dict:
    net = _net()
    model = DDP(net, bucket_cap_mb=0.0005)
    # one optimizer, or two splitting the model (Adam on the first layer, SGD with momentum on
    # the rest): the guard must hold every one of them back
    parts = (
        [list(net.parameters())] if n_opts == 1 else [list(net[0].parameters()), list(net[2:].parameters())]
    )
    opts = [torch.optim.Adam(parts[0], lr=1e-2)] + [
        torch.optim.SGD(p, lr=1e-2, momentum=0.9) for p in parts[1:]
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.9) for o in opts]
    mon = None
    if guarded:
        mon = distmon.GradMonitor(
            model,
            opts if n_opts > 1 else opts[0],
            serve="none",
            guard="skip",
            lr_scheduler=scheds if n_opts > 1 else scheds[0],
            detect=distmon.DetectorConfig(warmup_steps=WARMUP),
        )
    target = net[2].weight
    for step in range(1, STEPS + 1):
        if skip_bad_batch and step == BAD:
            continue
        handle = None
        if step == BAD and rank == 1:
            value = float("nan") if fault == "nan" else 1e4
            handle = target.register_hook(lambda g, v=value: g * v)
        x, y = _batch(step, rank)
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if handle:
            handle.remove()
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()
    out = {
        "params": [p.detach().clone() for p in net.parameters()],
        "state": [copy.deepcopy(opt.state_dict()["state"]) for opt in opts],
        "lr": [s.get_last_lr() for s in scheds],
        "sched_epoch": [s.last_epoch for s in scheds],
    }
    if mon is not None:
        snap = mon.flush()
        out["last_step"] = snap.step
        mon.close()
    return out


def _guard_job(rank: int, world: int, fault: str, n_opts: int) -> tuple[dict, dict]:
    return _train(rank, fault, guarded=True, skip_bad_batch=False, n_opts=n_opts), _train(
        rank, fault, guarded=False, skip_bad_batch=True, n_opts=n_opts
    )


def _bit_identical(a: dict, b: dict) -> None:
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    for sa, sb in zip(a["state"], b["state"], strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            for name, va in sa[k].items():
                assert torch.equal(va, sb[k][name]), (k, name)
    assert a["lr"] == b["lr"] and a["sched_epoch"] == b["sched_epoch"]


@pytest.mark.slow
@pytest.mark.parametrize("fault,n_opts", [("nan", 1), ("spike", 1), ("nan", 2)])
def test_guard_skip_leaves_everything_as_if_the_step_was_never_taken(fault, n_opts):
    """The reference is DDP without any hook: distmon's default reduction is DDP's own."""
    for guarded, reference in run_ranks(_guard_job, 2, fault, n_opts, timeout=180):
        _bit_identical(guarded, reference)
        assert guarded["last_step"] == STEPS  # the skipped step is still a monitored step


def _raise_job(rank: int, world: int) -> list[int]:
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = distmon.GradMonitor(
        model, opt, serve="none", guard="raise", detect=distmon.DetectorConfig(warmup_steps=WARMUP)
    )
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


@pytest.mark.slow
def test_guard_raise_raises_on_every_rank_at_the_same_step():
    assert run_ranks(_raise_job, 2) == [[9], [9]]


CLIP_CASES = [
    dict(max_norm=0.05),
    dict(max_norm=0.5, foreach=True),
    dict(max_norm=1e6, foreach=False),
    dict(max_norm="tensor"),
    dict(max_norm=0.2, error_if_nonfinite=True),
]


def _clip_job(rank: int, world: int) -> dict:
    model = DDP(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = distmon.GradMonitor(model, opt, serve="none")
    out: dict = {"cases": []}

    def backward(step: int, poison: bool = False) -> list[nn.Parameter]:
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x * (float("nan") if poison else 1.0)), y).backward()
        copies = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for c, p in zip(copies, model.parameters()):
            c.grad = p.grad.detach().clone()
        return copies

    for step, case in enumerate(CLIP_CASES, start=1):
        kwargs = dict(case)
        if kwargs["max_norm"] == "tensor":
            kwargs["max_norm"] = torch.tensor(0.3)
        copies = backward(step)
        ref_total = torch.nn.utils.clip_grad_norm_(copies, **kwargs)
        total = mon.clip_grad_norm_(**kwargs)
        worst = max(
            ((p.grad - c.grad).abs().max() / c.grad.abs().max()).item()
            for p, c in zip(model.parameters(), copies)
        )
        out["cases"].append((abs(total.item() - ref_total.item()) / ref_total.item(), worst, case))
        opt.step()
    # a non-finite norm with error_if_nonfinite: both raise; bad options raise before touching gradients
    saved = [p.detach().clone() for p in model.parameters()]
    copies = backward(len(CLIP_CASES) + 1, poison=True)
    raised = []
    for clip in (
        lambda: torch.nn.utils.clip_grad_norm_(copies, 1.0, error_if_nonfinite=True),
        lambda: mon.clip_grad_norm_(1.0, error_if_nonfinite=True),
    ):
        try:
            clip()
            raised.append(None)
        except RuntimeError as e:
            raised.append(str(e))
    out["nonfinite"] = raised
    opt.step()  # the step goes on (its NaN update is undone: the parameters are restored)
    with torch.no_grad():
        for p, value in zip(model.parameters(), saved):
            p.copy_(value)
    backward(len(CLIP_CASES) + 2)
    before = [p.grad.clone() for p in model.parameters()]
    bad = []
    for kwargs in (dict(max_norm=-1.0), dict(max_norm=1.0, norm_type=1.0)):
        try:
            mon.clip_grad_norm_(**kwargs)
            bad.append(None)
        except ValueError as e:
            bad.append(str(e))
    out["bad"] = bad
    out["untouched"] = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    mon.close()
    return out


@pytest.mark.slow
def test_clip_grad_norm_matches_torch():
    for out in run_ranks(_clip_job, 2):
        for norm_err, grad_err, case in out["cases"]:
            assert norm_err <= 1e-6, case
            assert grad_err <= 1e-6, case
        assert out["nonfinite"][0] and out["nonfinite"][1] == out["nonfinite"][0]
        assert "max_norm" in out["bad"][0] and "norm_type" in out["bad"][1]
        assert out["untouched"]


def _uncovered_job(rank: int, world: int) -> list[str]:
    net = _net()
    model = DDP(net)
    opt = torch.optim.SGD(net[0].parameters(), lr=0.1)  # the last layer is stepped by nobody
    with pytest.warns(UserWarning) as caught:
        distmon.GradMonitor(model, opt, serve="none").close()
    return [str(w.message) for w in caught]


@pytest.mark.slow
def test_parameters_no_monitored_optimizer_steps_are_named_at_construction():
    (messages,) = run_ranks(_uncovered_job, 1)
    assert any("2.weight" in m and "2.bias" in m and "[opt1, opt2" in m for m in messages), messages
