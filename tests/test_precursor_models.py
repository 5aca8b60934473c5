"""The precursor's attention-logit bound on real Hugging Face models, against the queries and keys
their attention actually multiplies.

Each model (tiny configs, one process, ``sdpa`` attention where it has one) trains 3 steps under
``GradMonitor(precursor=PrecursorConfig(every=1))``; the reference is taken where the logits are
formed, not from distmon's hooks: a ``TorchFunctionMode`` sees every
``F.scaled_dot_product_attention`` call (BLOOM's ``baddbmm`` with ALiBi), and per layer
``max|q| * max|k| / sqrt(d_head)`` of those tensors (after rotary embeddings, which keep each
head vector's norm) is the bound distmon must serve for that step. The layouts covered: two
projections (Llama, grouped-query), a per-head qk-norm (Qwen3), a fused ``[Q | K | V]`` projection
(GPT-2's ``Conv1D``; Phi-3 with as many and with fewer key heads than query heads) and fused
projections that hold ``[queries | key | value]`` per key head (GPT-NeoX, BLOOM, Falcon classic,
multi-query and grouped). Before the fused split read head counts, Phi-3 with grouped-query
attention was served a wrong bound (its projection read in thirds: phi3-gqa fails here with that
split); a projection whose width the found head counts do not explain is refused at construction.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from framework_jobs import needs
from torch.overrides import TorchFunctionMode

import distmon
from distmon.step.attention_watch import find_attention

pytestmark = pytest.mark.slow  # imports transformers (~7 s of CPU): the pinned suite's

TINY = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    "gpt2": ("gpt2", dict(n_embd=32, n_head=4, n_layer=2)),
    "llama-gqa": ("llama", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-qk-norm": (
        "qwen3",
        dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    ),
    "phi3": ("phi3", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4)),
    "phi3-gqa": ("phi3", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1)),
    "gpt-neox": ("gpt_neox", dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)),
    "bloom": ("bloom", dict(hidden_size=32, n_head=4, n_layer=2)),
    "falcon-mha": ("falcon", dict(hidden_size=32, num_attention_heads=4, multi_query=False)),
    "falcon-mqa": ("falcon", dict(hidden_size=32, num_attention_heads=4, multi_query=True)),
    "falcon-gqa": (
        "falcon",
        dict(hidden_size=32, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True),
    ),
}
LAYERS = dict(num_hidden_layers=2, intermediate_size=64)


class Logits(TorchFunctionMode):
    """Every attention's queries and keys as the logits see them: per call, max|q| * max|k| /
    sqrt(d_head) in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.bounds: list[float] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._note(args[0], args[1])
        elif func is torch.Tensor.baddbmm:  # BLOOM: alibi.baddbmm(batch1=q, batch2=k^T)
            self._note(kwargs["batch1"], kwargs["batch2"].transpose(-1, -2))
        return func(*args, **kwargs)

    def _note(self, q: torch.Tensor, k: torch.Tensor) -> None:
        qn = q.detach().double().norm(dim=-1).max().item()
        kn = k.detach().double().norm(dim=-1).max().item()
        self.bounds.append(qn * kn / math.sqrt(q.shape[-1]))


def _model(kind: str, extra: dict) -> torch.nn.Module:
    needs("transformers")  # fails under CI=true, skips elsewhere
    import transformers

    cfg = transformers.AutoConfig.for_model(kind, **TINY, **{**LAYERS, **extra})
    torch.manual_seed(0)
    # BLOOM has no sdpa path: its eager one forms the logits with baddbmm (ALiBi)
    impl = "eager" if kind == "bloom" else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_served_bound_is_the_logits_own_on_real_models(name):
    kind, extra = MODELS[name]
    model = _model(kind, extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = distmon.GradMonitor(
        model, opt, serve="none", export_every=1, precursor=distmon.PrecursorConfig(every=1)
    )
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(3):
            x = torch.randint(3, 64, (2, 12), generator=g)
            seen = Logits()
            with seen:
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            served = list(mon.flush().attention_logit_bound.values())
            assert len(seen.bounds) == len(served) == 2, (step, seen.bounds, served)
            for got, want in zip(served, seen.bounds):
                assert abs(got - want) <= 2e-6 * want, (name, step, served, seen.bounds)
    finally:
        mon.close()


class _Fused(torch.nn.Module):
    """A fused projection 16 wide (8 head vectors of 2): 4 query heads + 2 x 2 key heads."""

    def __init__(self, **heads: int) -> None:
        super().__init__()
        self.qkv, self.head_dim = torch.nn.Linear(8, 16), 2
        for attr, value in heads.items():
            setattr(self, attr, value)


def test_a_fused_projection_the_head_counts_do_not_explain_is_refused_naming_the_fix():
    """Grouped-query heads distmon can find are read (4 + 2 x 2 = 8 vectors); without the key-head
    count the same projection is not three equal parts, and reading it as thirds would serve a
    wrong bound: refused, naming the counts it found and what to set."""
    found = find_attention(torch.nn.ModuleDict({"a": _Fused(n_heads=4, num_key_value_heads=2)}))
    assert [(b.layout, b.heads, b.kv_heads, b.head_dim) for b in found] == [("stacked", 4, 2, 2)]
    found = find_attention(torch.nn.ModuleDict({"a": _Fused(num_attention_heads=4, num_key_value_groups=2)}))
    assert [(b.heads, b.kv_heads) for b in found] == [(4, 2)]
    found = find_attention(torch.nn.ModuleDict({"a": _Fused(num_key_value_heads=2)}))  # 8 - 2 x 2 queries
    assert [(b.heads, b.kv_heads) for b in found] == [(4, 2)]
    for heads in ({"n_heads": 4}, {}, {"n_heads": 4, "num_key_value_heads": 3}):
        with pytest.raises(ValueError, match=r"'a\.qkv' outputs 16 features, 8 head vectors of 2") as e:
            find_attention(torch.nn.ModuleDict({"a": _Fused(**heads)}))
        assert "num_key_value_heads" in str(e.value) and "PrecursorConfig(queries=..., keys=...)" in str(
            e.value
        )
    model = torch.nn.ModuleDict({"a": _Fused(n_heads=4)})
    with pytest.raises(ValueError, match="8 head vectors of 2, which is not 4 query heads"):
        distmon.GradMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1), serve="none", precursor=True)


def test_a_projection_read_at_run_time_is_split_by_its_key_heads_or_not_at_all():
    """A fused module whose width is unknown at construction is split when its output comes: the
    queries are what the key and value heads leave; with no head count and no three equal parts,
    nothing is read (the hook counts the error)."""
    from distmon.step.attention_watch import AttentionBlock

    m = torch.nn.Identity()
    x = torch.arange(16.0)  # 8 head vectors of 2
    q, k = AttentionBlock("a", m, m, head_dim=2, layout="stacked", kv_heads=2).split(x)
    assert q.flatten().tolist() == list(range(8)) and k.flatten().tolist() == [8.0, 9.0, 10.0, 11.0]
    q, k = AttentionBlock("a", m, m, head_dim=2, layout="grouped", kv_heads=2).split(x)  # [q q k v] x 2
    assert q.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0]
    assert k.flatten().tolist() == [4.0, 5.0, 12.0, 13.0]
    with pytest.raises(ValueError, match=r"8 head vectors of 2, not \? query \+ 2 x \? key/value heads"):
        AttentionBlock("a", m, m, head_dim=2, layout="stacked").split(x)
