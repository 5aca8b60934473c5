"""What the tests and the jobs they run share: the model, the float64 reference, the scrape.

Every test module, job (``tests/jobs/``, under torchrun: tests/ on ``sys.path``) and harness
takes these from here, and only from here:

* the small GPT the jobs train: :class:`GPT` (embedding, residual blocks, final norm, head;
  each test's twist an option), :func:`make_batch`, :func:`lm_loss`;
* layer names and flat tensors: :func:`layer_of` (distmon's default layer: the module that owns
  the parameter), :func:`whole` (a ``DTensor`` made whole), :func:`flat` (tensors flattened into
  one float64 copy);
* the float64 reference, computed here and never by distmon: :func:`as_float64`,
  :func:`layer_sq` (each layer's sum of squares), :func:`reference_norms` (the global and the
  per-layer norms; a rank's own norms are the same on its local gradients), :class:`LocalGrads`
  (each rank's local gradient, as autograd hands it to the wrapper, from tensor hooks);
* comparing: :func:`close`, :func:`rel_err`, :func:`snapshot_dict`, :func:`sync_twin`;
* HTTP to 127.0.0.1, never through a proxy: :func:`http_get`, :func:`scrape_metrics` (a real
  scrape parsed with prometheus_client's parser), :func:`parse_samples`, :func:`sample_value`.

It imports torch, prometheus_client and the standard library only (no distmon).
"""

from __future__ import annotations

import functools
import math
import urllib.request
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# --------------------------------------------------------------------------
# The small GPT, its data and loss
# --------------------------------------------------------------------------

VOCAB = 24
DIM = 16
# ~2 KB buckets on the default ~7 KB model: several DDP buckets (after DDP's rebuild at step 2).
BUCKET_CAP_MB = 0.002


class Block(nn.Module):
    """A residual block: ``h + fc(tanh(ln(h)))``, or with ``hidden`` an MLP that tensor
    parallelism can shard (``fc1`` column-wise, ``fc2`` row-wise): ``h + fc2(tanh(fc1(ln(h))))``.
    ``unused=True`` adds a layer ``extra`` that forward never calls."""

    def __init__(self, dim: int, hidden: int | None = None, unused: bool = False) -> None:
        super().__init__()
        self.mlp = hidden is not None
        self.ln = nn.LayerNorm(dim)
        if not self.mlp:
            self.fc = nn.Linear(dim, dim)
        else:
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)
        if unused:
            self.extra = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mlp:
            return h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        return h + self.fc(torch.tanh(self.ln(h)))


class Phase(nn.Module):
    """A complex parameter: h + re(rot) + im(rot) / 2, so its gradient has both parts."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.rot = nn.Parameter(0.1 * torch.randn(dim, dtype=torch.cfloat))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.rot.real + 0.5 * self.rot.imag


class GPT(nn.Module):
    """Embedding -> [complex phase] -> residual blocks -> [optional branch] -> LayerNorm -> head.

    Layers in model order: emb, [phase], blocks.0.ln, blocks.0.fc (or .fc1, .fc2), ...,
    [extra], norm, head. ``blocks`` is a ``ModuleDict`` ("0", "1", ...): a pipeline stage is a
    copy with the other stages' modules removed or set to None (torchtitan's way: the names
    stay the model's). Options: ``hidden`` (MLP blocks), ``tied`` (head and embedding share the
    weight), ``branch`` (a layer ``extra`` that forward may skip), ``sparse`` (sparse embedding
    gradients), ``complex_param``, ``checkpoint`` (each block under ``torch.utils.checkpoint``,
    non-reentrant), ``unused`` (a layer in each block that forward never calls). Each block is
    called as a module (a test may compile, wrap or shard it).
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = DIM,
        n_blocks: int = 2,
        hidden: int | None = None,
        tied: bool = False,
        branch: bool = False,
        sparse: bool = False,
        complex_param: bool = False,
        checkpoint: bool = False,
        unused: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.emb = nn.Embedding(vocab, dim, sparse=sparse)
        self.phase = Phase(dim) if complex_param else None
        self.blocks = nn.ModuleDict({str(i): Block(dim, hidden, unused) for i in range(n_blocks)})
        self.extra = nn.Linear(dim, dim) if branch else None
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = self.emb(idx) if self.emb is not None else idx
        if self.phase is not None:
            h = self.phase(h)
        for b in self.blocks.values():
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False) if self.checkpoint else b(h)
        if self.extra is not None and use_extra:
            h = h + torch.relu(self.extra(h))
        return self.head(self.norm(h)) if self.head is not None else h


def make_batch(
    rank: int, step: int, micro: int = 0, seed: int = 0, batch: int = 4, seq: int = 6, vocab=VOCAB
):
    """(inputs, targets): deterministic, different on every rank / step / micro-batch."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * rank + 101 * step + micro)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------
# Layers and flat tensors
# --------------------------------------------------------------------------


def layer_of(param_name: str) -> str:
    """distmon's default layer of a parameter: the module that directly owns it.

    Example:
        >>> layer_of("transformer.h.0.attn.c_attn.weight"), layer_of("bias")
        ('transformer.h.0.attn.c_attn', '')
    """
    return param_name.rpartition(".")[0]


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A ``DTensor`` made whole (``full_tensor()``: a collective, on every rank alike); any other
    tensor, or None, as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Every tensor, whole (see :func:`whole`), flattened into one float64 copy, in order (a
    parameter list: equal copies, ``torch.equal``, iff equal parameters)."""
    return torch.cat([whole(t).detach().double().reshape(-1) for t in tensors])


# --------------------------------------------------------------------------
# The float64 reference
# --------------------------------------------------------------------------


def as_float64(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense real float64 tensor: a sparse one densified (duplicate indices
    summed), a complex one as its (real, imag) pairs, so its L2 norm is that of the gradient."""
    g = grad.detach()
    if g.is_sparse:
        g = g.to_dense()
    if g.is_complex():
        g = torch.view_as_real(g)
    return g.double()


def layer_sq(
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
    layers: Iterable[str] = (),
    layer: Callable[[str], str] = layer_of,
) -> dict[str, float]:
    """{layer: float64 sum of squares of its gradients} from (name, grad-or-None) pairs, in the
    order of ``layers`` then of first appearance; a None gradient adds 0 (its layer stays)."""
    sq = dict.fromkeys(layers, 0.0)
    for name, g in named_grads:
        key = layer(name)
        sq[key] = sq.get(key, 0.0) + (float(as_float64(g).pow(2).sum()) if g is not None else 0.0)
    return sq


def reference_norms(
    named_grads: Iterable[tuple[str, torch.Tensor | None]], **layer_sq_args
) -> tuple[float, dict[str, float]]:
    """(global norm, {layer: norm}) in float64 from (name, grad-or-None) pairs in model order:
    the square roots of :func:`layer_sq`'s sums and of their total. Computed here, never by
    distmon."""
    sq = layer_sq(named_grads, **layer_sq_args)
    return math.sqrt(sum(sq.values())), {k: math.sqrt(v) for k, v in sq.items()}


class LocalGrads:
    """A rank's local gradient: a tensor hook on every named parameter adds each backward's
    gradient (what autograd hands the wrapper, before any reduction) into a float64 sum per
    parameter, micro-batches summed, until :meth:`take`. Hooks registered on a parameter
    before this one's (an injected NaN, say) run first."""

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.backwards: dict[str, int] = {}  # per parameter: the backwards seen, never reset
        for name, p in named_params:
            p.register_hook(functools.partial(self._add, name))

    def _add(self, name: str, grad: torch.Tensor) -> None:
        self.backwards[name] = self.backwards.get(name, 0) + 1
        g = as_float64(grad)
        self.sums[name] = self.sums[name] + g if name in self.sums else g.clone()

    def take(self) -> dict[str, torch.Tensor]:
        """{name: float64 sum} since the last take (a parameter no backward reached: absent)."""
        sums, self.sums = self.sums, {}
        return sums


# --------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------


def sync_twin(twin: nn.Module, module: nn.Module) -> None:
    """Copy module's current parameters into its un-wrapped twin."""
    src = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for n, p in twin.named_parameters(remove_duplicate=False):
            p.copy_(src[n])


SNAPSHOT_FIELDS = (
    "step",
    "timestamp",
    "grad_norm",
    "layer_grad_norms",
    "rank_grad_norms",
    "rank_layer_grad_norms",
    "nonfinite",
    "nonfinite_ranks",
    "first_nonfinite",
    "run_id",
    "world_size",
)
MISSING = "<field missing from Snapshot>"


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def snapshot_dict(snap):
    """A distmon Snapshot as plain picklable data (None stays None)."""
    if snap is None:
        return None
    return {f: _plain(getattr(snap, f, MISSING)) for f in SNAPSHOT_FIELDS}


def claims_nonfinite(snap: dict) -> str | None:
    """What a snapshot dict (:func:`snapshot_dict`) of an all-finite step wrongly claims, or None."""
    if snap["nonfinite"] is False and snap["nonfinite_ranks"] == [] and snap["first_nonfinite"] is None:
        return None
    return (
        f"finite step reported nonfinite={snap['nonfinite']!r}, "
        f"nonfinite_ranks={snap['nonfinite_ranks']!r}, first_nonfinite={snap['first_nonfinite']!r}"
    )


def rel_err(actual, expected, abs_floor=1e-12):
    if not isinstance(actual, (int, float)) or isinstance(actual, bool):
        return math.inf
    if math.isnan(actual) or math.isnan(expected):
        return 0.0 if (math.isnan(actual) and math.isnan(expected)) else math.inf
    return abs(actual - expected) / max(abs(expected), abs_floor)


def close(actual, expected, rel=1e-5, abs_tol=1e-9):
    """|actual - expected| <= max(rel * |expected|, abs_tol) for real numbers."""
    if not isinstance(actual, (int, float)) or isinstance(actual, bool):
        return False
    if not math.isfinite(expected) or not math.isfinite(actual):
        return False
    return abs(actual - expected) <= max(rel * abs(expected), abs_tol)


# --------------------------------------------------------------------------
# HTTP: 127.0.0.1, never through a proxy
# --------------------------------------------------------------------------

# every request the tests make goes to this machine: an http_proxy in the environment must not
# take it elsewhere
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str, str]:
    """(status, Content-Type, body) of a GET, without any proxy; raises OSError (an HTTP error
    status: ``urllib.error.HTTPError``) as urllib does."""
    with _NO_PROXY.open(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def metrics_url(where: int | str) -> str:
    """An endpoint's /metrics: a port on 127.0.0.1, ``host:port``, or a whole URL."""
    if isinstance(where, int):
        return f"http://127.0.0.1:{where}/metrics"
    return where if "://" in where else f"http://{where}/metrics"


def parse_samples(text: str, by_family: bool = False):
    """[(sample name, labels, value)] of a Prometheus text exposition (prometheus_client's parser);
    ``by_family``: {family name (a counter's with ``_total``): [prometheus_client Sample, ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    if not by_family:
        return [
            (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
        ]
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name + ("_total" if family.type == "counter" else ""), []).extend(
            family.samples
        )
    return out


def scrape_metrics(where: int | str, timeout: float = 10.0, by_family: bool = False):
    """A real HTTP scrape of ``where`` (:func:`metrics_url`), parsed (:func:`parse_samples`)."""
    return parse_samples(http_get(metrics_url(where), timeout)[2], by_family)


def sample_value(samples, name, **labels):
    """The value of the one sample ``name`` whose labels include ``labels``."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]
