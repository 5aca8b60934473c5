"""Issue #28: what each rank sends and receives does not grow with the number of nodes.

Several torchrun agents on 127.0.0.1 stand for nodes (a c10d rendezvous joins them; each
agent's ranks are one node), 2 ranks each: 1, 2 and 4 nodes. ``tests/jobs/scale_job.py`` trains
a DDP model with distmon at its defaults and records, from ``torch.distributed``'s own
functions, every collective distmon's exchange issues and the bytes of its tensors (handed
over and handed back). The bytes per rank per step, averaged over the steps (export steps
included), must be the same within 10% at 2, 4 and 8 ranks; each rank's rows must hold its
own node's ranks only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ddp_harness import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "scale_job.py"
PER_NODE = 2


def run_nodes(nnodes: int, out: Path, timeout: float = 300.0) -> list[dict]:
    """Run the job on ``nnodes`` torchrun agents of ``PER_NODE`` ranks; every rank's record."""
    out.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTMON_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    endpoint, run = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    agents = []
    for node in range(nnodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--nproc-per-node", str(PER_NODE),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run,
            "--rdzv-conf", f"is_host={int(node == 0)}",
            str(JOB), str(out),
        ]  # fmt: skip
        log = open(out / f"agent{node}.log", "wb")
        agents.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    try:
        codes = [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            a.kill()
    logs = "\n".join((out / f"agent{n}.log").read_text(errors="replace")[-3000:] for n in range(nnodes))
    assert codes == [0] * nnodes, logs
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nnodes * PER_NODE)]


def per_step_bytes(record: dict) -> float:
    return sum(sent + received for _, sent, received in record["calls"]) / record["steps"]


def test_bytes_per_rank_do_not_grow_with_the_nodes(tmp_path):
    rows, means = [], {}
    for nnodes in (1, 2, 4):
        records = run_nodes(nnodes, tmp_path / f"nodes{nnodes}")
        world = nnodes * PER_NODE
        per_rank = [per_step_bytes(rec) for rec in records]
        means[world] = sum(per_rank) / len(per_rank)
        kinds = sorted({name for rec in records for name, _, _ in rec["calls"]})
        rows.append(
            f"{nnodes} x {PER_NODE} ranks: {min(per_rank):,.0f}-{max(per_rank):,.0f} bytes per rank "
            f"per step ({', '.join(kinds)})"
        )
        print(rows[-1])
        assert max(per_rank) <= 1.10 * min(per_rank), rows[-1]
        assert max(means.values()) <= 1.10 * min(means.values()), rows
        for rec in records:
            node = rec["rank"] // PER_NODE  # agents' ranks are contiguous
            assert rec["world_size"] == world
            assert rec["ranks"] == [PER_NODE * node + i for i in range(PER_NODE)], rec["ranks"]
            assert len(rec["rank_grad_norms"]) == PER_NODE
