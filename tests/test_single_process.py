"""One process, in process: a plain module, mixed precision, the GradScaler and clipping.

No ranks are spawned here (the fast tier). Every figure is compared with a reference the
test computes itself from ``p.grad`` in float64, and every clip with
``torch.nn.utils.clip_grad_norm_`` run on a twin model at the same point of the same loop.
The mixed-precision loop is nanoGPT's: ``scaler.scale(loss).backward()`` ->
``scaler.unscale_(opt)`` -> clip -> ``scaler.step(opt)`` -> ``scaler.update()``, with
overflows forced by an infinite loss, so the scale backs off and grows during the run.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder, free_port
from helpers import reference_norms, sample_value, scrape_metrics

import distmon

REL = 1e-6  # the tolerance for clipping against torch
LAYERS = ("0", "2", "4")


def make_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )
    return net.to(dtype)


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=g).to(dtype), torch.randn(16, 4, generator=g).to(dtype)


def loss_of(net, step, dtype=torch.float32, overflow=False):
    x, y = batch(step, dtype)
    loss = torch.nn.functional.mse_loss(net(x).float(), y.float())
    return loss * math.inf if overflow else loss


def reference(net):
    """(global norm, {layer: norm}) of the gradients as they are now, in float64
    (helpers.reference_norms; a layer is a top-level module of the Sequential)."""
    named = ((name, p.grad) for name, p in net.named_parameters())
    return reference_norms(named, layers=LAYERS, layer=lambda name: name.split(".")[0])


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------- figures


@pytest.mark.parametrize("accum", [1, 3])
def test_a_plain_module_is_measured_exactly_with_and_without_accumulation(tmp_path, accum):
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    refs = []
    with distmon.GradMonitor(
        net, opt, serve="none", export_every=4, log_path=str(tmp_path / "s.jsonl")
    ) as mon:
        assert mon.world_size == 1 and mon.rank == 0 and mon.layers == LAYERS
        for step in range(1, 9):
            for micro in range(accum):
                (loss_of(net, step * 10 + micro) / accum).backward()
            refs.append(reference(net))
            opt.step()
            opt.zero_grad()
            assert mon.step == step
    log = read_log(tmp_path / "s.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))
    for rec, (norm, layers) in zip(log, refs):
        assert rec["valid"] and not rec["nonfinite"] and rec["world_size"] == 1
        assert close(rec["grad_norm"], norm, 1e-5), (rec["step"], rec["grad_norm"], norm)
        assert close(rec["rank_grad_norms"][0], norm, 1e-5)
        for layer in LAYERS:
            assert close(rec["layer_grad_norms"][layer], layers[layer], 1e-5)


def test_a_step_without_gradients_is_invalid_not_zero(tmp_path):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with distmon.GradMonitor(net, opt, serve="none", export_every=1) as mon:
        opt.step()  # no backward before it
        snap = mon.flush()
        assert snap.step == 1 and not snap.valid and math.isnan(snap.grad_norm)
        loss_of(net, 1).backward()
        opt.step()
        assert close(mon.flush().grad_norm, reference(net)[0], 1e-5)


@pytest.mark.parametrize("variant", ["bf16_autocast", "fp16_autocast", "bf16_parameters"])
def test_autocast_and_bf16_parameters_are_summed_in_fp32(tmp_path, variant):
    dtype = torch.bfloat16 if variant == "bf16_parameters" else torch.float32
    net = make_net(dtype=dtype)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    refs = []
    with distmon.GradMonitor(net, opt, serve="none", export_every=3, log_path=str(tmp_path / "m.jsonl")):
        for step in range(1, 7):
            if variant == "bf16_parameters":
                loss = loss_of(net, step, dtype)
            else:
                amp = torch.bfloat16 if variant == "bf16_autocast" else torch.float16
                with torch.autocast("cpu", dtype=amp):
                    loss = loss_of(net, step)
            loss.backward()
            refs.append(reference(net))
            opt.step()
            opt.zero_grad()
    for rec, (norm, layers) in zip(read_log(tmp_path / "m.jsonl"), refs):
        # exact sums of the bf16 gradients' squares: fp32 accumulation, no bf16 rounding of the sum
        assert close(rec["grad_norm"], norm, 1e-5), (variant, rec["step"], rec["grad_norm"], norm)
        for layer in LAYERS:
            assert close(rec["layer_grad_norms"][layer], layers[layer], 1e-5)


# ---------------------------------------------------------------------------------------- GradScaler


def scaler_loop(mon_net, twin, mon, opt, twin_opt, scaler, twin_scaler, steps, overflow, clip):
    """nanoGPT's fp16 loop on both models; returns per step (true unscaled norm, scale)."""
    out = []
    for step in range(1, steps + 1):
        twin.load_state_dict(mon_net.state_dict())  # each step's clip starts from the same gradients
        for net, sc in ((mon_net, scaler), (twin, twin_scaler)):
            sc.scale(loss_of(net, step, overflow=step in overflow)).backward()
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        twin_scaler.unscale_(twin_opt)
        true = reference(mon_net)[0]
        if clip:
            got = mon.clip_grad_norm_(clip)
            want = torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)
            assert close(float(got), float(want), REL) or not math.isfinite(float(want)), (step, got, want)
            for p, q in zip(mon_net.parameters(), twin.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=REL, atol=0, equal_nan=True)
        for o, sc in ((opt, scaler), (twin_opt, twin_scaler)):
            sc.step(o)
            sc.update()
            o.zero_grad()
        out.append((true, scale))
    return out


def test_scaler_figures_are_in_gradient_units_and_skipped_steps_are_counted(tmp_path):
    net, twin = make_net(), make_net()
    opt, twin_opt = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    overflow = {4, 5, 11}
    mon = distmon.GradMonitor(
        net,
        opt,
        scaler=scaler,
        port=0,
        linger_s=0,
        export_every=5,
        log_path=str(tmp_path / "amp.jsonl"),
        detect=distmon.DetectorConfig(warmup_steps=0),
    )
    try:
        truth = scaler_loop(net, twin, mon, opt, twin_opt, scaler, twin_scaler, 14, overflow, clip=1.0)
        mon.flush()
        assert mon.step == 14  # every optimizer step the loop made, skipped or not
        metrics = scrape_metrics(mon.port)
    finally:
        mon.close()
    scales = {s for _, s in truth}
    assert len(scales) >= 3, scales  # the scale backed off and grew during the run
    log = read_log(tmp_path / "amp.jsonl")
    assert [r["step"] for r in log] == list(range(1, 15))
    for rec, (norm, _) in zip(log, truth):
        if rec["step"] in overflow:
            assert rec["skipped"] and rec["skip_reason"] == "scaler"
            assert not [e for e in rec["events"] if e["kind"] == "nonfinite"]  # routine overflow: no page
        else:
            assert not rec["skipped"] and rec["skip_reason"] == ""
            # unscaled: whatever the scale was (no jump when it backs off or grows)
            assert close(rec["grad_norm"], norm, 1e-5), (rec["step"], rec["grad_norm"], norm)
    run = {"run_id": mon.run_id}
    assert sample_value(metrics, "distmon_scaler_skipped_steps_total", **run) == 3
    assert sample_value(metrics, "distmon_nonfinite_steps_total", **run) == 0
    assert sample_value(metrics, "distmon_optimizer_steps_total", **run) == 14
    assert close(sample_value(metrics, "distmon_grad_norm", **run), truth[-1][0], 1e-5)
    assert sample_value(metrics, "distmon_anomalies_total", kind="nonfinite", **run) == 0


def test_a_run_of_scaler_skips_is_a_scaler_stuck_event():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    events = []
    cfg = distmon.DetectorConfig(scaler_stuck_steps=3)
    with distmon.GradMonitor(net, opt, scaler=scaler, serve="none", export_every=2, detect=cfg) as mon:
        mon.on_anomaly(lambda e, s: events.append((e.kind, e.step)))
        for step in range(1, 10):
            scaler.scale(loss_of(net, step, overflow=2 <= step <= 7)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        mon.flush()
    # six skips in a row (steps 2-7): one event, when the run reaches three
    assert events == [("scaler_stuck", 4)]


@pytest.mark.parametrize(
    "order,max_norm,foreach",
    [
        ("after_unscale", 1.0, None),
        ("after_unscale", "tensor", True),
        ("before_unscale", 1.0, False),
        ("before_unscale", "tensor", None),
        ("no_scaler", 0.5, True),
    ],
)
def test_clip_grad_norm_equals_torch_at_the_same_point_of_the_loop(order, max_norm, foreach):
    net, twin = make_net(), make_net()
    opt, twin_opt = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    enabled = order != "no_scaler"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2, enabled=enabled)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2, enabled=enabled)
    with distmon.GradMonitor(net, opt, scaler=scaler, serve="none") as mon:
        for step in range(1, 9):
            twin.load_state_dict(net.state_dict())  # each step's clip starts from the same gradients
            overflow = enabled and step == 3
            for n, sc in ((net, scaler), (twin, twin_scaler)):
                sc.scale(loss_of(n, step, overflow=overflow)).backward()
            if order == "after_unscale":
                scaler.unscale_(opt)
                twin_scaler.unscale_(twin_opt)
            mn = torch.tensor(1.0) if max_norm == "tensor" else max_norm
            got = mon.clip_grad_norm_(mn, foreach=foreach)
            want = torch.nn.utils.clip_grad_norm_(twin.parameters(), mn, foreach=foreach)
            if overflow:
                assert not math.isfinite(float(got)) and not math.isfinite(float(want))
            else:
                assert close(float(got), float(want), REL), (step, float(got), float(want))
                for p, q in zip(net.parameters(), twin.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=REL, atol=0)
            for o, sc in ((opt, scaler), (twin_opt, twin_scaler)):
                sc.step(o)
                sc.update()
                o.zero_grad()


def test_error_if_nonfinite_raises_like_torch():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with distmon.GradMonitor(net, opt, scaler=scaler, serve="none") as mon:
        scaler.scale(loss_of(net, 1, overflow=True)).backward()
        scaler.unscale_(opt)
        grads = [p.grad.clone() for p in net.parameters()]
        with pytest.raises(RuntimeError, match="non-finite") as ours:
            mon.clip_grad_norm_(1.0, error_if_nonfinite=True)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        with pytest.raises(RuntimeError, match="non-finite") as theirs:
            torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        assert str(ours.value) == str(theirs.value)


def test_a_loss_scale_distmon_was_not_told_is_refused_not_clipped():
    # gradients are read when backward ends, still scaled: a scale divided out by hand before
    # the clip, and not told, would make distmon's norm wrong by its factor; the clip refuses
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        (loss_of(net, 1) * 1024.0).backward()
        for p in net.parameters():
            p.grad.div_(1024.0)  # unscaled by hand
        with pytest.raises(RuntimeError, match="loss_scale="):
            mon.clip_grad_norm_(1e9)
        opt.step()
        opt.zero_grad()
    # a GradScaler that the monitor was not given: it measures scaled gradients, torch unscaled
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        scaler.scale(loss_of(net, 1)).backward()
        before = [p.grad.clone() for p in net.parameters()]
        mon.clip_grad_norm_(1e9)  # consistent: both see the scaled gradients (clip by a huge norm)
        scaler.unscale_(opt)
        for p, g in zip(net.parameters(), before):
            torch.testing.assert_close(p.grad, g / 2.0**10)


@pytest.mark.parametrize("unscaled_by_hand", [False, True])
def test_a_fixed_loss_scale_in_one_process_is_divided_out(unscaled_by_hand):
    """loss_scale=S: figures in gradient units; the clip learns whether the gradients still hold it."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with distmon.GradMonitor(net, opt, serve="none", loss_scale=1024.0, export_every=1) as mon:
        for step in (1, 2):
            (loss_of(net, step) * 1024.0).backward()
            if unscaled_by_hand:
                for p in net.parameters():
                    p.grad.div_(1024.0)
            direct = reference(net)[0]
            assert close(float(mon.clip_grad_norm_(1e9)), direct, 1e-5)  # the gradients as they are now
            truth = direct if unscaled_by_hand else direct / 1024.0
            opt.step()
            opt.zero_grad()
            assert close(mon.flush().grad_norm, truth, 1e-5)


def test_loss_scale_and_scaler_are_checked():
    net = make_net()
    with pytest.raises(ValueError, match="not both"):
        distmon.GradMonitor(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            serve="none",
            loss_scale=8.0,
            scaler=torch.amp.GradScaler("cpu"),
        )
    with pytest.raises(TypeError, match="GradScaler"):
        distmon.GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none", scaler=object())


# ---------------------------------------------------------------------------------------- cost


def test_no_host_sync_and_no_collective_on_ordinary_steps():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def step(n):
        scaler.scale(loss_of(net, n)).backward()
        scaler.unscale_(opt)
        mon.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    with distmon.GradMonitor(
        net, opt, scaler=scaler, serve="none", export_every=1000, export_interval_s=0
    ) as mon:
        for n in range(3):
            step(n)  # the first clip's one-time check syncs; it is over after these
        mon.flush()
        with SyncRecorder() as rec:
            for n in range(3, 10):
                step(n)
        # scaler.step's own read of found_inf runs inside distmon's scaler.step wrapper; it is the
        # scaler's sync, made with or without distmon
        ours = [r for r in rec.syncs if "found_inf_per_device" not in r[2]]
        assert len(rec.syncs) == 7 and ours == [] and rec.collectives == [], rec.describe(rec.syncs)
        assert mon.flush().step == 10 and mon.latest().valid


def test_a_world_of_one_with_torch_distributed_initialised(tmp_path):
    """A plain module and a DDP model on a one-rank gloo group, in process (the DDP source, fast)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        net = make_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        with distmon.GradMonitor(net, opt, serve="none", export_every=1) as mon:
            loss_of(net, 1).backward()
            norm = reference(net)[0]
            opt.step()
            assert close(mon.flush().grad_norm, norm, 1e-5)
        ddp = torch.nn.parallel.DistributedDataParallel(make_net())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with distmon.GradMonitor(ddp, opt, serve="none", export_every=2, scaler=scaler) as mon:
            for step in range(1, 5):
                scaler.scale(loss_of(ddp, step)).backward()  # read in the comm hook: still scaled
                scaler.unscale_(opt)
                norm = reference(ddp.module)[0]
                assert close(float(mon.clip_grad_norm_(1e9)), norm, 1e-5)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            snap = mon.flush()
        assert (
            snap.step == 4
            and close(snap.grad_norm, norm, 1e-5)
            and close(snap.rank_grad_norms[0], norm, 1e-5)
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [-1.0, 0, True, "1.0", torch.ones(2)])
def test_clip_rejects_a_bad_max_norm_before_touching_gradients(bad):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        loss_of(net, 1).backward()
        before = [p.grad.clone() for p in net.parameters()]
        with pytest.raises(ValueError, match="max_norm"):
            mon.clip_grad_norm_(bad)
        with pytest.raises(ValueError, match="norm_type"):
            mon.clip_grad_norm_(1.0, norm_type=1.0)
        assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), before))
    with pytest.raises(RuntimeError, match="closed GradMonitor"):
        mon.clip_grad_norm_(1.0)


@pytest.mark.slow  # a slow run on purpose (~3.4 s)
def test_a_slow_run_s_exploded_step_reaches_metrics_within_the_export_interval():
    """export_every=100 at 0.3 s steps would hold a step back 30 s; export_interval_s=0.5 does not."""
    import time

    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    step_s, interval = 0.3, 0.5
    seen_after = None
    with distmon.GradMonitor(
        net, opt, port=0, linger_s=0, export_every=100, export_interval_s=interval
    ) as mon:
        for step in range(1, 12):
            t0 = time.monotonic()
            (loss_of(net, step) * (1e4 if step == 5 else 1.0)).backward()  # step 5 explodes
            opt.step()
            opt.zero_grad()
            if step == 5:
                exploded_at = time.monotonic()
            time.sleep(max(0.0, step_s - (time.monotonic() - t0)))
            if step >= 5 and seen_after is None:
                peak = [v for n, _, v in scrape_metrics(mon.port) if n == "distmon_grad_norm_window_max"]
                if peak and peak[0] > 1000:
                    seen_after = time.monotonic() - exploded_at
    assert seen_after is not None, "the exploded step never reached /metrics"
    assert seen_after <= interval + step_s + 0.2, seen_after  # one interval and one step


def test_the_noise_scale_is_refused_for_one_process_and_a_bad_batch_size():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="2 or more data-parallel ranks"):
        distmon.GradMonitor(net, opt, serve="none", batch_size=32)
    for bad in (0, -1, True, "32"):
        with pytest.raises(ValueError, match="batch_size must be"):
            distmon.GradMonitor(net, opt, serve="none", batch_size=bad)
    with pytest.raises(ValueError, match="gns_alpha"):
        distmon.GradMonitor(net, opt, serve="none", gns_alpha=1.0)


def test_update_to_weight_ratio_on_export_steps_equals_a_float64_reference(tmp_path):
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    refs = {}
    log = tmp_path / "u.jsonl"
    with distmon.GradMonitor(net, opt, serve="none", export_every=3, update_ratio=True, log_path=str(log)):
        for step in range(1, 7):
            loss_of(net, step).backward()
            before = {n: p.detach().double().clone() for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad()
            upd, weight = dict.fromkeys(LAYERS, 0.0), dict.fromkeys(LAYERS, 0.0)
            for n, p in net.named_parameters():
                layer = n.split(".")[0]
                upd[layer] += float((p.detach().double() - before[n]).pow(2).sum())
                weight[layer] += float(before[n].pow(2).sum())
            refs[step] = {la: math.sqrt(upd[la] / weight[la]) for la in LAYERS}
    for rec in read_log(log):
        if rec["step"] % 3:
            assert rec["layer_update_ratio"] == {}, rec["step"]
            continue
        got, want = rec["layer_update_ratio"], refs[rec["step"]]
        for layer in LAYERS:
            assert close(got[layer], want[layer], 1e-5), (rec["step"], layer, got, want)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_norm_served_is_the_gradient_before_a_framework_clips_it(accumulation):
    """Frameworks clip between backward and step (Lightning, the HF Trainer, accelerate): the served
    norm is the one before clipping, as on several ranks (issue #22: it was the post-clip norm)."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with distmon.GradMonitor(net, opt, serve="none", export_every=1) as mon:
        for step in range(1, 4):
            for micro in range(accumulation):
                (loss_of(net, 10 * step + micro) / accumulation).backward()
            before = reference(net)
            clipped = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01 * before[0]))
            assert close(clipped, before[0], 1e-5) and reference(net)[0] < 0.02 * before[0]
            opt.step()
            opt.zero_grad()
            snap = mon.flush()
            assert snap.valid and close(snap.grad_norm, before[0], 1e-5), (snap.grad_norm, before)
            for layer, norm in before[1].items():
                assert close(snap.layer_grad_norms[layer], norm, 1e-5)


class _FlakyOptimizer(torch.optim.SGD):
    """An SGD whose step post-hook cannot be registered until ``fail`` is cleared."""

    fail = True

    def register_step_post_hook(self, hook):
        if self.fail:
            raise RuntimeError("no step post-hooks on this optimizer")
        return super().register_step_post_hook(hook)


class _FlakyLinear(torch.nn.Linear):
    """A module whose forward hooks cannot be registered until ``fail`` is cleared."""

    fail = True

    def register_forward_hook(self, hook, **kwargs):
        if self.fail:
            raise RuntimeError("no forward hooks on this module")
        return super().register_forward_hook(hook, **kwargs)


def _distmon_threads():
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("distmon")]


@pytest.mark.parametrize("where", ["optimizer", "activations"])
def test_a_failure_half_way_through_installing_leaves_nothing_and_a_retry_works(where):
    """The optimizer's pre-hook (or, with a guard, its wrapped step) is in when the next hook fails."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(_FlakyLinear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    opt = _FlakyOptimizer(net.parameters(), lr=0.1)
    net[0].fail = opt.fail = False
    options = {"port": free_port(), "linger_s": 0}
    if where == "optimizer":
        opt.fail = True
    else:  # the guard wrapped opt.step; then the activation hooks fail
        net[0].fail = True
        options.update(guard="skip", activations=["0"])
    with pytest.raises(RuntimeError, match="no (step post-|forward )hooks"):
        distmon.GradMonitor(net, opt, **options)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "step" not in vars(opt) and not net[0]._forward_hooks
    assert _distmon_threads() == []
    net[0].fail = opt.fail = False
    mon = distmon.GradMonitor(net, opt, **options)  # the same port: it was released
    x, y = batch(1)
    torch.nn.functional.mse_loss(net(x), y).backward()
    want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in net.parameters()))
    opt.step()
    snap = mon.flush()
    mon.close()
    assert snap.step == 1 and snap.valid and math.isclose(snap.grad_norm, want, rel_tol=1e-6)
