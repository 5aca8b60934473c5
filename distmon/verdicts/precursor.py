"""An early warning of divergence from sampled internal signals, as tensor math on the device.

Transformers that diverge at a high learning rate announce it first inside the forward pass:
without qk-layernorm the attention logits ``q . k / sqrt(d_head)`` grow by orders of magnitude
hundreds of steps before the loss moves (Wortsman et al. 2023, arXiv 2309.14322). The
detector reads signals sampled every ``every`` steps, one column per signal, and judges each
column on two rules, either of which may be left out per column:

- **bound**: the value exceeds a fixed bound in the signal's own units (``PrecursorConfig.bound``
  by default, 1000: an attention logit ten times the largest one any stable run reached in
  ``benchmarks/early_warning.py``; a logit gap of 20 already leaves ``e^-20 ~ 2e-9`` to the
  other keys, so a softmax at 1000 no longer learns);
- **rise**: the EMA of ``log(value)`` rises more than ``rise`` above its lowest point since the
  column was armed (after ``warmup`` samples): scale-free growth, for signals without a
  natural bound (measured there too, and not chosen: see below).

A column warns once either rule held for ``hold`` consecutive samples; a non-finite sample
warns at once (the forward already overflowed); a sample of 0 (or less) was not measured: it
moves nothing and breaks a run. The detector warns when any column does.

**What it needs (the shipped rule, the defaults).** One column per attention block: the
block's attention-logit bound ``max_i |q_i| * max_j |k_j| / sqrt(d_head)`` over the sampled
step's batch, heads and positions (queries and keys as the dot product sees them: after any
qk-norm; a rotary embedding keeps their norms; Cauchy-Schwarz makes it an upper bound of the
largest logit, and it needs no ``T x T`` scores: two vector norms and two max), taken on one forward of every
``every = 10``-th optimizer step and reduced with MAX over the ranks (data-parallel ranks see
different batches, tensor-parallel ranks different heads), so that every rank holds the same
samples and reaches the same verdict. ``benchmarks/divergence/cost.py`` measures that
sampling (forward hooks on each block's fused qkv projection, device ops only): on one CPU
thread, in the thread's CPU time, paired within rounds, 0.4-1.1 ms on a sampled 18-23 ms step
of the benchmark's 0.14M-parameter model (0.2-0.5% of a step at every 10 steps, over five runs
of the benchmark; ``benchmarks/results/early_warning.md`` holds the latest), and below this
shared machine's noise on a 3.3M-parameter one;
:meth:`PrecursorDetector.update` over 10 samples of 8 columns takes ~0.2 ms, once per export.

**The oscillation rule (``peak_lr=``).** A model with qk-layernorm bounds its attention logits
by construction; its high-rate divergences come when the warm-up takes the rate past what the
loss's curvature allows. Before that, consecutive steps' gradients point apart (the optimizer
overshoots along the sharpest direction: :mod:`distmon.step.grad_cosine`), as they also do in
stable runs at a high constant rate; what tells the two apart is that the schedule still raises
the rate. Given the schedule's highest rate, one more column holds ``1 -`` the interval's mean
cosine, with bound ``1 - cosine_below``; the judge hands it over only while the rate still
rises (it has not fallen from its highest) and ``peak_lr`` is ``rate_headroom`` times it or
more, and 0 ("not measured") elsewhere.
Measured (``benchmarks/results/early_warning.md``): over 71 diverging runs and 60 healthy ones
it warned in 57 (median 31% of the steps ahead) and on 2 healthy runs (one by a block's
bound); blind to runs whose rate is already too high when a short warm-up ends, and it can
warn on a run whose peak lies between where oscillation set in and the critical rate.

Everything is batched over the ``k`` samples of a call (EMA in closed form, running minimum
by ``cummin``, run lengths by prefix sums): device ops only, no host sync (``update`` runs on
the meta device), so it can run at export time over the samples since the last one. State:
per column the EMA, its floor and the run of samples over a rule (device tensors), and the
host count of samples; :meth:`PrecursorDetector.state_dict` gives them as plain lists.

Example:
    >>> det = PrecursorDetector(2, PrecursorConfig(hold=2))   # 2 attention blocks, bound 1000
    >>> samples = torch.tensor([[5.0, 20.0], [1500.0, 30.0], [4000.0, 35.0], [9000.0, 40.0]])
    >>> out = det.update(samples)
    >>> out.warn.tolist(), out.column.tolist()   # block 0 above 1000 for 2 samples: warns at the 3rd
    ([False, False, True, True], [-1, -1, 0, 0])
    >>> det.samples, det.state_dict()["run"]
    (4, [3.0, 0.0])
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..step.sums import prefix_ema, run_lengths, stable_run

__all__ = ["PrecursorConfig", "PrecursorDetector", "PrecursorVerdict"]


@dataclass(frozen=True)
class PrecursorConfig:
    r"""The precursor's settings (``GradMonitor(..., precursor=PrecursorConfig(...))``; the defaults
    are those ``benchmarks/early_warning.py`` measured).

    Attributes:
        every: the sampling interval in optimizer steps: the forwards of every ``every``-th step
            are read (the detector itself counts samples).
        bound: the attention-logit bound a block must exceed to warn (logit units).
        hold: consecutive samples a rule must hold before it warns.
        rise: the rise rule's threshold in log units (``log(10) ~ 2.3``: a tenfold rise of the
            smoothed signal over its floor; for columns without a bound).
        ema_alpha: the rise rule's smoothing per sample.
        warmup: samples before the rise rule's floor is armed.
        queries: a regular expression of the modules whose outputs are the queries, one per
            attention block (with ``keys`` None: fused ``[queries | keys | values]``
            projections); None: found by the names common models use
            (:func:`distmon.step.attention_watch.find_attention`).
        keys: a regular expression of the key modules, one per block (with ``queries``).
        head_dim: the head size; None: read from each block's attributes.
        peak_lr: the highest learning rate the schedule will reach (the first optimizer's first
            parameter group); None: the oscillation rule is off. Given, distmon also keeps the
            cosine between consecutive steps' gradients (its mean over each sampling interval)
            and warns while it is below ``cosine_below`` and the schedule will still raise the
            rate to ``rate_headroom`` times the current one or more (the rate has not fallen
            from the highest it reached, and ``peak_lr`` lies that far above): the optimizer already
            oscillates across the sharpest direction, and the warm-up is taking the rate past
            where the curvature allows it. Costs two copies of the gradient's memory and a
            pass over it per step; one process and DDP only.
        cosine_below: the oscillation rule's bound on the interval's mean cosine.
        rate_headroom: how far above the current rate ``peak_lr`` must lie for the oscillation
            rule to warn.

    Example:
        >>> PrecursorConfig().hold, PrecursorConfig(queries=r"attn\.c_attn$").keys
        (2, None)
        >>> PrecursorConfig(peak_lr=6e-4).oscillation_bound   # on 1 - cosine, the column's units
        1.2
    """

    every: int = 10
    bound: float = 1000.0
    hold: int = 2
    rise: float = math.log(10.0)
    ema_alpha: float = 0.3
    warmup: int = 20
    queries: str | None = None
    keys: str | None = None
    head_dim: int | None = None
    peak_lr: float | None = None
    cosine_below: float = -0.2
    rate_headroom: float = 1.2

    @property
    def oscillation_bound(self) -> float:
        """The oscillation rule's bound on its column, ``1 - cosine`` (> 0 where sampled)."""
        return 1.0 - self.cosine_below

    def __post_init__(self) -> None:
        if self.every < 1 or self.hold < 1 or self.warmup < 0 or not self.bound > 0:
            raise ValueError(f"distmon: precursor every/hold must be >= 1, warmup >= 0, bound > 0: {self}")
        if not (0 < self.ema_alpha < 1) or not self.rise > 0:
            raise ValueError(f"distmon: precursor ema_alpha must be in (0, 1) and rise > 0, got {self}")
        if self.keys is not None and self.queries is None:
            raise ValueError("distmon: precursor keys= needs queries= (the query modules' pattern)")
        for pattern in (self.queries, self.keys):
            if pattern is not None:
                re.compile(pattern)  # a re.error names what is wrong with it
        if self.head_dim is not None and not (isinstance(self.head_dim, int) and self.head_dim > 0):
            raise ValueError(f"distmon: precursor head_dim must be an int > 0, got {self.head_dim!r}")
        if self.peak_lr is not None and not (math.isfinite(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(
                f"distmon: precursor peak_lr must be the schedule's highest learning rate (> 0), got "
                f"{self.peak_lr!r}"
            )
        if not (-1.0 < self.cosine_below < 1.0) or not self.rate_headroom >= 1.0:
            raise ValueError(
                "distmon: precursor cosine_below must be in (-1, 1) and rate_headroom >= 1, got "
                f"{self.cosine_below!r} and {self.rate_headroom!r}"
            )


class PrecursorVerdict(NamedTuple):
    """Per sample of one call, on the device: ``warn`` (bool), ``score`` (the largest margin over
    any column's rule, in log units: > 0 means over), ``column`` (the warning column with the
    largest margin, -1 when none warns)."""

    warn: torch.Tensor
    score: torch.Tensor
    column: torch.Tensor


class PrecursorDetector:
    """Running state of the precursor rule over ``n_signals`` columns, in device tensors.

    ``bounds[c]``: column c's bound (None or ``inf``: no bound rule; default: ``cfg.bound`` for
    every column); ``rises[c]``: whether column c also has the rise rule (default: only columns
    without a bound).
    """

    _STATE = ("ema", "floor", "run")

    def __init__(
        self,
        n_signals: int,
        cfg: PrecursorConfig | None = None,
        *,
        bounds: Sequence[float | None] | None = None,
        rises: Sequence[bool] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg or PrecursorConfig()
        self.n = n_signals
        bounds = list(bounds) if bounds is not None else [self.cfg.bound] * n_signals
        if len(bounds) != n_signals:
            raise ValueError(
                f"distmon: precursor bounds must be one per signal ({n_signals}), got {len(bounds)}"
            )
        rises = list(rises) if rises is not None else [b is None for b in bounds]
        f32 = dict(dtype=torch.float32, device=device)
        self._log_bound = torch.tensor(
            [math.log(b) if b is not None and math.isfinite(b) else math.inf for b in bounds], **f32
        )
        self._has_rise = torch.tensor(rises, dtype=torch.bool, device=device)
        self.ema = torch.full((n_signals,), math.nan, **f32)  # EMA of log value (NaN: no sample yet)
        self.floor = torch.full((n_signals,), math.inf, **f32)  # lowest EMA since armed
        self.run = torch.zeros(n_signals, **f32)  # consecutive samples over a rule
        self.samples = 0  # host count: the warm-up needs no device read
        self._max_run = stable_run(self.cfg.ema_alpha)

    @classmethod
    def of(
        cls, cfg: PrecursorConfig, *, blocks: int, oscillation: bool, device: torch.device | str = "cpu"
    ) -> PrecursorDetector:
        """The detector of a monitor's samples: one bound column per attention block (``cfg.bound``),
        then with ``oscillation`` the ``1 - cosine`` column (``cfg.oscillation_bound``).

        Example:
            >>> det = PrecursorDetector.of(PrecursorConfig(peak_lr=1.0), blocks=1, oscillation=True)
            >>> out = det.update(torch.tensor([[5.0, 1.3], [5.0, 1.3]]))   # a cosine of -0.3, twice
            >>> det.n, out.warn.tolist(), out.column.tolist()
            (2, [False, True], [-1, 1])
        """
        bounds = [cfg.bound] * blocks + ([cfg.oscillation_bound] if oscillation else [])
        return cls(len(bounds), cfg, bounds=bounds, device=device)

    def update(self, samples: torch.Tensor) -> PrecursorVerdict:
        """Judge ``samples`` ``(k, n_signals)`` (consecutive samples, oldest first); advance the state."""
        if samples.dim() != 2 or samples.shape[1] != self.n:
            raise ValueError(f"distmon: precursor samples must be (k, {self.n}), got {tuple(samples.shape)}")
        if len(samples) > self._max_run:  # keep the closed-form EMA's powers moderate
            step = self._max_run
            parts = [self.update(samples[i : i + step]) for i in range(0, len(samples), step)]
            return PrecursorVerdict(*(torch.cat(p) for p in zip(*parts)))
        cfg, k = self.cfg, len(samples)
        x = samples.detach().to(self.ema.dtype)
        # NaN/Inf: the forward overflowed (warns at once); 0 (or less): not measured this sample
        # (a block no forward called): it moves nothing and breaks a run of samples over a rule
        finite = torch.isfinite(x) & (x > 0)
        bad = ~torch.isfinite(x)
        y = torch.log(torch.where(finite, x, 1.0))
        # the EMA of the log value, seeded with the first sample (closed form over the k rows)
        seeded = torch.isfinite(self.ema)
        start = torch.where(seeded, self.ema, y[0])
        before, after = prefix_ema(start, y, finite, cfg.ema_alpha)
        ema = torch.cat([before[1:], after.unsqueeze(0)])  # the EMA after each row
        # the rise rule: the EMA above its running floor, armed after the warm-up samples
        armed = (torch.arange(k, device=x.device) + self.samples >= cfg.warmup).unsqueeze(1) & finite
        floor = torch.minimum(torch.where(armed, ema, math.inf).cummin(0).values, self.floor)
        rise_margin = torch.where(self._has_rise & armed, ema - floor - cfg.rise, -math.inf)
        bound_margin = torch.where(finite, y - self._log_bound, -math.inf)
        margin = torch.maximum(rise_margin, bound_margin)
        over = (margin > 0) | bad
        run = run_lengths(over, self.run)
        col_warn = (run >= cfg.hold) | bad
        margin = torch.where(bad, math.inf, margin)
        warn = col_warn.any(1)
        score, worst = torch.where(col_warn, margin, -math.inf).max(1)
        best_margin = margin.max(1).values
        self.ema.copy_(after)
        self.floor.copy_(floor[-1])
        self.run.copy_(run[-1])
        self.samples += k
        return PrecursorVerdict(warn, torch.where(warn, score, best_margin), torch.where(warn, worst, -1))

    def state_dict(self) -> dict[str, object]:
        """The learned state as plain lists and numbers (JSON-ready)."""
        return {**{name: getattr(self, name).tolist() for name in self._STATE}, "samples": self.samples}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Go on from ``state`` (same number of signals)."""
        for name in self._STATE:
            value = torch.tensor(state[name], dtype=torch.float32, device=self.ema.device)
            if value.shape != (self.n,):
                raise ValueError(
                    f"distmon: the precursor state's {name} is {tuple(value.shape)}, this monitor's "
                    f"precursor reads {self.n} signals (one per attention block, one more with "
                    f"peak_lr=): load a state saved with the same ones, or drop its 'precursor' entry"
                )
            getattr(self, name).copy_(value)
        self.samples = int(state["samples"])
