"""Lightning 2.6 with ``distmon.integrations.lightning.DistmonCallback``, run for real (issue #22).

One torchrun job of 2 gloo ranks and one plain process run tests/jobs/lightning_job.py, which
fits the model of launch/examples/lightning_example.py with the example's own ``train()``
(alongside, the example itself runs as a script, configured by ``DISTMON_*`` variables):

* ``auto``: ``strategy="ddp"``, automatic optimization (Lightning's closure) with
  ``gradient_clip_val``; ``auto_guard``: the same with ``guard="skip"``;
* ``manual``: ``strategy="ddp"``, manual optimization (``manual_backward``, ``clip_gradients``,
  ``opt.step()``);
* ``fsdp2``: ``ModelParallelStrategy`` (``fully_shard``, 2-way data parallel) with
  ``gradient_clip_val``;
* ``nan``: as ``auto_guard``, with a NaN in rank 1's batch at step ``NAN_STEP``;
* ``single``: one process (``devices=1``) with ``gradient_clip_val``.

``manual`` and ``fsdp2`` use ``guard="skip"`` too. Each case but ``nan`` is fitted again
without the callback (the script as it is without distmon). The references (float64, from
Lightning's hooks, never from distmon) are described in the job's docstring. Missing Lightning
skips these tests, except under ``CI=true``, where it fails.
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
from ddp_harness import free_port
from helpers import sample_value

pytestmark = pytest.mark.slow  # real ranks, real frameworks

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "lightning_job.py"
EXAMPLE = ROOT / "launch" / "examples" / "lightning_example.py"
STEPS, CLIP, NAN_STEP = 10, 0.5, 4  # the example's defaults, the job's NaN step
DDP_CASES = ("auto", "auto_guard", "manual", "fsdp2")
TOL = 1e-6
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _env() -> dict[str, str]:
    """This environment without distmon's or a launcher's variables; this checkout's distmon."""
    drop = (*LAUNCHER_VARS, "SLURM_JOB_ID")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_") and k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _rel(a: float | str, b: float) -> float:
    """Relative difference; 0 for two NaNs (the log writes non-finite floats as strings)."""
    a = float(a)
    return 0.0 if math.isnan(a) and math.isnan(b) else abs(a - b) / abs(b)


class Run:
    """One process group's results: each rank's references, rank 0's distmon log and scrapes."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]

    def snaps(self, case: str) -> list[dict]:
        with open(self.out / f"{case}.jsonl") as f:
            return [json.loads(line) for line in f]

    def refs(self, case: str, rank: int = 0) -> list[dict]:
        return self.ranks[rank][case]["steps"]

    def scrape(self, case: str) -> list:
        return json.loads((self.out / f"{case}.metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Starts the 2-rank job, the single process and the example script side by side."""
    if importlib.util.find_spec("lightning") is None:
        msg = "lightning is not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    ddp, single, script = (tmp_path_factory.mktemp(name) for name in ("ddp", "single", "script"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    # the example as a user runs it, distmon's options from the environment
    script_env = {
        "DISTMON_PORT": "0",
        "DISTMON_LINGER_S": "0",
        "DISTMON_LOG_PATH": str(script / "script.jsonl"),
    }
    jobs = {
        ddp: ([*torchrun, str(JOB), str(ddp)], {}),
        single: ([sys.executable, str(JOB), str(single)], {}),
        script: ([sys.executable, str(EXAMPLE), "--steps", "3"], script_env),
    }
    procs = {}
    for out, (cmd, env) in jobs.items():
        with open(out / "output.log", "w") as log:
            procs[out] = subprocess.Popen(
                cmd, cwd=ROOT, env={**_env(), **env}, stdout=log, stderr=subprocess.STDOUT
            )
    for out, proc in procs.items():
        proc.wait(timeout=300)
        log = (out / "output.log").read_text()
        assert proc.returncode == 0, f"{' '.join(jobs[out][0])} failed ({proc.returncode}):\n{log[-6000:]}"
    ddp_run, single_run = Run(ddp), Run(single)
    assert (len(ddp_run.ranks), len(single_run.ranks)) == (2, 1)
    return {**{case: ddp_run for case in (*DDP_CASES, "nan")}, "single": single_run, "script": Run(script)}


CASES = (*DDP_CASES, "nan", "single")


@pytest.mark.parametrize("case", CASES)
def test_every_step_is_valid_on_every_rank_without_errors(runs, case):
    snaps = runs[case].snaps(case)
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 1))
    assert all(s["valid"] and all(s["rank_valid"]) for s in snaps), snaps
    assert all(s["monitor_errors"] == 0 and not any(s["rank_monitor_errors"]) for s in snaps)
    skipped = [NAN_STEP] if case == "nan" else []
    assert [s["step"] for s in snaps if s["skipped"]] == skipped
    assert len(runs[case].refs(case)) == STEPS  # Lightning ran each backward once


@pytest.mark.parametrize("case", CASES)
def test_global_and_layer_norms_equal_the_reduced_gradient_before_clipping(runs, case):
    run = runs[case]
    errors = []
    for snap, *refs in zip(run.snaps(case), *(run.refs(case, r) for r in range(len(run.ranks))), strict=True):
        for ref in refs:  # every rank holds the same reduced gradient
            errors.append(_rel(snap["grad_norm"], ref["reduced"]["total"]))
            assert snap["layer_grad_norms"].keys() == ref["reduced"]["layers"].keys()
            errors += [_rel(v, ref["reduced"]["layers"][k]) for k, v in snap["layer_grad_norms"].items()]
    print(f"{case}: global and layer norms, max relative difference {max(errors):.2e}")
    assert max(errors) <= TOL
    # clipping changed every step's gradient (to a norm of CLIP): what was measured came before it
    assert min(float(s["grad_norm"]) for s in run.snaps(case) if not s["nonfinite"]) > 2 * CLIP


@pytest.mark.parametrize("case", CASES)
def test_rank_norms_equal_an_unwrapped_twin_on_the_rank_s_batch(runs, case):
    run = runs[case]
    errors = []
    for rank in range(len(run.ranks)):
        for snap, ref in zip(run.snaps(case), run.refs(case, rank), strict=True):
            errors.append(_rel(snap["rank_grad_norms"][rank], ref["local"]["total"]))
            local_layers = list(ref["local"]["layers"].values())
            errors += [
                _rel(v, r) for v, r in zip(snap["rank_layer_grad_norms"][rank], local_layers, strict=True)
            ]
    print(f"{case}: per-rank norms, max relative difference {max(errors):.2e}")
    assert max(errors) <= TOL


@pytest.mark.parametrize("case", CASES)
def test_the_norm_the_model_logs_agrees(runs, case):
    """Lightning's ``grad_norm`` (float32; FSDP2: torch's ``get_total_norm``) logged by the model."""
    run = runs[case]
    errors = [_rel(s["grad_norm"], r["logged"]) for s, r in zip(run.snaps(case), run.refs(case), strict=True)]
    print(f"{case}: logged grad_norm, max relative difference {max(errors):.2e}")
    assert max(errors) <= TOL


def test_a_nan_on_rank_1_is_refused_on_every_rank(runs):
    run = runs["nan"]
    snap = run.snaps("nan")[NAN_STEP - 1]
    assert snap["skipped"] and snap["skip_reason"] == "guard", snap
    assert snap["nonfinite"] and snap["nonfinite_ranks"] == [1]
    assert snap["first_nonfinite"][0] == 1 and snap["first_nonfinite"][1] in snap["layer_grad_norms"]
    # the log writes non-finite floats as strings
    assert snap["grad_norm"] == "nan" and snap["rank_grad_norms"][1] == "nan"
    assert math.isfinite(snap["rank_grad_norms"][0])
    for rank in run.ranks:
        case = rank["nan"]
        assert case["finite"]
        # the parameters moved at every step but the refused one, on every rank
        assert [not same for same in case["unchanged"]] == [i + 1 != NAN_STEP for i in range(STEPS - 1)]


@pytest.mark.parametrize("case", CASES)
def test_rank_0_serves_every_gradient_series(runs, case):
    """A real HTTP scrape of rank 0's endpoint when training ended, before the monitor closed."""
    run = runs[case]
    samples = run.scrape(case)
    refs = [run.refs(case, r)[-1] for r in range(len(run.ranks))]  # each rank's last step
    layers = refs[0]["reduced"]["layers"]

    def served(name: str, **labels: str) -> float:
        return sample_value(samples, name, **labels)

    def labels(name: str, key: str) -> list[str]:
        return sorted(lab[key] for n, lab, _ in samples if n == name)

    assert labels("distmon_layer_grad_norm", "layer") == sorted(layers)
    assert labels("distmon_rank_grad_norm", "rank") == [str(r) for r in range(len(refs))]
    errors = [_rel(served("distmon_grad_norm"), refs[0]["reduced"]["total"])]
    errors += [_rel(served("distmon_layer_grad_norm", layer=k), v) for k, v in layers.items()]
    errors += [
        _rel(served("distmon_rank_grad_norm", rank=str(r)), ref["local"]["total"])
        for r, ref in enumerate(refs)
    ]
    assert max(errors) <= TOL
    # the NaN step is counted, on rank 1, and kept out of the norm's histogram
    nonfinite = [int(case == "nan" and r == 1) for r in range(len(refs))]
    assert served("distmon_step_grad_norm_count") == STEPS - sum(nonfinite)
    assert served("distmon_nonfinite_steps_total") == sum(nonfinite)
    assert [served("distmon_rank_nonfinite_steps_total", rank=str(r)) for r in range(len(refs))] == nonfinite


@pytest.mark.parametrize("case", [*DDP_CASES, "single"])
def test_training_is_bit_identical_to_the_script_without_the_callback(runs, case):
    assert all(rank[case]["identical"] for rank in runs[case].ranks)


def test_the_example_runs_as_a_script(runs):
    """``python launch/examples/lightning_example.py --steps 3``, as it is: measured and served."""
    run = runs["script"]
    assert [(s["step"], s["valid"], s["skipped"]) for s in run.snaps("script")] == [
        (i, True, False) for i in (1, 2, 3)
    ]
    assert "distmon: serving metrics at http://127.0.0.1:" in (run.out / "output.log").read_text()
