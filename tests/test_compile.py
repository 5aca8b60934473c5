"""torch.compile and compiled autograd on 2 gloo ranks, DDP and FSDP2 (issue #22).

``torch.compile`` as users write it: nanoGPT's ``model = torch.compile(model)`` then DDP, DDP
then ``torch.compile(ddp)`` (the monitor is given the compiled module), each block compiled
(torchtitan), also under activation checkpointing (``checkpoint_wrapper`` per block, or
``torch.utils.checkpoint`` in the model's forward), and FSDP2 per block or whole. Every
configuration is monitored, its compiled code runs (forward and backward graphs counted), and:

* distmon's layer labels (``layer_grad_norms`` keys, the Prometheus ``layer`` labels) are the
  eager run's: no ``_orig_mod.`` or ``_checkpoint_wrapped_module.`` in them;
* every step is valid and its figures equal float64 references from the same run: the norms of
  the reduced ``p.grad`` (``full_tensor()`` under FSDP2) and, per rank, of an eager unwrapped
  twin's gradient on the same batch (1e-5: the compiled forward computes the same gradients up
  to float rounding).

The backend is ``aot_eager`` (its two compilers wrapped to count the graphs run): dynamo's
``OptimizedModule``, DDP's graph split at bucket boundaries and AOT autograd's joint graph and
partitioned backward, as with inductor, without generating C++: on this 2-core machine inductor
took 20 s for one tiny graph (cold cache), aot_eager 3 s, dynamo's start included.

Compiled autograd is refused at construction on every rank with a ``ValueError`` naming the
way out, nothing installed, the job training on bit-identically: with
``torch._dynamo.config.compiled_autograd = True``, and for a DDP built under
``optimize_ddp = "python_reducer"`` (before, backward raised ``AttributeError: 'tuple' object
has no attribute 'is_last'`` from distmon's comm hook, the job died). FSDP2 trained under the
compiled-autograd context manager with a monitor built before: no exception into backward, no
figure served as valid that is not exact (before, 0.34 of the true norm was served as valid),
training bit-identical to an unmonitored run.
"""

import collections
import functools

import pytest
import torch
import torch.distributed as dist
from ddp_harness import run_ranks
from helpers import GPT, close, lm_loss, make_batch, reference_norms, sample_value, scrape_metrics
from torch.nn.parallel import DistributedDataParallel as DDP

from distmon.compat import TORCH

pytestmark = pytest.mark.slow  # real ranks: not in the fast tier

STEPS = 3
REL = 1e-5
DDP_CONFIGS = (
    "eager",
    "compile_then_ddp",
    "ddp_then_compile",
    "compiled_blocks",
    "compiled_blocks_checkpoint_wrapper",
    "compiled_blocks_torch_checkpoint",
)
FSDP_CONFIGS = (
    "eager",
    "compiled_blocks",
    "compiled_blocks_checkpoint_wrapper",
    "compiled_blocks_torch_checkpoint",
    "compiled_model",
)
CONFIGS = [("ddp", c) for c in DDP_CONFIGS] + [("fsdp", c) for c in FSDP_CONFIGS]
COMPILED = [c for c in CONFIGS if c[1] != "eager"]
RUNS = collections.Counter()  # graphs run by the backend, per kind (in each rank)


def _counted(kind):
    from torch._dynamo.backends.debugging import boxed_nop

    def compiler(gm, example_inputs):
        run = boxed_nop(gm, example_inputs)

        def counted(args):
            RUNS[kind] += 1
            return run(args)

        counted._boxed_call = True
        return counted

    return compiler


def _backend():
    from torch._dynamo.backends.debugging import aot_eager

    return functools.partial(aot_eager, fw_compiler=_counted("forward"), bw_compiler=_counted("backward"))


def _full(t):
    """A tensor as one rank's whole value (a DTensor's full_tensor(), anything else as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sync(twin, net):
    """The eager twin's parameters := the model's (wrappers keep the parameters' order)."""
    with torch.no_grad():
        for mine, theirs in zip(twin.parameters(), net.parameters()):
            mine.copy_(_full(theirs.detach()))


def _build(kind, config, backend):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = GPT(checkpoint=config.endswith("torch_checkpoint"))
    if config.startswith("compiled_blocks"):
        for i, block in list(net.blocks.items()):
            if config.endswith("checkpoint_wrapper"):
                block = checkpoint_wrapper(block)
            net.blocks[i] = torch.compile(block, backend=backend)
    if kind == "fsdp":
        for block in net.blocks.values():
            fully_shard(block)
        fully_shard(net)
        return net, torch.compile(net, backend=backend) if config == "compiled_model" else net
    if config == "compile_then_ddp":  # nanoGPT
        return net, DDP(torch.compile(net, backend=backend))
    if config == "ddp_then_compile":
        return net, torch.compile(DDP(net), backend=backend)
    return net, DDP(net)


def _train_monitored(rank, kind, config, backend):
    import distmon

    torch._dynamo.reset()  # each configuration compiles (and counts) its own graphs
    before = RUNS.copy()
    net, model = _build(kind, config, backend)
    twin = GPT()  # eager, unwrapped, unsharded: this rank's local gradient
    names = [n for n, _ in twin.named_parameters()]  # the model's own names
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"error": None, "steps": []}
    try:
        mon = distmon.GradMonitor(
            model, opt, serve="rank0", port=0, addr="127.0.0.1", linger_s=0, export_every=1
        )
    except Exception as e:  # reported by the tests, per configuration
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    for step in range(1, STEPS + 1):
        x, y = make_batch(rank, step)
        _sync(twin, net)
        twin.zero_grad()
        lm_loss(twin(x), y).backward()
        lm_loss(model(x), y).backward()
        reduced = reference_norms([(n, _full(p.grad)) for n, p in zip(names, net.parameters())])
        local = reference_norms([(n, p.grad) for n, p in zip(names, twin.parameters())])[0]
        opt.step()
        opt.zero_grad()
        out["steps"].append({"reduced": reduced, "local": local, "snap": _fields(mon.flush())})
    if rank == 0:
        samples = scrape_metrics(mon.port)
        out["labels"] = sorted(lab["layer"] for n, lab, _ in samples if n == "distmon_layer_grad_norm")
        out["served_norm"] = sample_value(samples, "distmon_grad_norm")
    mon.close()
    out["runs"] = dict(RUNS - before)
    return out


def _fields(snap):
    keep = ("step", "valid", "rank_valid", "grad_norm", "layer_grad_norms", "rank_grad_norms")
    return {k: getattr(snap, k) for k in keep}


def _compile_job(rank, world):
    backend = _backend()
    return {(kind, config): _train_monitored(rank, kind, config, backend) for kind, config in CONFIGS}


@pytest.fixture(scope="module")
def compiled():
    return run_ranks(_compile_job, 2, timeout=300)


@pytest.mark.parametrize("kind,config", COMPILED, ids=[f"{k}-{c}" for k, c in COMPILED])
def test_compiled_models_are_monitored_and_their_graphs_run(compiled, kind, config):
    for rank in range(2):
        res = compiled[rank][(kind, config)]
        assert res["error"] is None, res["error"]
        assert res["runs"].get("forward", 0) >= STEPS and res["runs"].get("backward", 0) >= STEPS, res["runs"]


@pytest.mark.parametrize("kind,config", COMPILED, ids=[f"{k}-{c}" for k, c in COMPILED])
def test_layer_labels_are_the_eager_runs(compiled, kind, config):
    eager, res = compiled[0][(kind, "eager")], compiled[0][(kind, config)]
    assert res["error"] is None, res["error"]
    assert eager["labels"] == sorted(set(eager["labels"])) and len(eager["labels"]) == 7, eager["labels"]
    assert res["labels"] == eager["labels"], "Prometheus layer labels differ from the eager run's"
    for got, want in zip(res["steps"], eager["steps"]):
        assert list(got["snap"]["layer_grad_norms"]) == list(want["snap"]["layer_grad_norms"])


@pytest.mark.parametrize("kind,config", CONFIGS, ids=[f"{k}-{c}" for k, c in CONFIGS])
def test_every_figure_equals_the_float64_reference(compiled, kind, config):
    problems = []
    for rank in range(2):
        res = compiled[rank][(kind, config)]
        assert res["error"] is None, res["error"]
        for i, rec in enumerate(res["steps"]):
            snap, (total, by_layer), where = rec["snap"], rec["reduced"], f"rank {rank} step {i + 1}"
            if (snap["step"], snap["valid"], list(snap["rank_valid"])) != (i + 1, True, [True, True]):
                problems.append(f"{where}: {snap}")
            if not close(snap["grad_norm"], total, REL):
                problems.append(f"{where}: grad_norm {snap['grad_norm']!r}, reference {total!r}")
            problems += [
                f"{where}: layer {k} {v!r}, reference {by_layer.get(k)!r}"
                for k, v in snap["layer_grad_norms"].items()
                if not close(v, by_layer.get(k, -1.0), REL)
            ]
            for q in range(2):
                want, got = compiled[q][(kind, config)]["steps"][i]["local"], snap["rank_grad_norms"][q]
                if not close(got, want, REL):
                    problems.append(f"{where}: rank {q} norm {got!r}, twin {want!r}")
    served = compiled[0][(kind, config)]["served_norm"]
    if not close(served, compiled[0][(kind, config)]["steps"][-1]["reduced"][0], REL):
        problems.append(f"distmon_grad_norm {served!r} is not the last step's reference")
    assert not problems, f"{kind}-{config}:\n" + "\n".join(problems[:30])


# ========================================================================================
# Compiled autograd
# ========================================================================================

REFUSED = {  # torch._dynamo.config while the DDP model is built and trained
    "compiled_autograd": {"compiled_autograd": True},
    "python_reducer": {"optimize_ddp": "python_reducer"},
}


def _installed(ddp, opt):
    """What a monitor could have left on the model and the optimizer."""
    hooks = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return {"comm_hooks": len(ddp._comm_hooks), "step_hooks": hooks, "step": "step" in vars(opt)}


def _refused_run(rank, case, attempt, backend):
    """DDP trained under ``case``'s setting, after a GradMonitor was attempted (or not)."""
    import distmon

    torch._dynamo.reset()
    with torch._dynamo.config.patch(**REFUSED[case]):
        torch.manual_seed(0)
        ddp = DDP(GPT())
        model, opt = torch.compile(ddp, backend=backend), torch.optim.SGD(ddp.parameters(), lr=0.1)
        out = {"refusal": None, "raised": None, "losses": []}
        if attempt:
            try:
                distmon.GradMonitor(ddp, opt, serve="none")
                out["refusal"] = "accepted"
            except Exception as e:
                out["refusal"] = f"{type(e).__name__}: {e}"
        out["installed"] = _installed(ddp, opt)
        try:  # the job trains on: nothing of distmon's may raise into it
            for step in range(1, STEPS + 1):
                x, y = make_batch(rank, step)
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out["losses"].append(loss.detach())
        except Exception as e:
            out["raised"] = f"{type(e).__name__}: {e}"
        out["params"] = [p.detach().clone() for p in ddp.parameters()]
    return out


def _mean_over_ranks(grad):
    """The job's gradient in float64: a sharded one whole, a local one (FSDP left it unreduced) averaged."""
    if hasattr(grad, "full_tensor"):
        return grad.full_tensor().double()
    g = grad.detach().double().clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def _fsdp_compiled_autograd(rank, monitored):
    """FSDP2, backward under the compiled-autograd context manager, a monitor built before it."""
    from torch._dynamo import compiled_autograd
    from torch.distributed.fsdp import fully_shard

    import distmon

    torch._dynamo.reset()
    captures = torch._dynamo.utils.counters["compiled_autograd"]["captures"]
    torch.manual_seed(0)
    net, twin = GPT(), GPT()
    names = [n for n, _ in twin.named_parameters()]
    for block in net.blocks.values():
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = distmon.GradMonitor(net, opt, serve="none", export_every=1) if monitored else None
    out = {"raised": None, "losses": [], "steps": []}
    try:
        for step in range(1, STEPS + 1):
            x, y = make_batch(rank, step)
            _sync(twin, net)
            twin.zero_grad()
            lm_loss(twin(x), y).backward()
            loss = lm_loss(net(x), y)
            # the captured graph run as it is: compiling it adds minutes, not a hook call
            with compiled_autograd._enable(lambda graph: graph):
                loss.backward()
            out["losses"].append(loss.detach())
            truth = reference_norms([(n, _mean_over_ranks(p.grad)) for n, p in zip(names, net.parameters())])
            local = reference_norms([(n, p.grad) for n, p in zip(names, twin.parameters())])[0]
            opt.step()
            opt.zero_grad()
            if mon is not None:
                out["steps"].append({"truth": truth, "local": local, "snap": _fields(mon.flush())})
    except Exception as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    if mon is not None:
        mon.close()
    out["params"] = [_full(p.detach()) for p in net.parameters()]
    out["captures"] = torch._dynamo.utils.counters["compiled_autograd"]["captures"] - captures
    return out


def _compiled_autograd_job(rank, world):
    backend = _backend()
    out = {case: [_refused_run(rank, case, tried, backend) for tried in (False, True)] for case in REFUSED}
    out["fsdp"] = [_fsdp_compiled_autograd(rank, monitored) for monitored in (False, True)]
    return out


@pytest.fixture(scope="module")
def compiled_autograd():
    return run_ranks(_compiled_autograd_job, 2, timeout=300)


def _same_training(plain, monitored):
    return all(torch.equal(a, b) for a, b in zip(plain["losses"], monitored["losses"])) and all(
        torch.equal(a, b) for a, b in zip(plain["params"], monitored["params"])
    )


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_compiled_autograd_is_refused_at_construction_and_training_goes_on(compiled_autograd, case):
    for rank in range(2):
        plain, attempted = compiled_autograd[rank][case]
        assert attempted["refusal"].startswith("ValueError"), attempted["refusal"]
        for words in ("compiled autograd", "compiled_autograd = False", "'python_reducer'"):
            assert words in attempted["refusal"], attempted["refusal"]
        assert attempted["installed"] == {"comm_hooks": 0, "step_hooks": 0, "step": False}
        assert plain["raised"] is None and attempted["raised"] is None, attempted["raised"]
        assert len(attempted["losses"]) == STEPS and _same_training(plain, attempted), rank


def test_fsdp_under_compiled_autograd_serves_no_wrong_figure_and_trains_unchanged(compiled_autograd):
    plain = compiled_autograd[0]["fsdp"][0]
    if TORCH < (2, 11) and plain["raised"]:  # torch's own limit: the run without distmon fails alike
        pytest.skip(f"torch {torch.__version__}'s FSDP2 fails under compiled autograd: {plain['raised']}")
    problems = []
    for rank in range(2):
        plain, monitored = compiled_autograd[rank]["fsdp"]
        assert plain["captures"] > 0 and monitored["captures"] > 0, "compiled autograd did not run"
        assert monitored["raised"] is None, monitored["raised"]
        assert len(monitored["losses"]) == STEPS and _same_training(plain, monitored), rank
        for i, rec in enumerate(monitored["steps"]):
            snap, where = rec["snap"], f"rank {rank} step {i + 1}"
            if snap["step"] != i + 1:
                problems.append(f"{where}: snapshot of step {snap['step']}")
            if snap["valid"] and not close(snap["grad_norm"], rec["truth"][0], REL):
                problems.append(f"{where}: {snap['grad_norm']!r} served as valid, truth {rec['truth'][0]!r}")
            for q in range(2):
                want = compiled_autograd[q]["fsdp"][1]["steps"][i]["local"]
                if snap["rank_valid"][q] and not close(snap["rank_grad_norms"][q], want, REL):
                    problems.append(f"{where}: rank {q} {snap['rank_grad_norms'][q]!r} valid, twin {want!r}")
    assert not problems, "\n".join(problems)
