"""Mixed precision on real DDP ranks: nanoGPT's loop with a GradScaler, accumulation and clipping.

nanoGPT's training loop (``require_backward_grad_sync`` on the last micro-batch only,
``scaler.scale(loss).backward()``, ``scaler.unscale_``, ``clip_grad_norm_``,
``scaler.step``, ``scaler.update``) on 2 gloo ranks, with an overflow forced on one rank
(its loss made infinite), so the scaler skips that step on every rank, backs off, then
grows again. distmon reads the gradients inside backward, where they carry the loss scale;
every figure must still be in gradient units. References, per rank, computed by the test:
the reduced gradient after ``unscale_`` (float64), the rank's local gradient from an
un-wrapped twin run on the same micro-batches at the same scale, and
``torch.nn.utils.clip_grad_norm_`` on copies of the same gradients. Variants: clip after
``unscale_`` (nanoGPT), clip before it, and a fixed ``loss_scale`` divided out by hand.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from ddp_harness import run_ranks
from helpers import GPT, close, lm_loss, make_batch, reference_norms, sync_twin
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow

STEPS, ACCUM = 8, 2
OVERFLOW_STEP = 4  # rank 0's loss is infinite on this step: the scaler skips it everywhere
VARIANTS = ("clip_after_unscale", "clip_before_unscale", "fixed_loss_scale")
FIXED = 1024.0


def _run_variant(rank, variant, log_path):
    import distmon

    torch.manual_seed(0)
    model = GPT()
    twin = copy.deepcopy(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
    fixed = variant == "fixed_loss_scale"
    kwargs = {"loss_scale": FIXED} if fixed else {"scaler": scaler}
    mon = distmon.GradMonitor(ddp, opt, serve="none", export_every=3, log_path=log_path, **kwargs)
    names = [n for n, _ in model.named_parameters()]
    recs = []
    for step in range(1, STEPS + 1):
        sync_twin(twin, model)
        twin.zero_grad(set_to_none=True)
        scale = FIXED if fixed else scaler.get_scale()
        overflow = not fixed and step == OVERFLOW_STEP and rank == 0
        for micro in range(ACCUM):
            ddp.require_backward_grad_sync = micro == ACCUM - 1  # nanoGPT's no_sync
            x, y = make_batch(rank, step, micro)
            loss = lm_loss(ddp(x), y) / ACCUM
            loss = loss * math.inf if overflow else loss
            (loss * FIXED if fixed else scaler.scale(loss)).backward()
            (lm_loss(twin(x), y) / ACCUM * scale).backward()
        params = dict(model.named_parameters())
        tparams = dict(twin.named_parameters())
        local = reference_norms([(n, tparams[n].grad / scale) for n in names])[0]
        if variant == "clip_after_unscale":
            scaler.unscale_(opt)
        elif fixed:
            for p in model.parameters():
                p.grad.div_(FIXED)  # the user's own unscaling
        reduced = reference_norms([(n, params[n].grad) for n in names])[0]
        # torch's clip at this same point, on copies of the same gradients
        copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for c, p in zip(copies, model.parameters()):
            c.grad = p.grad.clone()
        want = float(torch.nn.utils.clip_grad_norm_(copies, 1.0))
        got = float(mon.clip_grad_norm_(1.0))
        grads_equal = all(
            torch.allclose(p.grad, c.grad, rtol=1e-6, atol=0) for p, c in zip(model.parameters(), copies)
        )
        if fixed:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        recs.append(
            {"step": step, "scale": scale, "local": local, "reduced": reduced, "got": got, "want": want}
        )
        recs[-1]["grads_equal"] = grads_equal or not math.isfinite(want)
        if variant == "clip_after_unscale":
            recs[-1]["reduced_unscaled"] = reduced
        else:
            recs[-1]["reduced_unscaled"] = reduced / (1.0 if fixed else scale)
    snaps = []
    mon.flush()
    mon.close()
    if rank == 0:
        import json

        with open(log_path) as f:
            snaps = [json.loads(line) for line in f]
    return {"recs": recs, "snaps": snaps, "mon_step": mon.step}


def _job(rank, world_size, tmp):
    assert dist.get_world_size() == world_size
    return {v: _run_variant(rank, v, f"{tmp}/{v}.jsonl") for v in VARIANTS}


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("amp")
    return run_ranks(_job, 2, str(tmp))


@pytest.mark.parametrize("variant", VARIANTS)
def test_clip_equals_torch_at_the_same_point_of_the_loop(amp_run, variant):
    for rank, out in enumerate(amp_run):
        for r in out[variant]["recs"]:
            if math.isfinite(r["want"]):
                assert close(r["got"], r["want"], 1e-6), (rank, r)
            else:
                assert not math.isfinite(r["got"]), (rank, r)
            assert r["grads_equal"], (rank, r)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_figure_is_in_gradient_units_whatever_the_scale(amp_run, variant):
    snaps = amp_run[0][variant]["snaps"]
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 1))
    assert amp_run[0][variant]["mon_step"] == STEPS
    for step, snap in enumerate(snaps, 1):
        if variant != "fixed_loss_scale" and step == OVERFLOW_STEP:
            continue
        for rank, out in enumerate(amp_run):
            r = out[variant]["recs"][step - 1]
            assert close(snap["rank_grad_norms"][rank], r["local"], 1e-5), (step, rank, snap, r)
        r = amp_run[0][variant]["recs"][step - 1]
        assert close(snap["grad_norm"], r["reduced_unscaled"], 1e-5), (step, snap["grad_norm"], r)
        if variant == "clip_after_unscale":  # clip_grad_norm_'s return value at this point of the loop
            assert close(snap["grad_norm"], r["want"], 1e-6), (step, snap["grad_norm"], r["want"])
    if variant != "fixed_loss_scale":
        scales = [r["scale"] for r in amp_run[0][variant]["recs"]]
        rose = any(b > a for a, b in zip(scales, scales[1:]))
        fell = any(b < a for a, b in zip(scales, scales[1:]))
        assert rose and fell, scales  # the scale grew and backed off: the figures did not follow


@pytest.mark.parametrize("variant", ["clip_after_unscale", "clip_before_unscale"])
def test_a_scaler_skip_is_recorded_counted_apart_and_not_paged(amp_run, variant):
    snap = amp_run[0][variant]["snaps"][OVERFLOW_STEP - 1]
    assert snap["step"] == OVERFLOW_STEP and snap["skipped"] and snap["skip_reason"] == "scaler"
    assert snap["nonfinite_ranks"] == [0]  # where the overflow came from
    assert snap["first_nonfinite"][0] == 0
    assert not [e for e in snap["events"] if e["kind"] == "nonfinite"]
    assert all(not s["skipped"] for s in amp_run[0][variant]["snaps"] if s["step"] != OVERFLOW_STEP)
