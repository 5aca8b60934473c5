"""`benchmarks/early_warning.py --quick` still runs end to end and writes what the issue asks for.

Two short runs (one that diverges through attention-logit growth, one healthy), every
detector applied through the same code as the full benchmark (distmon's precursor through
``distmon/verdicts/precursor.py``). ~20 s on an idle core, more on a busy machine: slow tier.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # spawns training processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("diverging_runs", "detected", "median_lead_steps", "healthy_runs", "false_warnings")


def test_quick_benchmark_writes_every_detectors_figures(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env["OMP_NUM_THREADS"] = "1"
    script = os.path.join(REPO, "benchmarks", "early_warning.py")
    args = [sys.executable, script, "--quick", "--out", str(tmp_path), "--cache", str(tmp_path / "cache")]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((tmp_path / "early_warning.json").read_text())
    assert set(res["detectors"]) == {
        "distmon_precursor",
        "distmon_precursor_peak_lr",
        "distmon_spike",
        "lightning_spike",
        "gradnorm_threshold",
    }
    for name, summary in res["detectors"].items():
        for key in KEYS:
            assert key in summary, (name, key)
        assert summary["diverging_runs"] == 1 and summary["healthy_runs"] == 1, name
    for name in ("distmon_precursor", "distmon_precursor_peak_lr"):
        mine = res["detectors"][name]
        assert mine["detected"] == 1 and mine["median_lead_steps"] > 0 and mine["false_warnings"] == 0, name
    assert (tmp_path / "early_warning.png").stat().st_size > 10_000
    assert "| distmon precursor | 1/1 |" in (tmp_path / "early_warning.md").read_text()
