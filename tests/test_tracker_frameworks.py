"""distmon's figures in the frameworks' own loggers, with no code but the callback (issue #43).

tests/jobs/tracker_frameworks_job.py runs, on 2 gloo ranks, Lightning with ``TensorBoardLogger``
and ``CSVLogger`` and the HF Trainer with ``report_to=["tensorboard"]``, each with
``DistmonCallback`` and a NaN in rank 1's batch at ``NAN_STEP``. Read back: the TensorBoard event
files with TensorBoard's ``EventAccumulator``, the CSV with ``csv``. Every figure of every step
must equal the JSONL log's (both loggers' TensorBoard writers store float32 scalars: the log's
value rounded to float32; the CSV holds it exactly), at its own step, and the NaN step's event
must be there (the HF TensorBoard integration also takes the events' text).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from ddp_harness import free_port
from tracker_readback import expected_figures, same, tensorboard_figures

pytestmark = pytest.mark.slow  # real ranks, real frameworks

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "tracker_frameworks_job.py"
STEPS, NAN_STEP = 12, 7  # the job's


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [m for m in ("lightning", "transformers", "tensorboard") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    out = tmp_path_factory.mktemp("tracker_frameworks")
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_") and k not in drop}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(JOB), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def _lines(out: Path, name: str) -> list[dict[str, object]]:
    with open(out / f"{name}.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert lines[NAN_STEP - 1]["skipped"] and lines[NAN_STEP - 1]["first_nonfinite"][0] == 1
    return lines


def _check(tool: str, got: dict[str, dict[int, float]], lines: list[dict[str, object]], exact: bool) -> int:
    """Every figure at every step equal to the log's (float32 unless ``exact``); the count checked."""
    n = 0
    for line in lines:
        for name, value in expected_figures(line).items():
            want = value if exact else float(np.float32(value))
            found = got.get(name, {}).get(line["step"])
            assert found is not None and same(found, want), (tool, name, line["step"], found, want)
            n += 1
    assert sorted(got["distmon/nonfinite"]) == list(range(1, STEPS + 1)), tool  # every step
    assert got["distmon.anomalies/nonfinite"] == {NAN_STEP: 1.0}, tool  # the event, at its step
    assert got["distmon/first_nonfinite_rank"] == {NAN_STEP: 1.0}, tool
    return n


def test_lightning_tensorboard_logger_holds_every_figure_at_its_step(out):
    got, _ = tensorboard_figures(out / "lt_tb" / "version_0")
    print(f"Lightning TensorBoardLogger: {_check('lt_tb', got, _lines(out, 'lightning'), False)} figures")
    assert "grad_norm" in got  # the model's own logging goes on beside distmon's


def test_lightning_csv_logger_holds_every_figure_at_its_step(out):
    got: dict[str, dict[int, float]] = defaultdict(dict)
    with open(out / "lt_csv" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k.startswith("distmon") and v != "":
                    got[k][int(row["step"])] = float(v)
    print(f"Lightning CSVLogger: {_check('lt_csv', got, _lines(out, 'lightning'), True)} figures")


def test_hf_trainer_report_to_tensorboard_holds_every_figure_at_its_step(out):
    got, texts = tensorboard_figures(out / "hf_tb", prefix="train/")  # the integration's prefix
    print(f"HF Trainer, report_to tensorboard: {_check('hf_tb', got, _lines(out, 'hf'), False)} figures")
    assert list(texts) == [NAN_STEP] and "nonfinite on rank 1" in texts[NAN_STEP], texts
    assert {"loss", "grad_norm"} <= set(got)  # the Trainer's own logs are still there
    # the Trainer's log history (saved in checkpoints) holds its own logs only
    state = json.loads((out / "hf_state.json").read_text())
    assert state and not any(k.startswith("distmon") for entry in state for k in entry)
