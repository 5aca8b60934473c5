"""A new user's first hour (#33): what happens when a script is written the way users write them.

Each case runs ``tests/jobs/exit_job.py`` on 2 gloo ranks under torchrun, as a script a user wrote:

- it ends without ``mon.close()``: the steps since the last export are still in the log, with
  every rank's figures, equal to float64 references the script took itself; the run is marked
  finished where Prometheus (a scraping thread) sees it; each rank says once on stderr that
  ``close()`` was not called;
- it ends with ``destroy_process_group()`` and no ``close()`` (nanoGPT): the last steps are still
  in the log, the global figures exact, the other rank's local figures "not measured" (NaN,
  ``rank_valid`` false), never made up;
- its gradient turns non-finite: one line on stderr names the first step, rank and layer.

numpy cannot be imported in these ranks (a fresh environment has none; distmon's start-up once
needed it through ``all_gather_object``). ``tests/fresh_install.sh`` (CI) runs the README's main
command in a bare virtual environment for the whole class of such misses.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_harness import free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "exit_job.py"
STEPS, EXPORT_EVERY, NAN_STEP = 13, 10, 3
REL = 1e-5


def _run(mode: str, out: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env.update(OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node=2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(JOB), mode, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{mode}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    with open(out / "log.jsonl") as f:
        log = [json.loads(line) for line in f]
    refs = [json.load(open(out / f"ref-rank{r}.json")) for r in range(2)]
    scraped = (out / "scrapes.txt").read_text() if (out / "scrapes.txt").exists() else ""
    return {"stderr": proc.stderr, "log": log, "refs": refs, "scraped": scraped}


@pytest.fixture(scope="module", params=["forgot", "destroyed", "nan"])
def job(request, tmp_path_factory):
    return request.param, _run(request.param, tmp_path_factory.mktemp(request.param))


def _num(v: object) -> float:
    return float(v) if isinstance(v, str) else v


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_a_script_that_never_closes_keeps_every_step(job):
    mode, run = job
    if mode == "nan":
        pytest.skip("closes properly")
    log, refs = run["log"], run["refs"]
    assert [row["step"] for row in log] == list(range(1, STEPS + 1)), "steps lost after the last export"
    for row in log:  # the global figures of every step, the exit-flushed ones too
        assert row["valid"], row["step"]
        assert _rel(_num(row["grad_norm"]), refs[0]["global"][row["step"] - 1]) < REL, row["step"]
    for row in log:
        for r in range(2):
            lost = mode == "destroyed" and row["step"] > EXPORT_EVERY and r == 1
            norm = _num(row["rank_grad_norms"][r])
            if lost:  # the group is gone: the other rank's last figures are not measured, never made up
                assert math.isnan(norm) and row["rank_valid"][r] is False, row
            else:
                assert row["rank_valid"][r], (row["step"], r)
                assert _rel(norm, refs[r]["local"][row["step"] - 1]) < REL, (row["step"], r)


def test_the_exit_says_close_was_not_called_once_per_rank(job):
    mode, run = job
    said = [line for line in run["stderr"].splitlines() if "exits without GradMonitor.close()" in line]
    if mode == "nan":
        assert said == [], said
        return
    assert sorted(line.split("rank ")[1][0] for line in said) == ["0", "1"], said
    expected = "marked finished" if mode == "forgot" else "process group already destroyed"
    assert all(expected in line and "mon.close()" in line for line in said), said


def test_a_clean_end_without_close_is_served_as_finished(job):
    mode, run = job
    if mode == "nan":
        pytest.skip("nobody scrapes")
    samples = {s.name: s.value for f in text_string_to_metric_families(run["scraped"]) for s in f.samples}
    assert samples.get("distmon_optimizer_steps_total") == STEPS, samples.get("distmon_optimizer_steps_total")
    assert samples.get("distmon_run_finished") == 1.0


def test_the_first_nonfinite_step_is_said_once_with_its_rank_and_layer(job):
    mode, run = job
    said = [line for line in run["stderr"].splitlines() if "the first whose gradient holds a NaN/Inf" in line]
    if mode != "nan":
        assert said == []
        return
    assert len(said) == 1, said  # steps 3..13 are all non-finite: one line, from rank 0
    assert f"step {NAN_STEP} is the first" in said[0] and "rank 1, layer 'inp'" in said[0], said
    nonfinite = [row["step"] for row in run["log"] if row["nonfinite"]]
    assert nonfinite[0] == NAN_STEP and run["log"][NAN_STEP - 1]["first_nonfinite"] == [1, "inp"]
