"""DeepSpeed ZeRO 0-3, alone and under the Hugging Face Trainer and accelerate, run for real (issue #29).

One torchrun job of 2 gloo ranks (``tests/jobs/deepspeed_job.py``) trains every configuration of
its grid (ZeRO 0-3 x fp32/bf16 x accumulation 1/4; ZeRO 1-3 in bf16 with fp32 accumulation;
ZeRO 0-2 with DeepSpeed MoE) with ``launch/examples/deepspeed_example.py``: without distmon,
with it, and with a NaN in rank 1's loss at step 20, with the guard and without (DeepSpeed on
its own). A second job (``tests/jobs/deepspeed_hf_job.py``) runs the Hugging Face Trainer with a
ZeRO-2 config and accelerate with a ZeRO-3 plugin. Every figure is compared with references
that do not come from distmon:

- global and per-layer norms: float64 norms of ``deepspeed.utils.safe_get_full_grad`` (DeepSpeed
  gathers its partitions) after each step's last backward, and DeepSpeed's own
  ``engine.get_global_grad_norm()`` where it reports one;
- each rank's local norms: float64 sums of every micro-batch's gradients from tensor hooks
  (what autograd hands DeepSpeed); their mean over the ranks is the reduced gradient (fp32).

``python -m pytest -s`` prints the closing table, per ZeRO stage (test_closing_table_per_stage,
which also checks it: every stage, every figure within its bound).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from framework_jobs import jsonl_rows, needs, torchrun_job
from helpers import sample_value
from test_framework_hf import NORM_SERIES  # what the Trainer and accelerate serve without DeepSpeed

pytestmark = pytest.mark.slow  # real ranks and frameworks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "jobs"))
import deepspeed_job as job  # noqa: E402

WORLD = 2
TOL = 1e-6  # relative, the acceptance bound
BF16_ACCUMULATION_TOL = 2e-2  # DeepSpeed sums micro-batches in bf16; the reference in float64
CONFIGS = {job.name(c): c for c in job.grid()}
MAIN = [n for n, c in CONFIGS.items() if c["main"]]


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> dict[str, object]:
    needs("deepspeed")
    out = tmp_path_factory.mktemp("deepspeed_grid")
    torchrun_job(ROOT / "tests" / "jobs" / "deepspeed_job.py", out, world=WORLD, timeout=420)
    ranks = [torch.load(out / f"deepspeed-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    logs = {p.stem: jsonl_rows(p) for p in out.glob("*.jsonl")}
    return {"ranks": ranks, "logs": logs}


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory) -> dict[str, object]:
    needs("deepspeed", "transformers", "accelerate")
    out = tmp_path_factory.mktemp("deepspeed_frameworks")
    torchrun_job(ROOT / "tests" / "jobs" / "deepspeed_hf_job.py", out, world=WORLD, timeout=300)
    return {
        fw: {
            "ranks": [torch.load(out / f"{fw}-rank{r}.pt", weights_only=False) for r in range(WORLD)],
            "rows": jsonl_rows(out / f"{fw}.jsonl"),
        }
        for fw in ("hf", "accelerate")
    }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def local_measured(cfg: dict[str, object]) -> bool:
    """Where one reduction input holds the step's local gradient: ZeRO 0 and 1 reduce at the
    boundary; ZeRO 2 and 3 reduce every micro-batch."""
    return cfg["stage"] <= 1 or cfg["accumulation"] == 1


def _job_layer_sq(ranks: list[dict], name: str, step: int, side: str) -> dict[str, float]:
    """The job's reduced per-layer sums of squares of ``step``: a dense layer's from rank 0 (every
    rank holds it), an expert layer's added up over the ranks (each holds its own expert)."""
    mon = [r[name]["monitored"] for r in ranks]
    experts = set(mon[0]["experts"])
    return {
        layer: sum(m["steps"][step - 1][side][layer] for m in mon) if layer in experts else value
        for layer, value in mon[0]["steps"][step - 1][side].items()
    }


def reduced_worst(grid: dict[str, object], name: str) -> dict[str, object]:
    """The worst relative differences of the served global and per-layer norms from float64, and
    of the global norm from DeepSpeed's own (or the fact that it reports none: ZeRO-0 in fp32)."""
    ranks, rows = grid["ranks"], grid["logs"][f"{name}-monitored"]
    worst: dict[str, object] = {"global vs float64": 0.0, "layers vs float64": 0.0, "vs DeepSpeed": 0.0}
    reported = 0
    for row in rows:
        layers = _job_layer_sq(ranks, name, row["step"], "reduced")
        norm = math.sqrt(sum(layers.values()))
        worst["global vs float64"] = max(worst["global vs float64"], _rel(row["grad_norm"], norm))
        for layer, sq in layers.items():
            got = row["layer_grad_norms"].get(layer, math.nan)
            worst["layers vs float64"] = max(worst["layers vs float64"], _rel(got, math.sqrt(sq)))
        ds = ranks[0][name]["monitored"]["steps"][row["step"] - 1]["deepspeed_norm"]
        if ds is not None:
            reported += 1
            worst["vs DeepSpeed"] = max(worst["vs DeepSpeed"], _rel(row["grad_norm"], ds))
    if not reported:
        worst["vs DeepSpeed"] = "none reported"
    return worst


def local_worst(grid: dict[str, object], name: str) -> float | str:
    """The worst relative difference of the served rank-local norms from float64, where measured."""
    if not local_measured(CONFIGS[name]):
        return "NaN (rank_valid False)"
    ranks, rows = grid["ranks"], grid["logs"][f"{name}-monitored"]
    worst = 0.0
    for row in rows:
        steps = [r[name]["monitored"]["steps"][row["step"] - 1] for r in ranks]
        for rank, s in enumerate(steps):
            worst = max(worst, _rel(row["rank_grad_norms"][rank], math.sqrt(sum(s["local"].values()))))
    return worst


def local_tol(cfg: dict[str, object]) -> float:
    return BF16_ACCUMULATION_TOL if cfg["precision"] == "bf16" and cfg["accumulation"] > 1 else TOL


def deepspeed_skips(grid: dict[str, object], name: str) -> bool:
    """Whether DeepSpeed, without a guard, skipped the NaN step itself (its overflow check)."""
    return not grid["ranks"][0][name]["nan_deepspeed"]["applied"][CONFIGS[name]["nan_step"] - 1]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_step_valid_global_and_layer_norms_equal_float64_and_deepspeed(grid, name):
    rows = grid["logs"][f"{name}-monitored"]
    assert [row["step"] for row in rows] == list(range(1, CONFIGS[name]["steps"] + 1))
    for row in rows:
        assert row["valid"] and not row["skipped"] and row["monitor_errors"] == 0, row
        assert list(row["layer_grad_norms"]) == list(
            _job_layer_sq(grid["ranks"], name, row["step"], "reduced")
        )
    worst = reduced_worst(grid, name)
    assert max(v for v in worst.values() if isinstance(v, float)) < TOL, worst


@pytest.mark.parametrize("name", CONFIGS)
def test_rank_local_figures_equal_float64_where_one_reduction_input_holds_them(grid, name):
    cfg, ranks, rows = CONFIGS[name], grid["ranks"], grid["logs"][f"{name}-monitored"]
    measured = local_measured(cfg)
    for row in rows:
        assert row["rank_valid"] == [measured] * WORLD, row
        steps = [r[name]["monitored"]["steps"][row["step"] - 1] for r in ranks]
        locals_ = [math.sqrt(sum(s["local"].values())) for s in steps]
        for rank, local in enumerate(locals_):
            served = row["rank_grad_norms"][rank]
            if measured:
                # each rank's own: nearer its reference than the other rank's (its own batches)
                assert abs(served - local) < abs(served - locals_[1 - rank]), (row, locals_)
            else:
                assert math.isnan(served), row
    if measured:
        assert local_worst(grid, name) < local_tol(cfg), local_worst(grid, name)


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c["precision"] == "fp32" and not c["moe"]])
def test_the_local_references_average_to_the_reduced_gradient(grid, name):
    """The method: autograd's local gradients (the references of every rank's local figures),
    averaged over the ranks, are the gradient DeepSpeed reduced (fp32: to rounding)."""
    ranks = [r[name]["monitored"]["steps"] for r in grid["ranks"]]
    for steps in zip(*ranks):
        mean = sum(s["local_vector"] for s in steps) / WORLD
        reduced = steps[0]["reduced_vector"]
        assert float((mean - reduced).norm() / reduced.norm()) < TOL, name
        assert all(torch.equal(s["reduced_vector"], reduced) for s in steps)  # the same on every rank


@pytest.mark.parametrize("name", CONFIGS)
def test_training_bit_identical_to_the_script_without_distmon(grid, name):
    steps = CONFIGS[name]["steps"]
    for rank, result in enumerate(grid["ranks"]):
        plain, monitored = result[name]["plain"], result[name]["monitored"]
        assert torch.equal(monitored["params"], plain["params"]), (name, rank)
        assert monitored["applied"] == plain["applied"] == [True] * steps, (name, rank)
        assert monitored["lrs"] == plain["lrs"], (name, rank)
        assert monitored["monitor_errors"] == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_nan_on_rank_1_named_and_not_applied_with_the_guard(grid, name):
    """The NaN is in rank 1's loss: every gradient of rank 1 is NaN, and the output layer is the
    first layer backward reaches. It is named with its rank (with gradient accumulation at stages
    2/3 from the sums of every micro-batch, which are no norm), and DeepSpeed takes the step without the
    update on every rank: parameters, optimizer step count and learning rate as before it."""
    cfg, rows = CONFIGS[name], grid["logs"][f"{name}-nan_guard"]
    nan_step = cfg["nan_step"]
    assert [row["step"] for row in rows] == list(range(1, nan_step + 2))
    for row in rows:
        bad = row["step"] == nan_step
        assert row["valid"] and row["monitor_errors"] == 0, row
        assert row["skipped"] == bad and row["skip_reason"] == ("guard" if bad else ""), row
        assert row["nonfinite"] == bad and math.isfinite(row["grad_norm"]) != bad, row
    bad = rows[nan_step - 1]
    rank = job.NAN_RANK
    assert bad["first_nonfinite"] == [rank, "out"], bad
    assert bad["rank_valid"] == [local_measured(cfg)] * 2, bad  # the norm itself: only where measured
    assert [(e["kind"], e["rank"], e["layer"]) for e in bad["events"]] == [("nonfinite", rank, "out")]
    for r, result in enumerate(grid["ranks"]):
        run, plain = result[name]["nan_guard"], result[name]["plain"]
        snaps = run["snapshots"]
        assert torch.equal(snaps[nan_step - 1], plain["snapshots"][nan_step - 1]), (name, r)
        assert torch.equal(snaps[nan_step], snaps[nan_step - 1]), (name, r)  # not applied
        assert torch.isfinite(run["params"]).all(), (name, r)
        assert not torch.equal(run["params"], snaps[nan_step]), (name, r)  # the next step was
        assert run["applied"] == [s != nan_step for s in range(1, nan_step + 2)], (name, r)
        assert run["skipped_steps"] == 1 and run["global_steps"] == nan_step + 1, (name, r)
        # the learning rate held back with the step: one step behind the plain run's after it
        assert run["lrs"][: nan_step - 1] == plain["lrs"][: nan_step - 1], (name, r)
        assert run["lrs"][nan_step - 1] == run["lrs"][nan_step - 2] < plain["lrs"][nan_step - 1], (name, r)
        assert run["lrs"][nan_step] == plain["lrs"][nan_step - 1], (name, r)


@pytest.mark.parametrize("name", MAIN)
def test_deepspeed_s_own_overflow_skip_is_recorded_like_the_grad_scaler_s(grid, name):
    """Without a guard: a step DeepSpeed skips itself (its overflow check) is recorded as skipped,
    like a GradScaler's ("scaler"); one it applies (no check in that configuration) is recorded
    as taken, its non-finite norm served, and the parameters are NaN: what the guard prevents."""
    nan_step = CONFIGS[name]["nan_step"]
    runs = [r[name]["nan_deepspeed"] for r in grid["ranks"]]
    skipped = not runs[0]["applied"][nan_step - 1]
    assert all(run["applied"][nan_step - 1] != skipped for run in runs)  # DeepSpeed agrees on every rank
    bad = grid["logs"][f"{name}-nan_deepspeed"][nan_step - 1]
    assert bad["nonfinite"] and bad["skipped"] == skipped, bad
    assert bad["skip_reason"] == ("scaler" if skipped else ""), bad
    for run in runs:
        assert bool(torch.isfinite(run["params"]).all()) == skipped, name


@pytest.mark.parametrize(
    "case, says",
    [
        ("fp16", "fp16 is not supported yet"),
        ("offload", "ZeRO-Offload"),
        ("another optimizer", "takes the optimizer deepspeed.initialize returned"),
        ("comm_hook", "a DeepSpeed engine reduces its gradients itself"),
        ("distinct_over", "a DeepSpeed engine says its layout itself"),
        ("a second monitor", "already measured by an open GradMonitor"),
    ],
)
def test_what_cannot_be_measured_exactly_is_refused_at_construction_on_every_rank(grid, case, says):
    for rank in grid["ranks"]:
        said = rank["refusals"][case]
        assert says in said and "did not start on any rank" in said, said


def test_clip_grad_norm_is_refused_on_an_engine_naming_gradient_clipping(grid):
    for rank in grid["ranks"]:
        said = rank["refusals"]["clip_grad_norm_"]
        assert said.startswith("RuntimeError: distmon: clip_grad_norm_ on a DeepSpeed engine"), said
        assert "set gradient_clipping in the DeepSpeed config" in said, said


def test_the_engine_s_module_passed_is_measured_as_the_engine(grid):
    """``GradMonitor(engine.module, optimizer)``: the engine that holds it is found and measured (#27)."""
    assert all(rank["refusals"]["the engine's module"] == "built" for rank in grid["ranks"])


def test_closing_table_per_stage(grid):
    """The closing table, per ZeRO stage (``python -m pytest -s`` prints it): every configuration
    of ZeRO 0-3, each with its worst relative differences (global and per-layer norms from
    float64 and from DeepSpeed's own norm; rank-local norms where measured) within their bounds,
    and whether DeepSpeed skips the NaN step itself (main grid)."""
    table = {}
    for name, cfg in CONFIGS.items():
        table[name] = {**reduced_worst(grid, name), "local vs float64": local_worst(grid, name)}
        if cfg["main"]:
            table[name]["DeepSpeed skips the NaN step itself"] = (
                "yes" if deepspeed_skips(grid, name) else "no"
            )
    lines = []
    for stage in range(4):
        lines.append(f"ZeRO-{stage}")
        for name in (n for n, c in CONFIGS.items() if c["stage"] == stage):
            figures = ", ".join(
                f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in table[name].items()
            )
            lines.append(f"  {name:22s} {figures}")
    print("\nmax relative difference of distmon's figures, per configuration\n" + "\n".join(lines))
    assert {c["stage"] for c in CONFIGS.values()} == {0, 1, 2, 3}, "a ZeRO stage left out of the grid"
    for name, figures in table.items():
        cfg = CONFIGS[name]
        bounds = {"global vs float64": TOL, "layers vs float64": TOL, "vs DeepSpeed": TOL}
        bounds["local vs float64"] = local_tol(cfg)
        over = {k: v for k, v in figures.items() if isinstance(v, float) and not v < bounds[k]}
        assert not over, (name, over)
        # a figure is a number but where the configuration says why not
        assert isinstance(figures["local vs float64"], float) == local_measured(cfg), (name, figures)
        assert isinstance(figures["vs DeepSpeed"], float) or (cfg["stage"], cfg["precision"]) == (
            0,
            "fp32",
        ), (
            name,
            figures,
        )


# -- the Hugging Face Trainer (ZeRO-2) and accelerate (ZeRO-3) --------------------------------------


@pytest.mark.parametrize("fw", ["hf", "accelerate"])
def test_framework_norms_equal_float64_and_the_framework_s_own(frameworks, fw):
    ranks, rows = frameworks[fw]["ranks"], frameworks[fw]["rows"]
    measured, meta = ranks[0]["measured"], ranks[0]["meta"]
    assert measured["engine"] == "DeepSpeedEngine"
    own = [h[1] for h in measured["history"]] if fw == "hf" else measured["history"]
    assert [row["step"] for row in rows] == list(range(1, meta["steps"] + 1))
    assert len(own) == len(measured["reference"]) == meta["steps"]
    worst = {"vs float64": 0.0, "vs framework": 0.0}
    for row, ref, logged in zip(rows, measured["reference"], own):
        assert row["valid"] and not row["skipped"], row
        assert row["rank_valid"] == [meta["accumulation"] == 1 or meta["stage"] <= 1] * WORLD
        assert ref > 1.5 * meta["max_grad_norm"], ref  # clipping was active: a clipped figure would fail
        worst["vs float64"] = max(worst["vs float64"], _rel(row["grad_norm"], ref))
        worst["vs framework"] = max(worst["vs framework"], _rel(row["grad_norm"], logged))
    assert max(worst.values()) < TOL, worst
    print(f"{fw}, ZeRO-{meta['stage']}, {WORLD} ranks: max relative difference {worst}")


@pytest.mark.parametrize("fw", ["hf", "accelerate"])
def test_framework_training_bit_identical_without_distmon(frameworks, fw):
    for rank, result in enumerate(frameworks[fw]["ranks"]):
        assert torch.equal(result["measured"]["params"], result["plain"]["params"]), rank
        assert result["measured"]["history"] == result["plain"]["history"], rank


@pytest.mark.parametrize("fw", ["hf", "accelerate"])
def test_framework_prometheus_serves_every_gradient_series(frameworks, fw):
    ranks = frameworks[fw]["ranks"]
    samples = ranks[0]["measured"]["samples"]
    assert samples and ranks[1]["measured"]["samples"] is None  # scraped on rank 0, the one serving
    served = {n for n, _, _ in samples}
    meta = ranks[0]["meta"]
    local = local_measured(meta)  # else NaN on every step, not served (ZeRO-2 with accumulation)
    expected = set(NORM_SERIES) - (set() if local else {"distmon_rank_grad_norm"})
    assert expected <= served, expected - served
    assert ("distmon_rank_grad_norm" in served) == local
    norms = ranks[0]["measured"]["reference"]
    assert _rel(sample_value(samples, "distmon_grad_norm"), norms[-1]) < TOL
    assert sample_value(samples, "distmon_optimizer_steps_total") == len(norms)
    assert sample_value(samples, "distmon_nonfinite_steps_total") == 0


# -- run-time notice: per-rank figures that this configuration cannot measure -----------------------

ONE_RANK_ZERO2_ACCUMULATION = """
import os, sys
sys.path[:0] = [{root!r}, {examples!r}]
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
import deepspeed_example as ex
import distmon
engine, optimizer = ex.build(ex.config(2, accumulation=2))
mon = distmon.GradMonitor(engine, optimizer, serve="none", export_every=2)
ex.train(engine, 4)
print("rank_valid", mon.flush().rank_valid, flush=True)
mon.close()
"""


def test_zero2_with_accumulation_says_once_why_per_rank_figures_are_nan(tmp_path):
    """ZeRO-2 reduces every micro-batch: no input holds the step's local gradient, so per-rank figures
    are NaN (documented, docs/frameworks.md); the run says so once at run time, naming why."""
    needs("deepspeed")
    from ddp_harness import free_port

    code = ONE_RANK_ZERO2_ACCUMULATION.format(
        root=str(ROOT), examples=str(ROOT / "launch" / "examples"), port=free_port()
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank_valid [False]" in proc.stdout, proc.stdout  # NaN per-rank figures, as documented
    said = [line for line in proc.stderr.splitlines() if "per-rank local figures" in line]
    assert len(said) == 1, proc.stderr[-3000:]  # 4 steps of 2 micro-batches: said once
    assert "ZeRO stage 2" in said[0] and "2 micro-batches" in said[0] and "NaN" in said[0], said
