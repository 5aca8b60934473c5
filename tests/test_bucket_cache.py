"""The per-bucket cache follows DDP's bucket rebuild and never pins freed bucket buffers."""

from __future__ import annotations

import gc

import pytest
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
    cache = mon._source.layouts._by_buffer
    alive = sum(1 for ref, _, _ in cache.values() if ref() is not None)
    layouts = len(mon._source.layouts._layouts)
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


def _runs_job(rank: int, world: int, groups, slack: int) -> tuple[list[dict], list[dict], int, list, list[int]]:  # noqa: ANN001
    from distmon.sources import ddp

    ddp.RUN_SLACK = slack  # this rank's process only
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    model = DDP(net, bucket_cap_mb=0.003)  # about two layers per bucket
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = distmon.GradMonitor(model, opt, serve="none", export_every=1, groups=groups)
    layer_of = dict(zip(mon._source.layouts.slot_of, mon._source.layouts.param_layer))
    ours, refs = [], []
    for step in range(4):
        torch.manual_seed(10 + step + 100 * rank)
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        # independent reference: float64 sums of the reduced p.grad, per layer
        sq = [0.0] * len(mon.layers)
        for p in net.parameters():
            sq[layer_of[id(p)]] += p.grad.double().pow(2).sum().item()
        refs.append({name: v ** 0.5 for name, v in zip(mon.layers, sq)})
        opt.step()
        ours.append(mon.flush().layer_grad_norms)
    stats = mon._source.layouts
    buckets = sum(1 for ref, _, _ in stats._by_buffer.values() if ref() is not None)
    # per set of buckets seen (before and after DDP's rebuild): views read per backward, and
    # whether each layer is one view (folded by the stack alone) or not (index_add)
    views = [(len(plan.layer_of), plan.order is not None) for plan in mon._tracker.fold._plans.values()]
    runs = [layout.split_sizes[i] for layout in stats._layouts.values()
            for i in (layout.pick or range(len(layout.split_sizes)))]
    mon.close()
    return ours, refs, buckets, views, runs


# (groups, RUN_SLACK, views per backward, each layer one view). Each Linear(16, 16) is a
# 256-element weight and a 16-element bias; 8 parameters in all.
RUN_CASES = [
    # default groups: each Linear's weight and bias lie end to end in a bucket: one view each
    (None, 1 << 16, 4, True),
    # weights vs biases: the two layers alternate through the buckets: one view per parameter
    ([(r"weight$", "weights"), (r"bias$", "biases")], 1 << 16, 8, False),
    # one layer, runs capped at 256 + 300 elements: a run takes two Linears (544), never three
    ([(r".", "all")], 300, None, False),
]


@pytest.mark.parametrize("groups,slack,n_views,direct", RUN_CASES)
def test_a_layers_adjacent_parameters_are_read_as_one_view_and_layers_stay_right(groups, slack, n_views, direct):
    for ours, refs, buckets, views, runs in run_ranks(_runs_job, 2, groups, slack):
        assert buckets >= 2
        for v, is_direct in views:
            assert is_direct == direct and (v == n_views if n_views else 2 <= v < 8), (groups, views)
        assert max(runs) <= 256 + slack, runs
        for got, want in zip(ours, refs):
            assert got.keys() == want.keys()
            for name in want:
                assert abs(got[name] - want[name]) <= 1e-5 * want[name], (groups, name)
