"""End to end: the repo's deployment (deploy/) against real training jobs.

A real Prometheus (Debian package) runs the repository's ``deploy/prometheus`` config and
rule files, a real Alertmanager runs ``deploy/alertmanager/alertmanager.yml`` with its
webhook pointed at a receiver in this test, and ``launch/train.py`` runs under torchrun
(2 gloo ranks per job) with injected faults. Jobs announce themselves through the
``file_sd`` target file (``DISTMON_FILE_SD_DIR``); nothing is registered by hand.

Jobs, all started together (module fixture) and throttled with ``--min-step-s`` so that
step numbers map to predictable times and CPU use stays low on a 2-core machine:

* ``e2e-explode``: ~65 s normal, ~60 s with one layer's gradient x200 (sustained
  explosion), then NaN; finishes cleanly.  -> explosion, spike, non-finite alerts, every
  dashboard query, clean finish (target file gone, no "metrics vanished").
* ``e2e-killed``: SIGKILL of the torchrun launcher mid-run, then of its workers (torchrun
  leaves them running in sessions of their own; a scheduler kills every process of a
  job).  -> target file left behind, DistmonMetricsVanished, DistmonTargetDown.
* ``e2e-stalled``: its loop hangs (``--hang-step``).  -> DistmonTrainingStalled (120 s,
  the production threshold: the job runs concurrently with the others, so its wait overlaps).
* ``e2e-nodes``: two torchrun "nodes" (c10d rendezvous, 2 ranks each, ``serve="node"``).
  -> one target per node, per-rank series once each, sum/max over ranks = the snapshot, and
  Prometheus' cross-rank comparison (median, robust z over both targets) = the snapshot's.
* ``e2e-secure`` (started by its own test): one rank serving over mutual TLS with basic
  auth (``DISTMON_TLS_*``, ``DISTMON_BASIC_AUTH_FILE``), announced in a target file of
  its own.  -> the commented ``distmon-secure`` job of prometheus.yml, run as written,
  scrapes it; the same job without ``basic_auth`` is refused with 401.

Deliberate deviation from "only paths and ports substituted": ``scrape_interval`` and
``evaluation_interval`` are 1 s instead of 15 s. With the production intervals the
explosion alert alone (20 healthy samples of history, then ``for: 15s``) would need
5+ minutes of history and the whole test many minutes. Rule files are used unmodified
(thresholds and ``for`` durations as in production).

Wall time: ~3.5 minutes. Without prometheus / prometheus-alertmanager the tests skip
(fail under ``CI=true``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time

import deploy_stack
import pytest
from deploy_stack import (
    ANONYMOUS_JOB,
    SCRAPE_S,
    STARTUP_S,
    STEP_S,
    alert_rules,
    dashboard_queries,
    grafana_regex_escape,
    grafana_substitute,
    read_jsonl,
    rule_for,
    scalar,
    targets_of,
    wait_scraped,
)
from e2e_stack import (
    DEPLOY,
    EndpointWatch,
    TorchrunJob,
    free_port,
    has_data,
    parse_duration,
    parse_rfc3339,
    require_binary,
    tail,
    wait_for,
)
from secure_endpoint import write_htpasswd

from distmon.report.log_reader import read_log

pytestmark = pytest.mark.slow  # real ranks or servers: not in the fast tier

yaml = pytest.importorskip("yaml")

stack = deploy_stack.stack  # the module fixture: the deployment of this module

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "distmon.json"
DATASOURCE_PROVISIONING = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"

EXPLODE, KILLED, STALLED, NODES = "e2e-explode", "e2e-killed", "e2e-stalled", "e2e-nodes"
SECURE = "e2e-secure"
SECURE_STEPS = 40  # e2e-secure: ~10 s of steps, then 3 s of linger

# e2e-explode timeline (steps of STEP_S). The explosion alert compares the latest norm with
# the median of the run's healthy samples (recorded every SCRAPE_S; exploded samples are
# left out), so the normal phase must hold the 20 healthy samples the alert needs: 65 s
# normal (~62 samples), 60 s spike (fires ~17 s in (for: 15s), notified after Alertmanager's
# group_wait, stays firing until the NaN at ~60 s: NaN compares false), then NaN for ~10 s.
# x200 on the middle block's mlp.fc1 puts the global norm at ~25-35x its median
# (measured; x50 gives only ~9-11x, too close to the 10x threshold).
EXPLODE_STEPS, SPIKE_FROM, SPIKE_UNTIL, NAN_STEP, SPIKE_FACTOR = 540, 261, 500, 501, 200
HANG_STEP = 41  # e2e-stalled: steps 1-40 run (step 40 is exported), then the loop hangs
KILL_AFTER_STEPS = 40  # e2e-killed: Prometheus has scraped this many steps when it is killed
NODES_STEPS = 120  # e2e-nodes: ~30 s
# e2e-restarted (torchrun --max-restarts 1, its run id torchrun's --rdzv-id): rank 1 fails at step
# CRASH_STEP on the first attempt, before training it; every worker restarts and resumes from the
# last checkpoint, of step CKPT_EVERY * ((CRASH_STEP - 1) // CKPT_EVERY); RESTART_STEPS in all
# (~40 s of steps)
RESTARTED, RESTART_STEPS, CRASH_STEP, CKPT_EVERY = "e2e-restarted", 160, 60, 20
LINGER_EXPLODE, LINGER_NODES = 5, 8  # >= 2 scrape intervals


@pytest.fixture(scope="module")
def jobs(stack):
    """Every job of the module, started together (they overlap in time, not in resources)."""
    w, sd = stack.workdir, str(stack.sd_dir)
    common = ["--preset", "tiny", "--min-step-s", f"{STEP_S:g}", "--print-every", "20"]
    nodes_rdzv = f"127.0.0.1:{free_port()}"
    js = {
        # Started first: its 120 s threshold is the longest wait of the module.
        "stalled": TorchrunJob(
            "stalled",
            w,
            [*common, "--port", "0", "--steps", "100000", "--hang-step", str(HANG_STEP)],
            {"DISTMON_FILE_SD_DIR": sd, "DISTMON_RUN_ID": STALLED},
        ),
        "explode": TorchrunJob(
            "explode",
            w,
            [
                *common,
                "--port",
                "0",
                "--steps",
                str(EXPLODE_STEPS),
                "--spike-step",
                str(SPIKE_FROM),
                "--spike-until",
                str(SPIKE_UNTIL),
                "--spike-factor",
                str(SPIKE_FACTOR),
                "--nan-step",
                str(NAN_STEP),
                "--log-path",
                str(w / "explode.jsonl"),
            ],
            {"DISTMON_FILE_SD_DIR": sd, "DISTMON_RUN_ID": EXPLODE, "DISTMON_LINGER_S": str(LINGER_EXPLODE)},
            nproc=3,  # rank outlier scores are served for groups of 3+ ranks: the dashboard's panel has data
        ),
        "killed": TorchrunJob(
            "killed",
            w,
            [*common, "--port", "0", "--steps", "100000"],
            {"DISTMON_FILE_SD_DIR": sd, "DISTMON_RUN_ID": KILLED},
        ),
    }
    restart_port = free_port()
    js["restarted"] = TorchrunJob(
        "restarted",
        w,
        [
            *common,
            "--port",
            str(restart_port),
            "--steps",
            str(RESTART_STEPS),
            "--log-path",
            str(w / "restarted.jsonl"),
        ]
        + [
            "--crash-step",
            str(CRASH_STEP),
            "--crash-rank",
            "1",
            "--checkpoint-dir",
            str(w / "restarted-ckpt"),
        ]
        + ["--checkpoint-every", str(CKPT_EVERY), "--linger", "5"],
        # torchrun's shared rendezvous store hands restarted gloo/NCCL ranks their predecessors'
        # addresses (pytorch/pytorch#135712: 2 of 3 restarts fail here without this)
        {"DISTMON_FILE_SD_DIR": sd, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        rdzv_id=RESTARTED,  # the run id is torchrun's (TORCHELASTIC_RUN_ID): the same after a restart
        max_restarts=1,
    )
    for i in (0, 1):
        js[f"node{i}"] = TorchrunJob(
            f"node{i}",
            w,
            [*common, "--steps", str(NODES_STEPS), "--log-path", str(w / "nodes.jsonl")],
            {
                "DISTMON_SERVE": "node",
                "DISTMON_PORT": "0",
                "DISTMON_FILE_SD_DIR": sd,
                "DISTMON_RUN_ID": NODES,
                "DISTMON_LINGER_S": str(LINGER_NODES),
            },
            # As launch/torchrun_multi_node.sh: node 0 hosts the c10d store (--node-rank is
            # ignored by c10d; global ranks follow the rendezvous' GROUP_RANK).
            nnodes=2,
            rdzv_endpoint=nodes_rdzv,
            rdzv_id=NODES,
            rdzv_conf="is_host=true" if i == 0 else "is_host=false",
        )
    watch = None
    try:
        for job in js.values():
            job.start()
        watch = js["restarted"].watch = EndpointWatch(
            f"http://127.0.0.1:{restart_port}/metrics", js["restarted"]
        )
        yield js
    finally:
        if watch is not None:
            watch.stop()
        for job in js.values():
            if job.proc is not None:
                job.kill_all()


# --------------------------------------------------------------------------- tests


def test_two_nodes_serve_one_target_each_and_sums_match_the_snapshot(stack, jobs):
    """Acceptance 4: --nnodes 2 x 2 ranks, serve="node": one target per node, per-rank series
    once each, and sum/max over ranks in PromQL equal the last snapshot of the JSONL log."""
    nodes = [jobs["node0"], jobs["node1"]]
    prom = stack.prom

    def diag() -> str:
        return stack.diagnose(nodes, [NODES])

    def two_targets_up() -> list[dict] | None:
        for job in nodes:
            if job.poll() is not None:
                pytest.fail(f"{job.name} exited before its targets were seen\n{diag()}", pytrace=False)
        ts = targets_of(stack, NODES)
        return ts if len(ts) == 2 and all(t["health"] == "up" for t in ts) else None

    targets = wait_for(two_targets_up, STARTUP_S, "two healthy targets of run e2e-nodes", diag)
    node_labels = sorted(t["labels"]["node"] for t in targets)
    assert len(set(node_labels)) == 2, targets
    assert node_labels == ["0", "1"], node_labels  # the node's index, as on its per-rank series
    assert all(
        t["discoveredLabels"]["__meta_filepath"] == str(stack.sd_dir / f"{NODES}.json") for t in targets
    )
    instance_of = {t["labels"]["node"]: t["labels"]["instance"] for t in targets}

    # Per-rank series: all 4 ranks, once each, each served by its own node's target.
    def four_ranks() -> list | None:
        counts = prom.values(f'count by (rank) (distmon_rank_grad_norm{{run_id="{NODES}"}})')
        return counts if len(counts) == 4 else None

    counts = wait_for(four_ranks, 30, "per-rank series of 4 ranks of e2e-nodes", diag)
    assert sorted((m["rank"], v) for m, v in counts) == [("0", 1), ("1", 1), ("2", 1), ("3", 1)], counts
    for series in prom.query(f'distmon_rank_grad_norm{{run_id="{NODES}"}}'):
        m = series["metric"]
        rank = int(m["rank"])
        assert m["local_rank"] == str(rank % 2), m
        assert m["instance"] == instance_of[str(rank // 2)], (m, instance_of)
        # the series' own node label (the node index, #28) wins over the target's (honor_labels)
        assert m["node"] == str(rank // 2) and m["hostname"], m
    # Cluster-wide families come from global rank 0 only.
    assert scalar(prom, f'count(distmon_grad_norm{{run_id="{NODES}"}})') == 1
    assert scalar(prom, f'count(distmon_run_info{{run_id="{NODES}", world_size="4", serve="node"}})') == 1

    # The clean finish: every serving process keeps serving its final state for the linger.
    wait_for(
        lambda: scalar(prom, f'distmon_run_finished{{run_id="{NODES}"}}') == 1,
        NODES_STEPS * STEP_S * 3 + 60,
        "distmon_run_finished == 1 for e2e-nodes",
        diag,
    )
    t_seen = time.time()
    time.sleep(3 * SCRAPE_S)  # > 2 scrapes of both targets after the final export, < linger (8 s)
    t_query = time.time()
    stamps = prom.values(f'timestamp(distmon_rank_grad_norm{{run_id="{NODES}"}})', at=t_query)
    assert len(stamps) == 4 and all(v >= t_seen + 1 for _, v in stamps), (
        f"per-rank series not scraped after the finish (seen at {t_seen:.1f}): {stamps}\n{diag()}"
    )
    for job in nodes:
        rc = job.wait(LINGER_NODES + 60, diag)
        assert rc == 0, f"{job.name} failed\n{diag()}"

    # each node's first rank logs its own node's ranks (#28): nodes.jsonl and nodes.node1.jsonl
    lasts = [read_jsonl(stack.workdir / name)[-1] for name in ("nodes.jsonl", "nodes.node1.jsonl")]
    assert [(row["step"], row["world_size"], row["node"]) for row in lasts] == [
        (NODES_STEPS, 4, 0),
        (NODES_STEPS, 4, 1),
    ], lasts
    by_rank = {r: float(x) for row in lasts for r, x in zip(row["ranks"], row["rank_grad_norms"])}
    norms = [by_rank[r] for r in range(4)]
    assert len(by_rank) == 4 and all(math.isfinite(x) and x > 0 for x in norms), by_rank
    sel = f'distmon_rank_grad_norm{{run_id="{NODES}"}}'
    assert scalar(prom, f"sum({sel})", at=t_query) == pytest.approx(sum(norms), rel=1e-6)
    assert scalar(prom, f"max({sel})", at=t_query) == pytest.approx(max(norms), rel=1e-6)
    per_rank = {int(m["rank"]): v for m, v in prom.values(sel, at=t_query)}
    assert per_rank == pytest.approx(dict(enumerate(norms)), rel=1e-6)
    # Prometheus compares the ranks across both node targets (recording rules of the group
    # distmon-rank-comparison): the same statistics computed here from the log's norms.
    logs = [math.log10(x) for x in norms]
    median = statistics.median(logs)
    mad = statistics.median(abs(x - median) for x in logs)
    expected_z = {r: (x - median) / (1.4826 * max(mad, 0.05)) for r, x in enumerate(logs)}
    got_median = scalar(prom, f'distmon:rank_grad_norm:log10_median{{run_id="{NODES}"}}', at=t_query)
    assert got_median == pytest.approx(median, rel=1e-6, abs=1e-9), (got_median, median, diag())
    z = prom.values(f'distmon:rank_grad_norm:robust_z{{run_id="{NODES}"}}', at=t_query)
    assert {int(m["rank"]): v for m, v in z} == pytest.approx(expected_z, rel=1e-6, abs=1e-9), (z, expected_z)
    assert {m["hostname"] for m, _ in z} and all("instance" not in m for m, _ in z), z
    assert scalar(prom, f'distmon_optimizer_steps_total{{run_id="{NODES}"}}', at=t_query) == NODES_STEPS


def test_killed_job_fires_metrics_vanished_and_target_down(stack, jobs):
    """Acceptance 3 (killed): SIGKILL of the launcher; the target file stays behind, so
    DistmonMetricsVanished fires (and DistmonTargetDown, inhibited by it in Alertmanager)."""
    job = jobs["killed"]
    rec = stack.recorder

    def diag() -> str:
        return stack.diagnose([job], [KILLED])

    wait_scraped(stack, job, KILLED, KILL_AFTER_STEPS, diag)
    workers = job.worker_pids()
    assert len(workers) == 2, f"expected 2 workers, found {workers}\n{diag()}"
    t_kill = time.time()
    job.kill_launcher()
    time.sleep(2)
    survivors = [p for p in workers if p in job.pids()]
    # torchrun starts every worker in a session of its own (start_new_session=True) and sets
    # no parent-death signal: workers outlive a SIGKILLed agent and go on training and
    # serving (observed with torch 2.13). What kills a job in production kills all of its
    # processes (Slurm: the step's cgroup; Kubernetes: the container), so do that too:
    # SIGKILL each surviving worker (its process group). Nothing gets to clean up.
    print(
        f"e2e-killed: launcher SIGKILLed; workers still alive 2 s later: {survivors} of {workers}; "
        f"SIGKILLing them"
    )
    job.kill_all()
    assert not job.pids(), f"processes of e2e-killed survive SIGKILL\n{diag()}"
    assert (stack.sd_dir / f"{KILLED}.json").exists(), "a killed job cannot withdraw its target file"

    wait_for(
        lambda: any(t["health"] == "down" for t in targets_of(stack, KILLED)),
        30,
        "the e2e-killed target to be down",
        diag,
    )
    vanished_for, down_for = rule_for("DistmonMetricsVanished"), rule_for("DistmonTargetDown")
    fired = wait_for(
        lambda: rec.prom_alert("DistmonMetricsVanished", KILLED, "firing"),
        vanished_for + 60,
        "DistmonMetricsVanished to fire for e2e-killed",
        diag,
    )
    first_firing = fired[0]["states"]["firing"][0]
    assert first_firing >= t_kill + vanished_for - 2, "fired before its `for` had passed"
    assert float(fired[0]["value"]) >= KILL_AFTER_STEPS, fired  # the value is the last step seen
    wait_for(
        lambda: rec.am_alert("DistmonMetricsVanished", KILLED),
        30,
        "Alertmanager to list DistmonMetricsVanished for e2e-killed",
        diag,
    )
    wait_for(
        lambda: stack.webhook.received("DistmonMetricsVanished", KILLED),
        40,
        "the webhook to receive DistmonMetricsVanished for e2e-killed",
        diag,
    )

    wait_for(
        lambda: rec.prom_alert("DistmonTargetDown", KILLED, "firing"),
        down_for + 60,
        "DistmonTargetDown to fire for e2e-killed",
        diag,
    )
    am_down = wait_for(
        lambda: rec.am_alert("DistmonTargetDown", KILLED),
        30,
        "Alertmanager to list DistmonTargetDown for e2e-killed",
        diag,
    )
    # alertmanager.yml inhibits "target down" while "metrics vanished" fires for the run.
    assert any("suppressed" in a["states"] and a["last_inhibitedBy"] for a in am_down), am_down


def test_tls_and_basic_auth_endpoint_scraped_by_the_documented_job(stack):
    """A job serving over mutual TLS with basic auth, set up by environment variables alone,
    is scraped by the ``distmon-secure`` job of deploy/prometheus/prometheus.yml as written:
    target up over https, its metrics queryable. The same job without credentials sees the
    target down with 401. (Placed before the explosion test: it runs while that job's
    timeline plays out, so it adds little to the module's wall time.)"""
    if stack.secure is None:
        require_binary("openssl", package="openssl")  # skips, or fails under CI
    secure, prom, rec = stack.secure, stack.prom, stack.recorder
    users = write_htpasswd(stack.workdir / "users", {secure.username: secure.password}, rounds=10)
    pki = secure.pki
    job = TorchrunJob(
        "secure",
        stack.workdir,
        [
            "--preset",
            "tiny",
            "--min-step-s",
            f"{STEP_S:g}",
            "--print-every",
            "20",
            "--port",
            "0",
            "--steps",
            str(SECURE_STEPS),
        ],
        {
            "DISTMON_FILE_SD_DIR": str(secure.sd_dir),
            "DISTMON_RUN_ID": SECURE,
            "DISTMON_LINGER_S": "3",
            "DISTMON_TLS_CERT": str(pki.server_cert),
            "DISTMON_TLS_KEY": str(pki.server_key),
            "DISTMON_TLS_CLIENT_CA": str(pki.ca),
            "DISTMON_BASIC_AUTH_FILE": str(users),
        },
        nproc=1,
    )

    def diag() -> str:
        return stack.diagnose([job], [SECURE])

    def by_job() -> dict[str, dict]:
        return {r["labels"]["job"]: r for r in rec.target_records(SECURE)}

    def scraped_and_refused() -> bool:
        if job.poll() not in (None, 0):
            pytest.fail(f"e2e-secure failed\n{diag()}", pytrace=False)
        targets = by_job()
        steps = scalar(prom, f'max_over_time(distmon_optimizer_steps_total{{run_id="{SECURE}"}}[10m])')
        return (
            "up" in targets.get("distmon", {}).get("states", {})
            and bool(steps)
            and "401" in (targets.get(ANONYMOUS_JOB, {}).get("last_lastError") or "")
        )

    job.start()
    try:
        wait_for(
            scraped_and_refused,
            STARTUP_S + SECURE_STEPS * STEP_S * 3,
            "distmon-secure to scrape e2e-secure and distmon-secure-anonymous to get 401",
            diag,
        )
        targets = by_job()
        assert targets["distmon"]["scrapeUrl"].startswith("https://127.0.0.1:"), targets
        assert "up" not in targets[ANONYMOUS_JOB]["states"], targets
        served = prom.values(f'count by (job) (last_over_time(distmon_run_info{{run_id="{SECURE}"}}[10m]))')
        assert served == [({"job": "distmon"}, 1.0)], served
        assert job.wait(STARTUP_S + SECURE_STEPS * STEP_S * 3, diag) == 0, diag()
        assert not (secure.sd_dir / f"{SECURE}.json").exists(), "target file left behind"
    finally:
        job.kill_all()


def test_explosion_and_nonfinite_alerts_reach_alertmanager(stack, jobs):
    """Acceptance 1: Prometheus discovers the job through its target file; the sustained
    explosion, the spike and the NaN alerts reach Alertmanager (API) and its webhook."""
    job = jobs["explode"]
    rec = stack.recorder

    def diag() -> str:
        return stack.diagnose([job], [EXPLODE])

    # The timeline above rests on these rule conditions; a changed rule must fail here.
    rules = alert_rules()
    explosion = rules["DistmonGradientExplosion"]
    assert rule_for("DistmonGradientExplosion") == 15, explosion
    assert "distmon:grad_norm:median_30m > 10" in explosion["expr"], explosion["expr"]
    assert "distmon:grad_norm:samples_30m >= 20" in explosion["expr"], explosion["expr"]

    expected = {
        "DistmonGradientExplosion": {},
        "DistmonGradientSpikeBetweenScrapes": {},
        "DistmonNonFiniteGradients": {},
        "DistmonNonFiniteGradientsRank": {"rank": "0"},
    }

    def all_in_alertmanager() -> bool:
        if job.poll() not in (None, 0):
            pytest.fail(f"e2e-explode failed\n{diag()}", pytrace=False)
        return all(rec.am_alert(name, EXPLODE, **labels) for name, labels in expected.items())

    wait_for(
        all_in_alertmanager,
        STARTUP_S + EXPLODE_STEPS * STEP_S * 1.5 + 60,
        f"Alertmanager to list {sorted(expected)} for e2e-explode",
        diag,
    )
    for name, labels in expected.items():
        assert rec.prom_alert(name, EXPLODE, "firing", **labels), f"{name} never fired\n{diag()}"
    wait_for(
        lambda: all(stack.webhook.received(name, EXPLODE) for name in expected),
        40,
        "the webhook to receive every expected alert of e2e-explode",
        diag,
    )

    # No false alarm in the normal phase: both went pending only once the spike was exported.
    rows = read_jsonl(stack.workdir / "explode.jsonl")
    t_spike = next(r["timestamp"] for r in rows if r["step"] == SPIKE_FROM)
    for name in ("DistmonGradientExplosion", "DistmonGradientSpikeBetweenScrapes"):
        for r in rec.prom_alert(name, EXPLODE):
            assert parse_rfc3339(r["activeAt"]) >= t_spike - 1, (name, r, t_spike)
    ratio = max(float(r["last_value"]) for r in rec.prom_alert("DistmonGradientExplosion", EXPLODE, "firing"))
    assert ratio > 10, ratio
    t_nan = next(r["timestamp"] for r in rows if r["step"] == NAN_STEP)
    print(f"\ne2e-explode timeline (s after the spike's first step; NaN at {t_nan - t_spike:+.1f}):")
    for name in expected:
        for r in rec.prom_alert(name, EXPLODE):
            states = ", ".join(
                f"{s} {a - t_spike:+.1f}..{b - t_spike:+.1f}" for s, (a, b) in r["states"].items()
            )
            hooks = [a["received"] - t_spike for a in stack.webhook.received(name, EXPLODE)]
            print(f"  {name}: {states}; webhook at {min(hooks, default=float('nan')):+.1f}")

    # Discovery: the target came from the job's file, with its labels, and was healthy.
    seen = rec.target_records(EXPLODE)
    assert any(
        r["discoveredLabels"].get("__meta_filepath") == str(stack.sd_dir / f"{EXPLODE}.json")
        and r["labels"].get("node")
        and r["labels"].get("job") == "distmon"
        and "up" in r["states"]
        for r in seen
    ), f"no healthy file_sd target of e2e-explode was seen: {seen}\n{diag()}"


def test_every_dashboard_query_returns_data_for_the_run(stack, jobs):
    """Acceptance 2: every panel query (and annotation / variable query) of the dashboard,
    variables substituted as Grafana would, returns data from this Prometheus after the
    explosion run; a misspelled metric name returns nothing (the check can fail)."""
    job = jobs["explode"]
    prom = stack.prom

    def diag() -> str:
        return stack.diagnose([job], [EXPLODE])

    rc = job.wait(STARTUP_S + EXPLODE_STEPS * STEP_S * 1.5 + 60, diag)
    assert rc == 0, f"e2e-explode failed\n{diag()}"
    up_since = [r["states"]["up"][0] for r in stack.recorder.target_records(EXPLODE) if "up" in r["states"]]
    assert up_since, diag()
    start, end = min(up_since) - 5, job.ended + 2
    dash = json.loads(DASHBOARD.read_text())

    # Template variables, queried as Grafana does.
    run_ids = prom.api("label/run_id/values", **{"match[]": "distmon_run_info", "start": start, "end": end})
    assert EXPLODE in run_ids, run_ids
    layers = prom.api(
        "label/layer/values",
        **{"match[]": f'distmon_layer_grad_norm{{run_id="{EXPLODE}"}}', "start": start, "end": end},
    )
    logged_layers = read_jsonl(stack.workdir / "explode.jsonl")[0]["layer_grad_norms"]
    assert sorted(layers) == sorted(logged_layers), (layers, list(logged_layers))
    all_layers = "(" + "|".join(map(grafana_regex_escape, layers)) + ")"  # every layer selected

    queries = dashboard_queries(dash)
    assert len(queries) >= 20, queries
    annotations = [
        (a["name"], a["expr"], parse_duration(a.get("step", "30s")))
        for a in dash["annotations"]["list"]
        if a.get("expr")
    ]
    assert annotations, "the dashboard should annotate firing alerts"

    # Grafana: $__interval = max(range / points, data source timeInterval); $__rate_interval =
    # max($__interval + timeInterval, 4 x timeInterval). Once with a data source matching this
    # Prometheus (1 s), once with the provisioned data source's timeInterval.
    provisioned = yaml.safe_load(DATASOURCE_PROVISIONING.read_text())["datasources"][0]
    intervals = sorted({SCRAPE_S, parse_duration(provisioned["jsonData"]["timeInterval"])})
    missing = []
    for ti in intervals:
        step = max(ti, (end - start) / 1000)
        for layer in (".*", all_layers):  # Grafana's All (allValue) and every layer selected
            values = {
                "datasource": "prometheus",
                "run_id": EXPLODE,
                "layer": layer,
                "__interval": f"{step:g}s",
                "__interval_ms": str(int(step * 1000)),
                "__rate_interval": f"{max(step + ti, 4 * ti):g}s",
                "__range": f"{int(end - start)}s",
                "__range_s": str(int(end - start)),
                "__range_ms": str(int((end - start) * 1000)),
            }
            for title, ref, expr, instant in queries:
                q = grafana_substitute(expr, values)
                result = prom.query(q, at=end) if instant else prom.query_range(q, start, end, step)
                if not has_data(result):
                    missing.append(f"{title} [{ref}] (timeInterval {ti:g}s, layer {layer}): {q}")
            for name, expr, ann_step in annotations:
                q = grafana_substitute(expr, values)
                if not has_data(prom.query_range(q, start, end, ann_step)):
                    missing.append(f"annotation {name}: {q}")
    assert not missing, "dashboard queries without data:\n" + "\n".join(missing) + "\n" + diag()

    # Panels about anomalies and alerts show what this run did, not just zeros.
    def series_max(expr: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in prom.query_range(expr, start, end, SCRAPE_S):
            vals = [float(v) for _, v in s["values"] if not math.isnan(float(v))]
            out[s["metric"].get(label, "")] = max(vals, default=0.0)
        return out

    subst = {
        "datasource": "prometheus",
        "run_id": EXPLODE,
        "layer": ".*",
        "__rate_interval": "1m",
        "__interval": "1s",
        "__range": f"{int(end - start)}s",
    }
    by_title = {(t, r): e for t, r, e, _ in queries}
    anomalies = series_max(
        grafana_substitute(by_title[("Anomalies by kind (in-process detectors)", "A")], subst), "kind"
    )
    assert anomalies.get("spike", 0) > 0 and anomalies.get("nonfinite", 0) > 0, anomalies
    per_rank = series_max(grafana_substitute(by_title[("Non-finite steps per rank", "A")], subst), "rank")
    assert per_rank.get("0", 0) > 0, per_rank
    firing = {
        s["metric"]["alertname"]
        for s in prom.query(grafana_substitute(by_title[("Firing alerts", "A")], subst), at=end)
    }
    assert "DistmonNonFiniteGradients" in firing, firing
    annotated = series_max(grafana_substitute(annotations[0][1], subst), "alertname")
    assert {
        "DistmonGradientExplosion",
        "DistmonGradientSpikeBetweenScrapes",
        "DistmonNonFiniteGradients",
    } <= set(annotated), annotated

    # Self-check: the same check on a misspelled metric name / recording rule finds nothing.
    for _title, _ref, expr, _instant in queries:
        if expr.startswith("distmon_grad_norm{"):
            typo = grafana_substitute(expr.replace("distmon_grad_norm{", "distmon_grad_nrom{"), subst)
            assert has_data(prom.query_range(grafana_substitute(expr, subst), start, end, SCRAPE_S))
            assert not has_data(prom.query_range(typo, start, end, SCRAPE_S)), typo
            break
    else:
        pytest.fail("no panel queries distmon_grad_norm")
    typo = grafana_substitute('distmon:grad_norm:median_3m{run_id="$run_id"}', subst)
    assert not has_data(prom.query_range(typo, start, end, SCRAPE_S))


def test_clean_finish_removes_target_file_and_vanished_stays_silent(stack, jobs):
    """Acceptance 3 (clean finish): after a clean finish the target file is gone, the
    target leaves discovery, and DistmonMetricsVanished never even goes pending."""
    runs = {EXPLODE: [jobs["explode"]], NODES: [jobs["node0"], jobs["node1"]]}
    all_jobs = [j for js in runs.values() for j in js]
    prom, rec = stack.prom, stack.recorder

    def diag() -> str:
        return stack.diagnose(all_jobs, list(runs))

    for job in all_jobs:
        rc = job.wait(STARTUP_S + EXPLODE_STEPS * STEP_S * 1.5 + 60, diag)
        assert rc == 0, f"{job.name} failed\n{diag()}"
    for run_id in runs:
        assert not (stack.sd_dir / f"{run_id}.json").exists(), f"{run_id}: target file left behind"
        assert rec.target_records(run_id), f"{run_id} was never discovered\n{diag()}"
    wait_for(
        lambda: not any(t["labels"].get("run_id") in runs for t in prom.targets()),
        30,
        "Prometheus to drop the finished runs' targets",
        diag,
    )
    for run_id in runs:  # what keeps the alert silent: the finish was scraped
        assert scalar(prom, f'max_over_time(distmon_run_finished{{run_id="{run_id}"}}[30m])') == 1, run_id

    # Wait past the rule's `for` (+ margin) after the targets went away, watching all along.
    quiet_until = max(j.ended for j in all_jobs) + rule_for("DistmonMetricsVanished") + 15
    while True:
        for run_id in runs:
            assert not rec.prom_alert("DistmonMetricsVanished", run_id), (
                f"vanished alert for {run_id}\n{diag()}"
            )
        if time.time() > quiet_until:
            break
        time.sleep(1)
    t0 = min(j.started for j in all_jobs)
    selector = f'ALERTS{{alertname="DistmonMetricsVanished", run_id=~"{EXPLODE}|{NODES}"}}'
    assert not has_data(prom.query_range(selector, t0, time.time(), SCRAPE_S)), diag()
    for run_id in runs:
        assert not rec.am_alert("DistmonMetricsVanished", run_id)
        assert not stack.webhook.received("DistmonMetricsVanished", run_id)
    # A scrape between the server's close and Prometheus' reaction to the removed file may
    # fail (up == 0: DistmonTargetDown pending); once the target left discovery it must
    # be gone, never having fired.
    for run_id in runs:
        assert not rec.prom_alert("DistmonTargetDown", run_id, "firing"), diag()
    assert not [
        a
        for a in prom.alerts()
        if a["labels"].get("alertname") == "DistmonTargetDown" and a["labels"].get("run_id") in runs
    ], diag()


def test_stalled_job_fires_training_stalled(stack, jobs):
    """Acceptance 3 (stalled): a hung loop keeps answering scrapes; after the rule's 120 s
    without a step DistmonTrainingStalled fires (not earlier) and reaches Alertmanager."""
    job = jobs["stalled"]
    prom, rec = stack.prom, stack.recorder

    def diag() -> str:
        return stack.diagnose([job], [STALLED])

    expr = alert_rules()["DistmonTrainingStalled"]["expr"]
    threshold = float(re.search(r"distmon_last_step_timestamp_seconds > 0\)\s*>\s*(\d+)", expr)[1])
    wait_for(
        lambda: f"--hang-step {HANG_STEP}:" in tail(job.out, 20000),
        STARTUP_S + HANG_STEP * STEP_S * 3,
        "e2e-stalled to hang",
        diag,
    )
    wait_scraped(stack, job, STALLED, HANG_STEP - 1, diag)
    last_step_at = scalar(prom, f'distmon_last_step_timestamp_seconds{{run_id="{STALLED}"}}')
    assert last_step_at and last_step_at < time.time(), diag()

    fired = wait_for(
        lambda: rec.prom_alert("DistmonTrainingStalled", STALLED, "firing"),
        last_step_at + threshold + 60 - time.time(),
        "DistmonTrainingStalled for e2e-stalled",
        diag,
    )
    assert parse_rfc3339(fired[0]["activeAt"]) >= last_step_at + threshold - 2, (fired, last_step_at)
    # Still alive and answering scrapes: only the step timestamp tells.
    assert job.poll() is None, diag()
    assert scalar(prom, f'up{{run_id="{STALLED}"}}') == 1, diag()
    assert scalar(prom, f'distmon_run_finished{{run_id="{STALLED}"}}') == 0, diag()
    wait_for(
        lambda: rec.am_alert("DistmonTrainingStalled", STALLED),
        30,
        "Alertmanager to list DistmonTrainingStalled for e2e-stalled",
        diag,
    )
    wait_for(
        lambda: stack.webhook.received("DistmonTrainingStalled", STALLED),
        40,
        "the webhook to receive DistmonTrainingStalled for e2e-stalled",
        diag,
    )


def test_a_restarted_job_comes_back_on_its_port_and_pages_only_the_restart(stack, jobs):
    """#30: torchrun --max-restarts 1, rank 1 failing at step CRASH_STEP on the first attempt. The job
    finishes; the restarted workers serve on the same port, under the same run id (torchrun's),
    with distmon_restart_count 1; the log holds both attempts and reads as one
    run resumed from the checkpoint; the shipped rules raise DistmonRunRestarted and no non-finite,
    stalled or explosion alert."""
    job, prom, rec = jobs["restarted"], stack.prom, stack.recorder

    def diag() -> str:
        return stack.diagnose([job], [RESTARTED]) + f"\nworkers {job.watch.workers}"

    rc = job.wait(STARTUP_S * 2 + RESTART_STEPS * STEP_S * 3, diag)
    assert rc == 0, f"e2e-restarted failed\n{diag()}"
    job.watch.stop()
    restarted = [start for start, count in job.watch.workers.values() if count == 1]
    assert len(restarted) == 2, diag()
    back = [t for t, count in job.watch.scrapes if count == 1.0]
    assert back, f"the restarted workers never answered on the same port\n{diag()}"
    # how soon (10 s) is tests/test_restarts.py's: here a dozen processes share two cores
    assert back[0] - max(restarted) <= STARTUP_S, (back[0] - max(restarted), diag())
    before = [t for t, count in job.watch.scrapes if count == 0.0]
    assert before and before[-1] < back[0], diag()  # the same port served both attempts
    log = read_jsonl(stack.workdir / "restarted.jsonl")
    assert {row["run_id"] for row in log} == {RESTARTED}  # torchrun's id, unchanged by the restart
    assert {row["restart"] for row in log} == {0, 1}
    resumed = [row for row in log if row["resumed_from"] is not None]
    checkpoint = CKPT_EVERY * ((CRASH_STEP - 1) // CKPT_EVERY)  # step CRASH_STEP never trained
    assert [row["step"] for row in resumed] == [checkpoint + 1] and resumed[0]["resumed_from"] == checkpoint
    read = read_log(str(stack.workdir / "restarted.jsonl"))
    assert read.run_count == 1 and list(read.run.steps) == list(range(1, RESTART_STEPS + 1)), read.runs
    assert len(read.run.restarts) == 1
    wait_for(
        lambda: rec.prom_alert("DistmonRunRestarted", RESTARTED, "firing"), 60, "DistmonRunRestarted", diag
    )
    for name in ("DistmonNonFiniteGradients", "DistmonTrainingStalled", "DistmonGradientExplosion"):
        assert not rec.prom_alert(name, RESTARTED), (name, diag())
    assert scalar(prom, f'max_over_time(distmon_restart_count{{run_id="{RESTARTED}"}}[10m])') == 1, diag()
