"""End to end, issue #28: one job of 4 torchrun agents ("nodes") x 2 gloo ranks, serve="node".

The deployment of ``tests/deploy_stack.py`` (its ``stack`` fixture, this module's own: a real
Prometheus running ``deploy/prometheus`` with the shipped recording and alert rules, unmodified,
1 s scrape and evaluation; a real Alertmanager) discovers the job through its ``file_sd`` target file alone.
The four agents share one c10d rendezvous on 127.0.0.1 (the first hosts the store); every
agent's two ranks are one node. distmon runs at its defaults (``serve="node"``: each node's
first rank serves its node's per-rank series, global rank 0 also the job-wide ones).

Faults (launch/train.py): rank 7 (node 3) has a bad data shard from the first step (its loss x8,
``--corrupt-rank``), rank 2 (node 1) puts a NaN into one layer's gradient at step NAN_STEP
(``--guard skip`` keeps that step out of the weights, so the other steps stay finite).

What is checked, by direct scrapes of the four endpoints and by Prometheus queries:

* each node's endpoint serves exactly its own two ranks' per-rank series (``rank``, ``node``
  labels), the other nodes' serve nothing else; rank 0's endpoint serves no other node's
  per-rank series and as many samples, family by family, as rank 0's endpoint of the same job
  on 2 nodes (a reference job run while the main one hangs): it does not grow with the nodes;
* the bad rank is named by the job's rank_outlier events (every node's log, rank 0's
  ``distmon_anomalies_total`` and ``distmon_rank_outlier_worst_rank``), by the recording rule
  ``distmon:rank_grad_norm:robust_z`` (and its top-5) and by the alert DistmonRankOutlier;
* the NaN is named with its rank and layer in the job-wide series
  (``distmon_last_nonfinite_step{rank, layer}`` on rank 0's endpoint), by
  DistmonNonFiniteGradientsRank (rank 2 only, its counter served by node 1's endpoint) and by
  ``first_nonfinite`` in every node's log;
* rank 6 (node 3) hangs before step HANG_STEP (``--hang-step --hang-rank``), the other ranks
  waiting for it in that step's all-reduce: no export after the one before it can complete
  anywhere, so every node's log ends at that export (a stop at an arbitrary moment could land
  inside an export's collective, which some peers complete and log and others never do);
* node 3 then goes dark: every process of its agent is stopped (SIGSTOP), as a machine that
  dies or drops off the network looks to its peers. Why not SIGKILL: on one host a killed
  process' sockets are closed at once and every gloo peer fails within seconds (measured: all
  other agents exit with status 1 within ~5 s), so the job ends and nothing stalls; a lost
  machine closes nothing, and NCCL peers hang until their watchdog (10 min by default), which
  the stop reproduces. -> DistmonTargetDown for node 3's target only, the other nodes still up
  and their agents running (their ranks hang in the collective, rank 0 keeps answering
  scrapes: DistmonTrainingStalled then fires 120 s after the last step, as
  tests/test_e2e_deploy.py's stalled job shows, not waited for here), and no
  DistmonMetricsVanished (the run's job-wide series are still served);
* finally every process is stopped, then killed (no process writes after another is gone), and
  ``python -m distmon report`` over the log directory (``run.jsonl`` and ``run.node{1,2,3}.jsonl``)
  reports all 8 ranks from the 4 node logs, none missing, no disagreement, the NaN's rank and
  layer, rank 7 as the most outlying rank.

The shipped thresholds make the wall time: DistmonRankOutlier's ``for: 30s`` before the stop,
DistmonTargetDown's after it. ~2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import deploy_stack
import pytest
from deploy_stack import (
    SCRAPE_S,
    STARTUP_S,
    STEP_S,
    Stack,
    read_jsonl,
    rule_for,
    scalar,
    targets_of,
)
from e2e_stack import ROOT, TorchrunJob, free_port, parse_rfc3339, wait_for
from helpers import scrape_metrics

from distmon.report.log_reader import read_log
from distmon.serve.prometheus_exporter import METRICS, RANK_LABELS

pytestmark = pytest.mark.slow

yaml = pytest.importorskip("yaml")

stack = deploy_stack.stack  # the module fixture: a deployment of this module's own

RUN, REFERENCE = "e2e-nodes4", "e2e-nodes4-ref"
NODES, PER_NODE = 4, 2
WORLD = NODES * PER_NODE
BAD_RANK, BAD_SCALE = WORLD - 1, 8  # rank 7, on the last node: loss x8 from step 1
NAN_RANK, NAN_STEP, NAN_LAYER = (
    2,
    60,
    "blocks.0.attn.qkv",
)  # rank 2 on node 1; a scheduled export step (export_every 10)
DARK_NODE = 3
SEEN_STEPS = NAN_STEP + 10  # Prometheus has scraped this many steps when node 3 goes dark
# the job hangs mid-interval after SEEN_STEPS, an export step: every node logs through it, none beyond
HANG_STEP, HANG_RANK = SEEN_STEPS + 5, PER_NODE * DARK_NODE
# the families a node's serving rank serves for each of its ranks (labels rank, local_rank, node ...)
PER_RANK = sorted(name for name, spec in METRICS.items() if spec.labels == RANK_LABELS)


def train_args(log_path: Path, corrupt_rank: int, steps: int) -> list[str]:
    return [
        "--preset", "tiny", "--min-step-s", f"{STEP_S:g}", "--print-every", "20", "--port", "0",
        "--steps", str(steps), "--log-path", str(log_path), "--guard", "skip",
        "--corrupt-rank", str(corrupt_rank), "--corrupt-scale", str(BAD_SCALE),
        "--nan-step", str(NAN_STEP), "--nan-rank", str(NAN_RANK), "--nan-layer", NAN_LAYER,
    ]  # fmt: skip


def agents(name: str, workdir: Path, nodes: int, args: list[str], env: dict[str, str]) -> list[TorchrunJob]:
    """``nodes`` torchrun agents of PER_NODE ranks joined by one c10d rendezvous (the first hosts it)."""
    rdzv = f"127.0.0.1:{free_port()}"
    return [
        TorchrunJob(
            f"{name}-node{i}",
            workdir,
            args,
            env,
            nproc=PER_NODE,
            nnodes=nodes,
            rdzv_endpoint=rdzv,
            rdzv_id=name,
            rdzv_conf=f"is_host={'true' if i == 0 else 'false'}",
        )
        for i in range(nodes)
    ]


def stop(job: TorchrunJob) -> list[int]:
    """SIGSTOP every process of the agent's job: it answers nothing and closes no connection."""
    pids = job.pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def scrape(address: str) -> dict[str, list]:
    """The samples an endpoint serves, by family: {family: [Sample, ...]} (counters: ``_total``)."""
    return scrape_metrics(address, timeout=5, by_family=True)


def counts(samples: dict[str, list]) -> dict[str, int]:
    return {name: len(v) for name, v in sorted(samples.items())}


def node_targets(sd_file: Path) -> dict[int, str]:
    """node index -> the address its target file entry names (its `node` label)."""
    entries = json.loads(sd_file.read_text())
    return {int(e["labels"]["node"]): e["targets"][0] for e in entries}


def test_four_nodes_serve_their_own_ranks_name_the_faults_and_page_for_a_dark_node(stack: Stack):
    t_begin = time.time()
    prom, rec = stack.prom, stack.recorder
    workdir = stack.workdir / "nodes4"
    logs = workdir / "logs"
    env = {"DISTMON_FILE_SD_DIR": str(stack.sd_dir), "DISTMON_RUN_ID": RUN}
    hang = ["--hang-step", str(HANG_STEP), "--hang-rank", str(HANG_RANK)]
    job = agents(RUN, workdir, NODES, [*train_args(logs / "run.jsonl", BAD_RANK, 100_000), *hang], env)
    ref_sd = workdir / "reference-sd"  # not under Prometheus' file_sd glob: scraped here only
    reference: list[TorchrunJob] = []  # built when it starts: its rendezvous port drawn then
    figures: list[str] = []

    def diag() -> str:
        return stack.diagnose(job + reference, [RUN])

    workdir.mkdir()
    try:
        for agent in job:
            agent.start()

        # ---- four targets, one per node, from the job's target file ------------------------
        def four_up() -> list[dict] | None:
            for agent in job:
                if agent.poll() is not None:
                    pytest.fail(f"{agent.name} exited\n{diag()}", pytrace=False)
            ts = targets_of(stack, RUN)
            return ts if len(ts) == NODES and all(t["health"] == "up" for t in ts) else None

        targets = wait_for(four_up, STARTUP_S, f"{NODES} healthy targets of {RUN}", diag)
        instance = node_targets(stack.sd_dir / f"{RUN}.json")
        assert sorted(instance) == list(range(NODES)), instance
        assert sorted(t["labels"]["instance"] for t in targets) == sorted(instance.values()), targets
        t_up = time.time()

        # ---- run until the faults are in Prometheus and the outlier alert fired ------------
        def faults_seen() -> bool:
            for agent in job:
                if agent.poll() is not None:
                    pytest.fail(f"{agent.name} exited\n{diag()}", pytrace=False)
            steps = scalar(prom, f'distmon_optimizer_steps_total{{run_id="{RUN}"}}')
            return (
                steps is not None
                and steps >= SEEN_STEPS
                and bool(rec.prom_alert("DistmonRankOutlier", RUN, "firing", rank=str(BAD_RANK)))
                and bool(rec.prom_alert("DistmonNonFiniteGradientsRank", RUN, "firing", rank=str(NAN_RANK)))
            )

        wait_for(
            faults_seen,
            STARTUP_S + SEEN_STEPS * STEP_S * 4,
            f"{SEEN_STEPS} steps of {RUN} scraped, DistmonRankOutlier (rank {BAD_RANK}) and "
            f"DistmonNonFiniteGradientsRank (rank {NAN_RANK}) firing",
            diag,
        )
        t_seen = time.time()

        # ---- what each endpoint serves (direct scrapes) ------------------------------------
        served = {n: scrape(address) for n, address in instance.items()}
        for n, samples in served.items():
            own = {str(PER_NODE * n + i) for i in range(PER_NODE)}
            for name in PER_RANK:
                got = samples.get(name, [])
                assert sorted(s.labels["rank"] for s in got) == sorted(own), (n, name, got)
                for s in got:
                    rank = int(s.labels["rank"])
                    assert s.labels["node"] == str(n) and s.labels["local_rank"] == str(rank % PER_NODE), s
                    assert s.labels["run_id"] == RUN and s.labels["hostname"], s
            job_wide = {name for name in samples if name not in PER_RANK}
            if n == 0:
                assert {"distmon_grad_norm", "distmon_last_nonfinite_step", "distmon_run_info"} <= job_wide
            else:  # nothing but its ranks' series: a node's endpoint does not grow with the job
                assert job_wide == set(), (n, sorted(job_wide))
                assert sum(map(len, samples.values())) == len(PER_RANK) * PER_NODE, counts(samples)
        rank0 = served[0]
        (info,) = rank0["distmon_run_info"]
        assert info.labels["world_size"] == str(WORLD) and info.labels["serve"] == "node", info
        sizes = ", ".join(f"node {n}: {sum(map(len, s.values()))}" for n, s in served.items())
        figures.append(f"samples per endpoint at step >= {SEEN_STEPS}: {sizes}")

        # ---- the same through Prometheus: every rank once, from its own node's target ------
        per_rank = prom.query(f'distmon_rank_grad_norm{{run_id="{RUN}"}}')
        assert sorted(int(s["metric"]["rank"]) for s in per_rank) == list(range(WORLD)), per_rank
        for s in per_rank:
            m = s["metric"]
            n = int(m["rank"]) // PER_NODE
            assert m["instance"] == instance[n] and m["node"] == str(n), (m, instance)
        job_wide_instances = prom.values(
            f'count by (instance) ({{__name__=~"distmon_.+", run_id="{RUN}", rank=""}})'
        )
        assert [m["instance"] for m, _ in job_wide_instances] == [instance[0]], job_wide_instances
        scraped = {m["instance"]: v for m, v in prom.values(f'scrape_samples_scraped{{run_id="{RUN}"}}')}
        assert {scraped[instance[n]] for n in range(1, NODES)} == {len(PER_RANK) * PER_NODE}, scraped

        # ---- the bad rank: the job's events, rank 0's series, the recording rules ----------
        assert scalar(prom, f'distmon_anomalies_total{{run_id="{RUN}", kind="rank_outlier"}}') > 0
        assert scalar(prom, f'distmon_rank_outlier_worst_rank{{run_id="{RUN}"}}') == BAD_RANK, diag()
        assert scalar(prom, f'distmon_rank_outlier_worst_score{{run_id="{RUN}"}}') > 8
        z = {
            int(m["rank"]): (m, v)
            for m, v in prom.values(f'distmon:rank_grad_norm:robust_z{{run_id="{RUN}"}}')
        }
        assert sorted(z) == list(range(WORLD)), z
        bad_labels, bad_z = z[BAD_RANK]
        assert bad_z > 5 and bad_labels["node"] == str(DARK_NODE) and bad_labels["hostname"], z[BAD_RANK]
        assert all(abs(v) < 5 for r, (_, v) in z.items() if r != BAD_RANK), z
        top = prom.values(f'topk(1, distmon:rank_grad_norm:top5_abs_robust_z{{run_id="{RUN}"}})')
        assert [m["rank"] for m, _ in top] == [str(BAD_RANK)], top
        outlier = rec.prom_alert("DistmonRankOutlier", RUN, "firing")
        assert {(a["labels"].get("rank"), a["labels"]["signal"]) for a in outlier} == {
            (str(BAD_RANK), "score")
        }
        figures.append(f"robust z: rank {BAD_RANK} {bad_z:.1f}, others {min(v for _, v in z.values()):.2f}..")

        # ---- the NaN: its rank and layer in the job-wide series, the per-rank alert --------
        last_bad = prom.values(f'distmon_last_nonfinite_step{{run_id="{RUN}"}}')
        assert [(m["rank"], m["layer"], m["instance"], v) for m, v in last_bad] == [
            (str(NAN_RANK), NAN_LAYER, instance[0], NAN_STEP)
        ], last_bad
        assert scalar(prom, f'distmon_nonfinite_steps_total{{run_id="{RUN}"}}') == 1
        counted = prom.values(f'distmon_rank_nonfinite_steps_total{{run_id="{RUN}"}} > 0')
        assert [(m["rank"], m["instance"], v) for m, v in counted] == [
            (str(NAN_RANK), instance[NAN_RANK // PER_NODE], 1)
        ], counted
        assert {a["labels"]["rank"] for a in rec.prom_alert("DistmonNonFiniteGradientsRank", RUN)} == {
            str(NAN_RANK)
        }
        assert rec.prom_alert("DistmonNonFiniteGradients", RUN, "firing"), diag()

        # ---- node 3 goes dark --------------------------------------------------------------
        # the job hangs at HANG_STEP: once every node's log holds the export before it, none can follow
        def last_logged(path: Path) -> int:
            rows = read_jsonl(path)
            return rows[-1]["step"] if rows else 0

        node_logs = [logs / "run.jsonl"] + [logs / f"run.node{n}.jsonl" for n in range(1, NODES)]
        wait_for(
            lambda: [last_logged(p) for p in node_logs] == [SEEN_STEPS] * NODES,
            30,
            f"every node's log to hold step {SEEN_STEPS}, the last export before the hang at {HANG_STEP}",
            diag,
        )
        frozen = stop(job[DARK_NODE])
        t_dark = time.time()
        assert len(frozen) == 1 + PER_NODE, frozen  # its agent and its two workers
        reference[:] = agents(  # the 2-node reference runs while the job hangs
            REFERENCE,
            workdir,
            2,
            train_args(workdir / "reference.jsonl", 2 * PER_NODE - 1, SEEN_STEPS + 5),
            {"DISTMON_FILE_SD_DIR": str(ref_sd), "DISTMON_RUN_ID": REFERENCE, "DISTMON_LINGER_S": "20"},
        )
        for agent in reference:
            agent.start()
        last_step_at = scalar(prom, f'distmon_last_step_timestamp_seconds{{run_id="{RUN}"}}')
        assert last_step_at is not None and last_step_at <= t_dark, diag()

        # rank 0's endpoint of the same job on 2 nodes: the same samples, family by family
        def reference_served() -> dict[str, list] | None:
            for agent in reference:
                if agent.poll() not in (None, 0):
                    pytest.fail(f"{agent.name} failed\n{diag()}", pytrace=False)
            sd_file = ref_sd / f"{REFERENCE}.json"
            if not sd_file.exists():
                return None
            samples = scrape(node_targets(sd_file)[0])
            steps = samples.get("distmon_optimizer_steps_total")
            return samples if steps and steps[0].value >= SEEN_STEPS else None

        ref0 = wait_for(
            reference_served, STARTUP_S + SEEN_STEPS * STEP_S * 4, f"{REFERENCE} at step {SEEN_STEPS}", diag
        )
        assert counts(rank0) == counts(ref0), (counts(rank0), counts(ref0))
        assert {s.labels["rank"] for name in PER_RANK for s in ref0.get(name, [])} == {"0", "1"}
        figures.append(
            f"rank 0's endpoint: {sum(map(len, rank0.values()))} samples at 4 nodes, "
            f"{sum(map(len, ref0.values()))} at 2 nodes"
        )

        down_for = rule_for("DistmonTargetDown")
        fired = wait_for(
            lambda: rec.prom_alert("DistmonTargetDown", RUN, "firing"),
            down_for + 60,
            f"DistmonTargetDown for node {DARK_NODE} of {RUN}",
            diag,
        )
        assert [a["labels"]["instance"] for a in fired] == [instance[DARK_NODE]], fired
        assert parse_rfc3339(fired[0]["activeAt"]) >= t_dark - 2 * SCRAPE_S, (fired, t_dark)
        t_down = fired[0]["states"]["firing"][0]

        # the rest of the job hangs, still served: one target down, the run not vanished
        for agent in job:
            assert agent.poll() is None, f"{agent.name} exited\n{diag()}"
        assert not rec.prom_alert("DistmonMetricsVanished", RUN), diag()
        ups = {m["instance"]: v for m, v in prom.values(f'up{{run_id="{RUN}"}}')}
        assert ups == {address: float(n != DARK_NODE) for n, address in instance.items()}, ups
        wait_for(
            lambda: rec.am_alert("DistmonTargetDown", RUN), 30, "Alertmanager to list the dark node", diag
        )
        figures.append(
            f"after node {DARK_NODE} went dark: DistmonTargetDown firing at +{t_down - t_dark:.0f} s "
            f"(last exported step at {last_step_at - t_dark:+.1f} s)"
        )
        for agent in reference:
            assert agent.wait(STARTUP_S, diag) == 0, diag()
    finally:
        for agent in job:  # stop every process first: none writes a log line after another is gone
            if agent.proc is not None:
                stop(agent)
        for agent in job + reference:
            if agent.proc is not None:
                agent.kill_all()

    # ---- the report over the node logs ---------------------------------------------------------
    paths = sorted(str(p) for p in logs.glob("*.jsonl"))
    assert [Path(p).name for p in paths] == ["run.jsonl"] + [f"run.node{n}.jsonl" for n in range(1, NODES)]
    last = {Path(p).name: last_logged(Path(p)) for p in paths}
    assert set(last.values()) == {SEEN_STEPS}, last  # the job hung: no export after the hang
    for path in paths:  # every node's log names the faults alike (job-wide fields)
        rows = read_jsonl(Path(path))
        (bad,) = [r for r in rows if r["first_nonfinite"]]
        assert bad["step"] == NAN_STEP and bad["first_nonfinite"] == [NAN_RANK, NAN_LAYER], (path, bad)
        events = Counter((e["kind"], e["rank"]) for r in rows for e in r["events"])
        assert set(events) == {("rank_outlier", BAD_RANK), ("nonfinite", NAN_RANK)}, (path, events)
    read = read_log(paths)
    run = read.run
    assert run.world_size == WORLD, run.world_size
    assert not run.missing and run.disagreements == 0, (run.missing, run.disagreements)
    assert sorted(run.log_ranks.values()) == [f"{PER_NODE * n}-{PER_NODE * n + 1}" for n in range(NODES)]
    assert len(run.rank_norms[-1]) == WORLD and all(math.isfinite(x) for x in run.rank_norms[-1])
    scores = list(run.rank_score)
    assert len(scores) == WORLD and max(range(WORLD), key=scores.__getitem__) == BAD_RANK, scores
    out = workdir / "report"
    done = subprocess.run(
        [sys.executable, "-m", "distmon", "report", str(logs), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    summary = (out / "summary.md").read_text()
    assert f"world size {WORLD}; {NODES} logs read" in summary, summary
    for n in range(NODES):
        assert f"| {n} | {PER_NODE * n}-{PER_NODE * n + 1} |" in summary, summary
    assert "ranks missing" not in summary and "disagree" not in summary, summary
    assert f"**first non-finite step {NAN_STEP}**: rank {NAN_RANK}, layer `{NAN_LAYER}`" in summary, summary
    outlying = summary.split("Most outlying ranks", 1)[1].split("\n\n", 2)[1].splitlines()[2:]
    assert len(outlying) == WORLD and outlying[0].startswith(f"| {BAD_RANK} |"), outlying
    figures.append(
        f"wall time {time.time() - t_begin:.0f} s (targets up at +{t_up - t_begin:.0f} s, "
        f"faults seen at +{t_seen - t_begin:.0f} s)"
    )
    print("\n" + "\n".join(figures))
