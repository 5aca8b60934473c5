"""distmon in a Hugging Face ``Trainer`` and in an accelerate loop, run for real (issue #22).

The example scripts users would copy (``launch/examples/hf_trainer_example.py``: a tiny GPT-2
built from its config, ``max_grad_norm``, ``gradient_accumulation_steps=2``,
``DistmonCallback``; ``launch/examples/accelerate_example.py``: ``accelerator.prepare``,
``accelerator.accumulate``, ``accelerator.clip_grad_norm_``, ``GradMonitor`` on the prepared
objects) run in one torchrun job of 2 gloo ranks and in one plain process
(``tests/jobs/hf_job.py``; each configuration is described there). Every figure is
compared with references that do not come from distmon:

- global and per-layer norms: float64 norms of the reduced ``p.grad`` copied just before the
  framework clips (``accelerator.clip_grad_norm_`` wrapped on the instance; in transformers
  5.23 ``on_pre_optimizer_step`` runs after clipping), and the framework's own pre-clip norm
  (the Trainer's logged ``grad_norm``, the value ``clip_grad_norm_`` returned);
- each rank's local norms: float64 sums of every micro-batch's parameter gradients from tensor
  hooks (what autograd hands DDP); their mean over the ranks must be the reduced gradient.

Clipping is active on every step (the pre-clip norm is above ``max_grad_norm``, the clipped
one at it), so a figure read after clipping would fail.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_harness import free_port
from helpers import sample_value

pytestmark = pytest.mark.slow  # real ranks and frameworks

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "hf_job.py"
FRAMEWORKS = ["hf", "accelerate"]
WORLD = 2
TOL = 1e-6  # relative, the acceptance bound
NORM_SERIES = [
    "distmon_grad_norm",
    "distmon_layer_grad_norm",
    "distmon_step_grad_norm_bucket",
    "distmon_step_grad_norm_count",
    "distmon_step_grad_norm_sum",
    "distmon_grad_norm_window_max",
    "distmon_grad_norm_zscore",
    "distmon_optimizer_steps_total",
    "distmon_nonfinite_steps_total",
    "distmon_rank_grad_norm",
    "distmon_rank_nonfinite_steps_total",
]  # not distmon_rank_outlier_score: with 2 ranks there is no outlier to tell apart (test_first_hour)
NOISE_SERIES = [  # served with batch_size=, on 2+ ranks
    "distmon_gradient_noise_scale",
    "distmon_layer_gradient_noise_scale",
    "distmon_gradient_noise_trace",
    "distmon_gradient_noise_signal",
]


def _require_frameworks() -> None:
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DISTMON_")
        and k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    }
    # nothing may be downloaded
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return env


def _numbers(value: object) -> object:
    """A JSONL value with its ``"nan"``/``"inf"`` strings as floats."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return value


def _run_job(out: Path, world: int) -> dict[str, dict[str, object]]:
    """Runs the job; per framework: ``ranks`` (each rank's results) and ``logs`` (config -> rows)."""
    _require_frameworks()
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={world}"]
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [*launcher, str(JOB), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    results = {}
    for fw in FRAMEWORKS:
        ranks = [torch.load(out / f"{fw}-rank{r}.pt", weights_only=False) for r in range(world)]
        logs = {}
        for path in out.glob(f"{fw}-*.jsonl"):
            with open(path) as f:
                logs[path.stem.split("-", 1)[1]] = [_numbers(json.loads(line)) for line in f]
        results[fw] = {"ranks": ranks, "logs": logs}
    return results


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    return _run_job(tmp_path_factory.mktemp("fw_hf_ddp"), WORLD)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run_job(tmp_path_factory.mktemp("fw_hf_one"), 1)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _framework_norms(fw: str, result: dict[str, object]) -> list[float]:
    """The framework's own pre-clip norm per step: the Trainer's logged ``grad_norm``; the
    values the accelerate loop got from ``clip_grad_norm_``."""
    if fw == "hf":
        return [h["grad_norm"] for h in result["history"] if "grad_norm" in h]
    return result["history"]


def _layer_norms(vector: torch.Tensor, layers: list[tuple[str, int, int]]) -> dict[str, float]:
    return {name: float(vector[a:b].norm()) for name, a, b in layers}


def _check_global(fw: str, ranks: list[dict], rows: list[dict]) -> dict[str, float]:
    """Every step valid, its global and per-layer norms equal to the references; the max
    relative differences."""
    worst = {"vs float64": 0.0, "vs framework": 0.0, "layers vs float64": 0.0}
    meta, ref = ranks[0]["meta"], ranks[0]["measured"]
    framework = _framework_norms(fw, ref)
    assert [row["step"] for row in rows] == list(range(1, meta["steps"] + 1))
    assert len(ref["steps"]) == len(framework) == meta["steps"]
    for row, step, logged in zip(rows, ref["steps"], framework):
        assert row["valid"] and all(row["rank_valid"]) and not row["skipped"], row
        # the reduced gradient is the same on every rank (DDP's all-reduce)
        for other in ranks[1:]:
            assert torch.equal(other["measured"]["steps"][row["step"] - 1]["reduced"], step["reduced"])
        norm = float(step["reduced"].norm())
        # clipping was active: a figure read after it would be max_grad_norm, not the norm
        clip = meta["max_grad_norm"]
        assert norm > 1.5 * clip and abs(step["post_clip"] - clip) < 1e-5, (norm, step["post_clip"])
        worst["vs float64"] = max(worst["vs float64"], _rel(row["grad_norm"], norm))
        worst["vs framework"] = max(worst["vs framework"], _rel(row["grad_norm"], logged))
        layers = _layer_norms(step["reduced"], ref["layers"])
        assert list(row["layer_grad_norms"]) == list(layers)
        for name, value in layers.items():
            worst["layers vs float64"] = max(
                worst["layers vs float64"], _rel(row["layer_grad_norms"][name], value)
            )
    assert max(worst.values()) < TOL, worst
    return worst


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_every_step_valid_global_norms_equal_float64_and_framework(distributed, fw):
    worst = _check_global(fw, distributed[fw]["ranks"], distributed[fw]["logs"]["measured"])
    print(f"{fw}, {WORLD} ranks: max relative difference {worst}")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_rank_local_norms_equal_float64_reference(distributed, fw):
    ranks = [r["measured"] for r in distributed[fw]["ranks"]]
    rows = distributed[fw]["logs"]["measured"]
    worst = {"rank": 0.0, "rank x layer": 0.0, "mean of locals vs reduced": 0.0}
    for i, row in enumerate(rows):
        locals_ = [r["steps"][i]["local"] for r in ranks]
        # the references are right: autograd's local gradients average to what DDP reduced ...
        reduced = ranks[0]["steps"][i]["reduced"]
        mean = sum(locals_) / WORLD
        worst["mean of locals vs reduced"] = max(
            worst["mean of locals vs reduced"], float((mean - reduced).norm() / reduced.norm())
        )
        # ... and are not alike (each rank's own batches), so a rank's figure must be its own
        assert float((locals_[0] - locals_[1]).norm()) > 0.1 * float(locals_[0].norm())
        for rank, local in enumerate(locals_):
            assert ranks[rank]["steps"][i]["micro_batches"] == 2
            worst["rank"] = max(worst["rank"], _rel(row["rank_grad_norms"][rank], float(local.norm())))
            layers = _layer_norms(local, ranks[0]["layers"])
            for j, value in enumerate(layers.values()):
                worst["rank x layer"] = max(
                    worst["rank x layer"], _rel(row["rank_layer_grad_norms"][rank][j], value)
                )
    assert max(worst.values()) < TOL, worst
    print(f"{fw}, {WORLD} ranks: max relative difference {worst}")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_nan_on_rank_1_is_skipped_on_every_rank(distributed, fw):
    rows = distributed[fw]["logs"]["nan"]
    ranks = [r["nan"] for r in distributed[fw]["ranks"]]
    meta = distributed[fw]["ranks"][0]["meta"]
    steps, nan_step, nan_rank, nan_layer = (meta[k] for k in ("steps", "nan_step", "nan_rank", "nan_layer"))
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        bad = row["step"] == nan_step
        assert row["valid"] and all(row["rank_valid"]), row
        assert row["skipped"] == bad and row["skip_reason"] == ("guard" if bad else "")
        assert row["nonfinite"] == bad and math.isfinite(row["grad_norm"]) != bad
    bad = rows[nan_step - 1]
    assert nan_rank == 1 and bad["first_nonfinite"] == [1, nan_layer] and bad["nonfinite_ranks"] == [1], bad
    assert [(e["kind"], e["rank"], e["layer"]) for e in bad["events"]] == [("nonfinite", 1, nan_layer)]
    assert math.isfinite(bad["rank_grad_norms"][0]) and not math.isfinite(bad["rank_grad_norms"][1])
    for rank, result in enumerate(ranks):
        # the NaN reached every rank's reduced gradient: the framework's own norm is NaN
        assert math.isnan(_framework_norms(fw, result)[nan_step - 1]), rank
        before = [s["params_before"] for s in result["steps"]] + [result["params"]]
        for step in range(1, steps + 1):
            updated = not torch.equal(before[step - 1], before[step])
            assert updated == (step != nan_step), (rank, step)
        assert torch.isfinite(result["params"]).all(), rank
        assert torch.equal(result["params"], ranks[0]["params"])
        assert set(result["adam_steps"]) == {steps - 1}, (rank, result["adam_steps"])
    if fw == "hf":  # the Trainer's LR schedule was held back with the step
        lrs = [h["learning_rate"] for h in ranks[0]["history"] if "grad_norm" in h]
        assert lrs[nan_step] == lrs[nan_step - 1] and lrs[nan_step - 1] < lrs[nan_step - 2]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_prometheus_serves_every_gradient_series(distributed, fw):
    ranks = [r["measured"] for r in distributed[fw]["ranks"]]
    samples = ranks[0]["samples"]
    assert samples and ranks[1]["samples"] is None  # scraped on rank 0, the one serving
    served = {name for name, _, _ in samples}
    assert set(NORM_SERIES + NOISE_SERIES) <= served, set(NORM_SERIES + NOISE_SERIES) - served
    # 10 steps, one export: the running median has no earlier norm yet, so no ratio is served
    assert "distmon_grad_norm_median_ratio" not in served
    assert "distmon_rank_outlier_score" not in served  # 2 ranks: no outlier to tell apart (README)
    norms = [float(s["reduced"].norm()) for s in ranks[0]["steps"]]
    last = ranks[0]["steps"][-1]
    assert _rel(sample_value(samples, "distmon_grad_norm"), norms[-1]) < TOL
    for name, value in _layer_norms(last["reduced"], ranks[0]["layers"]).items():
        assert _rel(sample_value(samples, "distmon_layer_grad_norm", layer=name), value) < TOL, name
    layers = {lab["layer"] for n, lab, _ in samples if n == "distmon_layer_grad_norm"}
    assert layers == {name for name, _, _ in ranks[0]["layers"]}
    for rank, result in enumerate(ranks):
        local = float(result["steps"][-1]["local"].norm())
        assert _rel(sample_value(samples, "distmon_rank_grad_norm", rank=str(rank)), local) < TOL
        assert sample_value(samples, "distmon_rank_nonfinite_steps_total", rank=str(rank)) == 0
    assert sample_value(samples, "distmon_optimizer_steps_total") == len(norms)
    assert sample_value(samples, "distmon_nonfinite_steps_total") == 0
    assert sample_value(samples, "distmon_step_grad_norm_count") == len(norms)
    assert _rel(sample_value(samples, "distmon_step_grad_norm_sum"), sum(norms)) < TOL
    assert _rel(sample_value(samples, "distmon_grad_norm_window_max"), max(norms)) < TOL
    for name, labels, value in samples:
        if name == "distmon_step_grad_norm_bucket":
            assert value == sum(n <= float(labels["le"]) for n in norms), labels


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_training_bit_identical_to_the_script_without_distmon(distributed, fw):
    for rank, result in enumerate(distributed[fw]["ranks"]):
        plain = result["plain"]
        for config in ("monitored", "measured"):
            assert torch.equal(result[config]["params"], plain["params"]), (rank, config)
            assert _history(fw, result[config]) == _history(fw, plain), (rank, config)
        assert len(_history(fw, plain)) == result["meta"]["steps"]


def _history(fw: str, result: dict[str, object]) -> list:
    """Per step what the framework reported (loss, norm, learning rate), timings left out."""
    if fw == "hf":
        return [
            (h["loss"], h["grad_norm"], h["learning_rate"]) for h in result["history"] if "grad_norm" in h
        ]
    return result["history"]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_single_process_serves_the_pre_clip_norm(single, fw):
    ranks, logs = single[fw]["ranks"], single[fw]["logs"]
    assert ranks[0]["measured"]["world_size"] == 1
    worst = _check_global(fw, ranks, logs["measured"])
    for row, step in zip(logs["measured"], ranks[0]["measured"]["steps"]):
        # one process: the local gradient is the global one
        assert _rel(row["rank_grad_norms"][0], float(step["local"].norm())) < TOL
    last = ranks[0]["measured"]["steps"][-1]
    served = sample_value(ranks[0]["measured"]["samples"], "distmon_grad_norm")
    assert _rel(served, float(last["reduced"].norm())) < TOL and served > 1.5 * last["post_clip"]
    for config in ("monitored", "measured"):
        assert torch.equal(ranks[0][config]["params"], ranks[0]["plain"]["params"]), config
        assert _history(fw, ranks[0][config]) == _history(fw, ranks[0]["plain"]), config
    print(f"{fw}, one process: max relative difference {worst}")


NOT_DISTRIBUTED = """
import sys
sys.path.insert(0, {examples!r})
import hf_trainer_example as example

made = example.TrainingArguments
example.TrainingArguments = lambda **kw: made(**{{**kw, "use_cpu": False}})  # the flag forgotten
example.main(["--port", "0", "--steps", "2", "--output-dir", {out!r}])
"""


@pytest.mark.slow
def test_trainer_on_cpu_ranks_without_use_cpu_is_told_the_flag(tmp_path):
    """torchrun on a machine without a GPU, the Trainer not told ``use_cpu``: transformers sets up no
    DDP and each process trains alone; the error names what happened and the flag (#33)."""
    _require_frameworks()
    script = tmp_path / "not_distributed.py"
    script.write_text(NOT_DISTRIBUTED.format(examples=str(ROOT / "launch" / "examples"), out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node=2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    said = [line for line in proc.stderr.splitlines() if "distmon: torchrun started 2 processes" in line]
    assert said, proc.stderr[-4000:]
    assert "not training distributed" in said[0] and "--use_cpu" in said[0] and "use_cpu=True" in said[0]
