"""Non-finite gradients on real DDP ranks: attributed to their rank and layer, everything else exact.

A NaN / Inf injected into one layer's gradient on one rank (2 ranks, with and without the ranks x
layers matrix; and 8 ranks) is reported at that step with that (rank, layer) by every rank's
monitor; the other ranks' and layers' figures of that step, and every figure of the finite steps
around it, equal the float64 references (``ddp_twin``: DDP's reduced ``p.grad`` and an unwrapped
twin's local gradient); training goes on with finite losses.
"""

import copy
import math

import pytest
from ddp_harness import run_ranks
from ddp_twin import LAYERS, number_problems, setup, train_step
from helpers import claims_nonfinite, snapshot_dict

pytestmark = pytest.mark.slow  # real ranks: not in the fast tier


NONFINITE_STEPS = 7
# step -> (rank, layer, factor); the gradient of that layer's weight is multiplied by factor
INJECT = {3: (1, "blocks.1.fc", float("nan")), 5: (0, "blocks.0.fc", float("inf"))}


def _nonfinite_job(rank, world_size, rank_layers):
    import distmon

    model, twin, ddp, opt = setup()
    mon = distmon.GradMonitor(ddp, opt, export_every=1, serve="none", rank_layers=rank_layers)
    current = {"step": 0}

    def make_hook(layer):
        def hook(grad):
            plan = INJECT.get(current["step"])
            if plan and plan[0] == rank and plan[1] == layer:
                return grad * plan[2]
            return grad

        return hook

    for layer in {p[1] for p in INJECT.values()}:
        model.get_submodule(layer).weight.register_hook(make_hook(layer))

    recs = []
    for step in range(1, NONFINITE_STEPS + 1):
        current["step"] = step
        saved = copy.deepcopy(model.state_dict()) if step in INJECT else None
        rec = train_step(rank, step, model, twin, ddp, opt)
        if saved is not None:  # undo the poisoned update so training goes on
            model.load_state_dict(saved)
        rec["loss"] = float(rec["loss"])
        mon.flush()
        rec["snap"] = snapshot_dict(mon.latest())
        recs.append(rec)
    mon.close()
    return recs


@pytest.fixture(scope="module", params=[True, False], ids=["rank_layers", "rank_totals"])
def nonfinite_run(request):
    """With the ranks x layers matrix, the first bad layer is found on the host from it;
    without, each rank finds it on the device and sends it: both must agree."""
    return run_ranks(_nonfinite_job, 2, request.param, timeout=120), request.param


def test_nonfinite_reported_with_rank_and_layer(nonfinite_run):
    recs, rank_layers = nonfinite_run
    _assert_nonfinite_reported(recs, rank_layers, 2)


def test_eight_ranks_figures_exact_and_nan_localized():
    """The same checks on 8 gloo ranks (a tiny model, within the CI budget)."""
    _assert_nonfinite_reported(run_ranks(_nonfinite_job, 8, True, timeout=240), True, 8)


def _assert_nonfinite_reported(recs, rank_layers, world):
    problems = []
    for r in range(world):  # every rank's monitor reports the same
        for rec in recs[r]:
            step, snap = rec["step"], rec["snap"]
            if snap is None or snap["step"] != step:
                problems.append(f"rank {r} step {step}: snapshot {snap and snap['step']!r}")
                continue
            if (snap["rank_layer_grad_norms"] is None) == rank_layers:
                problems.append(
                    f"rank {r} step {step}: rank_layer_grad_norms {snap['rank_layer_grad_norms']!r} "
                    f"with rank_layers={rank_layers}"
                )
            if step in INJECT:
                bad_rank, bad_layer, _ = INJECT[step]
                j = LAYERS.index(bad_layer)
                if snap["nonfinite"] is not True:
                    problems.append(f"rank {r} step {step}: nonfinite = {snap['nonfinite']!r}")
                if snap["nonfinite_ranks"] != [bad_rank]:
                    problems.append(
                        f"rank {r} step {step}: nonfinite_ranks = {snap['nonfinite_ranks']!r}, "
                        f"expected [{bad_rank}]"
                    )
                fnf = snap["first_nonfinite"]
                if fnf is None or tuple(fnf) != (bad_rank, bad_layer):
                    problems.append(
                        f"rank {r} step {step}: first_nonfinite = {fnf!r}, expected {(bad_rank, bad_layer)!r}"
                    )
                if not _isnonfinite(snap["grad_norm"]):
                    problems.append(f"rank {r} step {step}: grad_norm {snap['grad_norm']!r} is finite")
                if not _isnonfinite(snap["layer_grad_norms"].get(bad_layer)):
                    problems.append(f"rank {r} step {step}: layer_grad_norms[{bad_layer}] is finite")
                if not _isnonfinite(snap["rank_grad_norms"][bad_rank]):
                    problems.append(f"rank {r} step {step}: rank_grad_norms[{bad_rank}] is finite")
                if rank_layers and not _isnonfinite(snap["rank_layer_grad_norms"][bad_rank][j]):
                    problems.append(
                        f"rank {r} step {step}: rank_layer_grad_norms[{bad_rank}][{bad_layer}] is finite"
                    )
                # everything else is still measured exactly: the other rank, the other layers
                skip = {("reduced", None), ("reduced", bad_layer), (bad_rank, None), (bad_rank, bad_layer)}
                problems += [f"rank {r}: {p}" for p in number_problems(snap, step, recs, world, skip)]
            else:
                if claim := claims_nonfinite(snap):
                    problems.append(f"rank {r} step {step}: {claim}")
                problems += [f"rank {r}: {p}" for p in number_problems(snap, step, recs, world)]
    assert not problems, "\n".join(problems[:30])
    # training went on: the steps after the injections have finite losses
    assert all(math.isfinite(rec["loss"]) for rec in recs[0])


def _isnonfinite(x):
    return isinstance(x, float) and not math.isfinite(x)
