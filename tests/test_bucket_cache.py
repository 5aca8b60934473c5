"""DDP bucket layouts: cached per live bucket buffer, a layer's adjacent parameters read as one view.

The units are driven by real DDP buckets from a plain comm hook of the test's own (no
GradMonitor): ``BucketLayouts`` splits each bucket into runs and caches their views,
``LayerFold`` folds the run sums into layers. The per-layer sums are compared with float64
sums of squares of the reduced ``p.grad``, across DDP's bucket rebuild after the first step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from ddp_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow


def _job(rank: int, world: int, groups, slack: int) -> dict:  # noqa: ANN001
    from distmon.layout.grouping import build_grouping
    from distmon.sources import ddp as source
    from distmon.step.sums import LayerFold

    source.RUN_SLACK = slack  # this rank's process only
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    model = DDP(net, bucket_cap_mb=0.003)  # about two layers per bucket, rebuilt after the first step
    grouping = build_grouping(net, groups, 128)
    layouts = source.BucketLayouts(grouping, torch.device("cpu"))
    fold = LayerFold(len(grouping.layers), torch.device("cpu"))
    pending, seen, buffers = [], [], []

    def measuring_hook(group, bucket):  # noqa: ANN001
        layout, views, buffer = layouts.layout(bucket)
        seen.append(layout)
        buffers.append(weakref.ref(buffer))
        if bucket.is_last():
            layouts.end_backward()

        def reduced(fut):  # noqa: ANN001
            pending.append((layout, layout.measure(fut.value(), views)))
            return fut.value()

        return source.ddp_allreduce_hook(group, bucket).then(reduced)

    model.register_comm_hook(model.process_group, measuring_hook)
    layer_of = dict(zip(map(id, grouping.params), grouping.param_layer))
    out = {"ours": [], "refs": [], "views": [], "direct": [], "runs": []}
    for step in range(5):
        torch.manual_seed(10 + step + 100 * rank)
        pending.clear()
        seen.clear()
        model.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        layer_sq = torch.empty(len(grouping.layers))
        fold(pending, layer_sq)
        ref = [0.0] * len(grouping.layers)
        for p in net.parameters():
            ref[layer_of[id(p)]] += p.grad.double().pow(2).sum().item()
        out["ours"].append(layer_sq.tolist())
        out["refs"].append(ref)
        ids = [layer for layout in seen for layer in layout.layer_ids]
        out["views"].append(len(ids))
        out["direct"].append(sorted(ids) == list(range(len(grouping.layers))))  # the fold's one-stack case
        out["runs"] += [
            layout.split_sizes[i] for layout in seen for i in (layout.pick or range(len(layout.split_sizes)))
        ]
    gc.collect()
    out["cached"], out["live_buckets"] = layouts.cached_buffers, len(seen)
    out["alive_buffers"] = len({id(b()) for b in buffers if b() is not None})
    return out


def test_cache_holds_only_live_buffers_and_sums_stay_right():
    for out in run_ranks(_job, 2, None, 1 << 16):
        # DDP frees the first iteration's bucket buffers when it rebuilds its buckets; their
        # entries (and the views they held) must be gone, or old gradient memory stays pinned
        assert out["cached"] == out["live_buckets"] >= 2
        assert out["alive_buffers"] == out["live_buckets"]  # the first iteration's buffers were freed
        for ours, refs in zip(out["ours"], out["refs"]):
            assert ours == pytest.approx(refs, rel=1e-5)


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
def test_a_layers_adjacent_parameters_are_read_as_one_view_and_layers_stay_right(
    groups, slack, n_views, direct
):
    for out in run_ranks(_job, 2, groups, slack):
        for views, is_direct in zip(out["views"], out["direct"]):
            assert is_direct == direct and (views == n_views if n_views else 2 <= views < 8), (groups, out)
        assert max(out["runs"]) <= 256 + slack, out["runs"]
        for ours, refs in zip(out["ours"], out["refs"]):
            assert ours == pytest.approx(refs, rel=1e-5)
