"""The collective-scaling benchmark's model (``benchmarks/collective_scaling.py``) and its tables in the docs.

In-process and fast. The bytes a rank sends per step and the alpha-beta times are checked
against counts written out by hand from issue #28's schedule (not the script's own functions),
the node schedule's bytes are checked to stay flat in the world size over generated shapes,
and the tables in ``docs/scale.md`` and ``benchmarks/results/collective_scaling.md`` must be
what the script prints (the measured one: the same in both).
"""

import importlib.util
import math
import os
import random
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "collective_scaling", os.path.join(ROOT, "benchmarks", "collective_scaling.py")
)
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)

DEFAULTS = {"layers": 128, "every": 10, "per_node": 8}  # the model's defaults (--model)


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("world", [8, 64, 1024, 16384])
def test_node_schedule_bytes_at_defaults_by_hand(world):
    # an export step: 7 node peers' rows (10 steps x 131 float32 each), a SUM of 71 float64
    # (10 steps x (4 counts + the peer group's n, sum x, sum x^2), the vote) and a MAX of 30
    # int64 (10 steps x (first non-finite key, the group's largest and smallest x)); an
    # all-reduce: 2 x its bytes; 9 ordinary steps: the 1-float vote
    export = 7 * 10 * 131 * 4 + 2 * 71 * 8 + 2 * 30 * 8
    want = (export + 9 * 2 * 4) / 10
    assert cs.mean_bytes("node", world, 8, 128, 10) == pytest.approx(want)
    # today's: every other rank's rows over the job
    want_gather = ((world - 1) * 10 * 131 * 4 + 9 * 2 * 4) / 10
    assert cs.mean_bytes("gather", world, 8, 128, 10) == pytest.approx(want_gather)


def test_the_modelled_sizes_are_distmons_own():
    """The schedule's per-step SUM and MAX widths and row width are those distmon's exchange
    builds at defaults (DDP: one peer group, the export vote; no noise scale, no activations)."""
    import torch

    from distmon.step.crossrank import CrossRank
    from distmon.step.rows import RowPlan

    plan = RowPlan.build(n_layers=128, world=64, vote=True)
    extra = plan.rank.reduced.stop - plan.rank.reduced.start
    cross = CrossRank(plan, rank=0, n_rows=10, device=torch.device("cpu"), n_extra=extra)
    assert (cross.sum_width, cross.max_width, cross.n_extra) == (cs.SUM_PER_STEP, cs.MAX_PER_STEP, 1)
    assert plan.rank.width == 128 + 3
    gather, sums, maxes = cs.export_calls("node", 64, 8, 128, 10)
    assert gather[2] == 10 * plan.rank.width * 4
    assert sums[2] == (10 * cross.sum_width + cross.n_extra) * 8 and maxes[2] == 10 * cross.max_width * 8


def test_node_schedule_bytes_never_grow_with_the_world_size():
    rng = random.Random(28)
    for _ in range(200):
        layers, every, per_node = rng.randint(1, 4000), rng.randint(1, 200), rng.choice([1, 2, 4, 8, 16])
        vote = rng.random() < 0.5
        worlds = sorted({per_node * rng.randint(2, 4096) for _ in range(6)})
        node = {cs.mean_bytes("node", w, per_node, layers, every, vote) for w in worlds}
        assert len(node) == 1, (layers, every, per_node, worlds, node)
        gather = [cs.mean_bytes("gather", w, per_node, layers, every, vote) for w in worlds]
        assert gather == sorted(gather) and gather[0] < gather[-1], (layers, every, worlds, gather)


def test_alpha_beta_times_by_hand():
    beta = 1 / 25e3  # us per byte at 25 GB/s
    w = 16384
    rows = 10 * 131 * 4
    ordinary = 2 * math.log2(w) * 10 + 2 * 4 * beta
    gather_export = (w - 1) * (10 + rows * beta)
    node_export = (
        7 * (10 + rows * beta)
        + (2 * math.log2(w) * 10 + 2 * 71 * 8 * beta)
        + (2 * math.log2(w) * 10 + 2 * 30 * 8 * beta)
    )
    assert cs.model_us(cs.ordinary_calls(w), 10, beta) == pytest.approx(ordinary)
    assert cs.model_us(cs.export_calls("gather", w, 8, 128, 10), 10, beta) == pytest.approx(gather_export)
    assert cs.model_us(cs.export_calls("node", w, 8, 128, 10), 10, beta) == pytest.approx(node_export)
    # issue #28's acceptance: the node schedule's mean per step <= 1 ms at 16,384 GPUs; today's misses it
    assert (node_export + 9 * ordinary) / 10 <= 1000 < (gather_export + 9 * ordinary) / 10


def test_the_model_table_says_whether_the_target_is_met():
    table = cs.cost_model(128, 10, 8, 10, 25)
    assert table.endswith("per step on average (target <= 1 ms, 0.1% of 1 s): met")
    assert cs.cost_model(128, 10, 8, 200, 25).endswith(": NOT met")  # a 200 us hop misses it


def test_docs_and_results_hold_the_tables_the_script_prints():
    model = cs.cost_model(DEFAULTS["layers"], DEFAULTS["every"], DEFAULTS["per_node"], 10.0, 25.0)
    page, results = _read("docs", "scale.md"), _read("benchmarks", "results", "collective_scaling.md")
    stale = "rerun `python benchmarks/collective_scaling.py --model` and paste its output"
    assert model in results, stale + " into benchmarks/results/collective_scaling.md"
    assert model in page, stale + " into docs/scale.md"

    def measured(text: str) -> str:
        found = re.search(r"^gloo on .*?\n\n(\| ranks \|.*?)(?:\n\n|\Z)", text, re.S | re.M)
        assert found, "no measured table"
        return found.group(0)

    assert measured(page) == measured(results), "docs/scale.md's measured table differs from the results'"
