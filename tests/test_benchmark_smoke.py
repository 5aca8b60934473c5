"""The overhead benchmark still runs: `benchmarks/overhead.py --smoke` under torchrun with 2 ranks.

A tiny model and a few steps of every approach (bare DDP, distmon at defaults and at its most
detailed, the tutorial hook, wandb-style histograms, Lightning's grad_norm, the hand-written
best effort, the hook-read reference). Timing is not asserted (a tiny model on a shared
machine says nothing); that the benchmark produces its table with every row, that the
monitors ran without errors and that distmon's global norm equals an independent computation
on an identical model copy are.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # real ranks or servers: not in the fast tier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "overhead.py")
# every peer the benchmark must measure (the list), baseline first, then the hook-read
# reference (one read of the local buckets inside a comm hook: what a read costs where distmon reads)
APPROACHES = [
    "baseline",
    "distmon",
    "distmon-detailed",
    "distmon-activations",
    "tutorial",
    "wandb-hist",
    "wandb-hist-1",
    "lightning",
    "hand-written",
    "hook-read",
]


def _run(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTMON_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_smoke_benchmark_produces_every_row(tmp_path):
    proc = _run(SCRIPT, "--smoke", "--out", str(tmp_path), "--ranks", "2")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]

    md = (tmp_path / "overhead.md").read_text()
    res = json.loads((tmp_path / "overhead.json").read_text())
    names = APPROACHES
    assert res["approaches"] == names
    (size,) = res["sizes"]
    assert size["info"]["size"] == "smoke"
    assert size["n_rounds"] >= 3

    for name in names:
        label = res["labels"][name]
        assert f"| {label} |" in md, f"no table row for {name} ({label!r})"
        row = size["rows"][name]
        for key in ("median_ms", "cpu_ms", "ratio", "own_ms"):
            assert math.isfinite(row[key]), (name, key, row[key])
        assert row["median_ms"] > 0 and row["cpu_ms"] > 0
        if name != "baseline":  # the paired ratio (same round) and its bootstrap interval
            assert 0 < row["paired_lo"] <= row["paired"] <= row["paired_hi"], (name, row)
    assert size["floor_ms"] > 0 and size["floor_cpu_ms"] > 0

    assert not size["info"].get("uninstrumented"), (
        "distmon's internals changed: the benchmark no longer times these sites "
        f"(update benchmarks/overheadbench/distmon_internals.py): {size['info']['uninstrumented']}"
    )

    # every monitoring approach actually ran its code on the timed steps
    for name in names[1:]:
        assert size["rows"][name]["own_ms"] > 0, name
    for name in ("distmon", "distmon-detailed"):
        sites = size["rows"][name]["sites_ms"]
        for site in (
            "distmon::local_sums",
            "distmon::reduced_sums",
            "distmon::before_step",
            "distmon::after_step",
        ):
            assert sites.get(site, 0) > 0, (name, site, sites)
        assert size["rows"][name]["kept_bytes"] > 0

    # the monitors measured the right thing: identical copies, identical steps
    health = size["health"]
    ref = health["hand-written"]["grad_norm"]
    for name in ("distmon", "distmon-detailed"):
        h = health[name]
        assert h["errors"] == 0, h
        assert h["nonfinite"] is False, h
        assert math.isclose(h["grad_norm"], ref, rel_tol=1e-4), (name, h["grad_norm"], ref)
    assert health["distmon-detailed"]["n_layers"] == size["info"]["n_tensors"]

    # the report's other parts
    for part in (
        "## Acceptance",
        "## Where distmon's time goes",
        "## How it is measured",
        "paired ratio [95% CI]",
        "Command: `",
        "torch " + res["machine"]["torch"],
    ):
        assert part in md, part
    assert size["profile"]["distmon"]["sites_ms"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        png = tmp_path / "overhead.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# the GPU preset's approaches (issue #35), baseline first
GPU_APPROACHES = [
    "baseline",
    "distmon",
    "distmon-detailed",
    "distmon-activations",
    "allreduce-hook",
    "hand-written",
    "clip-item",
]


def test_gpu_preset_runs_on_a_tiny_model(tmp_path):
    """``--gpu`` on the smoke size: it runs anywhere (here on CPU: gloo, one rank, bf16 autocast) and
    writes what the GPU run commits: per size and approach the paired ratio and its spread, the
    GPU's name (none here) and the torch version, and the issue's targets in ``overhead.md``."""
    proc = _run(SCRIPT, "--gpu", "--sizes", "smoke", "--out", str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in log, log[-6000:]
    res = json.loads((tmp_path / "overhead.json").read_text())
    md = (tmp_path / "overhead.md").read_text()
    assert res["mode"] == "gpu" and res["approaches"] == GPU_APPROACHES
    assert res["machine"]["world_size"] == 1 and res["machine"]["torch"] and "gpu" in res["machine"]
    (size,) = res["sizes"]
    for name in GPU_APPROACHES[1:]:
        row = size["rows"][name]
        assert row["paired_q25"] <= row["paired"] <= row["paired_q75"], (name, row)
        assert 0 < row["paired_lo"] <= row["paired"] <= row["paired_hi"], (name, row)
        assert f"| {res['labels'][name]} |" in md, name
    assert size["rows"]["distmon"]["sites_ms"].get("distmon::local_sums", 0) > 0
    for name in ("distmon", "distmon-detailed", "distmon-activations"):
        assert size["health"][name]["errors"] == 0
        want = size["health"]["hand-written"]["grad_norm"]
        assert math.isclose(size["health"][name]["grad_norm"], want, rel_tol=1e-4), name
    assert "## Targets (issue #35)" in md and "distmon <= the hand-written best effort" in md
    assert "No GPU: these are CPU figures" in md


@pytest.mark.parametrize(
    "layout, size, header",
    [
        ("fsdp", "1M", "FSDP2, 2 gloo ranks (mesh dp=2)"),
        # 4 ranks on a (dp=2, tp=2) mesh: the smoke size keeps it to seconds on 2 cores
        ("tp-fsdp", "smoke", "TP + FSDP2, 4 gloo ranks (mesh dp=2 x tp=2)"),
    ],
)
def test_fsdp_benchmark_runs_and_reports_its_row(layout, size, header):
    script = os.path.join(REPO, "benchmarks", "fsdp_overhead.py")
    proc = _run(script, "--layout", layout, "--sizes", size, "--rounds", "2")
    # exit 1 also when distmon's snapshot of the check step was invalid on a rank or its
    # grad_norm missed the gathered gradients' norm: a benchmark of a refusing monitor means nothing
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    # gloo of torch <= 2.10 says "[Gloo] Rank 0 is connected to 1 peer ranks ..." on stdout
    report = "".join(line for line in proc.stdout.splitlines(True) if not line.startswith("[Gloo] "))
    assert report.startswith(header), proc.stdout
    row = [line for line in report.splitlines() if line.startswith(f"| {size} |")]
    assert len(row) == 1, proc.stdout
    cells = [c.strip() for c in row[0].split("|")]
    ratio = float(cells[5])
    assert 0.5 < ratio < 2.0, row  # a measured ratio, not a placeholder
    lo, hi = map(float, cells[6].split("-"))
    assert lo <= ratio <= hi, row
    figures, err = cells[10].split()
    assert figures == "valid" and float(err.strip("()")) < 1e-4, row


def test_collective_scaling_measures_both_schedules_on_nodes():
    """``collective_scaling.py`` on 2 and 4 gloo ranks in nodes of 2: a row per schedule and world
    size with positive times, the node schedule's bytes the same at both sizes, today's growing
    (the script itself exits non-zero when the tensors its ranks handed gloo differ from the
    model's bytes); a world size that is no whole number of nodes is refused."""
    script = os.path.join(REPO, "benchmarks", "collective_scaling.py")
    proc = _run(script, "--ranks", "2", "4", "--per-node", "2", "--steps", "10", "--layers", "8")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (proc.stdout + proc.stderr)[-6000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0].isdigit():
            rows[int(cells[0]), cells[1]] = [
                float(c.replace(",", "").rstrip("x") or "nan") for c in cells[2:]
            ]
    assert set(rows) == {(w, s) for w in (2, 4) for s in ("gather", "node")}, proc.stdout
    for (world, schedule), (sent, ordinary, export, mean, ratio) in rows.items():
        assert sent > 0 and ordinary > 0 and export > 0 and mean > 0, (world, schedule, rows)
        if schedule == "node":
            assert ratio > 0, rows
    assert rows[2, "node"][0] == rows[4, "node"][0]
    assert rows[2, "gather"][0] < rows[4, "gather"][0]

    bad = _run(script, "--ranks", "4", "--per-node", "3")
    assert bad.returncode == 2 and "multiple of --per-node" in bad.stderr, bad.stderr
