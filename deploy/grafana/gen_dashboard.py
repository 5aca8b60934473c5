#!/usr/bin/env python3
"""Generate deploy/grafana/dashboards/distmon.json (the distmon Grafana dashboard).

The JSON is committed; this script is its source: one function per dashboard row,
top to bottom in ROWS, built from the panel kinds and the auto-layout of panels.py
(a row is a list of lines; the panels of a line share the 24 columns equally). Edit the
panels here and run

    python deploy/grafana/gen_dashboard.py            # rewrite the JSON
    python deploy/grafana/gen_dashboard.py --check    # exit 1 if the JSON is stale

(tests/test_deploy_manifests.py runs --check.) Editing the JSON in Grafana and
exporting it is fine too, as long as you port the change back here.

Conventions the tests rely on:
- the data source is the dashboard variable ``datasource`` (type datasource), never
  ``__inputs`` (file provisioning does not resolve ``__inputs``);
- every target names ``{"type": "prometheus", "uid": "${datasource}"}``;
- queries use only the variables ``$run_id``, ``$layer`` (multi, regex-matched with
  ``=~``), ``$__rate_interval`` and ``$__range``;
- metric names are the exported ``distmon_*`` names or ``distmon:*`` recording rules.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from panels import DS, Row, heatmap, layout, line, query_variable, stat, table, target, targets, timeseries

OUT = Path(__file__).resolve().parent / "dashboards" / "distmon.json"

RUN = 'run_id="$run_id"'
LAYER = f'{RUN}, layer=~"$layer"'
FIRING_ALERTS = f'ALERTS{{{RUN}, alertstate="firing"}}'
STEP_AGE = f"time() - (distmon_last_step_timestamp_seconds{{{RUN}}} > 0)"
STEP_RATE_1M = f"distmon:optimizer_steps:rate1m{{{RUN}}}"
RANK_LEGEND = "rank {{rank}} ({{hostname}})"
RANK_Z = f"distmon:rank_grad_norm:robust_z{{{RUN}}}"
RANK_Z_TOP5 = f"distmon:rank_grad_norm:top5_abs_robust_z{{{RUN}}}"
LARGEST_Z = "largest |robust z| in range"


def per_layer(metric: str) -> tuple[str, str]:
    """The (expr, legend) pair of a per-layer metric, filtered by ``$layer`` and named by depth.

    >>> per_layer("distmon_layer_grad_norm")[1]
    '{{depth}} {{layer}}'
    """
    return f"{metric}{{{LAYER}}}", "{{depth}} {{layer}}"


# --------------------------------------------------------------------------------------------
# The dashboard's rows, top to bottom.


def overview() -> Row:
    return Row(
        "Overview",
        [
            line(
                4,
                stat(
                    "Steps / s",
                    target(STEP_RATE_1M, "steps/s"),
                    description="rate(distmon_optimizer_steps_total[1m]) (recording rule).",
                ),
                stat(
                    "Time since last step",
                    target(STEP_AGE, "age"),
                    unit="s",
                    thresholds=[("green", None), ("orange", 60), ("red", 120)],
                    description="DistmonTrainingStalled fires above 120 s while the run is not finished.",
                ),
                stat("Optimizer steps", target(f"distmon_optimizer_steps_total{{{RUN}}}", "steps")),
                stat(
                    "Non-finite steps (time range)",
                    target(f"sum(increase(distmon_nonfinite_steps_total{{{RUN}}}[$__range]))", "steps"),
                    thresholds=[("green", None), ("red", 1)],
                ),
                stat(
                    "Run finished",
                    target(f"distmon_run_finished{{{RUN}}}", "finished"),
                    description="0 while training, 1 after a clean finish (served ~30 s more).",
                ),
                stat(
                    "World size",
                    target(f"max by (world_size) (distmon_run_info{{{RUN}}})", "{{world_size}} ranks"),
                    text_mode="name",
                    description="From the world_size label of distmon_run_info.",
                ),
            ),
            line(
                4,
                table(
                    "Firing alerts",
                    target(FIRING_ALERTS, "", fmt="table", instant=True),
                    description="Prometheus ALERTS series for this run (rules in deploy/prometheus/rules).",
                ),
            ),
        ],
    )


def _step_norm_bucket_query(q: float, fn: str) -> str:
    return (
        f"histogram_quantile({q}, sum by (le) ({fn}(distmon_step_grad_norm_bucket"
        f"{{{RUN}}}[$__rate_interval])))"
    )


def global_norm() -> Row:
    return Row(
        "Global gradient norm",
        [
            line(
                9,
                timeseries(
                    "Global grad norm: latest, 60 s window max, 30 min median",
                    targets(
                        (f"distmon_grad_norm{{{RUN}}}", "latest step (gauge)"),
                        (f"distmon_grad_norm_window_max{{{RUN}}}", "max over last 60 s"),
                        (f"distmon:grad_norm:median_30m{{{RUN}}}", "30 min median"),
                        (f"10 * distmon:grad_norm:median_30m{{{RUN}}}", "explosion threshold (10x median)"),
                    ),
                    log=True,
                    description="The gauge shows only the step that was latest at scrape time; the window "
                    "max and the histogram panels show every step.",
                    overrides=[
                        {
                            "matcher": {"id": "byName", "options": "explosion threshold (10x median)"},
                            "properties": [
                                {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                            ],
                        }
                    ],
                ),
                timeseries(
                    "Every step's norm: quantiles from the histogram",
                    targets(
                        (_step_norm_bucket_query(0.5, "rate"), "p50"),
                        (_step_norm_bucket_query(0.99, "rate"), "p99"),
                        (_step_norm_bucket_query(1, "increase"), "max (bucket upper bound)"),
                        (f"distmon:step_grad_norm:max_bucket_5m{{{RUN}}}", "max bucket, last 5 min"),
                    ),
                    log=True,
                    description="distmon_step_grad_norm counts every step's finite global norm, so spikes "
                    "between scrapes show up here (bucket resolution 1, 2.5, 5 x 10^k).",
                ),
            ),
            line(
                8,
                heatmap(
                    "Step norm distribution (histogram buckets)",
                    target(
                        f"sum by (le) (increase(distmon_step_grad_norm_bucket{{{RUN}}}[$__rate_interval]))",
                        "{{le}}",
                        fmt="heatmap",
                    ),
                    description="Steps per norm bucket per interval. A lone cell far above the band is a "
                    "spike, even when no scrape caught it.",
                ),
                timeseries(
                    "Spike scores",
                    targets(
                        (f"distmon_grad_norm_median_ratio{{{RUN}}}", "norm / running median (in-process)"),
                        (f"distmon_grad_norm_zscore{{{RUN}}}", "z-score of log norm (in-process)"),
                        (
                            f"max by (run_id) (distmon_grad_norm_window_max{{{RUN}}})"
                            f" / distmon:grad_norm:median_30m{{{RUN}}}",
                            "window max / 30 min median",
                        ),
                    ),
                    thresholds=[("green", None), ("red", 10)],
                    description="Alert DistmonGradientSpikeBetweenScrapes: window max above 10x the median.",
                ),
            ),
        ],
    )


def ranks() -> Row:
    return Row(
        "Ranks",
        [
            line(
                9,
                timeseries(
                    "Per-rank local grad norm (before all-reduce)",
                    targets((f"distmon_rank_grad_norm{{{RUN}}}", RANK_LEGEND)),
                    log=True,
                    description="Each rank's own gradient norm before averaging. Ranks should overlap; a "
                    "rank that sits apart has a bad shard or a faulty device.",
                ),
                timeseries(
                    "Rank outlier score",
                    targets((f"distmon_rank_outlier_score{{{RUN}}}", RANK_LEGEND)),
                    thresholds=[("green", None), ("red", 8)],
                    description="|log rank norm - median log norm| in units of the detector's running "
                    "scale. DistmonRankOutlier fires above 8 for 30 s (with >= 3 ranks; with 2 "
                    "ranks the score is the same for both).",
                ),
            ),
            line(
                7,
                timeseries(
                    "Rank spread of local grad norms",
                    targets(
                        (f"distmon:rank_grad_norm:max_over_median{{{RUN}}}", "max / median"),
                        (f"distmon:rank_grad_norm:max_over_min{{{RUN}}}", "max / min"),
                    ),
                    log=True,
                    thresholds=[("green", None), ("red", 10)],
                    description="1 = all ranks agree. DistmonRankOutlier (signal=spread) fires when "
                    "max / min stays above 10 for 30 s.",
                ),
                timeseries(
                    "Non-finite steps per rank",
                    targets(
                        (
                            "sum by (rank, hostname) (increase(distmon_rank_nonfinite_steps_total"
                            f"{{{RUN}}}[$__rate_interval]))",
                            RANK_LEGEND,
                        )
                    ),
                    draw="bars",
                    description="Which rank's local gradient held NaN/Inf.",
                ),
            ),
            line(
                8,
                timeseries(
                    "Robust z of the 5 farthest ranks (Prometheus' cross-rank comparison)",
                    targets((f"{RANK_Z} and on (run_id, rank) {RANK_Z_TOP5}", RANK_LEGEND)),
                    thresholds=[("red", None), ("green", -5), ("red", 5)],
                    description="(log10 rank norm - peer-group median) / (1.4826 x max(MAD, 0.05)), "
                    "computed by the recording rules over every node's target, per peer group "
                    "(tp_rank, pp_stage, ep_rank) of >= 3 ranks; at each time the 5 ranks with the "
                    "largest |z|. DistmonRankOutlierSustained fires beyond +-5 for 5 min.",
                ),
                table(
                    "Rank outliers: the 5 ranks farthest from their peers",
                    target(f"topk(5, max_over_time({RANK_Z_TOP5}[$__range]))", fmt="table", instant=True),
                    first=("rank", "hostname", "node", "local_rank", "gpu_uuid", "Value"),
                    hidden=("Time", "__name__", "run_id"),
                    rename={"Value": LARGEST_Z},
                    sort_desc=LARGEST_Z,
                    description="Largest |robust z| each rank reached in the time range "
                    "(distmon:rank_grad_norm:top5_abs_robust_z): the node to look at first.",
                ),
            ),
        ],
    )


def layers() -> Row:
    norm_expr, legend = per_layer("distmon_layer_grad_norm")
    return Row(
        "Layers",
        [
            line(
                12,
                heatmap(
                    "Per-layer grad norm (log10), model order top to bottom",
                    target(f"log10({norm_expr})", legend),
                    reverse=True,
                    scale="linear",
                    description="One row per layer, colour = log10 of its global grad norm. Rows are in "
                    "model order: depth is zero-padded and is the first label of the result, "
                    "so Prometheus' label-sorted output is already depth order.",
                ),
            ),
            line(9, timeseries("Per-layer grad norm", targets((norm_expr, legend)), log=True)),
            line(
                8,
                timeseries(
                    "Per-layer update / weight ratio",
                    targets(per_layer("distmon_layer_update_ratio")),
                    log=True,
                    description="||update|| / ||weights|| per layer at export steps (update_ratio=True). "
                    "Updates that grow relative to the weights precede loss spikes; ~1e-3 is typical "
                    "for Adam.",
                ),
            ),
        ],
    )


def noise_scale() -> Row:
    return Row(
        "Gradient noise scale (with batch_size=)",
        [
            line(
                8,
                timeseries(
                    "Gradient noise scale B_simple (batch_size units)",
                    targets((f"distmon_gradient_noise_scale{{{RUN}}}", "B_simple")),
                    log=True,
                    description="EMA tr(Sigma) / EMA |G|^2 (McCandlish et al. 2018): the batch size beyond "
                    "which a bigger batch stops buying proportionally faster training, in the units of "
                    "the batch_size given to distmon. NaN until 1/gns_alpha steps went in.",
                ),
                timeseries(
                    "Per-layer gradient noise scale",
                    targets(per_layer("distmon_layer_gradient_noise_scale")),
                    log=True,
                    description="The same per layer (needs rank_layers=True).",
                ),
            )
        ],
    )


def activations() -> Row:
    return Row(
        "Forward activations (with activations=)",
        [
            line(
                8,
                timeseries(
                    "Activation RMS per watched module",
                    targets((f"distmon_activation_rms{{{RUN}}}", "{{layer}}")),
                    log=True,
                    description="RMS of each watched module's forward output (serving rank, every "
                    "activation_every steps). Output norms that keep growing precede divergence.",
                ),
                timeseries(
                    "Activation max |x| per watched module",
                    targets((f"distmon_activation_absmax{{{RUN}}}", "{{layer}}")),
                    log=True,
                    description="Largest absolute value of each watched module's output (Inf: non-finite).",
                ),
            )
        ],
    )


def precursor() -> Row:
    return Row(
        "Divergence precursor (with precursor=)",
        [
            line(
                8,
                timeseries(
                    "Attention-logit bound per block",
                    targets((f"distmon_attention_logit_bound{{{RUN}}}", "{{layer}}")),
                    log=True,
                    thresholds=[("green", None), ("red", 1000)],
                    description="max|q| max|k| / sqrt(d_head) of each attention block on every 10th "
                    "step's forwards, the largest over the ranks: an upper bound of its attention logits. "
                    "Runs that diverged through attention-logit growth crossed 1000 hundreds of steps "
                    "before their loss moved (benchmarks/early_warning.py); the precursor warns after 2 "
                    "samples above it (DistmonDivergenceAhead).",
                ),
                timeseries(
                    "Consecutive gradients' cosine",
                    targets((f"max by (run_id) (distmon_gradient_cosine{{{RUN}}})", "cosine")),
                    thresholds=[("red", None), ("green", -0.2)],
                    description="With PrecursorConfig(peak_lr=...): the mean cosine between consecutive "
                    "steps' gradients over each sampling interval. Below 0 the optimizer overshoots along "
                    "the sharpest direction (the edge of stability, stable at a constant rate); the "
                    "precursor warns after 2 samples below -0.2 while the schedule will still raise the "
                    "rate 1.2-fold or more.",
                ),
                timeseries(
                    "Divergence warning",
                    targets(
                        (f"max by (run_id) (distmon_divergence_warning{{{RUN}}})", "warning"),
                        (
                            "sum by (run_id) (increase(distmon_anomalies_total"
                            f'{{{RUN},kind="divergence_warning"}}[10m]))',
                            "events (10 min)",
                        ),
                    ),
                    description="1 while the precursor warns at the latest sampled step; its "
                    "divergence_warning events over the last 10 min.",
                ),
            )
        ],
    )


def health() -> Row:
    return Row(
        "Training and monitor health",
        [
            line(
                7,
                timeseries(
                    "Non-finite steps",
                    targets(
                        (
                            f"increase(distmon_nonfinite_steps_total{{{RUN}}}[$__rate_interval])",
                            "non-finite steps",
                        )
                    ),
                    draw="bars",
                    description="From the counter; the norm gauge reads NaN on such steps and cannot be "
                    "alerted on.",
                ),
                timeseries(
                    "Steps per second",
                    targets(
                        (f"rate(distmon_optimizer_steps_total{{{RUN}}}[$__rate_interval])", "steps/s"),
                        (STEP_RATE_1M, "steps/s (1 min)"),
                    ),
                ),
                timeseries(
                    "Time since last step",
                    targets((STEP_AGE, "seconds")),
                    unit="s",
                    thresholds=[("green", None), ("red", 120)],
                ),
            ),
            line(
                7,
                timeseries(
                    "Anomalies by kind (in-process detectors)",
                    targets(
                        (
                            f"sum by (kind) (increase(distmon_anomalies_total{{{RUN}}}[$__rate_interval]))",
                            "{{kind}}",
                        )
                    ),
                    draw="bars",
                ),
                timeseries(
                    "Monitor errors",
                    targets((f"increase(distmon_monitor_errors_total{{{RUN}}}[$__rate_interval])", "errors")),
                    draw="bars",
                    description="Exceptions caught inside distmon (training continued).",
                ),
            ),
        ],
    )


ROWS = (overview, global_norm, ranks, layers, noise_scale, activations, precursor, health)


# --------------------------------------------------------------------------------------------
# Variables, annotations and the dashboard around the panels.


def variables() -> list[dict]:
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "regex": "",
        "hide": 0,
        "refresh": 1,
        "current": {},
        "options": [],
        "includeAll": False,
        "multi": False,
    }
    return [
        datasource,
        query_variable("run_id", "Run", "label_values(distmon_run_info, run_id)", sort=1),
        query_variable(
            "layer", "Layer", f"label_values(distmon_layer_grad_norm{{{RUN}}}, layer)", sort=0, multi=True
        ),
    ]


def annotations() -> list[dict]:
    return [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "datasource": DS,
            "enable": True,
            "hide": False,
            "iconColor": "red",
            "name": "distmon alerts",
            "expr": FIRING_ALERTS,
            "step": "30s",
            "titleFormat": "{{alertname}}",
            "textFormat": "{{severity}} {{rank}}",
            "tagKeys": "alertname,severity",
            "useValueForTime": False,
        },
    ]


def build() -> dict:
    return {
        "title": "distmon - gradient monitor",
        "uid": "distmon",
        "description": "Gradients of distributed PyTorch training, from distmon "
        "(global, per-rank and per-layer norms; alerts from "
        "deploy/prometheus/rules).",
        "tags": ["distmon", "pytorch", "training"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": annotations()},
        "templating": {"list": variables()},
        "panels": layout([row() for row in ROWS]),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if the committed JSON differs from what would be generated",
    )
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
