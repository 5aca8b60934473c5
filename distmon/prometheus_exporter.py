"""Prometheus export: a custom Collector over the latest snapshots (served by ``http_server``).

The publisher thread folds every snapshot into :class:`MetricsAggregate` (counters, the
histogram of every step's norm, the window maximum) and swaps in a new immutable view;
``collect()`` only reads that view, so a scrape never touches torch or blocks training.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)
from prometheus_client.registry import Collector

from .hostinfo import RankInfo
from .snapshot import Snapshot

__all__ = ["MetricsAggregate", "GradCollector", "ANOMALY_KINDS", "NORM_BUCKETS", "METRICS"]

ANOMALY_KINDS = ("nonfinite", "spike", "vanishing", "rank_outlier")
# 1, 2.5, 5 x 10^k for k = -4..4: wide enough for fp32 training from init to late phases
NORM_BUCKETS = tuple(m * 10.0 ** k for k in range(-4, 5) for m in (1.0, 2.5, 5.0))

# name -> (type, extra labels, help); the README's metric table and the deploy tests read this
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "distmon_run_info": ("gauge", ("world_size", "version", "serve"), "Run metadata; value 1."),
    "distmon_grad_norm": ("gauge", (), "L2 norm of the reduced gradient at the latest step."),
    "distmon_layer_grad_norm": ("gauge", ("layer", "depth"),
                                "L2 norm of one layer's reduced gradient at the latest step; depth = position in model order."),
    "distmon_step_grad_norm": ("histogram", (), "Every step's finite global gradient norm (spikes between scrapes)."),
    "distmon_grad_norm_window_max": ("gauge", (), "Largest global gradient norm over the last window_s seconds."),
    "distmon_optimizer_steps_total": ("counter", (), "Optimizer steps taken."),
    "distmon_last_step_timestamp_seconds": ("gauge", (), "Unix time of the latest optimizer step."),
    "distmon_nonfinite_steps_total": ("counter", (), "Steps whose gradient held a NaN or Inf on some rank."),
    "distmon_monitor_errors_total": ("counter", (), "Errors caught in distmon's own code, all ranks."),
    "distmon_run_finished": ("gauge", (), "1 after a clean finish (served a while longer), else 0."),
    "distmon_anomalies_total": ("counter", ("kind",), "Detector events by kind."),
    "distmon_grad_norm_zscore": ("gauge", (), "Spike score: z-score of the log global norm against its EMA."),
    "distmon_grad_norm_median_ratio": ("gauge", (), "Global norm over the running median of recent norms."),
    "distmon_rank_grad_norm": ("gauge", ("rank", "local_rank", "hostname", "gpu_uuid"),
                               "A rank's local gradient norm before all-reduce, latest step."),
    "distmon_rank_nonfinite_steps_total": ("counter", ("rank", "local_rank", "hostname", "gpu_uuid"),
                                           "Steps whose local gradient held a NaN or Inf on this rank."),
    "distmon_rank_outlier_score": ("gauge", ("rank", "local_rank", "hostname", "gpu_uuid"),
                                   "Robust distance of a rank's log-norm from the other ranks'."),
}


@dataclass(frozen=True)
class _View:
    latest: Optional[Snapshot] = None
    steps: int = 0
    nonfinite_steps: int = 0
    rank_nonfinite: tuple[int, ...] = ()
    anomalies: tuple[tuple[str, int], ...] = ()
    hist_counts: tuple[int, ...] = ()
    hist_sum: float = 0.0
    hist_count: int = 0
    window_max: float = math.nan
    finished: bool = False


@dataclass
class MetricsAggregate:
    """Host-side accumulation of snapshots into what the collector serves.

    ``cluster`` says whether this process serves the cluster-wide families; ``ranks`` are the
    ranks whose per-rank series it serves.
    """

    run_id: str
    world_size: int
    version: str
    serve: str
    cluster: bool
    ranks: tuple[RankInfo, ...]
    window_s: float = 60.0
    view: _View = field(default_factory=_View)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._window: deque[tuple[float, float]] = deque()
        self._counts = [0] * len(NORM_BUCKETS)
        self._anomalies = dict.fromkeys(ANOMALY_KINDS, 0)
        self._rank_nonfinite = [0] * self.world_size
        self._sum = 0.0
        self._n = 0
        self._nonfinite = 0

    def add(self, snaps: Sequence[Snapshot]) -> None:
        """Fold snapshots (in step order) in and publish a new view."""
        with self._lock:
            for s in snaps:
                if math.isfinite(s.grad_norm):
                    i = bisect.bisect_left(NORM_BUCKETS, s.grad_norm)  # first bucket with le >= norm
                    if i < len(NORM_BUCKETS):  # above the top bucket: only +Inf counts it
                        self._counts[i] += 1
                    self._sum += s.grad_norm
                    self._n += 1
                    self._window.append((s.timestamp, s.grad_norm))
                self._nonfinite += s.nonfinite
                for r in s.nonfinite_ranks:
                    self._rank_nonfinite[r] += 1
                for e in s.events:
                    self._anomalies[e.kind] = self._anomalies.get(e.kind, 0) + 1
            last = snaps[-1]
            while self._window and self._window[0][0] < last.timestamp - self.window_s:
                self._window.popleft()
            cumulative, acc = [], 0
            for c in self._counts:
                acc += c
                cumulative.append(acc)
            self.view = _View(
                latest=last, steps=last.step, nonfinite_steps=self._nonfinite,
                rank_nonfinite=tuple(self._rank_nonfinite), anomalies=tuple(self._anomalies.items()),
                hist_counts=tuple(cumulative), hist_sum=self._sum, hist_count=self._n,
                window_max=max((v for _, v in self._window), default=math.nan),
                finished=self.view.finished)

    def mark_finished(self) -> None:
        with self._lock:
            self.view = replace(self.view, finished=True)


def _fmt_le(x: float) -> str:
    return repr(x) if x < 1e-3 else f"{x:g}"


class GradCollector(Collector):
    """Yields distmon's metric families from the aggregate's current view (never touches torch)."""

    def __init__(self, agg: MetricsAggregate) -> None:
        self.agg = agg

    def collect(self) -> Iterable[Metric]:
        agg, v = self.agg, self.agg.view
        run = [agg.run_id]
        ranks = agg.ranks
        rank_keys = ["run_id", "rank", "local_rank", "hostname"] + (
            ["gpu_uuid"] if ranks and ranks[0].gpu_uuid else [])

        def rank_values(info: RankInfo) -> list[str]:
            return [agg.run_id] + list(info.labels().values())

        if agg.cluster:
            info = GaugeMetricFamily("distmon_run_info", METRICS["distmon_run_info"][2],
                                     labels=["run_id", "world_size", "version", "serve"])
            info.add_metric(run + [str(agg.world_size), agg.version, agg.serve], 1.0)
            yield info
            yield self._gauge("distmon_run_finished", 1.0 if v.finished else 0.0)
            yield self._counter("distmon_optimizer_steps", v.steps)
            yield self._counter("distmon_nonfinite_steps", v.nonfinite_steps)
            yield self._counter("distmon_monitor_errors", v.latest.monitor_errors if v.latest else 0)
            anomalies = CounterMetricFamily("distmon_anomalies", METRICS["distmon_anomalies_total"][2],
                                            labels=["run_id", "kind"])
            for kind, n in v.anomalies or tuple((k, 0) for k in ANOMALY_KINDS):
                anomalies.add_metric(run + [kind], n)
            yield anomalies
            hist = HistogramMetricFamily("distmon_step_grad_norm", METRICS["distmon_step_grad_norm"][2],
                                         labels=["run_id"])
            counts = v.hist_counts or (0,) * len(NORM_BUCKETS)
            buckets = [(_fmt_le(le), c) for le, c in zip(NORM_BUCKETS, counts)]
            hist.add_metric(run, buckets + [("+Inf", v.hist_count)], v.hist_sum)
            yield hist
            if v.latest is not None:
                s = v.latest
                yield self._gauge("distmon_grad_norm", s.grad_norm)
                yield self._gauge("distmon_last_step_timestamp_seconds", s.timestamp)
                yield self._gauge("distmon_grad_norm_window_max", v.window_max)
                for name, key in (("distmon_grad_norm_zscore", "zscore"),
                                  ("distmon_grad_norm_median_ratio", "median_ratio")):
                    if key in s.scores:
                        yield self._gauge(name, s.scores[key])
                layers = GaugeMetricFamily("distmon_layer_grad_norm", METRICS["distmon_layer_grad_norm"][2],
                                           labels=["run_id", "layer", "depth"])
                for depth, (layer, norm) in enumerate(s.layer_grad_norms.items()):
                    layers.add_metric(run + [layer, f"{depth:04d}"], norm)
                yield layers
        if ranks:
            s = v.latest
            nonfinite = CounterMetricFamily("distmon_rank_nonfinite_steps",
                                            METRICS["distmon_rank_nonfinite_steps_total"][2], labels=rank_keys)
            for info in ranks:
                count = v.rank_nonfinite[info.rank] if v.rank_nonfinite else 0
                nonfinite.add_metric(rank_values(info), count)
            yield nonfinite
            if s is not None:
                norms = GaugeMetricFamily("distmon_rank_grad_norm", METRICS["distmon_rank_grad_norm"][2],
                                          labels=rank_keys)
                for info in ranks:
                    norms.add_metric(rank_values(info), s.rank_grad_norms[info.rank])
                yield norms
                if s.rank_outlier_scores:
                    outlier = GaugeMetricFamily("distmon_rank_outlier_score",
                                                METRICS["distmon_rank_outlier_score"][2], labels=rank_keys)
                    for info in ranks:
                        outlier.add_metric(rank_values(info), s.rank_outlier_scores[info.rank])
                    yield outlier

    def _gauge(self, name: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, METRICS[name][2], labels=["run_id"])
        g.add_metric([self.agg.run_id], value)
        return g

    def _counter(self, base: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(base, METRICS[base + "_total"][2], labels=["run_id"])
        c.add_metric([self.agg.run_id], value)
        return c
