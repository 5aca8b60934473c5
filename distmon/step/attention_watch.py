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
``query``/``key``, ``wq``/``wk``, ``to_q``/``to_k``), else a fused projection whose output is
``[queries | keys | values]`` in equal thirds (``qkv``, ``c_attn``, ``Wqkv``, ``qkv_proj``). The
head size comes from ``PrecursorConfig(head_dim=...)``, else the block's ``head_dim``/
``head_size`` attribute, else its width over its ``n_heads``/``n_head``/``num_heads``/
``num_attention_heads``. Heads must be contiguous ``head_dim``-wide slices of the last
dimension (every layout above); anything else is refused at construction, naming the fix.
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
FUSED = ("qkv", "c_attn", "Wqkv", "qkv_proj")  # [queries | keys | values], equal thirds
HEAD_SIZE = ("head_dim", "head_size", "d_head")
HEADS = ("n_heads", "n_head", "num_heads", "num_attention_heads")


@dataclass(frozen=True)
class AttentionBlock:
    """One attention block: its name (the label its bound is served under), the module whose
    output holds its queries and the one holding its keys (the same one when ``fused``:
    ``[queries | keys | values]``), and its head size."""

    name: str
    queries: torch.nn.Module
    keys: torch.nn.Module
    head_dim: int
    fused: bool = False


def _width(m: torch.nn.Module) -> int | None:
    """The last-dimension width of ``m``'s output, where its kind says it (Linear, a norm)."""
    if isinstance(m, torch.nn.Linear):
        return m.out_features
    shape = getattr(m, "normalized_shape", None)
    return int(shape[-1]) if shape else None


def _queries_width(parent: torch.nn.Module, q: torch.nn.Module, fused: bool) -> int | None:
    """The width of all heads' queries: the block's projection's (a qk-norm may see one head at a
    time, or be an ``Identity``), else the query module's own."""
    children = dict(parent.named_children())
    fused_proj = next((children[f] for f in FUSED if f in children), None)
    if fused_proj is not None and _width(fused_proj):
        return _width(fused_proj) // 3
    proj = next((children[p[0]] for p in PAIRS[3:] if p[0] in children), None)
    if proj is not None and _width(proj):
        return _width(proj)
    width = _width(q)
    return width // 3 if fused and width else width


def _head_dim(parent: torch.nn.Module, width: int | None, given: int | None) -> int | None:
    if given is not None:
        return given
    for attr in HEAD_SIZE:
        value = getattr(parent, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    for attr in HEADS:
        heads = getattr(parent, attr, None)
        if isinstance(heads, int) and heads > 0 and width and width % heads == 0:
            return width // heads
    return None


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
    ``queries`` modules are fused ``[queries | keys | values]`` projections); None: found by name.

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
    blocks = []
    for block, (qname, q), (_, k), fused in found:
        parent = by_name.get(block, model)
        dh = _head_dim(parent, _queries_width(parent, q, fused), head_dim)
        if dh is None:
            raise ValueError(
                f"distmon: the precursor cannot tell the head size of attention block {block or '<root>'!r} "
                f"(queries from {qname!r}; no {'/'.join(HEAD_SIZE)} or {'/'.join(HEADS)} attribute): "
                "pass GradMonitor(..., precursor=PrecursorConfig(head_dim=...))"
            )
        blocks.append(AttentionBlock(block or "<root>", queries=q, keys=k, head_dim=dh, fused=fused))
    return blocks


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
                    self._handles.append(
                        b.queries.register_forward_hook(self._hook(i, b.head_dim, fused=True))
                    )
                else:
                    self._handles.append(
                        b.queries.register_forward_hook(self._hook(i, b.head_dim, into=self._q))
                    )
                    self._handles.append(
                        b.keys.register_forward_hook(self._hook(i, b.head_dim, into=self._k))
                    )
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(
        self, index: int, head_dim: int, *, into: torch.Tensor | None = None, fused: bool = False
    ) -> Callable[[torch.nn.Module, object, object], None]:
        @torch.compiler.disable
        def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
            if not self.active or graph_task_id() != -1:
                return  # not a sampled step, or a checkpoint's recomputation inside backward
            try:
                x = output.detach() if isinstance(output, torch.Tensor) else None
                if x is None or not x.is_floating_point() or not x.numel():
                    return
                if fused:  # [queries | keys | values]
                    third = x.shape[-1] // 3
                    self._keep(self._q, index, x[..., :third], head_dim)
                    self._keep(self._k, index, x[..., third : 2 * third], head_dim)
                else:
                    self._keep(into, index, x, head_dim)
            except Exception:
                self._errors.record("attention hook")

        return hook

    @staticmethod
    def _keep(into: torch.Tensor, index: int, x: torch.Tensor, head_dim: int) -> None:
        """``into[index]`` <- the larger of it and ``x``'s largest head vector norm (NaN wins)."""
        heads = x.unflatten(-1, (-1, head_dim))
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
