"""Each attention block's logit bound on sampled forwards: what the divergence precursor reads.

Without qk-layernorm, a transformer that will diverge at a high learning rate first grows its
attention logits ``q . k / sqrt(d_head)`` by orders of magnitude, hundreds of steps before its
loss moves (``benchmarks/early_warning.py``). The logits themselves are ``T x T`` per head; their
bound ``max_i |q_i| * max_j |k_j| / sqrt(d_head)`` (Cauchy-Schwarz, over the step's batch, heads
and positions) needs two vector norms and two maxima of what the query and key projections
output. Forward hooks on those modules take them on the forwards of every ``every``-th step
(a step's micro-batches included), in fp32, with device ops only; :meth:`AttentionWatch.bounds`
gives one bound per block when the step begins, and the hooks' maxima start afresh.

Which modules are the queries and keys (:func:`find_attention`): given as name patterns
(``PrecursorConfig(queries=..., keys=...)``), or found by the names the common models use, each
block the parent module of its pair: after a qk-norm (``q_norm``/``k_norm``, ``q_layernorm``/
``k_layernorm``: what the dot product sees), else separate projections (``q_proj``/``k_proj``,
``query``/``key``, ``wq``/``wk``, ``to_q``/``to_k``), else a fused projection: ``qkv``, ``c_attn``,
``Wqkv``, ``qkv_proj`` hold ``[all queries | all keys | all values]``; ``query_key_value``
(GPT-NeoX, BLOOM, Falcon, Megatron) holds, per key head, ``[its queries | key | value]``. The
head size comes from ``PrecursorConfig(head_dim=...)``, else the block's (or its ``config``'s)
``head_dim``/``head_size`` attribute, else its width over its heads. A fused projection's head
counts (queries ``n_heads``/``n_head``/``num_heads``/``num_attention_heads``; keys
``num_key_value_heads`` and the like, or ``num_key_value_groups`` queries per key: grouped-query
attention, where keys are fewer than queries) come from the block or its ``config``, and its
width must hold exactly that many head vectors: a projection that does not (a key-head count
distmon cannot find) is refused at construction, naming the fix, rather than read with the
wrong split. Heads must be contiguous ``head_dim``-wide slices of the last dimension (every
layout above).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from ..compat import graph_task_id
from ..errors import ErrorCounter
from ..layout.grouping import plain_name

__all__ = ["AttentionBlock", "AttentionWatch", "find_attention"]

# (query, key) leaf names of a block, most faithful first: after a qk-norm, then projections
PAIRS = (
    ("q_norm", "k_norm"),
    ("q_layernorm", "k_layernorm"),
    ("query_layernorm", "key_layernorm"),
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("wq", "wk"),
    ("to_q", "to_k"),
)
STACKED = ("qkv", "c_attn", "Wqkv", "qkv_proj")  # [all queries | all keys | all values]
GROUPED = ("query_key_value",)  # per key head [its queries | key | value]: GPT-NeoX, BLOOM, Falcon, Megatron
FUSED = STACKED + GROUPED  # one projection holds queries and keys
HEAD_SIZE = ("head_dim", "head_size", "d_head")
HEADS = ("n_heads", "n_head", "num_heads", "num_attention_heads")
KV_HEADS = (  # key (and value) heads, fewer than the query heads under grouped-query attention
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "kv_n_heads",
    "n_head_kv",
    "num_query_groups",
)
PER_KV = "num_key_value_groups"  # query heads per key head (Hugging Face's attention modules)


@dataclass(frozen=True)
class AttentionBlock:
    """One attention block: its name (the label its bound is served under), the module whose
    output holds its queries and the one holding its keys, and its head size. ``layout``:
    ``"pair"`` (two modules), ``"stacked"`` (one module: ``[all queries | all keys | all values]``)
    or ``"grouped"`` (one module: per key head ``[its queries | key | value]``); a stacked or
    grouped block's ``heads`` and ``kv_heads`` (query and key heads; None: not named, read from
    each output: the query heads are what the key and value heads leave, else a third each)."""

    name: str
    queries: torch.nn.Module
    keys: torch.nn.Module
    head_dim: int
    layout: str = "pair"
    heads: int | None = None
    kv_heads: int | None = None

    @property
    def fused(self) -> bool:
        """Queries and keys come out of one projection."""
        return self.layout != "pair"

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused projection's output as ``(queries, keys)`` head vectors (views, ``head_dim`` last);
        raises ``ValueError`` when its width is not this block's head vectors.

        Example:
            >>> m = torch.nn.Linear(4, 4)
            >>> b = AttentionBlock("b", m, m, head_dim=1, layout="grouped", heads=2, kv_heads=1)
            >>> [t.flatten().tolist() for t in b.split(torch.tensor([1.0, 2.0, 3.0, 4.0]))]  # [q q k v]
            [[1.0, 2.0], [3.0]]
        """
        v = x.unflatten(-1, (-1, self.head_dim))
        n = v.shape[-2]
        heads, kv = _counts(n, self.heads, self.kv_heads)
        if heads is None:
            raise ValueError(
                f"distmon: the precursor cannot split the output of attention block {self.name!r}: {n} "
                f"head vectors of {self.head_dim}, not {self.heads or '?'} query + 2 x "
                f"{self.kv_heads or '?'} key/value heads: set the block's head counts "
                "(num_attention_heads, num_key_value_heads) or pass "
                "PrecursorConfig(head_dim=...)"
            )
        if self.layout == "stacked":
            return v[..., :heads, :], v[..., heads : heads + kv, :]
        per = heads // kv
        g = v.unflatten(-2, (kv, per + 2))
        return g[..., :per, :], g[..., per, :]


def _counts(vectors: int, heads: int | None, kv: int | None) -> tuple[int | None, int | None]:
    """``(query heads, key heads)`` of a fused projection of ``vectors`` head vectors, given the
    counts its block names (None: not named): the query heads unnamed are what the key and value
    heads leave, else a third each; ``(None, None)`` when no such split exists (the key heads must
    divide the query heads).

    Example:
        >>> _counts(12, None, None), _counts(12, None, 2), _counts(12, 8, 2)
        ((4, 4), (8, 2), (8, 2))
        >>> _counts(8, None, None), _counts(12, 4, 2), _counts(11, None, 3)  # no thirds; 4 + 4; 5 + 6
        ((None, None), (None, None), (None, None))
    """
    if heads is None:
        if kv is None:
            if vectors % 3:
                return None, None
            kv = vectors // 3
        heads = vectors - 2 * kv
    kv = kv or heads
    if heads <= 0 or kv <= 0 or vectors != heads + 2 * kv or heads % kv:
        return None, None
    return heads, kv


def _width(m: torch.nn.Module) -> int | None:
    """The last-dimension width of ``m``'s output, where its kind says it (Linear, a norm, the
    transposed ``Conv1D`` of GPT-2 in transformers: ``nf``)."""
    if isinstance(m, torch.nn.Linear):
        return m.out_features
    if type(m).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int):
        return m.nf
    shape = getattr(m, "normalized_shape", None)
    return int(shape[-1]) if shape else None


def _attribute(parent: torch.nn.Module, names: Sequence[str]) -> int | None:
    """The first positive int among ``names`` on ``parent``, then on its ``config``."""
    for owner in (parent, getattr(parent, "config", None)):
        for attr in names:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _heads(parent: torch.nn.Module) -> tuple[int | None, int | None]:
    """The block's query and key head counts (None: not found; keys default to the queries)."""
    heads = _attribute(parent, HEADS)
    kv = _attribute(parent, KV_HEADS)
    per = _attribute(parent, (PER_KV,))
    if kv is None and heads is not None and per is not None and heads % per == 0:
        kv = heads // per
    return heads, kv if kv is not None else heads


def _split_head_dim(parent: torch.nn.Module, q: torch.nn.Module, heads: int, kv: int) -> int | None:
    """The head size of a block of two modules, from its head counts: its fused projection's width
    over the head vectors it holds (a qk-norm may see one head at a time, or be an ``Identity``),
    else its query projection's width, else the query module's own, over the query heads."""
    children = dict(parent.named_children())
    fused = next((children[f] for f in FUSED if f in children), None)
    if fused is not None and _width(fused):
        width, vectors = _width(fused), heads + 2 * kv
    else:
        proj = next((children[p[0]] for p in PAIRS[3:] if p[0] in children), None)
        width, vectors = (_width(proj) if proj is not None else None) or _width(q), heads
    return width // vectors if width and width % vectors == 0 else None


def _head_dim(parent: torch.nn.Module, given: int | None) -> int | None:
    return given if given is not None else _attribute(parent, HEAD_SIZE)


def find_attention(
    model: torch.nn.Module,
    *,
    queries: str | None = None,
    keys: str | None = None,
    head_dim: int | None = None,
) -> list[AttentionBlock]:
    """The attention blocks of ``model``, in model order (see the module docstring); raises
    ``ValueError`` naming the fix for what it cannot read.

    ``queries``/``keys``: regular expressions of the modules' qualified names (``keys`` None: the
    ``queries`` modules are fused projections, read by their names as in the module docstring);
    None: found by name.

    Example:
        >>> class Attention(torch.nn.Module):   # GPT-2's names: a fused c_attn, n_head heads
        ...     def __init__(self):
        ...         super().__init__(); self.c_attn = torch.nn.Linear(64, 192); self.n_head = 4
        >>> model = torch.nn.ModuleDict({"h0": Attention(), "h1": Attention()})
        >>> [(b.name, b.fused, b.head_dim) for b in find_attention(model)]
        [('h0', True, 16), ('h1', True, 16)]
    """
    named = [(plain_name(name), m) for name, m in model.named_modules()]
    by_name = dict(named)
    if queries is not None:
        qs = [(n, m) for n, m in named if n and re.search(queries, n)]
        ks = [(n, m) for n, m in named if n and re.search(keys, n)] if keys is not None else qs
        if not qs or len(qs) != len(ks):
            raise ValueError(
                f"distmon: precursor queries={queries!r} matches {len(qs)} modules and keys={keys!r} "
                f"{len(ks)}: give patterns that match one query and one key module per attention block"
            )
        found = [(q[0].rpartition(".")[0], q, k, keys is None) for q, k in zip(qs, ks)]
    else:
        found = []
        for name, parent in named:
            children = dict(parent.named_children())
            pair = next((p for p in PAIRS if p[0] in children and p[1] in children), None)
            fused = next((f for f in FUSED if f in children), None)
            prefix = f"{name}." if name else ""
            if pair is not None:
                found.append(
                    (
                        name,
                        (prefix + pair[0], children[pair[0]]),
                        (prefix + pair[1], children[pair[1]]),
                        False,
                    )
                )
            elif fused is not None:
                q = (prefix + fused, children[fused])
                found.append((name, q, q, True))
    return [
        _block(block, q, k, fused, parent=by_name.get(block, model), head_dim=head_dim)
        for block, q, k, fused in found
    ]


def _block(
    block: str,
    query: tuple[str, torch.nn.Module],
    key: tuple[str, torch.nn.Module],
    fused: bool,
    *,
    parent: torch.nn.Module,
    head_dim: int | None,
) -> AttentionBlock:
    """One block's :class:`AttentionBlock`, its head size and (one projection) its head counts
    checked against the projection's width; raises ``ValueError`` naming the fix."""
    (qname, q), (_, k) = query, key
    label = block or "<root>"
    heads, kv = _heads(parent)
    dh = _head_dim(parent, head_dim)
    if not fused:
        if dh is None and heads:
            dh = _split_head_dim(parent, q, heads, kv)
        if dh is None:
            raise ValueError(
                f"distmon: the precursor cannot tell the head size of attention block {label!r} "
                f"(queries from {qname!r}; no {'/'.join(HEAD_SIZE)} or {'/'.join(HEADS)} attribute): "
                "pass GradMonitor(..., precursor=PrecursorConfig(head_dim=...))"
            )
        return AttentionBlock(label, q, k, dh)
    layout = "grouped" if qname.rpartition(".")[2] in GROUPED else "stacked"
    width = _width(q)
    if dh is None and heads and width and width % (heads + 2 * kv) == 0:
        dh = width // (heads + 2 * kv)
    if dh is None:
        raise ValueError(
            f"distmon: the precursor cannot tell the head size of attention block {label!r} (queries "
            f"and keys from {qname!r}; no {'/'.join(HEAD_SIZE)} attribute, and no head count that "
            "divides its width): pass GradMonitor(..., precursor=PrecursorConfig(head_dim=...))"
        )
    if width is not None:  # else the hook checks each output's width
        n, rest = divmod(width, dh)
        split = _counts(n, heads, kv) if not rest else (None, None)
        if split[0] is None:
            raise ValueError(
                f"distmon: the precursor cannot split attention block {label!r}: {qname!r} outputs "
                f"{width} features, {n if not rest else width / dh:g} head vectors of {dh}, which is not "
                f"{heads or '?'} query heads + 2 x {kv or '?'} key/value heads (key heads dividing the "
                f"query heads). Set the block's head counts (its num_attention_heads and, with "
                f"grouped-query attention, num_key_value_heads), pass PrecursorConfig(head_dim=...) "
                f"if the head size is wrong, or name separate query and key modules "
                f"(PrecursorConfig(queries=..., keys=...))"
            )
        heads, kv = split
    return AttentionBlock(label, q, k, dh, layout=layout, heads=heads, kv_heads=kv)


class AttentionWatch:
    """The hooks and device buffers of the attention blocks' query and key norms.

    ``active`` is set by the step schedule for the forwards of sampled steps. Each hooked output
    is viewed as ``(..., heads, head_dim)`` and its largest head vector norm kept (fp32, device
    ops); :meth:`bounds` writes each block's ``max|q| * max|k| / sqrt(head_dim)`` (NaN/Inf when
    a forward overflowed) and starts the maxima afresh.

    Example:
        >>> net = torch.nn.Module(); net.qkv = torch.nn.Linear(4, 12); net.head_dim = 2
        >>> watch = AttentionWatch(find_attention(net), device=torch.device("cpu"), errors=ErrorCounter())
        >>> with torch.no_grad():
        ...     _ = net.qkv.weight.zero_(); _ = net.qkv.bias.copy_(torch.arange(12.0))
        >>> watch.install(); watch.active = True; _ = net.qkv(torch.ones(1, 4))
        >>> out = torch.empty(1); watch.bounds(out); watch.remove()
        >>> round(out.item(), 3) == round(math.hypot(2, 3) * math.hypot(6, 7) / math.sqrt(2), 3)
        True
    """

    def __init__(self, blocks: Sequence[AttentionBlock], *, device: torch.device, errors: ErrorCounter):
        self.blocks = list(blocks)
        self.names = [b.name for b in blocks]
        self.n = len(blocks)
        self.active = False
        self._errors = errors
        f32 = dict(dtype=torch.float32, device=device)
        self._q = torch.zeros(self.n, **f32)  # the largest query head norm this step, per block
        self._k = torch.zeros(self.n, **f32)
        self._scale = torch.tensor([1.0 / math.sqrt(b.head_dim) for b in blocks], **f32)
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        try:
            for i, b in enumerate(self.blocks):
                if b.fused:
                    self._handles.append(b.queries.register_forward_hook(self._hook(i, b)))
                else:
                    self._handles.append(b.queries.register_forward_hook(self._hook(i, b, into=self._q)))
                    self._handles.append(b.keys.register_forward_hook(self._hook(i, b, into=self._k)))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(
        self, index: int, block: AttentionBlock, *, into: torch.Tensor | None = None
    ) -> Callable[[torch.nn.Module, object, object], None]:
        """The forward hook of ``block``'s query module (``into``: ``_q``), key module (``_k``), or
        with ``into`` None its one projection (both)."""

        @torch.compiler.disable
        def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
            if not self.active or graph_task_id() != -1:
                return  # not a sampled step, or a checkpoint's recomputation inside backward
            try:
                x = output.detach() if isinstance(output, torch.Tensor) else None
                if x is None or not x.is_floating_point() or not x.numel():
                    return
                if into is None:
                    q, k = block.split(x)
                    self._keep(self._q, index, q)
                    self._keep(self._k, index, k)
                else:
                    self._keep(into, index, x.unflatten(-1, (-1, block.head_dim)))
            except Exception:
                self._errors.record("attention hook")

        return hook

    @staticmethod
    def _keep(into: torch.Tensor, index: int, heads: torch.Tensor) -> None:
        """``into[index]`` <- the larger of it and the largest norm of the head vectors ``heads``
        (``head_dim`` last; NaN wins)."""
        norm = torch.linalg.vector_norm(heads, dim=-1, dtype=torch.float32).amax()
        into[index] = torch.maximum(into[index], norm)

    def bounds(self, out: torch.Tensor) -> None:
        """Write each block's logit bound of the sampled step into ``out`` and start afresh."""
        torch.mul(self._q * self._k, self._scale, out=out)
        self.reset()

    def reset(self) -> None:
        """Forget this step's maxima (written, or dropped with a step that failed)."""
        self._q.zero_()
        self._k.zero_()
