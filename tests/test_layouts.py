"""Tensor, pipeline and data parallelism combined, on real gloo ranks: exact figures for the job.

Every layout of ``LAYOUTS`` trains the harness's small GPT (``tests/layout_harness.py``) with the
real ``parallelize_module``, ``fully_shard``, ``DistributedDataParallel(device_mesh=...)`` and
``torch.distributed.pipelining`` schedules, bare and with distmon, and each step is compared with
references computed another way: the job's gradient from every rank's ``full_tensor()``
gradients merged by parameter name (stages and shards meet in the test, not in distmon), each
rank's local gradient from an unsharded float64 twin on that rank's batch. The layouts that share
a world size run in one spawn.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from ddp_harness import run_ranks
from helpers import close, rel_err
from layout_harness import (
    LAYERS,
    NAN_LAYER,
    SPY_STEPS,
    STEPS,
    Layout,
    by_layer,
    combined,
    layout_job,
    torch_limit,
)

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
LAYOUTS = [
    # torchtitan's 2-D: tensor parallel inside, FSDP2 over the data-parallel dimension
    Layout("tp_fsdp", {"dp": 2, "tp": 2}, dp="fsdp"),
    Layout("tp_fsdp_bf16", {"dp": 2, "tp": 2}, dp="fsdp", dtype=BF16),
    # HSDP + TP, 3-D
    Layout("hsdp_tp", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, dp="hsdp"),
    # tensor parallelism alone: the plain parameters (embedding, norms, head) are declared copies
    Layout("tp", {"tp": 4}, declare="tp"),
    Layout("tp_ddp", {"dp": 2, "tp": 2}, dp="ddp"),
    Layout("pp_gpipe", {"pp": 2}, schedule="GPipe", microbatches=2),
    Layout("pp_gpipe_bf16", {"pp": 2}, schedule="GPipe", microbatches=2, dtype=BF16),
    Layout("pp_1f1b", {"pp": 2}, schedule="1F1B", microbatches=4),
    # torch's DDP inside a pipeline stage takes one micro-batch (it asserts with more)
    Layout("pp_ddp", {"pp": 2, "dp": 2}, dp="ddp", microbatches=1),
    Layout("pp_fsdp", {"pp": 2, "dp": 2}, dp="fsdp", schedule="1F1B", microbatches=2),
    Layout("pp_tp_fsdp", {"pp": 2, "dp": 2, "tp": 2}, dp="fsdp"),
]
# every rank claims its copy of the plain parameters as its own: the first-step check must catch it
MISDECLARED = Layout("tp_misdeclared", {"tp": 4}, declare="self")
NAMES = [layout.name for layout in LAYOUTS]
BY_NAME = {layout.name: layout for layout in LAYOUTS + [MISDECLARED]}


class _Runs(dict):
    """Each layout's per-rank results; a layout this torch cannot run is skipped, naming why."""

    def __missing__(self, name: str) -> list[dict]:
        pytest.skip(torch_limit(BY_NAME[name]) or f"{name} was not selected")


def _selected(session: pytest.Session) -> set[str]:
    """The layouts the selected tests of this file compare (all of them when the file runs whole):
    ``pytest "tests/test_layouts.py::...[tp_fsdp]"`` trains that layout alone."""
    names = set()
    for item in session.items:
        if item.path.name == os.path.basename(__file__) and "runs" in getattr(item, "fixturenames", ()):
            param = getattr(item, "callspec", None)
            # the one test without a layout parameter compares the misdeclared layout with "tp"
            names |= {param.params["name"]} if param else {MISDECLARED.name, "tp"}
    return names


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, list[dict]]:
    """Each layout's per-rank results, the layouts of one world size in one spawn."""
    by_world: dict[int, list[Layout]] = {}
    wanted = _selected(request.session)
    for layout in LAYOUTS + [MISDECLARED]:
        if layout.name in wanted and torch_limit(layout) is None:
            by_world.setdefault(layout.world, []).append(layout)
    out = _Runs()
    for world, layouts in sorted(by_world.items()):
        logs = tmp_path_factory.mktemp(f"world{world}")
        ranks = run_ranks(layout_job, world, layouts, str(logs), timeout=600)
        for layout in layouts:
            out[layout.name] = [r[layout.name] for r in ranks]
    return out


def _tolerance(layout: Layout) -> float:
    # a rank's local figures against a float64 twin: bf16 activations and gradients round at
    # 2**-8 at every op of the chain (the twin computes exactly; measured: up to 1.4% on the
    # first block's norm), fp32 ones at 1e-7. A misread local figure is off by far more (a
    # tensor-parallel or data-parallel factor: 29% and up)
    return 5e-2 if layout.dtype == BF16 else 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_global_and_layer_figures_equal_the_float64_reference(runs, name):
    outs = runs[name]
    snaps = outs[0]["snaps"]
    assert [s["step"] for s in snaps] == list(range(1, STEPS + SPY_STEPS + 2))
    worst = 0.0
    for step in range(1, STEPS + 1):
        snap, ref = snaps[step - 1], by_layer(combined(outs, step))
        assert snap["valid"] and snap["world_size"] == len(outs), snap
        assert close(snap["grad_norm"], math.sqrt(sum(ref.values())), 1e-5), (step, snap["grad_norm"], ref)
        assert list(snap["layer_grad_norms"]) == list(LAYERS)
        for layer in LAYERS:
            assert close(snap["layer_grad_norms"][layer], math.sqrt(ref[layer]), 1e-5), (step, layer)
        pairs = [(snap["grad_norm"], sum(ref.values()))]
        pairs += [(snap["layer_grad_norms"][k], ref[k]) for k in LAYERS]
        worst = max([worst] + [rel_err(got, math.sqrt(sq)) for got, sq in pairs])
    print(f"{name}: global and per-layer figures within {worst:.1e} of the float64 reference")


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_s_local_figures_equal_its_twin(runs, name):
    outs, tol = runs[name], _tolerance(BY_NAME[name])
    for step in range(1, STEPS + 1):
        snap = outs[0]["snaps"][step - 1]
        assert snap["rank_valid"] == [True] * len(outs), snap
        for rank, out in enumerate(outs):
            local = by_layer(out["local"][step - 1])
            assert close(snap["rank_grad_norms"][rank], math.sqrt(sum(local.values())), tol), (step, rank)
            for i, layer in enumerate(LAYERS):
                got, want = snap["rank_layer_grad_norms"][rank][i], math.sqrt(local[layer])
                assert close(got, want, tol, abs_tol=1e-7), (step, rank, layer, got, want)


@pytest.mark.parametrize("name", NAMES)
def test_clip_grad_norm_returns_the_job_s_norm_on_every_rank(runs, name):
    outs = runs[name]
    for step in range(1, STEPS + 1):
        want = math.sqrt(sum(combined(outs, step).values()))
        for rank, out in enumerate(outs):
            assert close(out["clip"][step - 1], want, 1e-5), (step, rank, out["clip"][step - 1], want)


@pytest.mark.parametrize("name", NAMES + [MISDECLARED.name])
def test_training_is_bit_identical_to_the_same_script_without_distmon(runs, name):
    for rank, out in enumerate(runs[name]):
        assert out["same_losses"] and out["same_params"], rank


@pytest.mark.parametrize("name", NAMES)
def test_one_log_writer_one_endpoint_per_rank_series_labelled_with_coordinates(runs, name):
    outs = runs[name]
    assert outs[0]["port"] is not None and all(out["port"] is None for out in outs[1:])
    # every rank was given the same log_path: a second writer would repeat or interleave steps
    assert [s["step"] for s in outs[0]["snaps"]] == list(range(1, STEPS + SPY_STEPS + 2))
    series = {int(labels["rank"]): labels for _, labels, _ in outs[0]["scrape"]}
    assert sorted(series) == list(range(len(outs)))
    for rank, out in enumerate(outs):
        want = {k: "" if v is None else str(v) for k, v in out["coords"].items()}
        got = {k: series[rank][k] for k in want}
        assert got == want, (rank, got, want)


@pytest.mark.parametrize("name", NAMES)
def test_one_collective_per_step_and_no_host_sync_on_ordinary_steps(runs, name):
    for rank, out in enumerate(runs[name]):
        assert out["syncs"] == "", (rank, out["syncs"])
        assert out["per_step"] == list(range(1, SPY_STEPS + 1)), (rank, out["per_step"])


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_on_one_rank_is_named_with_its_coordinates_and_layer(runs, name):
    outs = runs[name]
    snap = outs[0]["snaps"][-1]
    bad = outs[0]["nan_rank"]
    assert snap["nonfinite"] and snap["first_nonfinite"] == [bad, NAN_LAYER], snap["first_nonfinite"]
    want = {k: "" if v is None else str(v) for k, v in outs[bad]["coords"].items()}
    assert {k: snap["first_nonfinite_coords"][k] for k in want} == want


def test_a_misdeclared_layout_is_caught_by_the_first_step_check_not_served(runs):
    outs = runs[MISDECLARED.name]
    snaps = outs[0]["snaps"]
    assert snaps and not any(s["valid"] for s in snaps), [s["valid"] for s in snaps]
    assert all(s["grad_norm"] == "nan" for s in snaps), [s["grad_norm"] for s in snaps]
    assert snaps[-1]["monitor_errors"] >= 1
    # the right declaration of the same layout passes the same check
    assert all(s["valid"] for s in runs["tp"][0]["snaps"][:STEPS])


def _interleaved_job(rank: int, world: int) -> str:
    """Two stages on each rank (an interleaved schedule's layout): refused on every rank, alike."""
    from helpers import GPT
    from layout_harness import MODEL
    from torch.distributed.pipelining import PipelineStage

    import distmon

    part = GPT(**MODEL)
    stage = PipelineStage(part, rank, 2 * world, torch.device("cpu"))
    try:
        distmon.GradMonitor(stage, torch.optim.SGD(part.parameters(), lr=0.1), serve="none")
    except ValueError as e:
        return str(e)
    return "accepted"


def test_several_stages_per_rank_are_refused_at_construction_naming_the_way_out():
    errors = run_ranks(_interleaved_job, 2, timeout=120)
    assert errors[0] == errors[1] and "interleaved schedules" in errors[0], errors
    assert "one stage per rank" in errors[0]


def _reindexed_stages_job(rank: int, world: int, passed: str) -> str:
    """Stages cut as re-indexed slices (``nn.Sequential(*layers[a:b])`` numbers each from 0): both
    stages hold '0.weight', different parameters under one name."""
    from torch.distributed.pipelining import PipelineStage

    import distmon

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    part = torch.nn.Sequential(*layers[2 * rank : 2 * rank + 2])
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    try:
        distmon.GradMonitor(
            stage if passed == "stage" else part, torch.optim.SGD(part.parameters(), lr=0.1), serve="none"
        )
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("passed", ["stage", "module"])
def test_stages_whose_parameters_share_names_are_refused_naming_the_cut(passed):
    """Not an options difference nor a missing declaration (#27): the refusal says how to cut stages."""
    errors = run_ranks(_reindexed_stages_job, 2, passed, timeout=120)
    assert errors[0] == errors[1], errors
    assert "pipeline stages 0 and 1" in errors[0] and "'0.weight'" in errors[0], errors[0]
    assert "names kept" in errors[0] and "options differ" not in errors[0], errors[0]
