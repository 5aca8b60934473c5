"""``tracker=``: distmon's figures in TensorBoard, W&B and MLflow, read back with each tool's own reader
(issue #43).

One job of 2 real gloo ranks trains the same seeded model four times, with the same options
(``guard="skip"``, a NaN in rank 1's batch at ``NAN_STEP``, the noise scale, update ratios and
activations on, so every figure kind appears) but for the tracker:

* ``plain``: none;
* ``trackers``: every kind by name, made on rank 0 (``tensorboard:DIR``, ``wandb:PROJECT`` as an
  offline run, ``mlflow:EXPERIMENT`` in a local file store) and a callable;
* ``raising``: a callable that raises on every call;
* ``blocking``: a callable that never returns, with a queue of ``CAPACITY`` snapshots.

Read back: the TensorBoard event files with TensorBoard's ``EventAccumulator``, the W&B run's
``.wandb`` transaction log with W&B's own reader (``wandb leet inspect --json``), the MLflow run
with ``MlflowClient.get_metric_history``. Each figure must equal what the JSONL log holds for that
step (the expected names and values are derived here from the log's fields, not by distmon's
code), at every step, and the events must be there. A tracker that raises or blocks leaves the
trained parameters bit-identical to ``plain`` and the steps on time, and what it lost is counted
in ``distmon_monitor_errors_total`` (scraped from rank 0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from ddp_harness import run_ranks
from helpers import sample_value, scrape_metrics
from torch.nn.parallel import DistributedDataParallel as DDP
from tracker_readback import expected_figures, same, tensorboard_figures

STEPS, EVERY, NAN_STEP, CAPACITY = 60, 5, 23, 20
CASES = ("plain", "trackers", "raising", "blocking")
MODULES = ("tensorboard", "wandb", "mlflow")


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


# -- the job: 2 gloo ranks ----------------------------------------------------------------------
def _raising(figures: dict[str, float], step: int) -> None:
    raise RuntimeError("tracker down")


def _blocking(figures: dict[str, float], step: int) -> None:
    threading.Event().wait()  # never returns


def _job(rank: int, world: int, workdir: str) -> dict[str, object]:
    import distmon
    import distmon.export.trackers as trackers

    trackers.TRACKER_CAPACITY = CAPACITY  # read when the monitor's sinks are built
    seen: list[tuple[int, dict[str, float]]] = []
    out: dict[str, object] = {}
    for case in CASES:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        tracker = {
            "plain": None,
            "trackers": [
                f"tensorboard:{workdir}/tb",
                "wandb:distmon-test",
                "mlflow:distmon-test",
                lambda figures, step: seen.append((step, figures)),
            ],
            "raising": _raising,
            "blocking": _blocking,
        }[case]
        mon = distmon.GradMonitor(
            ddp,
            opt,
            serve="rank0",
            port=0,
            linger_s=0,
            log_path=f"{workdir}/{case}.jsonl",
            export_every=EVERY,
            export_interval_s=0,
            guard="skip",
            batch_size=8,
            update_ratio=True,
            activations=True,
            tracker=tracker,
        )
        times = []
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 16, generator=g)
            if rank == 1 and step == NAN_STEP:
                x[0, 0] = float("nan")
            t0 = time.perf_counter()
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        mon.flush()  # every step exported: what the trackers lost is counted by now
        samples = scrape_metrics(mon.port) if rank == 0 else None
        errors = mon._run.errors.count
        t0 = time.perf_counter()
        mon.close()
        out[case] = {
            "times": times,
            "close_s": time.perf_counter() - t0,
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "errors": errors,
            "served_errors": samples and sample_value(samples, "distmon_monitor_errors_total"),
        }
    out["seen"] = seen
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    _require(*MODULES)
    workdir = tmp_path_factory.mktemp("trackers")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(workdir),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{workdir}/mlruns",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3's file store is opt-in
    }
    return workdir, run_ranks(_job, 2, str(workdir), timeout=420, env=env)


def _lines(workdir: Path, case: str) -> list[dict[str, object]]:
    with open(workdir / f"{case}.jsonl") as f:
        return [json.loads(line) for line in f]


def _check(tool: str, got: dict[str, dict[int, float]], lines: list[dict[str, object]]) -> int:
    """Every expected figure at every step equals the log's; no other distmon name. Returns the count."""
    checked, names = 0, set()
    for line in lines:
        for name, value in expected_figures(line).items():
            names.add(name)
            assert line["step"] in got.get(name, {}), (tool, name, line["step"])
            assert same(got[name][line["step"]], value), (
                tool,
                name,
                line["step"],
                got[name][line["step"]],
                value,
            )
            checked += 1
    extra = {n for n in got if n.startswith("distmon") and n not in names}
    assert not extra - {"distmon/rank_outlier_worst_score", "distmon/rank_outlier_worst_rank"}, (tool, extra)
    assert sorted(got["distmon/nonfinite"]) == [line["step"] for line in lines], tool  # every step
    return checked


# -- each tool, read back ----------------------------------------------------------------------
def _wandb(workdir: Path) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(history rows, metric definitions) of the offline run, from its .wandb file."""
    (run_file,) = workdir.glob("wandb/offline-run-*/run-*.wandb")
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
    metrics = [r["metric"] for r in records if r.get("type") == "metric"]
    return rows, metrics


def _wandb_number(value: object) -> float:
    return float(value) if not isinstance(value, str) else float(value.replace("Infinity", "inf"))


def _mlflow(workdir: Path) -> tuple[dict[str, dict[int, float]], dict[str, str], str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{workdir}/mlruns")
    experiment = client.get_experiment_by_name("distmon-test")
    (run,) = client.search_runs([experiment.experiment_id])
    got = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for name in run.data.metrics
    }
    return got, run.data.tags, run.info.status


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensorboard_holds_every_figure_of_every_step_as_the_log(job, monkeypatch):
    workdir, _ = job
    lines = _lines(workdir, "trackers")
    got, texts = tensorboard_figures(workdir / "tb")
    print(f"TensorBoard: {_check('tensorboard', got, lines)} figures equal to the JSONL log's")
    events = {line["step"] for line in lines if line["events"]}
    assert NAN_STEP in events and set(texts) == events
    assert "nonfinite on rank 1" in texts[NAN_STEP], texts[NAN_STEP]


@pytest.mark.slow
def test_wandb_offline_run_holds_every_figure_at_its_step(job, monkeypatch):
    workdir, _ = job
    lines = _lines(workdir, "trackers")
    rows, metrics = _wandb(workdir)
    got: dict[str, dict[int, float]] = defaultdict(dict)
    texts = {}
    for row in rows:
        step = int(row["distmon_step"])
        for k, v in row.items():
            if k == "distmon/events":
                texts[step] = v
            elif k.startswith("distmon/") or k.startswith("distmon."):
                got[k][step] = _wandb_number(v)
    print(f"W&B: {_check('wandb', got, lines)} figures equal to the JSONL log's")
    assert [int(r["distmon_step"]) for r in rows] == list(range(1, STEPS + 1))  # one row per step
    assert "nonfinite on rank 1" in texts[NAN_STEP], texts
    # distmon_step is the x-axis of every distmon key (W&B's own step counts rows)
    steps_of = {m.get("glob_name") or m.get("name"): m.get("step_metric") for m in metrics}
    assert steps_of.get("distmon/*") == steps_of.get("distmon.*") == "distmon_step", metrics


@pytest.mark.slow
def test_mlflow_file_store_holds_every_figure_at_its_step(job, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    workdir, _ = job
    lines = _lines(workdir, "trackers")
    got, tags, status = _mlflow(workdir)
    print(f"MLflow: {_check('mlflow', got, lines)} figures equal to the JSONL log's")
    assert "nonfinite on rank 1" in tags[f"distmon/events/{NAN_STEP}"]
    assert status == "FINISHED"  # distmon made the run, and ended it with the monitor


@pytest.mark.slow
def test_a_callable_gets_the_same_figures_as_every_tool(job):
    workdir, results = job
    lines = _lines(workdir, "trackers")
    seen = results[0]["seen"]
    assert [step for step, _ in seen] == list(range(1, STEPS + 1))
    got: dict[str, dict[int, float]] = defaultdict(dict)
    for step, figures in seen:
        for k, v in figures.items():
            got[k][step] = v
    _check("callable", got, lines)
    assert results[1]["seen"] == []  # only global rank 0 hands figures over


@pytest.mark.slow
def test_a_tracker_that_raises_or_blocks_leaves_training_bit_identical_and_on_time(job):
    workdir, results = job
    for rank, out in enumerate(results):
        plain = out["plain"]
        for case in ("trackers", "raising", "blocking"):
            assert torch.equal(out[case]["params"], plain["params"]), (rank, case)
            times = out[case]["times"]
            print(  # python -m pytest -s tests/test_trackers.py: the figures docs/trackers.md gives
                f"rank {rank} {case}: step ms median/max {1e3 * statistics.median(times):.2f}/"
                f"{1e3 * max(times):.1f} (plain {1e3 * statistics.median(plain['times']):.2f}/"
                f"{1e3 * max(plain['times']):.1f}); close {out[case]['close_s']:.1f} s"
            )
            if case == "trackers":  # real trackers' work on rank 0 (its GIL), not a wait: shown
                continue
            # a wait on the tracker (forever, for the blocking one) would show at once; the cases run
            # one after the other on 2 shared cores, so the medians get room for the machine's drift
            assert max(times) < max(plain["times"]) + 1.0, (rank, case, max(times))
            assert statistics.median(times) < 3 * statistics.median(plain["times"]) + 0.010, (rank, case)
        # close waits for the sinks at most SINK_WAIT_S (10 s) and stops them in 2 more
        assert out["blocking"]["close_s"] < 16.0, (rank, out["blocking"]["close_s"])
    rank0 = results[0]
    exports = STEPS // EVERY
    # every call raised (one batch of snapshots per export), each counted
    assert rank0["raising"]["errors"] == rank0["raising"]["served_errors"] == exports
    # the blocked tracker holds CAPACITY snapshots (the batch it is stuck on included): the rest are
    # dropped, counted
    dropped = STEPS - CAPACITY
    assert rank0["blocking"]["errors"] == rank0["blocking"]["served_errors"] == dropped
    assert rank0["plain"]["errors"] == rank0["trackers"]["errors"] == 0
    assert results[1]["raising"]["errors"] == results[1]["blocking"]["errors"] == 0  # rank 0's only
    # the log has every step in every case: the tracker's losses are its own
    for case in CASES:
        assert [line["step"] for line in _lines(workdir, case)] == list(range(1, STEPS + 1)), case


# -- in process: the option's checks, the names, the imports ------------------------------------
def test_a_wrong_tracker_fails_at_construction_naming_the_fix():
    import distmon

    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="no tracker distmon knows: pass a torch.utils.tensorboard"):
        distmon.GradMonitor(net, opt, serve="none", tracker=object())
    with pytest.raises(ValueError, match="'neptune' is not a tracker name: use 'tensorboard"):
        distmon.GradMonitor(net, opt, serve="none", tracker=["tensorboard", "neptune"])


def test_a_tracker_name_whose_library_is_missing_names_the_package(monkeypatch):
    from distmon.export import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    with pytest.raises(ValueError, match="needs wandb, which is not installed: pip install 'wandb'"):
        trackers.check_tracker("wandb:my-project")


def test_figures_are_named_one_section_per_kind():
    from distmon.export.tracker_figures import figures_of, mlflow_name
    from distmon.snapshot import AnomalyEvent, Snapshot

    snap = Snapshot(
        step=9,
        timestamp=12.5,
        grad_norm=3.0,
        valid=True,
        layer_grad_norms={"blocks.0.attn": 1.0, "other": 2.0},
        ranks=[0, 1],
        rank_grad_norms=[3.5, 2.5],
        rank_valid=[True, False],  # rank 1's local figures were not measured: not handed over
        events=(AnomalyEvent(kind="spike", step=9, rank=-1, layer="", value=8.0, threshold=6.0),),
        scores={"zscore": 8.0, "median_ratio": float("nan")},
        layer_update_ratio={"blocks.0.attn": 1e-3, "other": float("nan")},
    )
    f = figures_of(snap)
    assert (f.step, f.timestamp) == (9, 12.5)
    assert sorted({k.split("/")[0] for k in f.scalars}) == [
        "distmon",
        "distmon.anomalies",
        "distmon.layer_grad_norm",
        "distmon.layer_update_ratio",
        "distmon.rank_grad_norm",
    ]
    assert f.scalars["distmon.rank_grad_norm/0"] == 3.5 and "distmon.rank_grad_norm/1" not in f.scalars
    assert f.scalars["distmon.anomalies/spike"] == 1.0 and f.scalars["distmon/grad_norm_zscore"] == 8.0
    assert "distmon/grad_norm_median_ratio" not in f.scalars  # NaN: not yet meaningful
    assert list(f.scalars).count("distmon.layer_update_ratio/blocks.0.attn") == 1
    assert f.text == "step 9: spike, value 8 (threshold 6)"
    assert mlflow_name("distmon.layer_grad_norm/a(b)") == "distmon.layer_grad_norm/a_b_"


def test_a_mailbox_nobody_empties_drops_beyond_its_capacity_counted():
    from distmon.errors import ErrorCounter
    from distmon.export.trackers import Mailbox, tracker_workers
    from distmon.snapshot import Snapshot

    box, errors = Mailbox(capacity=3), ErrorCounter()
    (worker,) = tracker_workers([box], errors)
    worker.offer([Snapshot(step=s, timestamp=0.0, grad_norm=1.0) for s in range(1, 6)])
    assert worker.drain(5.0)
    worker.stop(5.0)
    assert [f.step for f in box.take()] == [1, 2, 3] and errors.count == 1


@pytest.mark.slow  # a fresh interpreter (~3 s)
def test_import_distmon_and_a_monitor_without_tracker_pull_in_no_tracker_library():
    code = (
        "import sys, torch, distmon; net = torch.nn.Linear(2, 1); "
        "distmon.GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve='none').close(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboard', 'wandb', 'mlflow'}))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_the_tracker_objects_a_user_already_has_are_written_and_left_open(tmp_path, monkeypatch):
    """One process: a ``SummaryWriter``, a W&B run and an MLflow run handed over as they are; distmon
    writes every step to each, flushes them at close and leaves them to the user, who logs on."""
    _require(*MODULES)
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(k, v)
    import mlflow
    import wandb
    from mlflow import MlflowClient
    from torch.utils.tensorboard import SummaryWriter

    import distmon

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"file:{tmp_path}/mlruns")
    try:
        writer = SummaryWriter(str(tmp_path / "tb"))
        run = wandb.init(project="distmon-test", dir=str(tmp_path), mode="offline")
        active = mlflow.start_run()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        log = tmp_path / "one.jsonl"
        with distmon.GradMonitor(net, opt, serve="none", log_path=str(log), tracker=[writer, run, active]):
            for _ in range(12):
                net(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        writer.add_scalar("loss", 1.0, 13)  # still the user's: open
        writer.close()
        run.log({"loss": 1.0})
        run.finish()
        mlflow.log_metric("loss", 1.0, step=13)
        mlflow.end_run()
        run_id = active.info.run_id
    finally:
        mlflow.set_tracking_uri(before)
    with open(log) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == list(range(1, 13))
    got, _ = tensorboard_figures(tmp_path / "tb")
    assert _check("tensorboard", got, lines) and sorted(got["loss"]) == [13]
    rows, _ = _wandb(tmp_path)
    assert [r.get("distmon_step") for r in rows] == [*range(1, 13), None] and rows[-1]["loss"] == 1
    client = MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")
    history = client.get_metric_history(run_id, "distmon/grad_norm")
    assert [(m.step, m.value) for m in history] == [(line["step"], line["grad_norm"]) for line in lines]


@pytest.mark.slow
def test_the_benchmark_s_tracker_rows_run(tmp_path):
    """``benchmarks/overhead.py --smoke`` with the two rows docs/trackers.md quotes (issue #43)."""
    _require("tensorboard", "wandb")
    root = Path(__file__).resolve().parents[1]
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTMON_", "TORCHELASTIC_")) and k not in drop
    }
    cmd = [
        sys.executable,
        str(root / "benchmarks" / "overhead.py"),
        "--smoke",
        "--no-profile",
        "--out",
        str(tmp_path),
    ]
    cmd += ["--approaches", "distmon", "distmon-tensorboard", "wandb-watch"]
    proc = subprocess.run(
        cmd, cwd=root, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    (size,) = json.loads((tmp_path / "overhead.json").read_text())["sizes"]
    for name in ("distmon-tensorboard", "wandb-watch"):
        row = size["rows"][name]
        assert 0 < row["paired_lo"] <= row["paired"] <= row["paired_hi"], (name, row)
