"""The warnings each detector gives on a recording: distmon's precursor, and the alternatives.

Every function takes one recording (:func:`benchmarks.divergence.runs.load`) and returns the
steps at which its detector warns (sorted; a detector that stops training, Lightning's,
warns once). Steps are 0-based loop indices, like the recording's loss.

- :func:`precursor_steps`: ``distmon.verdicts.precursor.PrecursorDetector`` (the code that ships) on a
  signal sampled every ``every`` steps, fed ``chunk`` samples per call as an export would;
- :func:`distmon_spike_steps`: distmon's own explosion detector (``GradMonitor(detect=True)``),
  its ``spike`` events as recorded live during the run (``event.step`` counts optimizer steps:
  loop index + 1), dated at the step they judge, not the export that delivers them;
- :func:`lightning_spike_step`: Lightning's ``SpikeDetection`` rule, reimplemented line by
  line from ``lightning.fabric.utilities.spike`` (defaults: mode min, window 10, warmup 1,
  atol None, rtol 2.0, finite_only True) on the per-step loss;
- :func:`gradnorm_steps`: the global gradient norm (before clipping) above a fixed threshold
  (and :func:`gradnorm_jump`, its largest rise within a window: a rule tried and not kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from distmon.verdicts.precursor import PrecursorConfig, PrecursorDetector

from .model import ModelConfig
from .train import RunSpec

Recording = dict[str, object]


def spec_of(rec: Recording) -> RunSpec:
    """The :class:`RunSpec` a recording was made with."""
    d = dict(rec["spec"])
    return RunSpec(**{**d, "model": ModelConfig(**d["model"])})


def signal(rec: Recording, name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(steps, values (samples, columns), column names)`` of a recorded signal.

    Names are the recorder's (``attn_logit_max``, ``lin_rms``, ...), a recorder name with a
    ``:`` filter on its column names (``lin_rms:fc2``), ``Z`` (``exp`` of the mean log Z, so that
    the rise rule reads nats of log Z), or ``1-grad_cos`` (one minus the consecutive gradients'
    cosine: positive, as the detector's signals are, and above 1 where they point apart).
    """
    arrays = rec["arrays"]
    key, _, pick = name.partition(":")
    if key == "Z":
        values, cols = np.exp(arrays["z_mean"].astype(np.float64)), ["log_z"]
    elif key == "1-grad_cos":  # NaN (a run's first step: no pair yet) as 0, "not measured"
        values, cols = np.nan_to_num(1.0 - arrays["grad_cos"].astype(np.float64), nan=0.0), [key]
    else:
        values = arrays[key]
        cols = {
            "lin_rms": rec["linears"],
            "lin_max": rec["linears"],
            "attn_logit_max": rec["blocks"],
            "attn_bound": rec["blocks"],
            "update_ratio": rec["layers"],
            "layer_grad_norm": rec["layers"],
        }.get(key, [key])
    if pick:
        keep = [i for i, c in enumerate(cols) if pick in c]
        values, cols = values[:, keep], [cols[i] for i in keep]
    return np.asarray(arrays["step"]), np.asarray(values, np.float64), list(cols)


def precursor_steps(
    rec: Recording,
    parts: Sequence[tuple[str, float | None]],
    cfg: PrecursorConfig,
    *,
    chunk: int = 10,
    schedule: bool = False,
) -> list[int]:
    """Steps whose sample warns: the signals of ``parts`` (``(name, bound)``, None: the rise rule)
    side by side as the detector's columns, sampled every ``cfg.every`` steps, ``chunk`` samples
    per call. With ``schedule``, the ``1-grad_cos`` columns count only while the run's rate still
    rises and its peak is ``cfg.rate_headroom`` times the rate at the sample or more: the oscillation rule as
    ``PrecursorConfig(peak_lr=`` the run's peak ``)`` applies it (``distmon.verdicts.judge``)."""
    cols: list[np.ndarray] = []
    bounds: list[float | None] = []
    gated: list[bool] = []
    steps = None
    for name, bound in parts:
        steps, values, names = signal(rec, name)
        cols.append(values)
        bounds += [bound] * len(names)
        gated += [schedule and name == "1-grad_cos"] * len(names)
    keep = steps % cfg.every == 0
    values = np.concatenate(cols, 1)[keep]
    if any(gated):  # elsewhere 0, the detector's "not measured", as distmon's judge hands it over
        spec = spec_of(rec)
        lr = np.array([spec.lr_at(int(s)) for s in steps[keep]])
        # headroom while the rate still rises (not below its highest so far), as GradientCosine gives it
        room = (spec.lr / lr >= cfg.rate_headroom) & (lr >= np.maximum.accumulate(lr))
        cols_gated = np.array(gated)
        values[:, cols_gated] = np.where(room[:, None], values[:, cols_gated], 0.0)
    det = PrecursorDetector(len(bounds), cfg, bounds=bounds)
    x = torch.tensor(values, dtype=torch.float32)
    warn = torch.cat([det.update(x[i : i + chunk]).warn for i in range(0, len(x), chunk)])
    return [int(s) for s in steps[keep][warn.numpy()]]


def distmon_spike_steps(rec: Recording, kinds: Sequence[str] = ("spike",)) -> list[int]:
    """Loop steps of distmon's events of ``kinds``."""
    return sorted({int(e["step"]) - 1 for e in rec["distmon_events"] if e["kind"] in kinds})


def lightning_spike_step(
    loss: Sequence[float],
    *,
    window: int = 10,
    warmup: int = 1,
    atol: float | None = None,
    rtol: float | None = 2.0,
    finite_only: bool = True,
) -> list[int]:
    """Lightning's ``SpikeDetection`` (mode ``min``): the batch it raises at, or none.

    Example:
        >>> lightning_spike_step([3.0, 2.9, 2.8, 9.0])   # 9 >= 2.8 + 2 * mean(3, 2.9, 2.8)
        [3]
        >>> lightning_spike_step([3.0, 2.9, 2.8, 8.0])
        []
    """
    values: list[float] = []  # torchmetrics Running(MeanMetric, window): mean of the last `window`
    last_val = 0.0
    for batch_idx, val in enumerate(loss):
        if batch_idx >= warmup:
            running = float(np.mean(values[-window:])) if values else math.nan
            if finite_only and not math.isfinite(val):
                return [batch_idx]
            better = val - last_val <= 0.0  # mode "min"
            if not better:
                ok_atol = atol is None or abs(val - running) >= abs(atol)
                ok_rtol = rtol is None or abs(val - running) >= abs(rtol * running)
                if ok_atol and ok_rtol:
                    return [batch_idx]  # TrainingSpikeException: training stops
        values.append(val)
        last_val = val
    return []


def gradnorm_steps(rec: Recording, threshold: float, *, after: int = 50) -> list[int]:
    """Steps (from ``after`` on) whose global gradient norm exceeds ``threshold`` or is non-finite."""
    g = np.asarray(rec["grad_norm"], np.float64)
    over = ~np.isfinite(g) | (g > threshold)
    over[:after] = False
    return [int(s) for s in np.flatnonzero(over)]


def gradnorm_jump(rec: Recording, until: int | None, *, window: int = 100, after: int = 50) -> float:
    """The largest rise of the global gradient norm within ``window`` steps, as a factor: the norm
    averaged over consecutive 10-step intervals, each interval's mean over the lowest of the
    intervals up to ``window`` steps before it, for intervals from ``after`` up to ``until``
    (the divergence step; None: the whole run). What a jump rule on the norm would threshold.

    Example:
        >>> rec = {"grad_norm": [1.0] * 60 + [4.0] * 40}
        >>> gradnorm_jump(rec, None, after=0)
        4.0
    """
    g = np.asarray(rec["grad_norm"], np.float64)[: until if until is not None else None]
    means = np.log(g[: len(g) // 10 * 10].reshape(-1, 10).mean(1))
    back = window // 10
    rises = [means[j] - means[max(0, j - back) : j + 1].min() for j in range(after // 10, len(means))]
    return float(np.exp(max(rises))) if rises else math.nan


def episodes(steps: Sequence[int], gap: int) -> int:
    """Separate warnings: runs of warning steps no more than ``gap`` apart count once.

    Example:
        >>> episodes([10, 20, 30, 200, 210], gap=10)
        2
    """
    n, last = 0, None
    for s in steps:
        if last is None or s - last > gap:
            n += 1
        last = s
    return n


def summarize(
    runs: Sequence[tuple[str, Recording, int | None]],
    warn: Callable[[Recording], list[int]],
    *,
    gap: int = 10,
) -> dict[str, object]:
    """The issue's figures for one detector over ``(class, recording, divergence step)`` triples.

    A diverging run is detected when the first warning comes no later than the divergence;
    its lead is ``divergence - first warning``. On the healthy runs every warning episode counts.
    """
    per_run, leads, fractions = [], [], []
    healthy = false_warnings = healthy_warned = 0
    for cls, rec, div in runs:
        steps = warn(rec)
        first = steps[0] if steps else None
        row = {"run": rec["name"], "class": cls, "diverged_at": div, "first_warning": first}
        if div is not None:
            hit = first is not None and first <= div
            row["lead_steps"] = div - first if hit else None
            if hit:
                leads.append(div - first)
                fractions.append((div - first) / max(div, 1))
        else:
            row["warnings"] = episodes(steps, gap)
            row["warning_steps"] = steps[:20]
            if cls == "healthy":
                healthy += 1
                false_warnings += row["warnings"]
                healthy_warned += bool(steps)
        per_run.append(row)
    diverging = sum(div is not None for _, _, div in runs)
    return {
        "diverging_runs": diverging,
        "detected": len(leads),
        "median_lead_steps": float(np.median(leads)) if leads else None,
        "min_lead_steps": int(min(leads)) if leads else None,
        "median_lead_fraction": float(np.median(fractions)) if fractions else None,
        "healthy_runs": healthy,
        "false_warnings": false_warnings,
        "healthy_runs_warned": healthy_warned,
        "runs": per_run,
    }
