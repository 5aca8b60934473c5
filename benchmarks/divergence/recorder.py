"""Every candidate precursor signal, measured with plain torch hooks, independently of distmon.

On a recorded step (every ``every`` steps) forward hooks note, per ``nn.Linear``, the RMS and the
largest absolute value of its output; per attention block, the largest attention logit
``q . k / sqrt(d_head)`` over causal pairs (from the queries and keys the dot product sees, the
outputs of ``attn.q_norm``/``attn.k_norm``) and the bound ``max|q| max|k| / sqrt(d_head)``;
from the LM head's output, the largest logit magnitude and the mean and largest ``log Z``
(log-sum-exp over the vocabulary). The training loop adds, per layer, the gradient norm
before clipping and the update-to-weight ratio ``|W_after - W_before| / |W_before|``, the
global gradient norm, and the cosine between consecutive steps' gradients
(:class:`ConsecutiveCosine`). Values are kept as float32 numpy rows, one per recorded step.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
from torch import nn

from launch.model import layer_names  # distmon's layers: the modules that own parameters


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the model's ``nn.Linear`` modules, in model order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


class Recorder:
    """Forward hooks and per-step rows of every candidate signal (see the module docstring).

    Example:
        >>> from benchmarks.divergence.model import ModelConfig, TinyGPT
        >>> net = TinyGPT(ModelConfig(d_model=16, n_heads=2, seq_len=8, n_layers=1))
        >>> rec = Recorder(net)
        >>> recorded = rec.begin(0); x = torch.zeros(2, 8, dtype=torch.long); _ = net(x, x)
        >>> sorted(rec.current)[:3]
        ['attn_bound', 'attn_logit_max', 'lin_max']
        >>> rec.remove()
    """

    def __init__(self, model: nn.Module, every: int = 1) -> None:
        self.model, self.every = model, every
        self.linears = linear_names(model)
        self.layers = layer_names(model)
        self.blocks = [n for n, m in model.named_modules() if hasattr(m, "q_norm") and hasattr(m, "k_norm")]
        self.active = False
        self.current: dict[str, np.ndarray] = {}
        self.rows: dict[str, list[np.ndarray]] = {}
        self.steps: list[int] = []
        self._q: dict[int, torch.Tensor] = {}
        self._handles = []
        mods = dict(model.named_modules())
        for i, name in enumerate(self.linears):
            self._handles.append(mods[name].register_forward_hook(self._linear_hook(i)))
        for i, name in enumerate(self.blocks):
            attn = mods[name]
            self._handles.append(attn.q_norm.register_forward_hook(self._q_hook(i)))
            self._handles.append(attn.k_norm.register_forward_hook(self._k_hook(i)))
        if "lm_head" in mods:
            self._handles.append(mods["lm_head"].register_forward_hook(self._logits_hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def begin(self, step: int) -> bool:
        """Start a step; returns whether it is recorded."""
        self.active = step % self.every == 0
        if self.active:
            n, b = len(self.linears), len(self.blocks)
            self.current = {
                "lin_rms": np.full(n, np.nan, np.float32),
                "lin_max": np.full(n, np.nan, np.float32),
                "attn_logit_max": np.full(b, np.nan, np.float32),
                "attn_bound": np.full(b, np.nan, np.float32),
                "logit_max": np.full(1, np.nan, np.float32),
                "z_mean": np.full(1, np.nan, np.float32),
                "z_max": np.full(1, np.nan, np.float32),
            }
            self._step = step
        return self.active

    def _linear_hook(self, i: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.active and torch.is_grad_enabled():
                x = out.detach().float()
                self.current["lin_rms"][i] = float(x.pow(2).mean().sqrt())
                self.current["lin_max"][i] = float(x.abs().max())

        return hook

    def _q_hook(self, i: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if self.active and torch.is_grad_enabled():
                self._q[i] = out.detach().float()

        return hook

    def _k_hook(self, i: int):  # noqa: ANN202
        def hook(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
            if not (self.active and torch.is_grad_enabled()) or i not in self._q:
                return
            q, k = self._q.pop(i), out.detach().float()  # (B, heads, T, head)
            scale = 1 / math.sqrt(q.shape[-1])
            scores = (q @ k.transpose(-1, -2)) * scale
            t = scores.shape[-1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            self.current["attn_logit_max"][i] = float(scores.masked_fill(~causal, 0.0).abs().max())
            bound = q.norm(dim=-1).amax() * k.norm(dim=-1).amax() * scale
            self.current["attn_bound"][i] = float(bound)

        return hook

    def _logits_hook(self, module: nn.Module, inputs: object, out: torch.Tensor) -> None:
        if self.active and torch.is_grad_enabled():
            x = out.detach().float()
            z = torch.logsumexp(x, -1)
            self.current["logit_max"][0] = float(x.abs().max())
            self.current["z_mean"][0] = float(z.mean())
            self.current["z_max"][0] = float(z.abs().max())

    def end(self, extra: dict[str, np.ndarray]) -> None:
        """Close a recorded step with the loop's figures (gradient norms, update ratios, loss)."""
        if not self.active:
            return
        self.current.update(extra)
        for key, value in self.current.items():
            self.rows.setdefault(key, []).append(np.asarray(value, np.float32).reshape(-1))
        self.steps.append(self._step)
        self.active = False

    def arrays(self) -> dict[str, np.ndarray]:
        """Every signal as a ``(recorded steps, columns)`` float32 array, and ``step``."""
        out = {k: np.stack(v) for k, v in self.rows.items()}
        out["step"] = np.asarray(self.steps, np.int64)
        return out


def layer_grad_norms(model: nn.Module, layers: list[str]) -> np.ndarray:
    """Each layer's gradient L2 norm (before clipping); NaN where no gradient."""
    sq = dict.fromkeys(layers, 0.0)
    for pname, p in model.named_parameters():
        if p.grad is not None:
            sq[pname.rpartition(".")[0]] += float(p.grad.detach().float().pow(2).sum())
    return np.sqrt(np.asarray([sq[n] for n in layers], np.float64)).astype(np.float32)


class UpdateRatios:
    """Per-layer ``|W_after - W_before| / |W_before|`` around one optimizer step."""

    def __init__(self, model: nn.Module, layers: list[str]) -> None:
        self.params = [(pname.rpartition(".")[0], p) for pname, p in model.named_parameters()]
        self.layers = layers
        self.before: list[torch.Tensor] = []

    def begin(self) -> None:
        self.before = [p.detach().clone() for _, p in self.params]

    def end(self) -> np.ndarray:
        d2 = dict.fromkeys(self.layers, 0.0)
        w2 = dict.fromkeys(self.layers, 0.0)
        for (layer, p), b in zip(self.params, self.before):
            d2[layer] += float((p.detach() - b).pow(2).sum())
            w2[layer] += float(b.pow(2).sum())
        return np.asarray([math.sqrt(d2[n] / w2[n]) if w2[n] else np.nan for n in self.layers], np.float32)


class ConsecutiveCosine:
    """The cosine between consecutive steps' gradients (after clipping: the ones the optimizer
    sees), averaged over the last ``window`` pairs.

    Why a candidate: a rate too high for the loss's curvature makes the iterate overshoot the
    valley's floor, so that the next gradient points back (hypergradient descent, Baydin et al.
    2018, arXiv 1703.04782, lowers the rate on exactly this sign). A batch's noise makes one
    pair's cosine noisy; the mean over an interval's pairs is what a sampled monitor would keep.

    Example:
        >>> net = nn.Linear(2, 1, bias=False); cos = ConsecutiveCosine(net, window=2)
        >>> for g in ([1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]):
        ...     net.weight.grad = torch.tensor([g]); cos.step()
        >>> cos.mean()   # the pairs' cosines: -1, then 0
        -0.5
    """

    def __init__(self, model: nn.Module, window: int = 10) -> None:
        self.params = list(model.parameters())
        self.prev: torch.Tensor | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def step(self) -> None:
        """Read this step's gradients (call after clipping, before the optimizer step)."""
        flat = torch.cat([p.grad.detach().reshape(-1) for p in self.params if p.grad is not None]).double()
        if self.prev is not None:
            self.recent.append(float(flat @ self.prev / (flat.norm() * self.prev.norm())))
        self.prev = flat

    def mean(self) -> float:
        """The mean over the last ``window`` pairs (NaN before the second step)."""
        return sum(self.recent) / len(self.recent) if self.recent else math.nan
