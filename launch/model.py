"""A small GPT-style causal language model and a synthetic token stream to train it on.

The demo trainer (``launch/train.py``) needs a *real* model -- embeddings, attention,
MLPs, LayerNorms, a tied LM head -- so that distmon's per-layer view looks like it does
on a production run, but nothing that has to be downloaded.  Everything here is plain
PyTorch; distmon is not imported.

Module layout (these qualified names are the layer names distmon reports, because
distmon groups parameters by the module that owns them)::

    tok_emb                      token embedding (its weight is also the LM head's)
    pos_emb                      learned position embedding
    blocks.{i}.ln1               LayerNorm before attention
    blocks.{i}.attn.qkv          fused query/key/value projection
    blocks.{i}.attn.proj         attention output projection
    blocks.{i}.ln2               LayerNorm before the MLP
    blocks.{i}.mlp.fc1           MLP up-projection (d_model -> 4 d_model)
    blocks.{i}.mlp.fc2           MLP down-projection (4 d_model -> d_model)
    ln_f                         final LayerNorm
    lm_head                      Linear without bias; weight tied to tok_emb.weight, so
                                 ``named_parameters()`` lists it once, as tok_emb.weight
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT` model."""

    vocab: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for field in ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (each position sees only its past)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (B, T, D) -> (B, heads, T, D / heads)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model with a weight-tied LM head.

    ``forward(idx)`` returns logits of shape (B, T, vocab); ``forward(idx, targets)``
    returns ``(logits, loss)`` with the mean next-token cross-entropy.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # tok_emb is registered before lm_head on purpose: the tied parameter is then
        # named tok_emb.weight in named_parameters() (which lists a shared one once).
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module.weight.is_meta:
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.fc2):
                if not proj.weight.is_meta:
                    nn.init.normal_(proj.weight, mean=0.0, std=resid_std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters' elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules that own parameters, in model order.

    These are the names distmon uses for its layers by default (the owning module of
    each parameter in ``named_parameters()``, which lists a tied weight once, under its
    first name).  The trainer's fault-injection flags take one of these names.
    """
    names: list[str] = []
    for pname, _ in model.named_parameters():
        owner = pname.rpartition(".")[0]
        if owner not in names:
            names.append(owner)
    return names


def layer_parameters(model: nn.Module, layer: str) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs that belong to ``layer`` (see :func:`layer_names`)."""
    return [(n, p) for n, p in model.named_parameters() if n.rpartition(".")[0] == layer]


class MarkovTokenStream:
    """Endless synthetic text from a fixed random second-order Markov chain over ``vocab`` tokens.

    The "grammar" is drawn once from ``grammar_seed``, so every rank learns the same
    language, while each rank samples its own sequences from ``stream_seed`` -- its own
    data shard.  Which tokens may follow depends on the previous token only (``branching``
    successors each), which a model picks up within tens of steps (the loss falls from
    ln(vocab) towards ln(branching)); how likely each successor is depends on the previous
    *two* tokens, so getting down to the floor (:attr:`entropy`) takes attention.
    """

    def __init__(
        self,
        vocab: int,
        *,
        grammar_seed: int,
        stream_seed: int,
        branching: int = 4,
        table_size: int = 65536,
    ) -> None:
        g = torch.Generator().manual_seed(grammar_seed)
        self.vocab = vocab
        self.table_size = min(table_size, vocab * vocab)
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=g)
        # Successor probabilities per (previous two tokens) context, hashed into table_size
        # rows; skewed (Dirichlet(1) via normalised exponentials).
        probs = -torch.log(torch.rand(self.table_size, branching, generator=g))
        probs = probs / probs.sum(dim=1, keepdim=True)
        self.cum_probs = probs.cumsum(dim=1)
        self.cum_probs[:, -1] = 1.0
        self.entropy = float(-(probs * probs.log()).sum(1).mean())  # nats, the loss floor (approx.)
        self.gen = torch.Generator().manual_seed(stream_seed)

    def _context(self, prev2: torch.Tensor, prev1: torch.Tensor) -> torch.Tensor:
        return (prev2 * 1_000_003 + prev1) % self.table_size

    def sample(self, batch: int, length: int) -> torch.Tensor:
        """A (batch, length) int64 tensor of tokens."""
        out = torch.empty(batch, length, dtype=torch.long)
        out[:, :2] = torch.randint(0, self.vocab, (batch, min(2, length)), generator=self.gen)
        for t in range(2, length):
            ctx = self._context(out[:, t - 2], out[:, t - 1])
            u = torch.rand(batch, 1, generator=self.gen)
            choice = (u > self.cum_probs[ctx]).sum(dim=1, keepdim=True)
            out[:, t] = self.successors[out[:, t - 1]].gather(1, choice).squeeze(1)
        return out

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch, seq_len)."""
        tokens = self.sample(batch, seq_len + 1)
        return tokens[:, :-1], tokens[:, 1:]
