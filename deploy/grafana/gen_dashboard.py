#!/usr/bin/env python3
"""Generate deploy/grafana/dashboards/distmon.json (the distmon Grafana dashboard).

The JSON is committed; this script is its source. Edit the panels here and run

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

OUT = Path(__file__).resolve().parent / "dashboards" / "distmon.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'run_id="$run_id"'

_next_id = 0


def _id() -> int:
    global _next_id
    _next_id += 1
    return _next_id


def target(
    expr: str, legend: str = "", ref: str = "A", *, fmt: str = "time_series", instant: bool = False
) -> dict:
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "range": not instant,
        "legendFormat": legend or "__auto",
        "refId": ref,
    }


def targets(*specs) -> list[dict]:
    """specs: (expr, legend) pairs; refIds A, B, C, ..."""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(specs)]


def grid(x: int, y: int, w: int, h: int) -> dict:
    return {"x": x, "y": y, "w": w, "h": h}


def row(title: str, y: int) -> dict:
    return {
        "type": "row",
        "title": title,
        "id": _id(),
        "collapsed": False,
        "gridPos": grid(0, y, 24, 1),
        "panels": [],
    }


def timeseries(
    title: str,
    gp: dict,
    tgts: list[dict],
    *,
    unit: str = "short",
    log: bool = False,
    description: str = "",
    draw: str = "line",
    thresholds: list[tuple[str, float | None]] | None = None,
    overrides: list[dict] | None = None,
) -> dict:
    custom = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 60 if draw == "bars" else 0,
        "pointSize": 4,
        "showPoints": "never",
        "spanNulls": False,
        "axisPlacement": "auto",
        "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
        "thresholdsStyle": {"mode": "line" if thresholds else "off"},
    }
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "id": _id(),
        "gridPos": gp,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom,
                "color": {"mode": "palette-classic"},
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": overrides or [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    gp: dict,
    tgt: dict,
    *,
    unit: str = "short",
    description: str = "",
    thresholds: list[tuple[str, float | None]] | None = None,
    text_mode: str = "auto",
) -> dict:
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "id": _id(),
        "gridPos": gp,
        "datasource": DS,
        "targets": [tgt],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
        },
    }


def heatmap(
    title: str,
    gp: dict,
    tgt: dict,
    *,
    description: str = "",
    y_unit: str = "short",
    reverse: bool = False,
    scale: str = "exponential",
) -> dict:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "id": _id(),
        "gridPos": gp,
        "datasource": DS,
        "targets": [tgt],
        "fieldConfig": {
            "defaults": {
                "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"},
                }
            },
            "overrides": [],
        },
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": "Spectral",
                "reverse": True,
                "scale": scale,
                "exponent": 0.5,
                "steps": 64,
                "fill": "dark-orange",
            },
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
            "yAxis": {"axisPlacement": "left", "reverse": reverse, "unit": y_unit},
            "cellValues": {},
            "showValue": "never",
        },
    }


def table(title: str, gp: dict, tgt: dict, *, description: str = "") -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "id": _id(),
        "gridPos": gp,
        "datasource": DS,
        "targets": [tgt],
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {
                        "Time": True,
                        "Value": True,
                        "__name__": True,
                        "job": True,
                        "alertstate": True,
                    },
                    "indexByName": {"alertname": 0, "severity": 1, "run_id": 2},
                },
            }
        ],
    }


def build() -> dict:
    global _next_id
    _next_id = 0
    panels: list[dict] = []
    y = 0

    # --- Overview ---------------------------------------------------------------------------
    panels.append(row("Overview", y))
    y += 1
    panels += [
        stat(
            "Steps / s",
            grid(0, y, 4, 4),
            target(f"distmon:optimizer_steps:rate1m{{{RUN}}}", "steps/s"),
            description="rate(distmon_optimizer_steps_total[1m]) (recording rule).",
        ),
        stat(
            "Time since last step",
            grid(4, y, 4, 4),
            target(f"time() - (distmon_last_step_timestamp_seconds{{{RUN}}} > 0)", "age"),
            unit="s",
            thresholds=[("green", None), ("orange", 60), ("red", 120)],
            description="DistmonTrainingStalled fires above 120 s while the run is not finished.",
        ),
        stat("Optimizer steps", grid(8, y, 4, 4), target(f"distmon_optimizer_steps_total{{{RUN}}}", "steps")),
        stat(
            "Non-finite steps (time range)",
            grid(12, y, 4, 4),
            target(f"sum(increase(distmon_nonfinite_steps_total{{{RUN}}}[$__range]))", "steps"),
            thresholds=[("green", None), ("red", 1)],
        ),
        stat(
            "Run finished",
            grid(16, y, 4, 4),
            target(f"distmon_run_finished{{{RUN}}}", "finished"),
            description="0 while training, 1 after a clean finish (served ~30 s more).",
        ),
        stat(
            "World size",
            grid(20, y, 4, 4),
            target(f"max by (world_size) (distmon_run_info{{{RUN}}})", "{{world_size}} ranks"),
            text_mode="name",
            description="From the world_size label of distmon_run_info.",
        ),
    ]
    y += 4
    panels.append(
        table(
            "Firing alerts",
            grid(0, y, 24, 4),
            target(f'ALERTS{{{RUN}, alertstate="firing"}}', "", fmt="table", instant=True),
            description="Prometheus ALERTS series for this run (rules in deploy/prometheus/rules).",
        )
    )
    y += 4

    # --- Global gradient norm ---------------------------------------------------------------
    panels.append(row("Global gradient norm", y))
    y += 1
    panels.append(
        timeseries(
            "Global grad norm: latest, 60 s window max, 30 min median",
            grid(0, y, 12, 9),
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
        )
    )
    panels.append(
        timeseries(
            "Every step's norm: quantiles from the histogram",
            grid(12, y, 12, 9),
            targets(
                (
                    "histogram_quantile(0.5, sum by (le) (rate(distmon_step_grad_norm_bucket"
                    f"{{{RUN}}}[$__rate_interval])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) (rate(distmon_step_grad_norm_bucket"
                    f"{{{RUN}}}[$__rate_interval])))",
                    "p99",
                ),
                (
                    "histogram_quantile(1, sum by (le) (increase(distmon_step_grad_norm_bucket"
                    f"{{{RUN}}}[$__rate_interval])))",
                    "max (bucket upper bound)",
                ),
                (f"distmon:step_grad_norm:max_bucket_5m{{{RUN}}}", "max bucket, last 5 min"),
            ),
            log=True,
            description="distmon_step_grad_norm counts every step's finite global norm, so spikes "
            "between scrapes show up here (bucket resolution 1, 2.5, 5 x 10^k).",
        )
    )
    y += 9
    panels.append(
        heatmap(
            "Step norm distribution (histogram buckets)",
            grid(0, y, 12, 8),
            target(
                f"sum by (le) (increase(distmon_step_grad_norm_bucket{{{RUN}}}[$__rate_interval]))",
                "{{le}}",
                fmt="heatmap",
            ),
            description="Steps per norm bucket per interval. A lone cell far above the band is a "
            "spike, even when no scrape caught it.",
        )
    )
    panels.append(
        timeseries(
            "Spike scores",
            grid(12, y, 12, 8),
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
        )
    )
    y += 8

    # --- Ranks ------------------------------------------------------------------------------
    panels.append(row("Ranks", y))
    y += 1
    panels.append(
        timeseries(
            "Per-rank local grad norm (before all-reduce)",
            grid(0, y, 12, 9),
            targets((f"distmon_rank_grad_norm{{{RUN}}}", "rank {{rank}} ({{hostname}})")),
            log=True,
            description="Each rank's own gradient norm before averaging. Ranks should overlap; a "
            "rank that sits apart has a bad shard or a faulty device.",
        )
    )
    panels.append(
        timeseries(
            "Rank outlier score",
            grid(12, y, 12, 9),
            targets((f"distmon_rank_outlier_score{{{RUN}}}", "rank {{rank}} ({{hostname}})")),
            thresholds=[("green", None), ("red", 8)],
            description="|log rank norm - median log norm| in units of the detector's running "
            "scale. DistmonRankOutlier fires above 8 for 30 s (with >= 3 ranks; with 2 "
            "ranks the score is the same for both).",
        )
    )
    y += 9
    panels.append(
        timeseries(
            "Rank spread of local grad norms",
            grid(0, y, 12, 7),
            targets(
                (f"distmon:rank_grad_norm:max_over_median{{{RUN}}}", "max / median"),
                (f"distmon:rank_grad_norm:max_over_min{{{RUN}}}", "max / min"),
            ),
            log=True,
            thresholds=[("green", None), ("red", 10)],
            description="1 = all ranks agree. DistmonRankOutlier (signal=spread) fires when "
            "max / min stays above 10 for 30 s.",
        )
    )
    panels.append(
        timeseries(
            "Non-finite steps per rank",
            grid(12, y, 12, 7),
            targets(
                (
                    "sum by (rank, hostname) (increase(distmon_rank_nonfinite_steps_total"
                    f"{{{RUN}}}[$__rate_interval]))",
                    "rank {{rank}} ({{hostname}})",
                )
            ),
            draw="bars",
            description="Which rank's local gradient held NaN/Inf.",
        )
    )
    y += 7

    # --- Layers -----------------------------------------------------------------------------
    panels.append(row("Layers", y))
    y += 1
    panels.append(
        heatmap(
            "Per-layer grad norm (log10), model order top to bottom",
            grid(0, y, 24, 12),
            target(f'log10(distmon_layer_grad_norm{{{RUN}, layer=~"$layer"}})', "{{depth}} {{layer}}"),
            reverse=True,
            scale="linear",
            description="One row per layer, colour = log10 of its global grad norm. Rows are in "
            "model order: depth is zero-padded and is the first label of the result, "
            "so Prometheus' label-sorted output is already depth order.",
        )
    )
    y += 12
    panels.append(
        timeseries(
            "Per-layer grad norm",
            grid(0, y, 24, 9),
            targets((f'distmon_layer_grad_norm{{{RUN}, layer=~"$layer"}}', "{{depth}} {{layer}}")),
            log=True,
        )
    )
    y += 9

    panels.append(
        timeseries(
            "Per-layer update / weight ratio",
            grid(0, y, 24, 8),
            targets((f'distmon_layer_update_ratio{{{RUN}, layer=~"$layer"}}', "{{depth}} {{layer}}")),
            log=True,
            description="||update|| / ||weights|| per layer at export steps (update_ratio=True). "
            "Updates that grow relative to the weights precede loss spikes; ~1e-3 is typical for Adam.",
        )
    )
    y += 8

    # --- Gradient noise scale -----------------------------------------------------------------
    panels.append(row("Gradient noise scale (with batch_size=)", y))
    y += 1
    panels += [
        timeseries(
            "Gradient noise scale B_simple (batch_size units)",
            grid(0, y, 12, 8),
            targets(
                (f"distmon_gradient_noise_scale{{{RUN}}}", "B_simple"),
            ),
            log=True,
            description="EMA tr(Sigma) / EMA |G|^2 (McCandlish et al. 2018): the batch size beyond "
            "which a bigger batch stops buying proportionally faster training, in the units of "
            "the batch_size given to distmon. NaN until 1/gns_alpha steps went in.",
        ),
        timeseries(
            "Per-layer gradient noise scale",
            grid(12, y, 12, 8),
            targets((f'distmon_layer_gradient_noise_scale{{{RUN}, layer=~"$layer"}}', "{{depth}} {{layer}}")),
            log=True,
            description="The same per layer (needs rank_layers=True).",
        ),
    ]
    y += 8

    # --- Activations ----------------------------------------------------------------------------
    panels.append(row("Forward activations (with activations=)", y))
    y += 1
    panels += [
        timeseries(
            "Activation RMS per watched module",
            grid(0, y, 12, 8),
            targets((f"distmon_activation_rms{{{RUN}}}", "{{layer}}")),
            log=True,
            description="RMS of each watched module's forward output (serving rank, every "
            "activation_every steps). Output norms that keep growing precede divergence.",
        ),
        timeseries(
            "Activation max |x| per watched module",
            grid(12, y, 12, 8),
            targets((f"distmon_activation_absmax{{{RUN}}}", "{{layer}}")),
            log=True,
            description="Largest absolute value of each watched module's output (Inf: non-finite).",
        ),
    ]
    y += 8

    # --- Health -----------------------------------------------------------------------------
    panels.append(row("Training and monitor health", y))
    y += 1
    panels.append(
        timeseries(
            "Non-finite steps",
            grid(0, y, 8, 7),
            targets(
                (f"increase(distmon_nonfinite_steps_total{{{RUN}}}[$__rate_interval])", "non-finite steps")
            ),
            draw="bars",
            description="From the counter; the norm gauge reads NaN on such steps and cannot be alerted on.",
        )
    )
    panels.append(
        timeseries(
            "Steps per second",
            grid(8, y, 8, 7),
            targets(
                (f"rate(distmon_optimizer_steps_total{{{RUN}}}[$__rate_interval])", "steps/s"),
                (f"distmon:optimizer_steps:rate1m{{{RUN}}}", "steps/s (1 min)"),
            ),
        )
    )
    panels.append(
        timeseries(
            "Time since last step",
            grid(16, y, 8, 7),
            targets((f"time() - (distmon_last_step_timestamp_seconds{{{RUN}}} > 0)", "seconds")),
            unit="s",
            thresholds=[("green", None), ("red", 120)],
        )
    )
    y += 7
    panels.append(
        timeseries(
            "Anomalies by kind (in-process detectors)",
            grid(0, y, 12, 7),
            targets(
                (f"sum by (kind) (increase(distmon_anomalies_total{{{RUN}}}[$__rate_interval]))", "{{kind}}")
            ),
            draw="bars",
        )
    )
    panels.append(
        timeseries(
            "Monitor errors",
            grid(12, y, 12, 7),
            targets((f"increase(distmon_monitor_errors_total{{{RUN}}}[$__rate_interval])", "errors")),
            draw="bars",
            description="Exceptions caught inside distmon (training continued).",
        )
    )
    y += 7

    var_ds = {
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
    var_run = {
        "name": "run_id",
        "label": "Run",
        "type": "query",
        "datasource": DS,
        "definition": "label_values(distmon_run_info, run_id)",
        "query": {
            "qryType": 1,
            "query": "label_values(distmon_run_info, run_id)",
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "sort": 1,
        "regex": "",
        "hide": 0,
        "current": {},
        "options": [],
        "includeAll": False,
        "multi": False,
    }
    var_layer = {
        "name": "layer",
        "label": "Layer",
        "type": "query",
        "datasource": DS,
        "definition": 'label_values(distmon_layer_grad_norm{run_id="$run_id"}, layer)',
        "query": {
            "qryType": 1,
            "query": 'label_values(distmon_layer_grad_norm{run_id="$run_id"}, layer)',
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "sort": 0,
        "regex": "",
        "hide": 0,
        "current": {},
        "options": [],
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
    }

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
        "annotations": {
            "list": [
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
                    "expr": f'ALERTS{{{RUN}, alertstate="firing"}}',
                    "step": "30s",
                    "titleFormat": "{{alertname}}",
                    "textFormat": "{{severity}} {{rank}}",
                    "tagKeys": "alertname,severity",
                    "useValueForTime": False,
                },
            ]
        },
        "templating": {"list": [var_ds, var_run, var_layer]},
        "panels": panels,
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
