"""Lightning Fabric (DDP, FSDP2) run for real: ``GradMonitor`` on what ``fabric.setup`` returned (#29).

One torchrun job of 2 gloo ranks (``tests/jobs/fabric_job.py``) trains
``launch/examples/fabric_example.py`` (gradient accumulation with ``fabric.no_backward_sync``,
``fabric.clip_gradients``) under each strategy, without distmon, with it and with a NaN in rank
1's loss and ``guard="skip"``. References, never from distmon: the norm
``fabric.clip_gradients`` returns, float64 norms of the reduced gradients copied just before it
(per layer), and (DDP) each rank's local gradient from tensor hooks.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from framework_jobs import jsonl_rows, needs, torchrun_job

pytestmark = pytest.mark.slow  # real ranks and frameworks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "jobs"))
import fabric_job as job  # noqa: E402

WORLD = 2
TOL = 1e-6  # relative, the acceptance bound


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory) -> dict[str, object]:
    needs("lightning")
    out = tmp_path_factory.mktemp("fabric")
    torchrun_job(ROOT / "tests" / "jobs" / "fabric_job.py", out, world=WORLD)
    results = {}
    for strategy in job.STRATEGIES:
        ranks = [torch.load(out / f"fabric-{strategy}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
        logs = {kind: jsonl_rows(out / f"fabric-{strategy}-{kind}.jsonl") for kind in ("measured", "nan")}
        results[strategy] = {"ranks": ranks, "logs": logs}
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("strategy", job.STRATEGIES)
def test_every_step_valid_and_equal_to_float64_and_fabric_s_own_norm(fabric_run, strategy):
    ranks, rows = fabric_run[strategy]["ranks"], fabric_run[strategy]["logs"]["measured"]
    measured = ranks[0]["measured"]
    assert (measured["module"], measured["inner"]) == (
        "_FabricModule",
        "DistributedDataParallel" if strategy == "ddp" else "FSDPSequential",
    )
    assert [row["step"] for row in rows] == list(range(1, job.STEPS + 1))
    worst = {"vs float64": 0.0, "vs fabric": 0.0, "layers vs float64": 0.0}
    for row, ref, own in zip(rows, measured["refs"], measured["norms"]):
        assert row["valid"] and all(row["rank_valid"]) and not row["skipped"], row
        norm = math.sqrt(sum(ref["reduced"].values()))
        worst["vs float64"] = max(worst["vs float64"], _rel(row["grad_norm"], norm))
        worst["vs fabric"] = max(worst["vs fabric"], _rel(row["grad_norm"], own))
        assert list(row["layer_grad_norms"]) == list(ref["reduced"])
        for layer, sq in ref["reduced"].items():
            worst["layers vs float64"] = max(
                worst["layers vs float64"], _rel(row["layer_grad_norms"][layer], math.sqrt(sq))
            )
    assert max(worst.values()) < TOL, worst
    # clipping was active on every step: a figure read after fabric.clip_gradients would be at most max_norm
    assert min(measured["norms"]) > 1.5 * measured["max_grad_norm"], measured["norms"]
    print(f"Fabric {strategy}, {WORLD} ranks: max relative difference {worst}")


def test_ddp_rank_local_figures_equal_float64(fabric_run):
    ranks, rows = fabric_run["ddp"]["ranks"], fabric_run["ddp"]["logs"]["measured"]
    worst = 0.0
    for row in rows:
        for rank, result in enumerate(ranks):
            local = math.sqrt(sum(result["measured"]["refs"][row["step"] - 1]["local"].values()))
            worst = max(worst, _rel(row["rank_grad_norms"][rank], local))
    assert worst < TOL, worst


@pytest.mark.parametrize("strategy", job.STRATEGIES)
def test_training_bit_identical_to_the_script_without_distmon(fabric_run, strategy):
    for rank, result in enumerate(fabric_run[strategy]["ranks"]):
        assert torch.equal(result["measured"]["params"], result["plain"]["params"]), rank
        assert result["measured"]["norms"] == result["plain"]["norms"], rank
        assert result["measured"]["errors"] == 0


@pytest.mark.parametrize("strategy", job.STRATEGIES)
def test_nan_on_rank_1_named_and_skipped_by_the_guard(fabric_run, strategy):
    rows = fabric_run[strategy]["logs"]["nan"]
    assert [row["skip_reason"] for row in rows] == [
        "guard" if s == job.NAN_STEP else "" for s in range(1, job.STEPS + 1)
    ]
    bad = rows[job.NAN_STEP - 1]
    assert bad["first_nonfinite"] == [job.NAN_RANK, "4"], bad  # the output layer: first in backward
    for rank, result in enumerate(fabric_run[strategy]["ranks"]):
        run = result["nan"]
        before = run["before"] + [run["params"]]  # the parameters before each step, then at the end
        for step in range(1, job.STEPS + 1):
            assert torch.equal(before[step - 1], before[step]) == (step == job.NAN_STEP), (rank, step)
        assert torch.isfinite(run["params"]).all(), rank
        assert run["errors"] == 0
