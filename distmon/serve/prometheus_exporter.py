"""Prometheus export: a custom Collector over the latest snapshots, in its own registry.

The export thread folds every snapshot into :class:`MetricsAggregate` (counters, the
histogram of every step's norm, the window maximum) and swaps in a new immutable view;
``collect()`` only reads that view, so a scrape never touches torch or blocks training.
Gauges show the latest step whose figures were measured: a step that measured nothing (no
backward, a monitor failure) leaves them at their last measured values, never at a
real-looking made-up number; counters, the step count and the step timestamp still advance.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..layout.placements import COORD_LABELS
from ..setup.hostinfo import RankInfo
from ..snapshot import ANOMALY_KINDS, Snapshot

__all__ = ["MetricsAggregate", "GradCollector", "ANOMALY_KINDS", "NORM_BUCKETS", "METRICS", "MetricSpec"]

# 1, 2.5, 5 x 10^k for k = -4..4: wide enough for fp32 training from init to late phases
NORM_BUCKETS = tuple(m * 10.0**k for k in range(-4, 5) for m in (1.0, 2.5, 5.0))
RANK_LABELS = ("rank", "local_rank", "hostname", "node", "gpu_uuid")


class MetricSpec(NamedTuple):
    """One metric: its type, its labels besides ``run_id``, its help text."""

    kind: Literal["gauge", "counter", "histogram"]
    labels: tuple[str, ...]
    help: str


# The one description of every metric: the collector builds its families from it, and the
# docs/metrics.md's table (distmon/doc_tables.py) and the deploy tests read it.
METRICS: dict[str, MetricSpec] = {
    "distmon_grad_norm": MetricSpec(
        "gauge", (), "L2 norm of the reduced gradient at the latest measured step."
    ),
    "distmon_layer_grad_norm": MetricSpec(
        "gauge",
        ("layer", "depth"),
        "L2 norm of one layer's reduced gradient at the latest measured step; depth = position in model "
        "order.",
    ),
    "distmon_rank_grad_norm": MetricSpec(
        "gauge", RANK_LABELS, "A rank's local gradient norm before all-reduce, latest measured step."
    ),
    "distmon_step_grad_norm": MetricSpec(
        "histogram", (), "Every step's finite global gradient norm (spikes between scrapes)."
    ),
    "distmon_grad_norm_window_max": MetricSpec(
        "gauge", (), "Largest global gradient norm over the last window_s seconds."
    ),
    "distmon_optimizer_steps_total": MetricSpec("counter", (), "Optimizer steps taken."),
    "distmon_last_step_timestamp_seconds": MetricSpec("gauge", (), "Unix time of the latest optimizer step."),
    "distmon_nonfinite_steps_total": MetricSpec(
        "counter", (), "Steps whose gradient held a NaN or Inf on some rank (GradScaler skips apart)."
    ),
    "distmon_scaler_skipped_steps_total": MetricSpec(
        "counter", (), "Steps the GradScaler skipped (Inf/NaN in the scaled gradient: fp16 overflow)."
    ),
    "distmon_monitor_errors_total": MetricSpec(
        "counter", (), "Errors caught in distmon's own code, all ranks."
    ),
    "distmon_restart_count": MetricSpec(
        "gauge",
        (),
        "Times the launcher restarted the job (torchrun's TORCHELASTIC_RESTART_COUNT, Slurm's "
        "SLURM_RESTART_COUNT).",
    ),
    "distmon_run_finished": MetricSpec(
        "gauge", (), "1 after a clean finish (served a while longer), else 0."
    ),
    "distmon_anomalies_total": MetricSpec("counter", ("kind",), "Detector events by kind."),
    "distmon_grad_norm_zscore": MetricSpec(
        "gauge", (), "Spike score: z-score of the log global norm against its EMA."
    ),
    "distmon_grad_norm_median_ratio": MetricSpec(
        "gauge",
        (),
        "Global norm over the running median of the norms of earlier exports (absent until there are some).",
    ),
    "distmon_gradient_noise_scale": MetricSpec(
        "gauge",
        (),
        "Gradient noise scale B_simple = EMA tr(Sigma) / EMA |G|^2, batch_size units (NaN until meaningful).",
    ),
    "distmon_layer_gradient_noise_scale": MetricSpec(
        "gauge", ("layer", "depth"), "One layer's gradient noise scale B_simple (NaN until meaningful)."
    ),
    "distmon_gradient_noise_trace": MetricSpec(
        "gauge", (), "Bias-corrected EMA of tr(Sigma), the per-example gradient variance (GNS numerator)."
    ),
    "distmon_gradient_noise_signal": MetricSpec(
        "gauge", (), "Bias-corrected EMA of |G|^2, the squared true gradient (noise scale denominator)."
    ),
    "distmon_activation_rms": MetricSpec(
        "gauge", ("layer",), "RMS of a watched module's forward output (serving rank, last activation step)."
    ),
    "distmon_activation_absmax": MetricSpec(
        "gauge", ("layer",), "Largest |value| of a watched module's forward output (Inf: non-finite)."
    ),
    "distmon_attention_logit_bound": MetricSpec(
        "gauge",
        ("layer",),
        "An attention block's logit bound max|q| max|k| / sqrt(d_head), the largest over the ranks at "
        "the latest sampled step (precursor=; warns above PrecursorConfig.bound, 1000).",
    ),
    "distmon_gradient_cosine": MetricSpec(
        "gauge",
        (),
        "The mean cosine between consecutive steps' gradients over the latest sampling interval "
        "(PrecursorConfig(peak_lr=...); warns below cosine_below, -0.2, while the schedule still "
        "raises the rate).",
    ),
    "distmon_divergence_warning": MetricSpec(
        "gauge",
        (),
        "1 while the divergence precursor warns at the latest sampled step (precursor=), else 0.",
    ),
    "distmon_layer_update_ratio": MetricSpec(
        "gauge",
        ("layer", "depth"),
        "A layer's ||update|| / ||weights|| at the latest export_every-th step (update_ratio=True).",
    ),
    "distmon_rank_nonfinite_steps_total": MetricSpec(
        "counter", RANK_LABELS, "Steps whose local gradient held a NaN or Inf on this rank."
    ),
    "distmon_rank_outlier_score": MetricSpec(
        "gauge", RANK_LABELS, "Robust distance of a rank's log-norm from the other ranks'."
    ),
    "distmon_rank_outlier_worst_score": MetricSpec(
        "gauge",
        (),
        "The job's largest rank-outlier score at the latest measured step, from every node (absent "
        "without a group of >= 3 peer ranks).",
    ),
    "distmon_rank_outlier_worst_rank": MetricSpec(
        "gauge", (), "The rank with that score (wherever it runs; its own series are on its node)."
    ),
    "distmon_last_nonfinite_step": MetricSpec(
        "gauge",
        ("rank", "layer"),
        "The latest step with a NaN/Inf gradient; labels: the first non-finite (rank, layer) in backward "
        "order, on any node (rank -1: non-finite only after the reduction).",
    ),
    "distmon_run_info": MetricSpec("gauge", ("world_size", "version", "serve"), "Run metadata; value 1."),
}


def _family(name: str, gpu: bool = True, coords: bool = False) -> Metric:
    """An empty family of metric ``name`` with ``run_id`` and its labels (``gpu_uuid`` only on GPUs;
    a per-rank family's parallel coordinates, ``dp_rank`` ..., in a job of several dimensions)."""
    spec = METRICS[name]
    labels = ["run_id"] + [label for label in spec.labels if gpu or label != "gpu_uuid"]
    if coords and spec.labels == RANK_LABELS:
        labels += COORD_LABELS
    if spec.kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=labels)
    if spec.kind == "histogram":
        return HistogramMetricFamily(name, spec.help, labels=labels)
    return GaugeMetricFamily(name, spec.help, labels=labels)


@dataclass(frozen=True)
class _View:
    latest: Snapshot | None = None  # the newest step
    measured: Snapshot | None = None  # the newest step whose figures were all measured
    nonfinite_steps: int = 0
    scaler_skipped_steps: int = 0
    rank_nonfinite: Mapping[int, int] = field(default_factory=dict)  # by rank, the served ones
    rank_norms: Mapping[int, float] = field(default_factory=dict)  # each rank's latest measured local norm
    anomalies: tuple[tuple[str, int], ...] = tuple((kind, 0) for kind in ANOMALY_KINDS)
    window_max: float = math.nan
    activations: Snapshot | None = None  # the newest step with activation figures
    precursor: Snapshot | None = None  # the newest step the precursor sampled (bounds, a cosine)
    nonfinite: Snapshot | None = None  # the newest step with a non-finite gradient (scaler skips apart)
    updates: Snapshot | None = None  # the newest step with update ratios
    finished: bool = False


@dataclass(kw_only=True)
class MetricsAggregate:
    """Host-side accumulation of snapshots into what the collector serves.

    ``cluster`` says whether this process serves the cluster-wide families; ``ranks`` are the
    ranks whose per-rank series it serves. ``own_errors`` reads this process's live error
    count, so errors it counts after its last exported step (a full disk under the JSONL
    log during the final export, say) still reach the served total.
    """

    run_id: str
    world_size: int
    version: str
    serve: str
    cluster: bool
    ranks: tuple[RankInfo, ...]
    window_s: float = 60.0
    rank: int = 0
    restart: int = 0  # the launcher's restart count
    own_errors: Callable[[], int] = lambda: 0
    view: _View = field(default_factory=_View)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._window: deque[tuple[float, float]] = deque()
        self._hist = Histogram(
            "distmon_step_grad_norm",
            METRICS["distmon_step_grad_norm"].help,
            ["run_id"],
            buckets=NORM_BUCKETS,
            registry=None,
        )
        self._hist_child = self._hist.labels(self.run_id)
        self._anomalies = dict(self.view.anomalies)
        self._rank_nonfinite = {info.rank: 0 for info in self.ranks}
        self._rank_norms: dict[int, float] = {}
        self._nonfinite = 0
        self._scaler_skipped = 0

    def add(self, snaps: Sequence[Snapshot]) -> None:
        """Fold snapshots (in step order) in and swap in a new view."""
        with self._lock:
            measured = self.view.measured
            activations, updates, precursor = self.view.activations, self.view.updates, self.view.precursor
            nonfinite = self.view.nonfinite
            for s in snaps:
                if s.activation_rms:
                    activations = s
                if s.layer_update_ratio:
                    updates = s
                if s.attention_logit_bound or not math.isnan(s.gradient_cosine):
                    precursor = s
                for e in s.events:
                    self._anomalies[e.kind] = self._anomalies.get(e.kind, 0) + 1
                if s.skip_reason == "scaler":  # routine fp16 overflow: counted apart, not served as a norm
                    self._scaler_skipped += 1
                    continue
                # a rank's local figures can be measured when the global ones are not, and back
                ranks = s.ranks or range(len(s.rank_grad_norms))
                for r, norm, ok in zip(ranks, s.rank_grad_norms, s.rank_valid or [s.valid] * len(ranks)):
                    if ok:
                        self._rank_norms[r] = norm
                if s.valid:
                    measured = s
                    if math.isfinite(s.grad_norm):
                        self._hist_child.observe(s.grad_norm)
                        self._window.append((s.timestamp, s.grad_norm))
                self._nonfinite += s.nonfinite
                if s.first_nonfinite is not None:
                    nonfinite = s
                for r in s.nonfinite_ranks:
                    if r in self._rank_nonfinite:  # another node's rank is counted by its node
                        self._rank_nonfinite[r] += 1
            last = snaps[-1]
            while self._window and self._window[0][0] < last.timestamp - self.window_s:
                self._window.popleft()
            self.view = replace(
                self.view,
                latest=last,
                measured=measured,
                nonfinite_steps=self._nonfinite,
                scaler_skipped_steps=self._scaler_skipped,
                activations=activations,
                updates=updates,
                precursor=precursor,
                nonfinite=nonfinite,
                rank_nonfinite=dict(self._rank_nonfinite),
                rank_norms=dict(self._rank_norms),
                anomalies=tuple(self._anomalies.items()),
                window_max=max((v for _, v in self._window), default=math.nan),
            )

    def mark_finished(self) -> None:
        with self._lock:
            self.view = replace(self.view, finished=True)

    def monitor_errors(self) -> int:
        """Errors summed over ranks as of the latest step, with this process's later ones."""
        latest = self.view.latest
        ranks = (latest.ranks or range(len(latest.rank_monitor_errors))) if latest is not None else ()
        if latest is None or self.rank not in ranks:
            return self.own_errors()
        mine = latest.rank_monitor_errors[list(ranks).index(self.rank)]
        return latest.monitor_errors - mine + self.own_errors()

    def histogram(self) -> Iterable[Metric]:
        """The histogram of every step's norm, as the client library counts it (no ``_created``)."""
        for metric in self._hist.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class GradCollector(Collector):
    """Yields distmon's metric families from the aggregate's current view (never touches torch).

    Example:
        >>> from prometheus_client import CollectorRegistry
        >>> agg = MetricsAggregate(run_id="run-1", world_size=1, version="0.1.0", serve="rank0",
        ...                        cluster=True, ranks=())
        >>> registry = CollectorRegistry()
        >>> registry.register(GradCollector(agg))
        >>> registry.get_sample_value("distmon_optimizer_steps_total", {"run_id": "run-1"})
        0
    """

    def __init__(self, agg: MetricsAggregate) -> None:
        self.agg = agg

    def describe(self) -> Iterable[Metric]:
        """Every family this collector can yield, empty: lets a registry answer ``?name[]=`` queries."""
        return [_family(name) for name in METRICS]

    def collect(self) -> Iterable[Metric]:
        """The key gauges first (global, per-layer and per-rank norms: what a person reading
        ``/metrics`` looks for), then detector scores, the noise scale, counters, the histogram."""
        agg, v = self.agg, self.agg.view
        m = v.measured
        if agg.cluster and m is not None:
            yield self._one("distmon_grad_norm", m.grad_norm)
            yield self._by_layer("distmon_layer_grad_norm", m.layer_grad_norms, depth=True)
        if agg.ranks and v.rank_norms:
            yield self._per_rank("distmon_rank_grad_norm", v.rank_norms.get)
        if agg.cluster:
            yield from self._cluster(v)
        if agg.ranks:
            yield self._per_rank("distmon_rank_nonfinite_steps_total", lambda r: v.rank_nonfinite.get(r, 0))
            scores = (
                dict(zip(m.ranks or range(len(m.rank_outlier_scores)), m.rank_outlier_scores)) if m else {}
            )
            if any(not math.isnan(x) for x in scores.values()):  # NaN: in a group of fewer than 3 ranks
                yield self._per_rank(
                    "distmon_rank_outlier_score",
                    lambda r: None if math.isnan(scores.get(r, math.nan)) else scores[r],
                )

    def _cluster(self, v: _View) -> Iterable[Metric]:
        """The cluster-wide families after the norms (global rank 0 only)."""
        agg, m = self.agg, v.measured
        if m is not None:
            yield self._one("distmon_grad_norm_window_max", v.window_max)
            if "zscore" in m.scores:
                yield self._one("distmon_grad_norm_zscore", m.scores["zscore"])
            if not math.isnan(m.scores.get("median_ratio", math.nan)):  # NaN: no earlier step yet
                yield self._one("distmon_grad_norm_median_ratio", m.scores["median_ratio"])
            if not math.isnan(m.scores.get("rank_outlier_worst", math.nan)):  # NaN: no group of 3+
                yield self._one("distmon_rank_outlier_worst_score", m.scores["rank_outlier_worst"])
                yield self._one("distmon_rank_outlier_worst_rank", m.scores["rank_outlier_worst_rank"])
            if m.layer_gradient_noise_scale:  # batch_size given: the noise scale is on
                yield self._one("distmon_gradient_noise_scale", m.gradient_noise_scale)
                yield self._one("distmon_gradient_noise_trace", m.noise_trace)
                yield self._one("distmon_gradient_noise_signal", m.noise_signal)
                yield self._by_layer(
                    "distmon_layer_gradient_noise_scale", m.layer_gradient_noise_scale, depth=True
                )
        if v.precursor is not None:  # precursor=: every rank holds the job's largest samples
            if v.precursor.attention_logit_bound:
                yield self._by_layer("distmon_attention_logit_bound", v.precursor.attention_logit_bound)
            if not math.isnan(v.precursor.gradient_cosine):
                yield self._one("distmon_gradient_cosine", v.precursor.gradient_cosine)
            yield self._one("distmon_divergence_warning", 1.0 if v.precursor.divergence_warning else 0.0)
        if v.nonfinite is not None and v.nonfinite.first_nonfinite is not None:
            rank, layer = v.nonfinite.first_nonfinite
            yield self._one("distmon_last_nonfinite_step", v.nonfinite.step, labels=(str(rank), layer))
        if v.latest is not None:
            yield self._one("distmon_last_step_timestamp_seconds", v.latest.timestamp)
        yield self._one("distmon_optimizer_steps_total", v.latest.step if v.latest else 0)
        yield self._one("distmon_nonfinite_steps_total", v.nonfinite_steps)
        yield self._one("distmon_scaler_skipped_steps_total", v.scaler_skipped_steps)
        yield self._one("distmon_monitor_errors_total", agg.monitor_errors())
        anomalies = _family("distmon_anomalies_total")
        for kind, n in v.anomalies:
            anomalies.add_metric([agg.run_id, kind], n)
        yield anomalies
        yield from agg.histogram()
        yield self._one("distmon_run_info", 1.0, labels=(str(agg.world_size), agg.version, agg.serve))
        yield self._one("distmon_run_finished", 1.0 if v.finished else 0.0)
        yield self._one("distmon_restart_count", agg.restart)
        if v.activations is not None:
            yield self._by_layer("distmon_activation_rms", v.activations.activation_rms)
            yield self._by_layer("distmon_activation_absmax", v.activations.activation_absmax)
        if v.updates is not None:
            yield self._by_layer("distmon_layer_update_ratio", v.updates.layer_update_ratio, depth=True)

    def _by_layer(self, name: str, values: dict[str, float], depth: bool = False) -> Metric:
        """A family with one series per layer (``depth``: with its position in model order)."""
        family = _family(name)
        for i, (layer, value) in enumerate(values.items()):
            family.add_metric([self.agg.run_id, layer] + ([f"{i:04d}"] if depth else []), value)
        return family

    def _per_rank(self, name: str, value_of: Callable[[int], float | None]) -> Metric:
        """A family with one series per served rank (``None``: never measured there, no series)."""
        agg = self.agg
        family = _family(name, bool(agg.ranks[0].gpu_uuid), coords=agg.ranks[0].coords is not None)
        for info in agg.ranks:
            value = value_of(info.rank)
            if value is not None:
                family.add_metric([agg.run_id, *info.labels().values()], value)
        return family

    def _one(self, name: str, value: float, labels: tuple[str, ...] = ()) -> Metric:
        family = _family(name)
        family.add_metric([self.agg.run_id, *labels], value)
        return family
