"""What sampling the precursor's signals costs a training step: hooks on, hooks off, paired and interleaved.

The sampling the detector would need in production, with device ops only (no host sync):
forward hooks on every ``nn.Linear`` adding their output's fp32 sum of squares and element
count to a device buffer (per-layer RMS), and on each attention block's fused ``qkv``
projection the attention-logit bound ``max_i |q_i| max_j |k_j| / sqrt(d_head)`` per block
(a ``torch.maximum`` into the buffer). One process, one CPU thread, the same batch every step;
each round times one full training step (forward, backward, AdamW) unsampled, with the bound
alone and with the bound and every Linear's RMS, in rotating order, in the thread's CPU time.
The per-sampled-step overhead is the median of the rounds' paired differences over the median
unsampled step; sampling every ``k`` steps costs that over ``k``. On a GPU the same hooks
queue a few small kernels per sampled step and read nothing back to the host.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

import torch
from torch import nn

from distmon.step.grad_cosine import GradientCosine
from distmon.step.sums import sq_sums

from .model import ModelConfig, TinyGPT


class SignalHooks:
    """The production-style sampling: per-Linear RMS and the per-block attention-logit bound."""

    def __init__(self, model: nn.Module) -> None:
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.blocks = [m for m in model.modules() if hasattr(m, "qkv") and hasattr(m, "n_heads")]
        n, b = len(self.linears), len(self.blocks)
        self.sq, self.count = torch.zeros(n), torch.zeros(n)
        self.bound = torch.zeros(b)
        self.mode = "off"  # MODES: which hooks are live
        self.handles = [m.register_forward_hook(self._rms(i)) for i, m in enumerate(self.linears)]
        for i, a in enumerate(self.blocks):
            self.handles.append(a.qkv.register_forward_hook(self._bound(i, a.n_heads)))

    def _rms(self, i: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.mode == "full":
                self.sq[i] += sq_sums([out.detach()])[0]
                self.count[i] += out.numel()

        return hook

    def _bound(self, i: int, heads: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.mode in ("bound", "full"):
                d_head = out.shape[-1] // (3 * heads)
                qk = out.detach().unflatten(-1, (3, heads, d_head))[..., :2, :, :]  # (..., q/k, head, d)
                peak = torch.linalg.vector_norm(qk, dim=-1).transpose(-1, -2).flatten(0, -2).amax(0)
                self.bound[i] = torch.maximum(self.bound[i], peak.prod() / math.sqrt(d_head))

        return hook

    def close_sample(self) -> torch.Tensor:
        """The sample's row (RMS per Linear, then bound per block), and the buffers reset."""
        row = torch.cat([torch.sqrt(self.sq / self.count), self.bound])  # RMS NaN in mode "bound"
        self.sq.zero_(), self.count.zero_(), self.bound.zero_()
        return row

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# no sampling; the attention bound; the bound and every Linear's RMS; the oscillation rule's read of
# the gradients (distmon.step.grad_cosine: a copy and a fused dot, every step, not only sampled ones)
MODES = ("off", "bound", "full", "cosine")


def measure(cfg: ModelConfig, batch: int, rounds: int, warm: int = 3) -> dict[str, object]:
    """Per mode, the median paired extra of a sampled step over an unsampled one (ms and fraction
    of the median unsampled step) and the quartiles of the paired extras: each round steps
    every mode once, in an order that cycles through all their permutations. Times are the
    thread's CPU time (``time.thread_time``): on a shared machine wall time mostly measures the
    neighbours; on one CPU thread every op runs synchronously, so CPU time is the step's cost."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    hooks = SignalHooks(model)
    cos = GradientCosine(list(model.parameters()), torch.device("cpu"))
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))

    def step(mode: str) -> float:
        hooks.mode = mode
        t = time.thread_time()  # CPU time of this thread: what the hooks add, whatever else the cores run
        _, loss, _ = model(x, x)
        loss.backward()
        if mode == "cosine":
            cos.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode in ("bound", "full"):
            hooks.close_sample()
        return time.thread_time() - t

    orders = list(itertools.permutations(MODES))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds + warm):
        took = {m: step(m) for m in orders[r % len(orders)]}
        if r >= warm:
            for m in MODES:
                times[m].append(took[m])
    hooks.remove()
    base = statistics.median(times["off"])
    out: dict[str, object] = {
        "params": sum(p.numel() for p in model.parameters()),
        "linears": len(hooks.linears),
        "blocks": len(hooks.blocks),
        "step_ms": 1e3 * base,
        "rounds": rounds,
    }
    for m in MODES[1:]:
        extra = [a - b for a, b in zip(times[m], times["off"])]
        q1, med, q3 = statistics.quantiles(extra, n=4)
        out[m] = {"extra_ms": 1e3 * med, "fraction": med / base, "quartiles_ms": [1e3 * q1, 1e3 * q3]}
    return out


def detector_cost(n_signals: int, k: int, calls: int = 200) -> float:
    """Median seconds of one :meth:`PrecursorDetector.update` over ``k`` samples."""
    from distmon.verdicts.precursor import PrecursorConfig, PrecursorDetector

    det = PrecursorDetector(n_signals, PrecursorConfig(), bounds=[100.0] * n_signals)
    x = torch.rand(k, n_signals) * 50
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        det.update(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
