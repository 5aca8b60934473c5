"""A tiny pre-LayerNorm GPT with the two mitigations of Wortsman et al. (2023) as options.

``qk_layernorm``: LayerNorm on each head's queries and keys before their dot product (removes
attention-logit growth); ``z_loss``: ``z_loss * mean(log Z)^2`` added to the loss, ``log Z``
the log-sum-exp of each position's output logits (removes output-logit divergence). The
queries and keys always pass through ``attn.q_norm`` / ``attn.k_norm`` (``nn.Identity``
without qk-layernorm), so a forward hook there sees exactly what the dot product sees.

Module names (what the recorder and distmon call the layers)::

    tok_emb, pos_emb
    blocks.{i}.ln1, blocks.{i}.attn.qkv, blocks.{i}.attn.q_norm, blocks.{i}.attn.k_norm,
    blocks.{i}.attn.proj, blocks.{i}.ln2, blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2
    ln_f, lm_head            (untied from tok_emb, as in the paper's models)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape and mitigations of a :class:`TinyGPT`."""

    vocab: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    qk_layernorm: bool = False
    z_loss: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Attention(nn.Module):
    """Causal multi-head self-attention; queries and keys pass ``q_norm``/``k_norm`` per head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        head = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.q_norm: nn.Module = nn.LayerNorm(head) if cfg.qk_layernorm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(head) if cfg.qk_layernorm else nn.Identity()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)  # (B, heads, T, head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Linear -> GELU -> Linear, 4x wide."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only byte-level language model; ``forward(idx, targets)`` returns ``(logits, loss, ce)``.

    ``loss`` is what is trained (cross-entropy plus the z-loss term, if any), ``ce`` the bare
    cross-entropy, the figure divergence is judged on.

    Example:
        >>> net = TinyGPT(ModelConfig(d_model=16, n_heads=2, seq_len=8, n_layers=1))
        >>> logits, loss, ce = net(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        >>> tuple(logits.shape), bool(abs(float(ce) - math.log(256)) < 0.2)
        ((2, 8, 256), True)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self._init()

    @torch.no_grad()
    def _init(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        flat = logits.reshape(-1, logits.shape[-1]).float()
        ce = F.cross_entropy(flat, targets.reshape(-1))
        loss = ce
        if self.cfg.z_loss:
            loss = ce + self.cfg.z_loss * torch.logsumexp(flat, -1).pow(2).mean()
        return logits, loss, ce.detach()
