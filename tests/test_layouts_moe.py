"""Mixture-of-experts layouts (#23) on 4 real gloo ranks: experts on their own expert-parallel
mesh under FSDP2 (torchtitan), and experts outside every wrapper next to DDP, reduced by the
model's own code and declared with ``replicated_over`` (DeepSpeed, Megatron); fp32 and bf16
parameters; a misdeclared and an undeclared layout. The models, the layouts and the references
are in ``moe_layouts.py``; every layout runs in one spawn, shared by the module's tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from ddp_harness import run_ranks
from helpers import close
from layout_harness import SPY_STEPS, STEPS, Layout, by_layer, combined
from moe_layouts import EP, MOE_LAYERS, NAN_LAYER, moe_job

pytestmark = pytest.mark.slow

EXACT = [
    Layout("ep_fsdp", {"efsdp": EP, "ep": EP}, dp="fsdp"),
    Layout("ep_fsdp_bf16", {"efsdp": EP, "ep": EP}, dp="fsdp", dtype=torch.bfloat16),
    Layout("ep_ddp", {"edp": EP, "ep": EP}, dp="ddp", declare="edp"),
    Layout("ep_ddp_bf16", {"edp": EP, "ep": EP}, dp="ddp", declare="edp", dtype=torch.bfloat16),
]
MISDECLARED = Layout("ep_ddp_misdeclared", {"edp": EP, "ep": EP}, dp="ddp", declare="self")
NAMES = [layout.name for layout in EXACT]
REDUCED_REL = 1e-5
# A rank's local figures against a float64 twin that computes its forward and backward in float64
# from the same weights: in fp32 they differ by rounding in the sums only; in bf16 every
# activation and gradient of the real run was rounded to 8 bits of mantissa (2^-9 relative) on
# the way, some 20 operations deep, so a layer's local norm is a few percent off (up to 1.7e-2
# here). The reduced figures compare the run's own gradients, so they stay exact in bf16 too.
LOCAL_REL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    log_dir = str(tmp_path_factory.mktemp("moe"))
    return run_ranks(moe_job, 4, EXACT + [MISDECLARED], log_dir, timeout=420)


def outs(ranks: list[dict], name: str) -> list[dict]:
    return [r[name] for r in ranks]


def labels(coords: dict[str, int | None]) -> dict[str, str]:
    """Coordinates as distmon's labels say them ("" for a dimension the job does not have)."""
    return {k: "" if v is None else str(v) for k, v in coords.items()}


def layout_named(name: str) -> Layout:
    return next(layout for layout in EXACT if layout.name == name)


@pytest.mark.parametrize("name", NAMES)
def test_reduced_figures_equal_the_float64_reference(ranks: list[dict], name: str) -> None:
    """Every step's global and per-layer figures (and clip_grad_norm_ on every rank) equal the
    sums of squares of the gradients the optimizer stepped with, made whole and merged by name
    across the ranks, each distinct expert shard once."""
    results = outs(ranks, name)
    snaps = results[0]["snaps"]
    for step in range(1, STEPS + 1):
        merged = combined(results, step)
        experts = [k for k in merged if k.startswith("moe.experts.")]
        # whole experts (FSDP: full_tensor) or each ep shard of them (DDP: name#ep<j>), once
        assert len(experts) == (2 if layout_named(name).dp == "fsdp" else 2 * EP), experts
        ref = by_layer(merged, MOE_LAYERS)
        snap = snaps[step - 1]
        assert snap["step"] == step and snap["valid"], snap
        total = math.sqrt(sum(ref.values()))
        assert close(snap["grad_norm"], total, REDUCED_REL), (step, snap["grad_norm"], total)
        for layer in MOE_LAYERS:
            got, want = snap["layer_grad_norms"][layer], math.sqrt(ref[layer])
            assert close(got, want, REDUCED_REL), (step, layer, got, want)
        for rank, out in enumerate(results):
            assert close(out["clip"][step - 1], total, REDUCED_REL), (step, rank, out["clip"], total)


@pytest.mark.parametrize("name", NAMES)
def test_local_figures_equal_each_ranks_own_contribution(ranks: list[dict], name: str) -> None:
    """A rank's local figures are its gradient before the data-parallel reduction: the dense
    layers' from its own batch, its experts' from every token its ep group sent them (a float64
    twin's, sliced to its experts), before the efsdp reduce-scatter or the model's edp all-reduce."""
    results = outs(ranks, name)
    snaps = results[0]["snaps"]
    rel = LOCAL_REL[layout_named(name).dtype]
    for step in range(1, STEPS + 1):
        snap = snaps[step - 1]
        for rank, out in enumerate(results):
            ref = by_layer(out["local"][step - 1], MOE_LAYERS)
            assert snap["rank_valid"][rank], (step, rank)
            total = math.sqrt(sum(ref.values()))
            assert close(snap["rank_grad_norms"][rank], total, rel), (step, rank, snap["rank_grad_norms"])
            got = dict(zip(snap["layer_grad_norms"], snap["rank_layer_grad_norms"][rank]))
            for layer in MOE_LAYERS:
                assert close(got[layer], math.sqrt(ref[layer]), rel), (step, rank, layer, got, ref)


@pytest.mark.parametrize("name", NAMES + [MISDECLARED.name])
def test_training_is_bit_identical_without_distmon(ranks: list[dict], name: str) -> None:
    for rank, out in enumerate(outs(ranks, name)):
        assert out["same_losses"] and out["same_params"], rank


@pytest.mark.parametrize("name", NAMES)
def test_one_log_one_endpoint_with_every_ranks_coordinates(ranks: list[dict], name: str) -> None:
    """Global rank 0 alone serves and logs; every rank's series carries its ep coordinate."""
    results = outs(ranks, name)
    assert results[0]["port"] and all(out["port"] is None for out in results[1:])
    snaps = results[0]["snaps"]
    assert [s["step"] for s in snaps] == list(range(1, STEPS + SPY_STEPS + 2))  # one writer
    assert all(s["world_size"] == 4 for s in snaps)
    served = {labels["rank"]: labels for _, labels, _ in results[0]["scrape"]}
    assert sorted(served) == ["0", "1", "2", "3"], served
    for rank, out in enumerate(results):
        want = labels(out["coords"])
        assert {k: served[str(rank)][k] for k in want} == want, (rank, served[str(rank)])


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_is_named_with_its_rank_coordinates_and_layer(ranks: list[dict], name: str) -> None:
    """The experts' output gradient poisoned on the last rank: its NaN reaches its ep peers' dense
    layers through the all-to-all (and, with DDP, its edp peer's experts through the model's
    all-reduce), but backward met it first in the poisoned rank's experts."""
    results = outs(ranks, name)
    snap, last = results[0]["snaps"][-1], results[-1]
    assert snap["nonfinite"] and math.isnan(float(snap["grad_norm"]))  # JSON: "nan"
    assert snap["first_nonfinite"] == [last["nan_rank"], NAN_LAYER]
    assert snap["first_nonfinite_coords"] == labels(last["coords"])
    assert last["coords"]["ep_rank"] == EP - 1


@pytest.mark.parametrize("name", NAMES + [MISDECLARED.name])
def test_one_collective_per_step_and_no_host_sync(ranks: list[dict], name: str) -> None:
    """The spy counts distmon's collectives only (the all-to-alls and the experts' all-reduce
    are the model's): one per ordinary step, and no host sync."""
    for out in outs(ranks, name):
        assert out["per_step"] == list(range(1, SPY_STEPS + 1)), out["per_step"]
        assert not out["syncs"], out["syncs"]


def test_misdeclared_experts_are_caught_by_the_first_step_check(ranks: list[dict]) -> None:
    """Each rank declares its experts' gradient its own (a group of one rank): they would count
    twice (edp copies); the first-step check refuses every figure and counts the error on every
    rank, while clip_grad_norm_ still returns the true norm (measured directly)."""
    results = outs(ranks, MISDECLARED.name)
    snaps = results[0]["snaps"]
    assert not any(s["valid"] for s in snaps)
    assert snaps[-1]["rank_monitor_errors"] == [1, 1, 1, 1], snaps[-1]
    for step in range(1, STEPS + 1):
        total = math.sqrt(sum(combined(results, step).values()))
        assert all(close(out["clip"][step - 1], total, REDUCED_REL) for out in results), step


def test_undeclared_experts_are_refused_at_construction(ranks: list[dict]) -> None:
    for rank in ranks:
        message = rank["undeclared"]
        assert "moe.experts.w1" in message and "replicated_over" in message, message
