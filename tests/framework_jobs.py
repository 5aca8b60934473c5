"""Running a framework job (``tests/jobs/*.py``) under torchrun on gloo ranks, and reading its JSONL.

``torchrun_job(script, out, world=2)`` starts ``python -m torch.distributed.run`` on ``script OUT``
in a clean environment (no ``DISTMON_*``, ``ACCELERATE_*`` or rank variables of the test's own
process; one thread per rank; nothing downloaded; no GPU) and fails the test with the job's output
when it fails; ``needs(*modules)`` skips a test whose framework is not installed (fails it under
``CI=true``); ``jsonl_rows(path)`` reads a distmon JSONL log with its ``"nan"``/``"inf"`` strings as
floats.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_harness import free_port

ROOT = Path(__file__).resolve().parents[1]


def needs(*modules: str) -> None:
    """Skip the calling test (fail it under ``CI=true``) when a framework is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (DS_BUILD_OPS=0 pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def job_env() -> dict[str, str]:
    """This process's environment for a job's ranks, less what would leak into them."""
    ranks = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTMON_", "ACCELERATE_")) and k not in ranks
    }
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",  # DeepSpeed's CPU accelerator, over gloo
        PYTHONWARNINGS="ignore",
    )
    return env


def torchrun_job(script: Path, out: Path, *, world: int = 2, timeout: float = 300) -> None:
    """Run ``script OUT`` on ``world`` torchrun ranks; the test fails with its output if it does."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={world}"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def numbers(value: object) -> object:
    """A JSONL value with its ``"nan"``/``"inf"`` strings as floats.

    Example:
        >>> numbers({"a": ["nan", 1.0]})
        {'a': [nan, 1.0]}
    """
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: numbers(v) for k, v in value.items()}
    return value


def jsonl_rows(path: Path) -> list[dict]:
    """Every row of a distmon JSONL log, its non-finite strings as floats."""
    with open(path) as f:
        return [numbers(json.loads(line)) for line in f]
