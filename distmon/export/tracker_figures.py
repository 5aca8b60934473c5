"""A snapshot as the figures an experiment tracker is handed: names grouped by kind, one step each.

Every tracker adapter (``trackers.py``) and the framework callbacks write these, so a figure has
one name and one value everywhere: the value is the snapshot's (what ``/metrics`` serves and
the JSONL log holds), the step is the snapshot's own ``step``, never the tracker's "now".

Names are built so that each tool's default grouping (TensorBoard, W&B and MLflow all group
charts by the part of the name before the first ``/``) shows one section per figure kind:

- ``distmon/<figure>``: the job-wide single figures (the global norm, its scores, non-finite
  and skipped flags, the noise scale, ...), one section ``distmon``;
- ``distmon.<kind>/<item>``: the per-layer, per-rank and per-module families, one section each
  (``distmon.layer_grad_norm``, ``distmon.rank_grad_norm``, ...).

A figure is handed over when it was measured: the global and per-layer norms when the step's
reduced gradient was (``valid``; a NaN or Inf there is the gradient's, and is handed over), a
rank's norm when its local gradient was (``rank_valid``), the other figures when they are not
NaN (NaN is "not yet meaningful" for the scores and the noise scale, "not on this step" for
update ratios). Which names exist is documented in ``docs/trackers.md``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from ..snapshot import AnomalyEvent, Snapshot

__all__ = ["Figures", "figures_of", "EVENTS", "STEP_KEY", "FAMILIES", "mlflow_name"]

EVENTS = "distmon/events"  # the text of a step's events, where a tool takes text
STEP_KEY = "distmon_step"  # W&B's x-axis for distmon's figures (its own step counts rows)
# the per-item families, in the order the docs list them
FAMILIES = (
    "layer_grad_norm",
    "rank_grad_norm",
    "rank_outlier_score",
    "layer_gradient_noise_scale",
    "layer_update_ratio",
    "activation_rms",
    "activation_absmax",
    "anomalies",
)
# score key in Snapshot.scores -> its figure
_SCORES = {
    "zscore": "distmon/grad_norm_zscore",
    "median_ratio": "distmon/grad_norm_median_ratio",
    "rank_outlier_worst": "distmon/rank_outlier_worst_score",
    "rank_outlier_worst_rank": "distmon/rank_outlier_worst_rank",
}


@dataclass(frozen=True)
class Figures:
    """One step's figures: ``scalars`` (name -> float) and ``text`` (its events, or ``""``).

    Example:
        >>> f = figures_of(Snapshot(step=3, timestamp=1.5, grad_norm=2.0, layer_grad_norms={"fc": 2.0}))
        >>> f.step, f.scalars["distmon/grad_norm"], f.scalars["distmon.layer_grad_norm/fc"], f.text
        (3, 2.0, 2.0, '')
    """

    step: int
    timestamp: float  # unix time the step finished (TensorBoard's walltime, MLflow's timestamp)
    scalars: dict[str, float] = field(default_factory=dict)
    text: str = ""

    def logs(self) -> dict[str, float | str]:
        """The scalars, with the events' text under :data:`EVENTS` on a step that has events."""
        return {**self.scalars, EVENTS: self.text} if self.text else dict(self.scalars)


def _family(out: dict[str, float], kind: str, items: dict[str, float] | list[tuple[object, float]]) -> None:
    pairs = items.items() if isinstance(items, dict) else items
    for item, value in pairs:
        if not math.isnan(value):
            out[f"distmon.{kind}/{item}"] = float(value)


def describe(event: AnomalyEvent) -> str:
    """One event as a line of text.

    Example:
        >>> describe(AnomalyEvent(kind="spike", step=7, rank=-1, layer="", value=9.5, threshold=6.0))
        'step 7: spike, value 9.5 (threshold 6)'
    """
    where = []
    if event.rank >= 0:
        where.append(f"rank {event.rank}")
    if event.layer:
        where.append(f"layer {event.layer!r}")
    place = f" on {', '.join(where)}" if where else ""
    value = f"value {event.value:.6g} (threshold {event.threshold:.6g})"
    return f"step {event.step}: {event.kind}{place}, {value}"


def figures_of(snap: Snapshot) -> Figures:
    """The figures of ``snap``, named as the module docstring says.

    Example:
        >>> snap = Snapshot(step=5, timestamp=0.0, grad_norm=float("nan"), nonfinite=True,
        ...                 ranks=[0, 1], rank_grad_norms=[1.0, float("nan")], rank_valid=[True, True],
        ...                 first_nonfinite=(1, "fc"), nonfinite_rank_count=1)
        >>> f = figures_of(snap)
        >>> f.scalars["distmon/nonfinite"], f.scalars["distmon/first_nonfinite_rank"]
        (1.0, 1.0)
        >>> sorted(k for k in f.scalars if k.startswith("distmon.rank"))
        ['distmon.rank_grad_norm/0', 'distmon.rank_grad_norm/1']
        >>> f.text
        "step 5: first non-finite gradient on rank 1, layer 'fc'"
    """
    s: dict[str, float] = {}
    if snap.valid:  # the reduced gradient was measured: its NaN/Inf is the gradient's own
        s["distmon/grad_norm"] = float(snap.grad_norm)
        for layer, value in snap.layer_grad_norms.items():
            s[f"distmon.layer_grad_norm/{layer}"] = float(value)
    for rank, value, ok in zip(snap.ranks, snap.rank_grad_norms, snap.rank_valid):
        if ok:
            s[f"distmon.rank_grad_norm/{rank}"] = float(value)
    nonfinite = snap.nonfinite and snap.skip_reason != "scaler"  # as distmon_nonfinite_steps_total
    s["distmon/nonfinite"] = float(nonfinite)
    s["distmon/nonfinite_rank_count"] = float(snap.nonfinite_rank_count)
    if snap.first_nonfinite is not None:
        s["distmon/first_nonfinite_rank"] = float(snap.first_nonfinite[0])
    s["distmon/skipped"] = float(snap.skipped)
    s["distmon/monitor_errors"] = float(snap.monitor_errors)
    for key, name in _SCORES.items():
        value = snap.scores.get(key, math.nan)
        if not math.isnan(value):
            s[name] = float(value)
    if "distmon/rank_outlier_worst_score" not in s:  # no peer group of 3+ ranks: no worst rank either
        s.pop("distmon/rank_outlier_worst_rank", None)
    _family(s, "rank_outlier_score", list(zip(snap.ranks, snap.rank_outlier_scores)))
    for name, value in (
        ("distmon/gradient_noise_scale", snap.gradient_noise_scale),
        ("distmon/gradient_noise_trace", snap.noise_trace),
        ("distmon/gradient_noise_signal", snap.noise_signal),
    ):
        if not math.isnan(value):
            s[name] = float(value)
    _family(s, "layer_gradient_noise_scale", snap.layer_gradient_noise_scale)
    _family(s, "layer_update_ratio", snap.layer_update_ratio)
    _family(s, "activation_rms", snap.activation_rms)
    _family(s, "activation_absmax", snap.activation_absmax)
    if snap.first_nonfinite_activation is not None:
        s["distmon/first_nonfinite_activation_rank"] = float(snap.first_nonfinite_activation[0])
    kinds = Counter(e.kind for e in snap.events)
    _family(s, "anomalies", {kind: float(n) for kind, n in kinds.items()})
    lines = [describe(e) for e in snap.events]
    if snap.first_nonfinite is not None and "nonfinite" not in kinds:
        rank, layer = snap.first_nonfinite
        lines.insert(0, f"step {snap.step}: first non-finite gradient on rank {rank}, layer {layer!r}")
    return Figures(step=snap.step, timestamp=snap.timestamp, scalars=s, text="\n".join(lines))


_MLFLOW_BAD = re.compile(r"[^\w\-. /]")


def mlflow_name(name: str) -> str:
    """``name`` as MLflow takes a metric or tag key: alphanumerics, ``_ - . /`` and spaces only.

    Example:
        >>> mlflow_name("distmon.layer_grad_norm/blocks[0]:fc")
        'distmon.layer_grad_norm/blocks_0__fc'
    """
    return _MLFLOW_BAD.sub("_", name).replace("..", "._")
