"""FSDP2 (``fully_shard``) and HSDP on real gloo ranks: the same exact figures as for DDP.

Each configuration trains a small transformer-shaped model (embedding, residual blocks, final
norm, head) with a ``fully_shard`` unit per block and one for the root, and compares every
step with references the test computes itself:
the reduced gradient from ``p.grad.full_tensor()`` (what the optimizer steps with, float64),
each rank's local gradient from an unsharded twin run on the same batch, and
``torch.nn.utils.clip_grad_norm_`` on the sharded parameters. Sizes are not multiples of the
ranks (width 10, vocabulary 25), so FSDP pads its flat buffers: padding must not change a
figure.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder, run_ranks
from helpers import GPT, close, layer_sq, lm_loss, make_batch, whole

pytestmark = pytest.mark.slow

STEPS = 5
VOCAB, DIM = 25, 10
LAYERS = ("emb", "blocks.0.ln", "blocks.0.fc", "blocks.1.ln", "blocks.1.fc", "norm", "head")
CONFIGS = {
    "fsdp_2": {"world": 2, "mesh": (2,)},
    # export_every=STEPS: step STEPS exports by count, its reduced figures (and clip's norm) from
    # the export's gathered shard sums instead of the ordinary step's all-reduce
    "fsdp_4": {"world": 4, "mesh": (4,), "export_every": STEPS},
    "hsdp_2x2": {"world": 4, "mesh": (2, 2), "export_every": STEPS},
    "bf16_params_fp32_reduce": {"world": 2, "mesh": (2,), "mp": torch.float32},
    # fp16 reductions are divided before the reduce-scatter (by 2 of 4): multiplied back for local figures
    "fp16_params_fp16_reduce": {"world": 4, "mesh": (4,), "mp": torch.float16},
    "accumulation_without_sync": {"world": 2, "mesh": (2,), "accum": 3},
    # FSDP2's default under accumulation: a reduce-scatter per micro-batch. No input holds a step's
    # local gradient: local figures NaN (rank_valid False), the reduced ones exact
    "accumulation_with_sync": {"world": 2, "mesh": (2,), "accum": 3, "sync_every_micro": True},
    # a parameter no rank uses: FSDP leaves it out of its unit's reduce-scatter input
    "unused_parameter": {"world": 2, "mesh": (2,), "unused": True},
    "sum_divide_factor": {"world": 2, "mesh": (2,), "divide": 1.0},
    "keep_unsharded_after_forward": {"world": 2, "mesh": (2,), "reshard": False},
    # on the last recorded step: the NaN update poisons the weights
    "nan_on_rank_1": {"world": 2, "mesh": (2,), "nan": (STEPS, 1, "blocks.1.fc")},
}


def _net(unused=False):
    """helpers.GPT, one fully_shard unit per block and the root; ``unused``: a layer in each block
    that forward never calls."""
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, dim=DIM, unused=unused)


def _layers(cfg):
    """The layers distmon reports for ``cfg``'s model, in model order."""
    if not cfg.get("unused"):
        return LAYERS
    extra = lambda i: (f"blocks.{i}.ln", f"blocks.{i}.fc", f"blocks.{i}.extra")  # noqa: E731
    return ("emb", *extra(0), *extra(1), "norm", "head")


def _shard(net, cfg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    names = ("replicate", "shard") if len(cfg["mesh"]) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", cfg["mesh"], mesh_dim_names=names)
    kw = {"mesh": mesh, "reshard_after_forward": cfg.get("reshard", True)}
    if cfg.get("mp"):
        param = torch.float16 if cfg["mp"] == torch.float16 else torch.bfloat16
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=cfg["mp"])
    for block in net.blocks.values():
        fully_shard(block, **kw)
    fully_shard(net, **kw)
    if cfg.get("divide") is not None:  # torchtitan's sum instead of mean; SUM, as gloo has no PREMUL_SUM
        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(cfg["divide"])
                m.set_force_sum_reduction_for_comms(True)
    return net


def _poison_output_gradient(module, inputs, out):
    out.register_hook(lambda g: g * math.nan)  # returns None: the output itself is unchanged


def _batch(rank, step, micro):
    return make_batch(rank, step, micro, vocab=VOCAB)


def _loss(model, batch):
    x, y = batch
    return lm_loss(model(x), y)


def _job(rank, world, name, log_path):
    import distmon

    cfg = CONFIGS[name]
    net, twin = _shard(_net(cfg.get("unused", False)), cfg), _net(cfg.get("unused", False))
    layers = _layers(cfg)
    dtype = {None: torch.float32, torch.float32: torch.bfloat16, torch.float16: torch.float16}[cfg.get("mp")]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # exports by count at most once, before the window below, which must see ordinary steps only
    every = cfg.get("export_every", 1000)
    mon = distmon.GradMonitor(
        net, opt, serve="none", export_every=every, export_interval_s=0, log_path=log_path
    )
    accum = cfg.get("accum", 1)
    recs = []
    for step in range(1, STEPS + 1):
        twin.load_state_dict({k: v.full_tensor().to(dtype) for k, v in net.state_dict().items()})
        twin.zero_grad()
        for micro in range(accum):
            net.set_requires_gradient_sync(cfg.get("sync_every_micro", False) or micro == accum - 1)
            batch = _batch(rank, step, micro)
            # the NaN starts in the gradient of blocks.1.fc's output on one rank: backward carries
            # it into every layer below, but blocks.1 is the first unit to reduce-scatter
            poison = None
            if cfg.get("nan") and cfg["nan"][:2] == (step, rank):
                poison = net.blocks["1"].fc.register_forward_hook(_poison_output_gradient)
            (_loss(net, batch) / accum).backward()
            if poison is not None:
                poison.remove()
            (_loss(twin.to(dtype), batch) / accum).backward()
        reduced = layer_sq(((n, whole(p.grad)) for n, p in net.named_parameters()), layers)
        local = layer_sq(((n, p.grad) for n, p in twin.named_parameters()), layers)
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        direct = float(torch.nn.utils.get_total_norm(grads).full_tensor())
        clipped = float(mon.clip_grad_norm_(1e9)) if math.isfinite(direct) else direct
        opt.step()
        opt.zero_grad()
        recs.append({"reduced": reduced, "local": local, "direct": direct, "clip": clipped})
    mon.flush()
    # no host sync and one collective of the monitor per ordinary step
    with SyncRecorder() as rec:
        per_step = []
        for step in range(STEPS + 1, STEPS + 4):
            _loss(net, _batch(rank, step, 0)).backward()
            opt.step()
            opt.zero_grad()
            per_step.append(len(rec.collectives))
    mon.flush()
    mon.close()
    snaps = []
    if rank == 0:
        with open(log_path) as f:
            snaps = [json.loads(line) for line in f]
    return {
        "recs": recs,
        "snaps": snaps,
        "n_syncs": len(rec.syncs),
        "syncs": rec.describe(rec.syncs),
        "per_step": per_step,
    }


@pytest.fixture(scope="module", params=sorted(c for c in CONFIGS if c != "nan_on_rank_1"))
def fsdp_run(request, tmp_path_factory):
    name = request.param
    log = str(tmp_path_factory.mktemp(name) / "steps.jsonl")
    return name, run_ranks(_job, CONFIGS[name]["world"], name, log, timeout=240)


def test_global_layer_and_rank_figures_equal_float64_references(fsdp_run):
    name, out = fsdp_run
    snaps = out[0]["snaps"]
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 4))
    layers = _layers(CONFIGS[name])
    no_local = CONFIGS[name].get("sync_every_micro", False)
    nan = CONFIGS[name].get("nan")
    for step, snap in enumerate(snaps[:STEPS], 1):
        ref = out[0]["recs"][step - 1]
        if nan and step == nan[0]:
            continue  # the next test's
        assert snap["valid"] and not snap["nonfinite"], (step, snap)
        assert close(snap["grad_norm"], math.sqrt(sum(ref["reduced"].values())), 1e-5), (step, snap, ref)
        assert close(snap["grad_norm"], ref["direct"], 1e-5)
        assert list(snap["layer_grad_norms"]) == list(layers)
        for layer in layers:
            want = math.sqrt(ref["reduced"][layer])
            assert close(snap["layer_grad_norms"][layer], want, 1e-5), (step, layer)
        if no_local:  # not measurable: NaN, never a real-looking number
            assert snap["rank_valid"] == [False] * len(out), snap
            assert all(v == "nan" for v in snap["rank_grad_norms"]), snap
            assert all(v == "nan" for row in snap["rank_layer_grad_norms"] for v in row), snap
            continue
        assert snap["rank_valid"] == [True] * len(out), snap
        for rank, rank_out in enumerate(out):
            local = rank_out["recs"][step - 1]["local"]
            assert close(snap["rank_grad_norms"][rank], math.sqrt(sum(local.values())), 1e-4), (step, rank)
            for i, layer in enumerate(layers):
                want = math.sqrt(local[layer])
                assert close(snap["rank_layer_grad_norms"][rank][i], want, 1e-4), (step, rank, layer)


def test_clip_grad_norm_returns_torch_s_norm_on_every_rank(fsdp_run):
    _, out = fsdp_run
    for rank_out in out:
        for r in rank_out["recs"]:
            if math.isfinite(r["direct"]):
                assert close(r["clip"], r["direct"], 1e-6), r


def test_no_host_sync_and_one_collective_per_step(fsdp_run):
    _, out = fsdp_run
    for rank_out in out:
        assert rank_out["n_syncs"] == 0, rank_out["syncs"]
        assert rank_out["per_step"] == [1, 2, 3], rank_out["per_step"]


def test_a_nan_on_one_rank_is_attributed_to_that_rank_and_layer(tmp_path):
    """Its own run (the other configurations' figures are in the tests above)."""
    name = "nan_on_rank_1"
    out = run_ranks(_job, CONFIGS[name]["world"], name, str(tmp_path / "steps.jsonl"), timeout=240)
    step, rank, layer = CONFIGS[name]["nan"]
    snap = out[0]["snaps"][step - 1]
    assert snap["nonfinite"] and snap["nonfinite_ranks"] == [rank], snap
    assert snap["first_nonfinite"] == [rank, layer], snap
    assert [e["kind"] for e in snap["events"]] == ["nonfinite"]


def _refusals(rank, world):
    import distmon

    net = _shard(_net(), {"mesh": (2,)})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    messages = []
    try:
        distmon.GradMonitor(net, opt, serve="none", comm_hook=lambda s, b: None)
    except (TypeError, ValueError) as e:
        messages.append(str(e))
    # a fixed loss scale: FSDP's gradients are read in backward, still scaled, like DDP's
    scale = 8.0
    with distmon.GradMonitor(net, opt, serve="none", loss_scale=scale, export_every=1) as mon:
        (_loss(net, _batch(rank, 0, 0)) * scale).backward()
        direct = float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]).full_tensor())
        opt.step()
        opt.zero_grad()
        measured = mon.flush().grad_norm
    # the monitor leaves nothing behind: an unmonitored step still trains
    _loss(net, _batch(rank, 0, 0)).backward()
    opt.step()
    assert dist.get_world_size() == world
    return messages, measured, direct / scale


def test_unsupported_combinations_are_refused_at_construction():
    messages, measured, want = run_ranks(_refusals, 2)[0]
    assert "comm_hook is a DDP option" in messages[0]
    assert close(measured, want, 1e-5), (measured, want)


def _unchanged(rank, world):
    import distmon

    def train(monitored):
        net = _shard(_net(), {"mesh": (2, 2)})
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        mon = distmon.GradMonitor(net, opt, serve="none") if monitored else None
        for step in range(1, 5):
            _loss(net, _batch(rank, step, 0)).backward()
            if mon is not None:
                mon.clip_grad_norm_(1e9)  # clip by a norm no gradient reaches: a no-op on the values
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.close()
        return [p.full_tensor() for p in net.parameters()]

    bare, monitored = train(False), train(True)
    return all(torch.equal(a, b) for a, b in zip(bare, monitored))


def test_hsdp_training_is_bit_identical_with_and_without_distmon():
    assert all(run_ranks(_unchanged, 4))


def _guard_job(rank, world, log_path):
    """guard="skip" with a reduce-scatter per micro-batch: a NaN on rank 1 at step 3 is refused."""
    import distmon

    net = _shard(_net(), {"mesh": (2,)})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = distmon.GradMonitor(
        net, opt, serve="none", guard="skip", export_every=2, export_interval_s=0, log_path=log_path
    )
    for step in range(1, 6):
        for micro in range(2):  # FSDP2's default: gradient sync on every micro-batch
            poison = None
            if (step, micro, rank) == (3, 1, 1):
                poison = net.blocks["1"].fc.register_forward_hook(_poison_output_gradient)
            (_loss(net, _batch(rank, step, micro)) / 2).backward()
            if poison is not None:
                poison.remove()
        opt.step()
        opt.zero_grad()
    mon.close()
    snaps = []
    if rank == 0:
        with open(log_path) as f:
            snaps = [json.loads(line) for line in f]
    finite = all(bool(p.full_tensor().isfinite().all()) for p in net.parameters())
    return {"finite": finite, "errors": mon._run.errors.count, "snaps": snaps}


def test_the_guard_refuses_a_nan_step_when_fsdp_reduce_scatters_every_micro_batch(tmp_path):
    """Before, every such step was invalid and the guard let the NaN through (parameters NaN)."""
    out = run_ranks(_guard_job, 2, str(tmp_path / "steps.jsonl"), timeout=180)
    for rank_out in out:
        assert rank_out["finite"], "a NaN step went through the guard"
        assert rank_out["errors"] == 0  # FSDP's default is no monitor error
    snaps = out[0]["snaps"]
    assert [s["step"] for s in snaps] == [1, 2, 3, 4, 5]
    assert [s["skip_reason"] for s in snaps] == ["", "", "guard", "", ""], snaps
    assert all(s["valid"] for s in snaps), snaps
    assert snaps[2]["nonfinite"] and [e["kind"] for e in snaps[2]["events"]] == ["nonfinite"]
    assert all(math.isfinite(s["grad_norm"]) for i, s in enumerate(snaps) if i != 2)
