"""Anomaly detectors that run on the device, with state in device tensors and no host sync.

Each step, :meth:`DeviceDetector.update` reads the step's ring row (reduced per-layer sums of
squares and every rank's gathered figures), updates its running state and writes its
verdicts into the row's detector columns; the host decodes them into
:class:`~distmon.snapshot.AnomalyEvent` objects when the row is exported.

Detectors, all on log-norms (gradient norms span decades, and ratios are what matter):

- spike: ``z = (log n - EMA mean) / EMA std`` above ``spike_zscore`` AND the norm above
  ``spike_ratio`` times its reference (the running median of recent global norms; for a layer,
  the geometric EMA of that layer's norm), after ``warmup_steps``. Both must hold: the z-score
  alone fires on tiny wiggles of a very steady norm, the ratio alone on a noisy one. The state
  is updated with the deviation clipped at ``spike_zscore`` std, so one spike does not poison
  the baseline while a lasting change of level is absorbed within ~1/alpha steps. Falling
  norms (early-training decay) only make z negative: never an event.
- vanishing: global norm below ``vanishing_norm`` for ``vanishing_steps`` consecutive steps.
- rank outlier: per rank, ``|log n_r - median_r log n_r|`` over a scale (the EMA over steps of
  the ranks' mean squared deviation leaving out the largest, floored at
  ``outlier_min_scale``), above ``outlier_score``. Leaving the largest out keeps a rank that
  stays bad, or is bad from step 1, from inflating the scale; a per-step MAD is no scale for
  a handful of ranks (biased low with 4, degenerate with 2). Needs at least 3 ranks (with 2,
  "which one is odd" has no answer).
- non-finite: already flagged by the core per rank and layer; reported as an event here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from .reduction import RANK_FIELDS
from .ring import RowLayout
from .snapshot import AnomalyEvent, Snapshot

__all__ = ["DetectorConfig", "DeviceDetector", "DetectorDecoder"]

# detector columns of a ring row, then one outlier score per rank
COLUMNS = ("zscore", "median_ratio", "layer_zmax", "spike_global", "spike_layer", "spike_layer_z", "vanishing",
           "outlier", "outlier_rank", "outlier_score", "block")
_C = {name: i for i, name in enumerate(COLUMNS)}


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the device detectors (defaults measured on the demo model; see README).

    Example:
        >>> DetectorConfig(spike_zscore=8.0).spike_ratio
        3.0
    """

    warmup_steps: int = 50
    ema_alpha: float = 0.05
    spike_zscore: float = 6.0
    spike_ratio: float = 3.0
    median_window: int = 64
    vanishing_norm: float = 1e-7
    vanishing_steps: int = 20
    outlier_score: float = 8.0
    outlier_min_scale: float = 0.1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                if not (f.name == "warmup_steps" and v == 0):
                    raise ValueError(f"distmon: detector option {f.name} must be a positive number, got {v!r}")
        if not self.ema_alpha < 1:
            raise ValueError(f"distmon: ema_alpha must be in (0, 1), got {self.ema_alpha}")
        if self.spike_ratio <= 1:
            raise ValueError(f"distmon: spike_ratio must be > 1, got {self.spike_ratio}")
        for name in ("warmup_steps", "median_window", "vanishing_steps"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"distmon: {name} must be an int, got {getattr(self, name)!r}")


def _trimmed_consistency(world: int, samples: int = 20000) -> float:
    """sigma^2 / E[trimmed mean squared deviation from the median] for ``world`` Gaussian ranks.

    Makes the rank-outlier score read in standard deviations whatever the world size (the
    trimmed mean of a handful of deviations is far below sigma^2). Seeded Monte Carlo, once,
    at construction.

    Example:
        >>> round(_trimmed_consistency(64), 1)
        1.1
    """
    if world < 2:
        return 1.0
    x = torch.randn(samples, world, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    d2 = (x - x.median(dim=1, keepdim=True).values) ** 2
    if world >= 3:
        d2 = d2.sort(dim=1).values[:, :-1]
    return float(1.0 / d2.mean())


class DeviceDetector:
    """Running detector state on the device; one :meth:`update` per optimizer step."""

    def __init__(self, cfg: DetectorConfig, n_layers: int, world: int, rank_layer_cols: int,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.world = world
        self.rank_layer_cols = rank_layer_cols
        self.n_outputs = len(COLUMNS) + world
        n = n_layers + 1  # global norm first, then layers
        f32 = dict(dtype=torch.float32, device=device)
        self.mean = torch.zeros(n, **f32)
        self.var = torch.full((n,), 0.25, **f32)  # std 0.5 in log units until data arrives
        self.seeded = torch.zeros(n, dtype=torch.bool, device=device)
        self.history = torch.full((cfg.median_window,), math.nan, **f32)
        self.below = torch.zeros((), **f32)
        self.dev_var = torch.full((), math.nan, **f32)  # cross-rank log-norm variance, EMA
        self._consistency = _trimmed_consistency(world)
        self.updates = 0  # host count of updates: the warm-up rule needs no device read
        self._log_ratio = math.log(cfg.spike_ratio)

    def update(self, row: torch.Tensor, layout: RowLayout, valid: bool) -> None:
        """Read the step's row, write the detector columns, advance the state (device ops only)."""
        cfg = self.cfg
        out = row[layout.detector]
        out.zero_()
        out[_C["spike_layer"]] = -1.0
        if not valid:
            return
        armed = self.updates >= cfg.warmup_steps
        x = 0.5 * torch.log(row[1:layout.layers.stop])  # log-norms: global, then layers
        finite = torch.isfinite(x)
        std = torch.sqrt(self.var + 1e-4)
        dev = x - self.mean
        z = torch.where(finite & self.seeded, dev / std, 0.0)
        slot = self.updates % cfg.median_window
        median = torch.nanmedian(self.history)
        log_ref_dev = torch.cat([(x[:1] - median).nan_to_num(0.0), dev[1:]])  # log(norm / reference)
        spike = finite & self.seeded & (z > cfg.spike_zscore) & (log_ref_dev > self._log_ratio)
        if armed:
            layer_z = torch.where(spike[1:], z[1:], -math.inf)
            best_z, best = layer_z.max(0)
            any_layer = spike[1:].any()
            out[_C["spike_global"]] = spike[0].float()
            out[_C["spike_layer"]] = torch.where(any_layer, best.float(), -1.0)
            out[_C["spike_layer_z"]] = torch.where(any_layer, best_z, 0.0)
        out[_C["zscore"]] = z[0]
        out[_C["layer_zmax"]] = z[1:].max()
        out[_C["median_ratio"]] = torch.exp(x[0] - median)

        # state: seed with the first finite value, then EMA of the clipped deviation
        bound = cfg.spike_zscore * std
        d = torch.maximum(torch.minimum(dev, bound), -bound)
        a = cfg.ema_alpha
        new_mean = torch.where(self.seeded, self.mean + a * d, x)
        new_var = torch.where(self.seeded, (1 - a) * (self.var + a * d * d), self.var)
        self.mean.copy_(torch.where(finite, new_mean, self.mean))
        self.var.copy_(torch.where(finite, new_var, self.var))
        self.seeded |= finite
        self.history[slot] = torch.where(finite[0], x[0], self.history[slot])

        # vanishing: consecutive steps under the floor; the event fires once, on the N-th
        below = finite[0] & (x[0] < math.log(cfg.vanishing_norm))
        self.below.copy_(torch.where(below, self.below + 1, 0.0))
        out[_C["vanishing"]] = (self.below == cfg.vanishing_steps).float()

        self._rank_outliers(row, layout, out, armed)
        out[_C["block"]] = (~finite[0] | spike.any() if armed else ~finite[0]).float()
        self.updates += 1

    def _rank_outliers(self, row: torch.Tensor, layout: RowLayout, out: torch.Tensor, armed: bool) -> None:
        w = layout.rank_width
        gathered = row[layout.gathered].view(self.world, w)
        base = self.rank_layer_cols
        total = gathered[:, base + RANK_FIELDS.index("total_sq")]
        ok = gathered[:, base + RANK_FIELDS.index("valid")] == 1.0
        x = torch.where(ok, 0.5 * torch.log(total), math.nan)
        x = torch.where(torch.isfinite(x), x, math.nan)  # non-finite ranks are the NaN event's
        dev = (x - torch.nanmedian(x)).abs()
        scale = torch.sqrt(self.dev_var.nan_to_num(0.0)).clamp(min=self.cfg.outlier_min_scale)
        score = (dev / scale).nan_to_num(0.0)
        # scale state: EMA over steps of the ranks' mean squared deviation without the largest
        # one, so a rank that stays bad (or is bad from the start) never inflates the scale
        d2 = dev * dev
        n = (~torch.isnan(d2)).sum()
        top = torch.where(torch.isnan(d2), 0.0, d2).max()
        trimmed = (torch.nansum(d2) - torch.where(n >= 3, top, 0.0)) / (n - (n >= 3).long()).clamp(min=1)
        m2 = torch.where(n >= 2, trimmed * self._consistency, math.nan)
        a = self.cfg.ema_alpha
        new_var = torch.where(torch.isnan(self.dev_var), m2, (1 - a) * self.dev_var + a * m2)
        self.dev_var.copy_(torch.where(torch.isfinite(m2), new_var, self.dev_var))
        out[len(COLUMNS):] = score
        best_score, best = score.max(0)
        if armed and self.world >= 3:
            out[_C["outlier"]] = (best_score > self.cfg.outlier_score).float()
        out[_C["outlier_rank"]] = best.float()
        out[_C["outlier_score"]] = best_score


class DetectorDecoder:
    """Host side: detector columns of a row -> events and scores added to the Snapshot."""

    def __init__(self, cfg: DetectorConfig, layers: Sequence[str]) -> None:
        self.cfg = cfg
        self.layers = tuple(layers)

    def __call__(self, step: int, cols: list[float], snap: Snapshot) -> Snapshot:
        c = {name: cols[i] for name, i in _C.items()}
        cfg = self.cfg
        events: list[AnomalyEvent] = []
        if snap.nonfinite:
            rank, layer = snap.first_nonfinite or (-1, "")
            events.append(AnomalyEvent("nonfinite", step, rank, layer, snap.grad_norm, math.inf))
        if c["spike_global"] or c["spike_layer"] >= 0:
            layer = self.layers[int(c["spike_layer"])] if c["spike_layer"] >= 0 else ""
            value = c["spike_layer_z"] if layer else c["zscore"]
            events.append(AnomalyEvent("spike", step, -1, layer, value, cfg.spike_zscore))
        if c["vanishing"]:
            events.append(AnomalyEvent("vanishing", step, -1, "", snap.grad_norm, cfg.vanishing_norm))
        if c["outlier"]:
            events.append(AnomalyEvent("rank_outlier", step, int(c["outlier_rank"]), "",
                                       c["outlier_score"], cfg.outlier_score))
        return replace(snap, events=tuple(events),
                       scores={"zscore": c["zscore"], "median_ratio": c["median_ratio"],
                               "layer_zmax": c["layer_zmax"]},
                       rank_outlier_scores=cols[len(COLUMNS):])


def block_column(layout: RowLayout) -> int:
    """Row index of the guard's verdict column (1.0 = do not take this step)."""
    return layout.detector.start + _C["block"]
