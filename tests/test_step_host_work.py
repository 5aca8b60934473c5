"""Where distmon's work runs in a DDP step (issue #35): nothing per bucket, per layer or per parameter.

On a GPU the host must stay ahead of the device queue: work inside the backward's kernel
launches (a comm hook runs between them, on every bucket) or chained on a bucket's future
(DDP's finalize waits for it) costs the step its full host time, while the same work done once
where the backward ends is hidden behind the kernels still queued. distmon's DDP path cost
7-24% of a step on an H200 when it read each bucket twice in the comm hook (the local
gradients, then the reduced ones in a continuation on the bucket's future): ~26 fused reads and
13 Python callbacks per step on GPT-124M, against ~1% for the one-process path's single read
where backward ends (and ~1% for a Python comm hook alone, torch's ``allreduce_hook``). CPU time
cannot show this (every op runs synchronously there), so these tests pin the mechanism
instead, on one in-process gloo rank:

* distmon chains no continuation on any bucket's future (``Future.then`` from distmon code);
* with its comm hook and DDP's default ``gradient_as_bucket_view=False``, no tensor op of
  distmon's runs in the hook of any bucket but the last, and what runs there and after it does
  not grow with the buckets; with bucket views (``p.grad`` is the bucket) exactly one per bucket;
* with DDP's own reduction (no comm hook: distmon's path on NCCL, forced here on gloo), no op of
  distmon's runs between two gradient accumulations: two fused reads among the final callbacks;
* an ordinary step dispatches the same ops, in number and kind, for 4 and 16 layers (buckets,
  parameters): nothing per layer, per parameter or per bucket anywhere in the step;
* a second backward through the same forward (``retain_graph``), which DDP does not reduce, is
  not read.

The first four fail on the code before this design (a fused read per bucket in the hook and a
``then`` continuation per bucket: 19 ops a step with 4 buckets, 43 with 16).
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from ddp_harness import distmon_dir, in_distmon_code
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import distmon
from distmon.sources import ddp as ddp_source

# no export on the measured steps (an export step reads rows to the host by design), the time
# rule's vote kept (its all-reduce is in every ordinary step) but never due
OPTIONS = {"serve": "none", "export_every": 1000, "export_interval_s": 3600.0}
WARMUP = 3  # DDP rebuilds its buckets after the first step; distmon plans its reads once
# one fused read's ops: torch._foreach_powsum, or before torch 2.11 its fallback (distmon.compat)
FUSED_READ = (
    ["aten._foreach_powsum.Scalar"]
    if hasattr(torch, "_foreach_powsum")
    else ["aten._foreach_norm.Scalar", "aten._foreach_mul_.List"]
)


class Events(TorchDispatchMode):
    """The tensor ops distmon's code dispatches, in order, with markers the test adds between them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._dm = distmon_dir()

    def mark(self, what: str) -> None:
        self.events.append(("mark", what))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if in_distmon_code(sys._getframe(1), self._dm):
            self.events.append(("op", str(func)))
        return func(*args, **(kwargs or {}))


def _model(layers: int, bucket_view: bool = False) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    # ~4 KB per layer and ~4 KB buckets: one bucket per layer once DDP has rebuilt them
    ddp = DDP(net, bucket_cap_mb=0.004, gradient_as_bucket_view=bucket_view)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def _steps(ddp: DDP, opt: torch.optim.Optimizer, n: int, events: Events | None = None) -> None:
    for _ in range(n):
        loss = ddp(torch.randn(8, 32)).pow(2).mean()
        if events is not None:
            events.mark("backward")
        loss.backward()
        if events is not None:
            events.mark("step")
        opt.step()
        opt.zero_grad()


def _marking_hook(events: list[Events]):  # noqa: ANN202
    """The user's comm hook (torch's own): marks each bucket it is called for, then reduces it."""

    def hook(state, bucket):  # noqa: ANN001, ANN202  (no annotations: DDP checks them)
        if events:
            events[0].mark("last bucket" if bucket.is_last() else "bucket")
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def test_no_continuation_is_chained_on_a_buckets_future(one_rank: None) -> None:
    """DDP's finalize waits for every bucket's future: a Python callback on it is on that path."""
    ddp, opt = _model(8)
    chained = []
    then = torch._C.Future.then
    dm = distmon_dir()

    def recording_then(self, callback):  # noqa: ANN001, ANN202
        if in_distmon_code(sys._getframe(1), dm):
            chained.append(getattr(callback, "__qualname__", repr(callback)))
        return then(self, callback)

    with distmon.GradMonitor(ddp, opt, **OPTIONS) as mon:
        torch._C.Future.then = recording_then
        try:
            _steps(ddp, opt, WARMUP + 2)
        finally:
            torch._C.Future.then = then
        snap = mon.flush()
    assert snap.valid and snap.monitor_errors == 0
    assert chained == [], f"distmon chained {len(chained)} callbacks on bucket futures: {chained[:4]}"


def _backward_segments(events: Events) -> list[list[str]]:
    """The ops of the last step's backward, split at each bucket's hook: segment i ran before bucket
    i's user hook (distmon's work on that bucket), the last one after the last bucket's hook."""
    start = max(i for i, e in enumerate(events.events) if e == ("mark", "backward"))
    end = max(i for i, e in enumerate(events.events) if e == ("mark", "step"))
    segments: list[list[str]] = [[]]
    for kind, what in events.events[start + 1 : end]:
        if kind == "mark":
            segments.append([])
        else:
            segments[-1].append(what)
    return segments


@pytest.mark.parametrize("bucket_view", [False, True], ids=["p.grad apart", "p.grad the bucket"])
def test_the_backward_runs_distmons_ops_only_where_it_ends(one_rank: None, bucket_view: bool) -> None:
    per_size = {}
    for layers in (4, 16):
        ddp, opt = _model(layers, bucket_view)
        holder: list[Events] = []
        with distmon.GradMonitor(ddp, opt, comm_hook=_marking_hook(holder), **OPTIONS) as mon:
            _steps(ddp, opt, WARMUP)
            holder.append(Events())
            with holder[0]:
                _steps(ddp, opt, 1, holder[0])
            snap = mon.flush()
        assert snap.valid and all(snap.rank_valid) and snap.monitor_errors == 0
        segments = _backward_segments(holder[0])
        assert len(segments) == layers + 1, (layers, segments)  # one bucket per layer
        per_size[layers] = segments
        buckets, after = segments[:-1], segments[-1]
        if bucket_view:  # each bucket read in its hook: one fused read, the same on every bucket
            assert all(ops == FUSED_READ for ops in buckets), buckets
        else:  # nothing in the hooks of the buckets before the last
            assert all(ops == [] for ops in buckets[:-1]), buckets
        assert len(after) <= 2, after  # the reduced read (and nothing per bucket)
    # what the last bucket's hook and the end of backward run does not grow with the buckets
    assert per_size[4][-2:] == per_size[16][-2:], per_size


@pytest.fixture
def hookless(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP keeps its own reduction under distmon, no comm hook registered (NCCL's path), on gloo."""
    monkeypatch.setattr(ddp_source, "HOOKLESS_BACKENDS", {"gloo", "nccl"})


def test_without_a_comm_hook_nothing_of_distmons_runs_inside_the_backward(one_rank: None, hookless: None):
    """DDP's own reduction (NCCL): no comm hook, and every op of distmon's in a backward runs after
    the last gradient was accumulated (among the backward's final callbacks): two fused reads."""
    for layers in (4, 16):
        ddp, opt = _model(layers)
        events = Events()
        for p in ddp.parameters():
            p.register_post_accumulate_grad_hook(lambda _, events=events: events.mark("accumulated"))
        with distmon.GradMonitor(ddp, opt, **OPTIONS) as mon:
            assert mon._schedule.source.hookless and not ddp._comm_hooks
            _steps(ddp, opt, WARMUP)
            events.events.clear()
            with events:
                _steps(ddp, opt, 1, events)
            snap = mon.flush()
        assert snap.valid and all(snap.rank_valid) and snap.monitor_errors == 0
        segments = _backward_segments(events)
        assert len(segments) == 2 * layers + 1  # a weight and a bias per layer
        assert all(ops == [] for ops in segments[:-1]), segments
        assert segments[-1] == FUSED_READ * 2, segments[-1]


@pytest.mark.parametrize("own_reduction", [False, True], ids=["comm hook", "DDP's own reduction"])
def test_an_ordinary_step_runs_the_same_ops_whatever_the_model(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, own_reduction: bool
) -> None:
    if own_reduction:
        monkeypatch.setattr(ddp_source, "HOOKLESS_BACKENDS", {"gloo", "nccl"})
    counts = {}
    for layers in (4, 16):
        ddp, opt = _model(layers)
        with distmon.GradMonitor(ddp, opt, **OPTIONS) as mon:
            assert mon._schedule.source.hookless == own_reduction
            _steps(ddp, opt, WARMUP)
            events = Events()
            with events:
                _steps(ddp, opt, 1, events)
            snap = mon.flush()
        assert snap.valid and snap.monitor_errors == 0
        counts[layers] = collections.Counter(what for kind, what in events.events if kind == "op")
    assert counts[4] == counts[16], counts
    # two fused reads a step: the local gradients and the reduced ones
    assert counts[4][FUSED_READ[0]] == 2, counts[4]


@pytest.mark.parametrize("own_reduction", [False, True], ids=["comm hook", "DDP's own reduction"])
def test_a_second_backward_through_the_same_forward_is_not_read(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, own_reduction: bool
) -> None:
    """DDP reduces the first backward after a forward only; a second one through the same graph
    (``retain_graph``) adds local gradients to the reduced ones, which no figure may report."""
    if own_reduction:
        monkeypatch.setattr(ddp_source, "HOOKLESS_BACKENDS", {"gloo", "nccl"})
    ddp, opt = _model(4)
    with distmon.GradMonitor(ddp, opt, **OPTIONS) as mon:
        _steps(ddp, opt, WARMUP)
        loss = ddp(torch.randn(8, 32)).pow(2).mean()
        loss.backward(retain_graph=True)
        first = sum(float(p.grad.double().pow(2).sum()) for p in ddp.parameters()) ** 0.5
        loss.backward()
        opt.step()
        snap = mon.flush()
    assert snap.valid and snap.monitor_errors == 0
    assert snap.grad_norm == pytest.approx(first, rel=1e-5)
    assert snap.rank_grad_norms[0] == pytest.approx(first, rel=1e-5)
