"""The per-bucket cache follows DDP's bucket rebuild and never pins freed bucket buffers."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_harness import run_ranks

import distmon


def _job(rank: int, world: int) -> tuple[int, int, int, list[float], list[float]]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    model = DDP(net, bucket_cap_mb=0.002)  # several buckets, rebuilt after the first step
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = distmon.GradMonitor(model, opt, serve="none", export_every=1)
    ours, refs = [], []
    for step in range(5):
        torch.manual_seed(10 + step + 100 * rank)
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        refs.append(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]).item())
        opt.step()
        ours.append(mon.flush().grad_norm)
    gc.collect()
    cache = mon._tracker.stats._by_buffer
    alive = sum(1 for ref, _, _ in cache.values() if ref() is not None)
    layouts = len(mon._tracker.stats._layouts)
    mon.close()
    return len(cache), alive, layouts, ours, refs


def test_cache_holds_only_live_buffers_and_numbers_stay_right():
    for entries, alive, layouts, ours, refs in run_ranks(_job, 2):
        # DDP frees the first iteration's bucket buffers when it rebuilds its buckets; their
        # entries (and the views they held) must be gone, or old gradient memory stays pinned
        assert entries == alive and entries >= 2
        assert layouts >= entries
        for a, b in zip(ours, refs):
            assert abs(a - b) <= 1e-5 * b
