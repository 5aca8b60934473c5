"""The Prometheus collector in process: snapshots in, samples out (client_python's own way of testing).

A ``MetricsAggregate`` is fed hand-made ``Snapshot`` objects and its ``GradCollector`` is
registered in a ``CollectorRegistry``; samples are read with ``get_sample_value`` and compared
with literal values. One test scrapes the same collector over HTTP with a ``name[]`` filter.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from helpers import metrics_url, scrape_metrics
from prometheus_client import CollectorRegistry

from distmon.serve.http_server import MetricServer
from distmon.serve.prometheus_exporter import ANOMALY_KINDS, METRICS, GradCollector, MetricsAggregate
from distmon.setup.hostinfo import RankInfo
from distmon.snapshot import AnomalyEvent, Snapshot

RUN = {"run_id": "r1"}
RANKS = (RankInfo(0, 0, "h0", "", "h0"), RankInfo(1, 1, "h0", "", "h0"))


def snap(
    step: int,
    norm: float,
    *,
    valid: bool = True,
    nonfinite: bool = False,
    ts: float = 1000.0,
    events: tuple = (),
    errors: tuple = (0, 0),
    ranks: tuple = (1.0, 2.0),
    bad_ranks: tuple = (),
    skip: str = "",
) -> Snapshot:
    return Snapshot(
        step=step,
        timestamp=ts + step,
        grad_norm=norm,
        layer_grad_norms={"a": norm / 2, "b.c": norm},
        rank_grad_norms=list(ranks),
        rank_layer_grad_norms=None,
        nonfinite=nonfinite,
        nonfinite_ranks=list(bad_ranks),
        first_nonfinite=None,
        events=events,
        monitor_errors=sum(errors),
        rank_monitor_errors=list(errors),
        valid=valid,
        run_id="r1",
        world_size=2,
        scores={"zscore": 0.5, "median_ratio": 1.1},
        rank_outlier_scores=[0.2, 0.3],
        skipped=bool(skip),
        skip_reason=skip,
    )


def registry(
    cluster: bool = True, ranks: tuple = RANKS, own_errors: int = 0, window_s: float = 60.0
) -> tuple[MetricsAggregate, CollectorRegistry]:
    agg = MetricsAggregate(
        run_id="r1",
        world_size=2,
        version="9.9",
        serve="rank0",
        cluster=cluster,
        ranks=ranks,
        window_s=window_s,
        rank=0,
        own_errors=lambda: own_errors,
    )
    reg = CollectorRegistry()
    reg.register(GradCollector(agg))
    return agg, reg


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {**RUN, **labels})


def test_before_any_step_only_counters_and_metadata_are_served():
    _, reg = registry()
    assert value(reg, "distmon_run_info", world_size="2", version="9.9", serve="rank0") == 1
    assert value(reg, "distmon_optimizer_steps_total") == 0
    assert value(reg, "distmon_run_finished") == 0
    assert value(reg, "distmon_step_grad_norm_count") == 0
    assert [value(reg, "distmon_anomalies_total", kind=k) for k in ANOMALY_KINDS] == [0] * len(ANOMALY_KINDS)
    assert value(reg, "distmon_grad_norm") is None  # nothing measured: no made-up gauge


def test_gauges_counters_and_per_rank_series():
    agg, reg = registry()
    spike = AnomalyEvent(kind="spike", step=2, rank=-1, layer="b.c", value=9.0, threshold=6.0)
    agg.add([snap(1, 0.5), snap(2, 4.0, events=(spike,))])
    assert value(reg, "distmon_optimizer_steps_total") == 2
    assert value(reg, "distmon_grad_norm") == 4.0
    assert value(reg, "distmon_last_step_timestamp_seconds") == 1002.0
    assert value(reg, "distmon_layer_grad_norm", layer="a", depth="0000") == 2.0
    assert value(reg, "distmon_layer_grad_norm", layer="b.c", depth="0001") == 4.0
    assert value(reg, "distmon_grad_norm_zscore") == 0.5
    assert value(reg, "distmon_anomalies_total", kind="spike") == 1
    assert value(reg, "distmon_rank_grad_norm", rank="1", local_rank="1", hostname="h0", node="0") == 2.0
    assert value(reg, "distmon_rank_outlier_score", rank="0", local_rank="0", hostname="h0", node="0") == 0.2
    assert value(reg, "distmon_grad_norm_window_max") == 4.0


def test_histogram_counts_every_finite_step_in_client_library_buckets():
    agg, reg = registry()
    agg.add([snap(1, 0.5), snap(2, 1.0), snap(3, 3.0), snap(4, math.nan, nonfinite=True)])
    # le is formatted as the client library does ("1.0", not "1")
    assert value(reg, "distmon_step_grad_norm_bucket", le="0.5") == 1
    assert value(reg, "distmon_step_grad_norm_bucket", le="1.0") == 2
    assert value(reg, "distmon_step_grad_norm_bucket", le="2.5") == 2
    assert value(reg, "distmon_step_grad_norm_bucket", le="5.0") == 3
    assert value(reg, "distmon_step_grad_norm_bucket", le="+Inf") == 3
    assert value(reg, "distmon_step_grad_norm_count") == 3
    assert value(reg, "distmon_step_grad_norm_sum") == 4.5
    assert value(reg, "distmon_step_grad_norm_created") is None
    assert value(reg, "distmon_nonfinite_steps_total") == 1


def test_an_unmeasured_step_advances_the_count_but_leaves_the_gauges():
    agg, reg = registry()
    agg.add([snap(1, 0.5)])
    agg.add([snap(2, math.nan, valid=False, ranks=(math.nan, math.nan))])
    assert value(reg, "distmon_optimizer_steps_total") == 2
    assert value(reg, "distmon_last_step_timestamp_seconds") == 1002.0
    assert value(reg, "distmon_grad_norm") == 0.5
    assert value(reg, "distmon_rank_grad_norm", rank="0", local_rank="0", hostname="h0", node="0") == 1.0
    assert value(reg, "distmon_step_grad_norm_count") == 1
    assert value(reg, "distmon_nonfinite_steps_total") == 0


def test_a_scaler_skipped_step_is_counted_apart_and_leaves_the_gauges():
    agg, reg = registry()
    agg.add([snap(1, 0.5)])
    stuck = AnomalyEvent(kind="scaler_stuck", step=3, rank=-1, layer="", value=2, threshold=2)
    agg.add(
        [
            snap(2, math.inf, nonfinite=True, bad_ranks=(1,), ranks=(1.0, math.inf), skip="scaler"),
            snap(3, math.inf, nonfinite=True, skip="scaler", events=(stuck,)),
        ]
    )
    assert value(reg, "distmon_optimizer_steps_total") == 3
    assert value(reg, "distmon_scaler_skipped_steps_total") == 2
    assert value(reg, "distmon_nonfinite_steps_total") == 0  # routine fp16 overflow pages nobody
    assert (
        value(reg, "distmon_rank_nonfinite_steps_total", rank="1", local_rank="1", hostname="h0", node="0")
        == 0
    )
    assert value(reg, "distmon_anomalies_total", kind="scaler_stuck") == 1
    assert value(reg, "distmon_grad_norm") == 0.5  # the last measured step's, not inf
    assert value(reg, "distmon_rank_grad_norm", rank="1", local_rank="1", hostname="h0", node="0") == 2.0
    assert value(reg, "distmon_step_grad_norm_count") == 1
    # a guard's skip is no scaler skip: its figures are served
    agg.add([snap(4, 7.0, skip="guard")])
    assert value(reg, "distmon_scaler_skipped_steps_total") == 2
    assert value(reg, "distmon_grad_norm") == 7.0


def test_rank_nonfinite_counters_and_errors_with_the_servers_later_ones():
    agg, reg = registry(own_errors=5)
    agg.add([snap(1, math.inf, nonfinite=True, bad_ranks=(1,), errors=(2, 3))])
    assert (
        value(reg, "distmon_rank_nonfinite_steps_total", rank="1", local_rank="1", hostname="h0", node="0")
        == 1
    )
    assert (
        value(reg, "distmon_rank_nonfinite_steps_total", rank="0", local_rank="0", hostname="h0", node="0")
        == 0
    )
    # rank 0 (this server) had counted 2 when the step was gathered, 5 now: 5 + rank 1's 3
    assert value(reg, "distmon_monitor_errors_total") == 8


def test_window_max_forgets_old_steps():
    agg, reg = registry(window_s=10.0)
    agg.add([snap(1, 9.0, ts=0.0), snap(20, 2.0, ts=0.0)])
    assert value(reg, "distmon_grad_norm_window_max") == 2.0


def test_a_node_server_serves_only_its_ranks_and_no_cluster_families():
    agg, reg = registry(cluster=False, ranks=RANKS[1:])
    agg.add([snap(1, 0.5)])
    assert value(reg, "distmon_rank_grad_norm", rank="1", local_rank="1", hostname="h0", node="0") == 2.0
    assert value(reg, "distmon_rank_grad_norm", rank="0", local_rank="0", hostname="h0", node="0") is None
    assert value(reg, "distmon_grad_norm") is None and value(reg, "distmon_optimizer_steps_total") is None


def test_gpu_uuid_label_only_on_gpus():
    gpu_ranks = (RankInfo(0, 0, "h0", "GPU-abc", "h0"), RankInfo(1, 1, "h0", "GPU-def", "h0"))
    agg, reg = registry(ranks=gpu_ranks)
    agg.add([snap(1, 0.5)])
    assert (
        value(
            reg,
            "distmon_rank_grad_norm",
            rank="1",
            local_rank="1",
            hostname="h0",
            node="0",
            gpu_uuid="GPU-def",
        )
        == 2.0
    )


def test_finished_mark():
    agg, reg = registry()
    agg.mark_finished()
    assert value(reg, "distmon_run_finished") == 1


def test_describe_names_every_family_and_the_name_filter_works_over_http():
    agg, _ = registry()
    agg.add([snap(1, 0.5)])
    assert {m.name for m in GradCollector(agg).describe()} == {
        name.removesuffix("_total") if spec.kind == "counter" else name for name, spec in METRICS.items()
    }
    server = MetricServer.bind("127.0.0.1", 0, fallback=False)
    try:
        server.attach(GradCollector(agg))
        query = "?name[]=distmon_grad_norm&name[]=distmon_optimizer_steps_total"
        families = scrape_metrics(metrics_url(server.port) + query, by_family=True)
    finally:
        server.close()
    assert set(families) == {"distmon_grad_norm", "distmon_optimizer_steps_total"}
    assert families["distmon_grad_norm"][0].value == 0.5


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_has_run_id_and_a_help_text(name):
    spec = METRICS[name]
    assert spec.kind in ("gauge", "counter", "histogram") and spec.help and "run_id" not in spec.labels


def test_noise_scale_gauges_only_when_it_is_on_and_nan_while_not_meaningful():
    from dataclasses import replace

    agg, reg = registry()
    agg.add([snap(1, 0.5)])
    assert value(reg, "distmon_gradient_noise_scale") is None  # off: no batch_size
    on = replace(
        snap(2, 0.5),
        gradient_noise_scale=33.0,
        noise_trace=66.0,
        noise_signal=2.0,
        layer_gradient_noise_scale={"a": 12.5, "b.c": math.nan},
    )
    agg.add([on])
    assert value(reg, "distmon_gradient_noise_scale") == 33.0
    assert value(reg, "distmon_gradient_noise_trace") == 66.0
    assert value(reg, "distmon_gradient_noise_signal") == 2.0
    assert value(reg, "distmon_layer_gradient_noise_scale", layer="a", depth="0000") == 12.5
    assert math.isnan(value(reg, "distmon_layer_gradient_noise_scale", layer="b.c", depth="0001"))


def test_activation_gauges_keep_the_last_activation_step_s_figures():
    from dataclasses import replace

    agg, reg = registry()
    agg.add([snap(1, 0.5)])
    assert value(reg, "distmon_activation_rms", layer="blocks.0") is None  # off
    watched = replace(
        snap(2, 0.5), activation_rms={"blocks.0": 1.5}, activation_absmax={"blocks.0": math.inf}
    )
    agg.add([watched, snap(3, 0.5)])  # step 3 was not an activation step
    assert value(reg, "distmon_activation_rms", layer="blocks.0") == 1.5
    assert value(reg, "distmon_activation_absmax", layer="blocks.0") == math.inf


def test_update_ratio_gauges_keep_the_last_export_step_s_figures():
    from dataclasses import replace

    agg, reg = registry()
    agg.add([replace(snap(3, 0.5), layer_update_ratio={"a": 1e-3, "b.c": 2e-3}), snap(4, 0.5)])
    assert value(reg, "distmon_layer_update_ratio", layer="a", depth="0000") == 1e-3
    assert value(reg, "distmon_layer_update_ratio", layer="b.c", depth="0001") == 2e-3


def test_the_key_gauges_come_first_in_the_exposition():
    """A person reading ``curl /metrics`` sees the norms before 40 lines of counters and buckets."""
    from prometheus_client import generate_latest

    agg, reg = registry()
    agg.add([snap(1, 0.5), snap(2, 4.0)])
    names = [
        line.split("{")[0] for line in generate_latest(reg).decode().splitlines() if not line.startswith("#")
    ]
    first = list(dict.fromkeys(names))[:3]
    assert first == ["distmon_grad_norm", "distmon_layer_grad_norm", "distmon_rank_grad_norm"], names[:12]
    assert list(METRICS)[:3] == first  # the README's table, rendered from METRICS, in the same order


def test_scores_that_mean_nothing_yet_are_not_served():
    """The median ratio before any earlier export gave a median; outlier scores in groups of < 3 ranks."""
    agg, reg = registry()
    first = snap(1, 0.5)
    agg.add(
        [
            Snapshot(
                **{
                    **first.__dict__,
                    "scores": {"zscore": 0.0, "median_ratio": math.nan},
                    "rank_outlier_scores": [math.nan, math.nan],
                }
            )
        ]
    )
    assert value(reg, "distmon_grad_norm") == 0.5
    assert value(reg, "distmon_grad_norm_median_ratio") is None
    assert value(reg, "distmon_rank_outlier_score", rank="0", local_rank="0", hostname="h0", node="0") is None
    agg.add([snap(2, 4.0)])  # a median, and a group of 3+ ranks
    assert value(reg, "distmon_grad_norm_median_ratio") == 1.1
    assert value(reg, "distmon_rank_outlier_score", rank="1", local_rank="1", hostname="h0", node="0") == 0.3


def test_a_node_serves_its_own_ranks_and_rank_0_the_job_s_worst_rank_and_first_nonfinite():
    """A node's endpoint serves the per-rank series of the ranks its snapshots hold (``ranks``),
    whatever their number in the job; rank 0's the job-wide worst rank-outlier score and the
    first non-finite (rank, layer) of the latest non-finite step, wherever those ranks run."""
    node1 = (RankInfo(6, 0, "h3", "", "h3/3", node_index=3), RankInfo(7, 1, "h3", "", "h3/3", node_index=3))
    agg, reg = registry(ranks=node1)
    worst = {"rank_outlier_worst": 9.5, "rank_outlier_worst_rank": 2.0}
    agg.add(
        [
            replace(snap(1, 0.5), ranks=[6, 7], world_size=8, scores=worst, nonfinite_ranks=[3]),
            replace(
                snap(2, 0.7, nonfinite=True), ranks=[6, 7], first_nonfinite=(3, "b.c"), nonfinite_ranks=[3]
            ),
            replace(snap(3, 0.6), ranks=[6, 7], scores=worst),
        ]
    )
    labels = dict(local_rank="1", hostname="h3", node="3")
    assert value(reg, "distmon_rank_grad_norm", rank="7", **labels) == 2.0
    assert value(reg, "distmon_rank_grad_norm", rank="1", local_rank="1", hostname="h0", node="0") is None
    assert value(reg, "distmon_rank_nonfinite_steps_total", rank="7", **labels) == 0  # rank 3 is node 1's
    assert value(reg, "distmon_rank_outlier_worst_score") == 9.5
    assert value(reg, "distmon_rank_outlier_worst_rank") == 2.0
    assert value(reg, "distmon_last_nonfinite_step", rank="3", layer="b.c") == 2.0
    agg, reg = registry()
    agg.add([replace(snap(1, 0.5), scores={"rank_outlier_worst": math.nan})])
    assert value(reg, "distmon_rank_outlier_worst_score") is None  # no group of 3+: not served
