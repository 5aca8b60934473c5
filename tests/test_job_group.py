"""Independent jobs side by side in one default group (``job_group=``, #39): each its own writer and endpoint.

A sweep trained side by side shares one default group; each job is a DDP model over its own
group, monitored with ``GradMonitor(..., job_group=its_group, log_path=its_own, port=its_own)``.
Under torchrun every process has ``LOCAL_RANK`` (its place on the host, among every job's
processes): the writer, the endpoint and the file_sd target are chosen within the job, so every
job writes its log, serves its metrics and lists its endpoint, with its own figures. Two jobs on
4 ranks and three (of 1, 3 and 2 ranks) on 6, as torchrun would start them on one host.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from ddp_harness import free_port, run_ranks
from helpers import as_float64, sample_value, scrape_metrics
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow

STEPS = 6


def _job_of(rank: int, jobs: list[list[int]]) -> int:
    return next(i for i, ranks in enumerate(jobs) if rank in ranks)


def _side_by_side(rank: int, world_size: int, jobs: list[list[int]], ports: list[int], out: str) -> dict:
    import distmon

    assert os.environ["LOCAL_RANK"] == str(rank)  # as torchrun sets it on one host
    groups = [dist.new_group(ranks) for ranks in jobs]  # every rank makes every group, in order
    j = _job_of(rank, jobs)
    torch.manual_seed(j)  # each job its own model
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net, process_group=groups[j])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = distmon.GradMonitor(
        model,
        opt,
        job_group=groups[j],
        log_path=os.path.join(out, f"job{j}.jsonl"),
        port=ports[j],
        file_sd_dir=os.path.join(out, f"sd{j}"),
        run_id=f"job{j}",
        export_every=2,
        linger_s=0,
    )
    norms = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        (model(x) - y).pow(2).mean().backward()
        norms.append(math.sqrt(sum(float(as_float64(p.grad).pow(2).sum()) for p in net.parameters())))
        opt.step()
        opt.zero_grad()
    snap = mon.flush()
    served = None
    if mon.port is not None:
        samples = scrape_metrics(mon.port)
        served = {"grad_norm": sample_value(samples, "distmon_grad_norm", run_id=f"job{j}"), "port": mon.port}
    mon.close()
    return {"job": j, "norms": norms, "grad_norm": snap.grad_norm, "world": snap.world_size, "served": served}


@pytest.mark.parametrize("jobs", [[[0, 1], [2, 3]], [[0], [1, 2, 3], [4, 5]]], ids=["two-jobs", "three-jobs"])
def test_every_declared_job_has_its_log_endpoint_target_and_figures(jobs, tmp_path):
    world = sum(len(r) for r in jobs)
    ports = [free_port() for _ in jobs]
    results = run_ranks(_side_by_side, world, jobs, ports, str(tmp_path), timeout=180)
    for j, ranks in enumerate(jobs):
        mine = [results[r] for r in ranks]
        lead = mine[0]
        # its figures: the job's world, its reduced gradient's norm
        assert all(r["world"] == len(ranks) for r in mine)
        assert abs(lead["grad_norm"] - lead["norms"][-1]) <= 1e-6 * lead["norms"][-1], (j, lead)
        # its endpoint: the job's first rank serves its metrics, the others do not
        assert lead["served"] is not None and lead["served"]["port"] == ports[j], (j, lead)
        assert abs(lead["served"]["grad_norm"] - lead["norms"][-1]) <= 1e-6 * lead["norms"][-1]
        assert all(r["served"] is None for r in mine[1:]), j
        # its log: every step, its own run id and norms
        with open(tmp_path / f"job{j}.jsonl") as f:
            lines = [json.loads(line) for line in f]
        assert [row["step"] for row in lines] == list(range(1, STEPS + 1)), j
        assert {row["run_id"] for row in lines} == {f"job{j}"}
        for row, norm in zip(lines, lead["norms"]):
            assert abs(row["grad_norm"] - norm) <= 1e-6 * norm, (j, row["step"])
        # its file_sd target: written by its rank 0 and withdrawn at the clean finish
        assert (tmp_path / f"sd{j}").is_dir() and not list((tmp_path / f"sd{j}").glob("*.json")), j
