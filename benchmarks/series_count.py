"""Prometheus series that distmon serves, per node endpoint and for a whole job.

Builds the real ``/metrics`` bodies: distmon's collector (``distmon/serve/prometheus_exporter.py``)
fed one measured step of a job of ``--gpus`` GPUs, ``--gpus-per-node`` per node, with
``--layers`` layer groups (default 128, the ``max_layers`` cap) and the other options at their
defaults (no noise scale, activations, update ratios or precursor, unless ``--all-options``:
then ``batch_size=``, ``update_ratio=True``, ``activations=`` watching one module per layer
group and ``precursor=True`` with an attention block per 8 layer groups; the detector on, so
every rank of a group of >= 3 has an outlier score). It counts the
samples (one series each) and the bytes of each body, as served at the default
``serve="node"`` (every node's local rank 0 serves its ranks' series, global rank 0 also the
job-wide ones; ``serve="rank0"`` serves rank 0's endpoint alone), and for comparison the one
endpoint that served every rank before issue #28 (rank 0's, with the per-rank series of the
whole job, their label sets without ``node``). Prometheus adds 5 series per target (``up``,
``scrape_duration_seconds``, ``scrape_samples_scraped``, ``scrape_samples_post_metric_relabeling``,
``scrape_series_added``).
The recording rules of ``deploy/prometheus/rules/distmon-recording.yml`` add their own series:
those of the rank comparison are counted from the rules' shapes (per rank, per peer group,
top k per run; DDP: one peer group).

    python benchmarks/series_count.py                       # 8, 1,024 and 16,384 GPUs
    python benchmarks/series_count.py --gpus 64 --gpus-per-node 4 --layers 32
    python benchmarks/series_count.py --all-options         # every optional family on

Label values are sized like production ones (hostnames ``gpu-node-01234``, full GPU UUIDs,
layer names such as ``model.layers.31.mlp.down_proj``), so the byte counts are a fair basis
for ``body_size_limit``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import yaml  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from distmon.serve.prometheus_exporter import GradCollector, MetricsAggregate  # noqa: E402
from distmon.setup.hostinfo import RankInfo  # noqa: E402
from distmon.snapshot import Snapshot  # noqa: E402

RULES = os.path.join(ROOT, "deploy", "prometheus", "rules", "distmon-recording.yml")
SCRAPE_SERIES = 5  # Prometheus' own per target: up, scrape_duration_seconds, scrape_samples_* ...
RUN_ID = "llm-pretrain-2025-06-01-a"


@dataclass(frozen=True)
class Body:
    series: int
    bytes: int


NODE_LABEL = re.compile(rb',node="[0-9]+"')  # the per-rank label that issue #28 added


def _rank(r: int, per_node: int) -> RankInfo:
    host = f"gpu-node-{r // per_node:05d}"
    uuid = f"GPU-{r:08x}-0000-4000-8000-{r:012x}"
    return RankInfo(r, r % per_node, host, uuid, host, node_index=r // per_node)


def _body(
    world: int,
    layers: int,
    cluster: bool,
    ranks: tuple[RankInfo, ...],
    serve: str,
    options: bool,
    before: bool = False,
) -> Body:
    """One endpoint's /metrics after one measured step: its series (samples) and bytes
    (``before``: without the per-rank ``node`` label, as served before issue #28)."""
    names = [f"model.layers.{i // 4}.mlp.{('up', 'gate', 'down', 'norm')[i % 4]}_proj" for i in range(layers)]
    per_layer = dict.fromkeys(names, 0.1) if options else {}
    agg = MetricsAggregate(
        run_id=RUN_ID, world_size=world, version="0.1.0", serve=serve, cluster=cluster, ranks=ranks
    )
    agg.add(
        [
            Snapshot(
                step=1,
                timestamp=1.0e9,
                grad_norm=1.0,
                layer_grad_norms=dict.fromkeys(names, 0.1),
                rank_grad_norms=[1.0] * len(ranks),
                rank_monitor_errors=[0] * len(ranks),
                ranks=[info.rank for info in ranks],
                node=ranks[0].node_index,
                run_id=RUN_ID,
                world_size=world,
                scores={"zscore": 0.0, "median_ratio": 1.0},
                rank_outlier_scores=[0.5 if world >= 3 else float("nan")] * len(ranks),
                gradient_noise_scale=100.0 if options else float("nan"),
                layer_gradient_noise_scale=per_layer,
                activation_rms=per_layer,
                activation_absmax=per_layer,
                layer_update_ratio=per_layer,
                # the precursor: one attention block per 8 layer groups (a transformer block's
                # norms, projections and MLP), its bound per block
                attention_logit_bound={f"model.layers.{i}.self_attn": 10.0 for i in range(len(names) // 8)}
                if options
                else {},
            )
        ]
    )
    reg = CollectorRegistry()
    reg.register(GradCollector(agg))
    samples = sum(len(family.samples) for family in reg.collect())
    body = generate_latest(reg)
    return Body(samples, len(NODE_LABEL.sub(b"", body) if before else body))


def recorded_rank_series(world: int) -> int:
    """Series the group distmon-rank-comparison records for one DDP run (one peer group): a
    ``topk by (run_id) (k, ...)`` rule records k, a rule aggregating ``by`` labels without
    ``rank`` one per peer group, any other one per rank."""
    groups = yaml.safe_load(Path(RULES).read_text())["groups"]
    (group,) = [g for g in groups if g["name"] == "distmon-rank-comparison"]
    total = 0
    for rule in group["rules"]:
        expr = rule["expr"].strip()
        topk = re.match(r"topk by \(run_id\) \((\d+),", expr)
        if topk:
            total += min(int(topk[1]), world)
        elif re.match(r"(quantile|count|sum|max|min) by \((?![^)]*\brank\b)", expr):
            total += 1
        else:
            total += world
    return total


def row(gpus: int, per_node: int, layers: int, options: bool) -> dict[str, int]:
    ranks = [_rank(r, per_node) for r in range(gpus)]
    nodes = max(1, gpus // per_node)
    rank0 = _body(gpus, layers, True, tuple(ranks[:per_node]), "node", options)
    other = (
        _body(gpus, layers, False, tuple(ranks[per_node : 2 * per_node]), "node", options)
        if nodes > 1
        else None
    )
    before = _body(gpus, layers, True, tuple(ranks), "rank0", options, before=True)
    node_job = rank0.series + (nodes - 1) * (other.series if other else 0)
    return {
        "gpus": gpus,
        "nodes": nodes,
        "rank0_series": rank0.series,
        "rank0_bytes": rank0.bytes,
        "node_series": other.series if other else 0,
        "node_bytes": other.bytes if other else 0,
        "job_series": node_job + nodes * SCRAPE_SERIES,
        "before_series": before.series + SCRAPE_SERIES,
        "before_bytes": before.bytes,
        "recorded": recorded_rank_series(gpus) if gpus >= 3 else 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 1024, 16384])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument(
        "--layers", type=int, default=128, help="layer groups (max_layers caps them; default 128)"
    )
    ap.add_argument(
        "--all-options",
        action="store_true",
        help="batch_size=, update_ratio=True, activations=, precursor= on",
    )
    args = ap.parse_args()
    print(
        f"{args.gpus_per_node} GPUs per node, {args.layers} layers, "
        f"{'every optional family on' if args.all_options else 'defaults otherwise'}; "
        "series = samples of one /metrics body (+5 per target that Prometheus adds in the job total)\n"
    )
    print(
        "| GPUs | nodes = targets | rank 0's endpoint: series / bytes | any other node's endpoint: "
        "series / bytes | whole job: series | before #28, rank 0 served every rank: series / bytes "
        "| recorded by the rank comparison |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in args.gpus:
        r = row(gpus, args.gpus_per_node, args.layers, args.all_options)
        other = f"{r['node_series']:,} / {r['node_bytes']:,}" if r["node_series"] else "-"
        print(
            f"| {gpus:,} | {r['nodes']:,} | {r['rank0_series']:,} / {r['rank0_bytes']:,} | {other} | "
            f"{r['job_series']:,} | {r['before_series']:,} / {r['before_bytes']:,} | "
            f"{r['recorded']:,} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
