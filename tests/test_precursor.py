"""The divergence precursor in a monitor (#42): ``GradMonitor(..., precursor=...)``.

In one process (fast): each attention block's logit bound on the sampled steps equals a float64
reference from the queries and keys the model computed (and bounds the true largest logit,
from explicit scores); a block whose queries grow warns once (``divergence_warning`` event,
counted, at the sample the rule says), none on a calm run; no host sync on ordinary steps;
training bit-identical to an unmonitored run; the blocks found by name in the common layouts,
and refusals naming the fix. On 2 gloo ranks (slow), DDP and FSDP2: every rank's snapshot holds
the largest bound over the ranks (each rank's own reference), and every rank warns at the
same step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from ddp_harness import SyncRecorder, run_ranks

import distmon
from distmon import PrecursorConfig
from distmon.step.attention_watch import find_attention

EVERY = 5


class Attention(torch.nn.Module):
    """Causal self-attention with a fused ``[q | k | v]`` projection (nanoGPT's ``c_attn``)."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.n_head = heads
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (q, k) per forward, for the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        self.seen.append((q.detach().double(), k.detach().double()))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.h = torch.nn.ModuleList(Attention() for _ in range(2))
        self.head = torch.nn.Linear(16, 32)
        self.scale = 1.0  # the inputs' scale (a test's rank-dependent twist)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * self.scale
        for block in self.h:
            x = x + block(x)
        return self.head(x)


def _reference(block: Attention) -> tuple[float, float]:
    """(the bound from the forwards' queries and keys, the largest logit of explicit scores), float64."""
    q = torch.cat([q.reshape(-1, q.shape[-1]) for q, _ in block.seen])
    k = torch.cat([k.reshape(-1, k.shape[-1]) for _, k in block.seen])
    d = q.shape[-1]
    bound = float(torch.einsum("nd,nd->n", q, q).sqrt().max() * torch.einsum("nd,nd->n", k, k).sqrt().max())
    logits = max(float((qq @ kk.transpose(-1, -2)).max()) for qq, kk in block.seen)
    return bound / math.sqrt(d), logits / math.sqrt(d)


def _train(net: Net, steps: int, grow_at: int | None = None, monitored: bool = True, **options) -> dict:
    """Train; from ``grow_at`` on, block h.0's query weights grow 3x a step (its logits blow up)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    mon = None
    if monitored:
        mon = distmon.GradMonitor(
            net, opt, serve="none", export_every=EVERY, precursor=PrecursorConfig(every=EVERY), **options
        )
    events, refs, snaps = [], {}, {}
    if mon is not None:
        mon.on_anomaly(lambda e, s: events.append(e))
    for step in range(1, steps + 1):
        for block in net.h:
            block.seen.clear()
        if grow_at is not None and step >= grow_at:
            with torch.no_grad():
                net.h[0].c_attn.weight[:16].mul_(3.0)
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 32, (4, 12), generator=g)
        F.cross_entropy(net(idx).reshape(-1, 32), idx.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            refs[step] = {f"h.{i}": _reference(b) for i, b in enumerate(net.h)}
        if mon is not None and step % EVERY == 0:
            snaps[step] = mon.flush()
    if mon is not None:
        mon.close()
    return {
        "events": events,
        "refs": refs,
        "snaps": snaps,
        "params": [p.detach().clone() for p in net.parameters()],
    }


def test_the_bounds_equal_float64_references_on_sampled_steps_and_bound_the_logits():
    run = _train(Net(), steps=20)
    for step, snap in run["snaps"].items():
        assert set(snap.attention_logit_bound) == {"h.0", "h.1"}, step
        for block, (bound, largest) in run["refs"][step].items():
            got = snap.attention_logit_bound[block]
            assert abs(got - bound) <= 1e-5 * bound, (step, block, got, bound)
            assert got >= largest - 1e-6, (step, block, got, largest)  # an upper bound of every logit
    assert [e for e in run["events"] if e.kind == "divergence_warning"] == []  # a calm run


def test_a_block_whose_logits_grow_warns_once_at_the_sample_the_rule_names():
    run = _train(Net(), steps=40, grow_at=6)
    warnings = [e for e in run["events"] if e.kind == "divergence_warning"]
    over = [s for s, refs in sorted(run["refs"].items()) if refs["h.0"][0] > 1000.0]
    # hold=2: the second sample in a row above 1000 warns; one event per episode
    assert len(warnings) == 1 and warnings[0].step == over[1], (warnings, over)
    assert warnings[0].layer == "h.0" and warnings[0].value > 1000.0 and warnings[0].threshold == 1000.0
    assert not run["snaps"][40].attention_logit_bound["h.0"] <= 1000.0  # above, or overflowed (NaN)


def test_no_host_sync_on_ordinary_steps_and_training_bit_identical():
    net, bare = Net(), Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with distmon.GradMonitor(
        net, opt, serve="none", export_every=50, export_interval_s=0, precursor=True
    ) as mon:
        for step in range(1, 31):
            idx = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(step))
            with SyncRecorder() as rec:
                F.cross_entropy(net(idx).reshape(-1, 32), idx.reshape(-1)).backward()
                opt.step()
            trained = [s for s in rec.syncs if s[1] == "MainThread"]  # the export thread reads host copies
            assert not trained, (step, rec.describe(trained))  # sampled steps (10, 20, 30) too
            opt.zero_grad()
        assert mon.step == 30
    assert all(
        torch.equal(a, b) for a, b in zip(net.parameters(), _train(bare, 30, monitored=False)["params"])
    )


def test_the_blocks_are_found_by_the_names_common_models_use():
    class HF(torch.nn.Module):  # Llama's names: q_proj/k_proj, head_dim
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.head_dim = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), 2

    class QKNorm(torch.nn.Module):  # a qk-norm per head after a fused projection: the norms count
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.q_norm, self.k_norm, self.n_heads = (
                torch.nn.Linear(8, 24),
                torch.nn.LayerNorm(2),
                torch.nn.LayerNorm(2),
                4,
            )

    model = torch.nn.ModuleDict({"a": HF(), "b": QKNorm(), "c": Attention()})
    found = [(b.name, type(b.queries).__name__, b.fused, b.head_dim) for b in find_attention(model)]
    assert found == [("a", "Linear", False, 2), ("b", "LayerNorm", False, 2), ("c", "Linear", True, 4)]
    assert [b.name for b in find_attention(model, queries=r"^c\.c_attn$")] == ["c"]


def test_blocks_named_in_the_config_are_read():
    """docs/detection.md's configuration: projections named ``attn.wq``/``attn.wk`` (no name the
    search knows, no head count), the head size given; the bound is the float64 one of their outputs."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wq(x) * self.wk(x)

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": Block()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = PrecursorConfig(queries=r"attn\.wq$", keys=r"attn\.wk$", head_dim=128, every=1)
    mon = distmon.GradMonitor(model, opt, serve="none", export_every=1, precursor=config)
    x = torch.randn(4, 256)
    with torch.no_grad():
        q, k = (m(x).double().reshape(-1, 128) for m in (model.attn.wq, model.attn.wk))
    model.attn(x).sum().backward()
    opt.step()
    snap = mon.flush()
    mon.close()
    expected = float(q.norm(dim=1).max() * k.norm(dim=1).max()) / math.sqrt(128)
    assert list(snap.attention_logit_bound) == ["attn"]
    assert abs(snap.attention_logit_bound["attn"] - expected) <= 1e-5 * expected


def test_what_the_precursor_cannot_read_is_refused_at_construction():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"found no attention block.*PrecursorConfig\(queries="):
        distmon.GradMonitor(mlp, opt, serve="none", precursor=True)

    class NoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(4, 12)

    net = NoHeads()
    with pytest.raises(ValueError, match=r"head size.*PrecursorConfig\(head_dim="):
        distmon.GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none", precursor=True)
    with pytest.raises(TypeError, match="precursor must be a bool or a distmon.PrecursorConfig"):
        distmon.GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none", precursor="on")


def _ranks_job(rank: int, world_size: int, kind: str) -> dict:
    net = Net()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in net.h:
            fully_shard(block)
        model = fully_shard(net)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = distmon.GradMonitor(
        model, opt, serve="none", export_every=EVERY, precursor=PrecursorConfig(every=EVERY)
    )
    events, own, snaps = [], {}, {}
    mon.on_anomaly(lambda e, s: events.append((e.kind, e.step, e.layer)))
    for step in range(1, 31):
        for block in net.h:
            block.seen.clear()
        net.scale = 40.0 if rank == 1 and step >= 6 else 1.0  # rank 1's inputs: its logits grow
        g = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, 32, (4, 12), generator=g)
        F.cross_entropy(model(idx).reshape(-1, 32), idx.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            own[step] = {f"h.{i}": _reference(b)[0] for i, b in enumerate(net.h)}
            snaps[step] = dict(mon.flush().attention_logit_bound)
    mon.close()
    return {"events": events, "own": own, "snaps": snaps}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_holds_the_largest_bound_over_the_ranks(kind):
    ranks = run_ranks(_ranks_job, 2, kind, timeout=180)
    for step in ranks[0]["snaps"]:
        for block in ("h.0", "h.1"):
            own = [r["own"][step][block] for r in ranks]
            largest = math.nan if any(map(math.isnan, own)) else max(own)  # NaN: an overflow, wins
            for r in ranks:
                got = r["snaps"][step][block]
                same = math.isnan(got) if math.isnan(largest) else abs(got - largest) <= 1e-5 * largest
                assert same, (kind, step, block, got, largest)
    assert ranks[0]["events"] == ranks[1]["events"]  # every rank judges the same samples alike
    # rank 1's logits, over the bound from the sample of step 10: the second sample (15) warns, on both
    assert [e[1] for e in ranks[0]["events"] if e[0] == "divergence_warning"] == [15]
