"""A failure in any of distmon's hook paths never reaches training (issue #22).

Each path distmon runs inside training is made to raise (``fault_injection.FailureInjector``)
on one step: DDP's comm hook (the local read at the last bucket, or in every bucket's hook where
``p.grad`` is the bucket; the reduced read in the autograd callback after DDP's; the end of
backward), FSDP2's reduce-scatter and post_backward wrappers and the read of its sharded
gradients when backward ends, the single process's gradient-accumulation hook and its
end-of-backward read, the optimizer step pre- and post-hooks, the guarded step
(``guard="skip"``), the GradScaler's step wrapper (on a step it skips) and the activation hooks.
On 2 gloo ranks only rank 1 fails, so the ranks' collectives must stay matched. Every faulted
step is followed by a clean one. Each configuration trains twice from the same seed,
unmonitored and monitored, and:

* the losses and final parameters are bit-identical (``torch.equal``);
* every injected failure fired and was counted (``Snapshot.monitor_errors``);
* every figure served is either exact (against float64 norms of the run's own gradients, an
  unwrapped twin's for each rank's local gradient, the test's own hooks for activations; 1e-5)
  or NaN and marked not valid (``valid``, ``rank_valid``);
* every clean step is valid and exact under the loop's step number: measuring resumes.

Before, a step hook that raised on one rank left its collective unissued there: the job hung
(gloo timed out in the next collective); in one process every later step was reported under
the number of the step before, with figures served as valid. An ``ActivationWatch.close_step``
that raised left its statistics in, added to the next step's.
"""

import math

import pytest
import torch
from ddp_harness import ddp_own_reduction, run_ranks
from fault_injection import FailureInjector
from helpers import GPT, close, lm_loss, make_batch, reference_norms
from torch.nn.parallel import DistributedDataParallel as DDP

REL = 1e-5
# the fused kernel distmon's sums run on (distmon.compat.sq_sums_fp32: _foreach_norm before torch 2.11)
FUSED = "_foreach_powsum" if hasattr(torch, "_foreach_powsum") else "_foreach_norm"
WATCHED = ("blocks.0.fc", "blocks.1.fc", "head")  # activations=[nn.Linear] on GPT
STEP_HOOKS = [{"StepSchedule.before_step"}, {"StepSchedule.after_step"}]
ACTIVATIONS = [{"distmon.step.activations.sq_sums"}, {"ActivationWatch.close_step"}]
# per configuration: its options, and the sites armed on each faulted step (every other step)
CONFIGS = {
    "ddp": {
        "kind": "ddp",
        "plan": [
            {"distmon.sources.grad_sums.sq_sums"},  # the fused reads (local at the last bucket, reduced)
            {f"torch.{FUSED}"},
            {"GradSums.read"},
            {"BackwardSums.add_local"},  # in the comm hook
            {"BackwardSums.add_reduced"},  # in the autograd callback after DDP's
            {"BackwardSums.end_backward"},
            *STEP_HOOKS,
            *ACTIVATIONS,
        ],
    },
    # DDP's own reduction, no comm hook (NCCL's path; on gloo when asked): a forward hook, a hook on
    # the outputs, the reads among the backward's final callbacks
    "ddp_own_reduction": {
        "kind": "ddp",
        "hookless": True,
        "plan": [
            {"distmon.sources.ddp.find_tensors"},  # the forward hook
            {"distmon.sources.grad_sums.sq_sums"},
            {"GradSums.read"},
            {"BackwardSums.begin_backward"},
            {"BackwardSums.add_local"},
            {"BackwardSums.add_reduced"},
            {"BackwardSums.end_backward"},
        ],
    },
    # p.grad is the bucket: each bucket read in its own hook
    "ddp_bucket_view": {
        "kind": "ddp_bucket_view",
        "plan": [
            {"distmon.sources.ddp.sq_sums"},
            {"BucketLayouts.layout"},
            {"BackwardSums.add_local"},
            {"GradSums.read"},
        ],
    },
    "ddp_guard": {"kind": "ddp", "guard": "skip", "plan": [{"StepSchedule.judge_now"}, *STEP_HOOKS]},
    "fsdp": {
        "kind": "fsdp",
        "plan": [
            {"distmon.sources.fsdp.sq_sums"},  # the reduce-scatter wrapper
            {"BackwardSums.add_local"},
            {"distmon.sources.fsdp._present"},  # the post_backward wrapper
            {"GradSums.read"},  # the sharded gradients, read when backward ends
            {"BackwardSums.add_reduced"},
            {"BackwardSums.end_backward"},
            *STEP_HOOKS,
        ],
    },
    # one process: 2 micro-batches a step, a GradScaler, the guard; the before_step failure
    # falls on a step the scaler skips (an Inf loss), so it goes through the scaler's wrapper
    "single_process": {
        "kind": "local",
        "guard": "skip",
        "scaler": True,
        "accum": 2,
        "overflow": 14,
        "plan": [
            {"distmon.sources.plain.in_compiled_autograd"},  # the gradient-accumulation hook
            {"GradSums.read"},  # the end-of-backward read
            {"distmon.sources.grad_sums.sq_sums"},
            {"BackwardSums.add_local"},
            {"BackwardSums.end_backward"},
            {"StepSchedule.judge_now"},
            *STEP_HOOKS,  # before_step on step 14
            *ACTIVATIONS,
        ],
    },
}


def _sites(kind):
    """Every (owner, attribute) a plan may arm, besides distmon.step.sums's functions."""
    import distmon.sources.plain as local
    from distmon.sources.ddp import BucketLayouts
    from distmon.step.activations import ActivationWatch
    from distmon.step.backward import BackwardSums
    from distmon.step.schedule import StepSchedule

    sites = [(BackwardSums, m) for m in ("begin_backward", "add_local", "add_reduced", "end_backward")]
    sites += [(StepSchedule, m) for m in ("before_step", "after_step", "judge_now")]
    sites += [(ActivationWatch, "close_step"), (BucketLayouts, "layout"), (local.GradSums, "read")]
    sites.append((local, "in_compiled_autograd"))
    if kind.startswith("ddp"):
        import distmon.sources.ddp as ddp

        sites.append((ddp, "find_tensors"))
    if kind == "fsdp":
        import distmon.sources.fsdp as fsdp

        sites.append((fsdp, "_present"))
    return sites


def _act_reference(model):
    """float64 RMS and max |x| of each watched module's output over a step's forwards (the test's hooks)."""
    seen = {}

    def hook(name):
        def record(module, inputs, out):
            x = out.detach().double()
            sq, n, peak = seen.get(name, (0.0, 0, 0.0))
            seen[name] = (sq + float(x.pow(2).sum()), n + x.numel(), max(peak, float(x.abs().max())))

        return record

    for name in WATCHED:
        model.get_submodule(name).register_forward_hook(hook(name))
    return seen


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wrap(net, kind):
    if kind.startswith("ddp"):  # several buckets
        return DDP(net, bucket_cap_mb=0.002, gradient_as_bucket_view=kind == "ddp_bucket_view")
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks.values():
            fully_shard(block)
        fully_shard(net)
    return net


def _snap(snap):
    keep = ("step", "valid", "rank_valid", "grad_norm", "layer_grad_norms", "rank_grad_norms")
    out = {k: getattr(snap, k) for k in keep + ("monitor_errors", "skip_reason")}
    out["activations"] = {k: (snap.activation_rms[k], snap.activation_absmax[k]) for k in snap.activation_rms}
    return out


def _train(rank, name, monitored):
    """One configuration, monitored or not; per step the loss and the references (and the snapshot)."""
    import distmon

    cfg = CONFIGS[name]
    plan, accum = cfg["plan"], cfg.get("accum", 1)
    torch.manual_seed(0)
    net, twin = GPT(), GPT()
    names = [n for n, _ in twin.named_parameters()]
    model = _wrap(net, cfg["kind"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0) if cfg.get("scaler") else None
    acts = _act_reference(net)
    out = {"losses": [], "recs": [], "fired": []}
    mon = inj = None
    if monitored:
        ddp_own_reduction(cfg.get("hookless", False))
        mon = distmon.GradMonitor(
            model,
            opt,
            serve="none",
            export_every=1,
            activations=[torch.nn.Linear],
            guard=cfg.get("guard"),
            scaler=scaler,
        )
        if cfg["kind"].startswith("ddp"):  # the path the configuration is about is the one taken
            assert mon._schedule.source.hookless == bool(cfg.get("hookless")), name
        inj = FailureInjector(_sites(cfg["kind"]))
        inj.install()
    try:
        for step in range(1, 2 * len(plan) + 2):
            faulted = step % 2 == 0 and rank == (1 if cfg["kind"] != "local" else 0)
            if inj is not None:
                inj.active = plan[step // 2 - 1] if faulted else False
                before = inj.raised
            with torch.no_grad():
                for mine, theirs in zip(twin.parameters(), net.parameters()):
                    mine.copy_(_full(theirs))
            twin.zero_grad()
            acts.clear()
            for micro in range(accum):
                x, y = make_batch(rank, step, micro)
                (lm_loss(twin(x), y) / accum).backward()
                loss = lm_loss(model(x), y) / accum * (math.inf if step == cfg.get("overflow") else 1.0)
                (loss if scaler is None else scaler.scale(loss)).backward()
            scale = 1.0 if scaler is None else scaler.get_scale()  # distmon's figures are unscaled
            reduced = [(n, _full(p.grad) / scale) for n, p in zip(names, net.parameters())]
            ref = reference_norms(reduced)
            local = reference_norms([(n, p.grad) for n, p in zip(names, twin.parameters())])[0]
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            out["losses"].append(loss.detach())
            if inj is not None:
                inj.active = False
                out["fired"].append(inj.raised - before)
                act = {k: (math.sqrt(sq / n), peak) for k, (sq, n, peak) in acts.items()}
                out["recs"].append({"ref": ref, "local": local, "acts": act, "snap": _snap(mon.flush())})
    finally:
        if inj is not None:
            inj.uninstall()
    if mon is not None:
        out["errors"], out["step"] = mon._run.errors.count, mon.step
        mon.close()
    out["params"] = [_full(p.detach()) for p in net.parameters()]
    return out


def _job(rank, world, name):
    return {"plain": _train(rank, name, False), "monitored": _train(rank, name, True)}


def _agrees(got, want):
    """Exact (1e-5), or both non-finite (an overflowing step's gradient)."""
    finite = isinstance(got, float) and math.isfinite(got) and math.isfinite(want)
    return close(got, want, REL) if finite else not (math.isfinite(got) or math.isfinite(want))


def _is_nan(x):
    return isinstance(x, float) and math.isnan(x)


def _figure_problems(step, snap, recs_by_rank, rank, clean):
    """Each figure of ``snap`` exact, or NaN where marked not measured; every one exact on a clean step."""
    where, out = f"step {step}", []
    if snap["step"] != step:
        out.append(f"{where}: snapshot of step {snap['step']}")
    if clean and not (snap["valid"] and all(snap["rank_valid"])):
        out.append(f"{where}: a clean step reads valid={snap['valid']} rank_valid={snap['rank_valid']}")
    ref_total, ref_layers = recs_by_rank[0][step - 1]["ref"]
    figures = [("grad_norm", snap["grad_norm"], ref_total, snap["valid"])]
    figures += [(f"layer {k}", v, ref_layers[k], snap["valid"]) for k, v in snap["layer_grad_norms"].items()]
    for q, recs in enumerate(recs_by_rank):
        got, want = snap["rank_grad_norms"][q], recs[step - 1]["local"]
        figures.append((f"rank {q}'s norm", got, want, snap["rank_valid"][q]))
    for label, got, want, valid in figures:
        if valid and not _agrees(got, want):
            out.append(f"{where}: {label} {got!r} served as valid, reference {want!r}")
        if not valid and not _is_nan(got):
            out.append(f"{where}: {label} {got!r} not NaN where not measured")
    acts = recs_by_rank[rank][step - 1]["acts"]  # a snapshot holds its own rank's activations
    for module in WATCHED:
        got = snap["activations"].get(module, (math.nan, math.nan))
        for kind, g, want in zip(("rms", "absmax"), got, acts[module]):
            if not (_agrees(g, want) or (not clean and _is_nan(g))):
                out.append(f"{where}: activation {kind} of {module} {g!r}, reference {want!r}")
    return out


def _check(name, out):
    plan = CONFIGS[name]["plan"]
    faulty = 0 if CONFIGS[name]["kind"] == "local" else 1
    problems = []
    for rank, res in enumerate(out):
        plain, mon = res["plain"], res["monitored"]
        if not all(torch.equal(a, b) for a, b in zip(plain["losses"], mon["losses"])):
            problems.append(f"rank {rank}: the losses differ from the unmonitored run's")
        if not all(torch.equal(a, b) for a, b in zip(plain["params"], mon["params"])):
            problems.append(f"rank {rank}: the parameters differ from the unmonitored run's")
        fired = mon["fired"]
        unfired = [sorted(plan[i // 2]) for i in range(1, len(fired), 2) if rank == faulty and not fired[i]]
        if unfired or any(fired[0::2]) or (rank != faulty and any(fired)):
            problems.append(f"rank {rank}: injected failures per step {fired}; never fired: {unfired}")
        if rank == faulty and mon["errors"] < len(plan):
            problems.append(f"rank {rank}: {mon['errors']} errors counted for {len(plan)} failed steps")
        if mon["step"] != len(mon["recs"]):
            problems.append(f"rank {rank}: the monitor counted {mon['step']} of {len(mon['recs'])} steps")
        recs = [r["monitored"]["recs"] for r in out]
        served = recs[rank][-1]["snap"]["monitor_errors"]
        if served < len(plan):
            problems.append(f"rank {rank}: Snapshot.monitor_errors {served} for {len(plan)} failed steps")
        for step in range(1, len(recs[rank]) + 1):
            snap = recs[rank][step - 1]["snap"]
            problems += [f"rank {rank} {p}" for p in _figure_problems(step, snap, recs, rank, step % 2 == 1)]
    assert not problems, f"{name}:\n" + "\n".join(problems[:40])


@pytest.mark.slow  # real ranks
@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c["kind"] != "local"])
def test_failures_on_one_rank_never_reach_training(name):
    _check(name, run_ranks(_job, 2, name, timeout=240))


def test_failures_in_one_process_never_reach_training():
    _check("single_process", [_job(0, 1, "single_process")])
