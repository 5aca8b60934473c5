"""What sampling the precursor's signals costs a training step: hooks on, hooks off, paired and interleaved.

The sampling the detector would need in production, with device ops only (no host sync):
forward hooks on every ``nn.Linear`` adding their output's fp32 sum of squares and element
count to a device buffer (per-layer RMS), and on each attention block's fused ``qkv``
projection the attention-logit bound ``max_i |q_i| max_j |k_j| / sqrt(d_head)`` per block
(a ``torch.maximum`` into the buffer). One process, one CPU thread, the same batch every step;
each round times one full training step (forward, backward, AdamW) with the hooks live and one
with them idle, in the order ABBA. The per-sampled-step overhead is the median of the rounds'
differences over the median idle step; sampling every ``k`` steps costs that over ``k``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from distmon.sums import sq_sums

from .model import ModelConfig, TinyGPT


class SignalHooks:
    """The production-style sampling: per-Linear RMS and the per-block attention-logit bound."""

    def __init__(self, model: nn.Module, rms: bool = True) -> None:
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)] if rms else []
        self.blocks = [m for m in model.modules() if hasattr(m, "qkv") and hasattr(m, "n_heads")]
        n, b = len(self.linears), len(self.blocks)
        self.sq, self.count = torch.zeros(n), torch.zeros(n)
        self.bound = torch.zeros(b)
        self.active = False
        self.handles = [m.register_forward_hook(self._rms(i)) for i, m in enumerate(self.linears)]
        for i, a in enumerate(self.blocks):
            self.handles.append(a.qkv.register_forward_hook(self._bound(i, a.n_heads)))

    def _rms(self, i: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.active:
                self.sq[i] += sq_sums([out.detach()])[0]
                self.count[i] += out.numel()

        return hook

    def _bound(self, i: int, heads: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.active:
                d_head = out.shape[-1] // (3 * heads)
                qk = out.detach().unflatten(-1, (3, heads, d_head))[..., :2, :, :]  # (..., q/k, head, d)
                peak = torch.linalg.vector_norm(qk, dim=-1).transpose(-1, -2).flatten(0, -2).amax(0)
                self.bound[i] = torch.maximum(self.bound[i], peak.prod() / math.sqrt(d_head))

        return hook

    def close_sample(self) -> torch.Tensor:
        """The sample's row (RMS per Linear, then bound per block), and the buffers reset."""
        row = torch.cat([torch.sqrt(self.sq / self.count), self.bound])
        self.sq.zero_(), self.count.zero_(), self.bound.zero_()
        return row

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure(
    cfg: ModelConfig, batch: int, rounds: int, *, rms: bool = True, warm: int = 3
) -> dict[str, float]:
    """Median idle step (ms), median paired extra of a sampled step (ms and fraction).

    ``rms``: the per-Linear RMS hooks as well as the attention-logit bound (else the bound alone).
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    hooks = SignalHooks(model, rms=rms)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))

    def step(active: bool) -> float:
        hooks.active = active
        t = time.perf_counter()
        _, loss, _ = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if active:
            hooks.close_sample()
        return time.perf_counter() - t

    on, off = [], []
    for r in range(rounds + warm):
        order = (True, False) if r % 4 in (0, 3) else (False, True)  # ABBA
        times = {a: step(a) for a in order}
        if r >= warm:
            on.append(times[True])
            off.append(times[False])
    hooks.remove()
    base = statistics.median(off)
    extra = statistics.median(a - b for a, b in zip(on, off))
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "params": n_params,
        "hooked_linears": len(hooks.linears),
        "blocks": len(hooks.blocks),
        "step_ms": 1e3 * base,
        "extra_ms": 1e3 * extra,
        "fraction_per_sampled_step": extra / base,
        "rounds": rounds,
    }


def detector_cost(n_signals: int, k: int, calls: int = 200) -> float:
    """Median seconds of one :meth:`PrecursorDetector.update` over ``k`` samples."""
    from distmon.precursor import PrecursorConfig, PrecursorDetector

    det = PrecursorDetector(n_signals, PrecursorConfig(), bounds=[100.0] * n_signals)
    x = torch.rand(k, n_signals) * 50
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        det.update(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
