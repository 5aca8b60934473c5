"""Non-finite attribution, no host sync, HTTP serving, failure isolation, on real DDP ranks.

Every scenario runs real gloo ranks (spawned processes, see ddp_harness.run_ranks) and,
where numbers are checked, compares them with references computed by the test itself:
the reduced `p.grad` of the DDP module and an un-wrapped twin of the module that runs
the same batch on each rank (its `.grad` is that rank's local gradient).

Non-finite: a NaN / Inf injected into one layer's gradient on one rank is reported at that
step with that (rank, layer); the next steps are finite again and still correct.
No host sync: on non-export steps the monitor performs no host sync (the test fails if
`.item()`, `.tolist()`, `.cpu()`, `.numpy()` or a synchronize is called from monitor
code on such a step) and issues exactly one collective of its own per optimizer step
(ddp_harness.SyncRecorder; checked on plain steps and on steps of two micro-batches
with no_sync(); a meta-test proves the recorder sees distmon-attributed calls, from
any thread, and ignores the same calls from user code.)
Serving: a real HTTP scrape of rank 0's /metrics, parsed with prometheus_client's parser,
against the snapshot and the references; rank 1 serves nothing; port 0, a taken port
and the default port_fallback (a taken port warns and serves elsewhere; strict: raises).
Failure isolation: a failure injected into monitor code does not stop training: the loss
sequence equals that of an unmonitored run and `distmon_monitor_errors_total` counts it.
"""

import contextlib
import copy
import math
import os
import socket
import threading
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder, distmon_dir, run_ranks
from fault_injection import FailureInjector
from helpers import (
    BUCKET_CAP_MB,
    GPT,
    VOCAB,
    close,
    lm_loss,
    make_batch,
    reference_norms,
    snapshot_dict,
    sync_twin,
)
from prometheus_client.parser import text_string_to_metric_families
from torch.nn.parallel import DistributedDataParallel as DDP

from distmon.compat import ALL_GATHER

pytestmark = pytest.mark.slow  # real ranks or servers: not in the fast tier

REL = 1e-5
LAYERS = ["emb", "blocks.0.ln", "blocks.0.fc", "blocks.1.ln", "blocks.1.fc", "norm", "head"]


# ----------------------------------------------------------------------------------------
# shared helpers (run inside the ranks)
# ----------------------------------------------------------------------------------------


def _setup(seed=0):
    torch.manual_seed(seed)
    model = GPT()
    twin = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return model, twin, ddp, opt


def _train_step(rank, step, model, twin, ddp, opt, batch=None, after_backward=None, accum=1):
    """One optimizer step on DDP and on the twin; returns the references (computed before
    opt.step). With accum > 1, the first accum - 1 micro-batches run under ddp.no_sync()."""
    sync_twin(twin, model)
    opt.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    for micro in range(accum):
        x, y = batch if batch is not None else make_batch(rank, step, micro)
        with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            loss = lm_loss(ddp(x), y)
            loss.backward()
        lm_loss(twin(x), y).backward()
    params = dict(model.named_parameters())
    tparams = dict(twin.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    ref_total, ref_layers = reference_norms([(n, params[n].grad) for n in names])
    loc_total, loc_layers = reference_norms([(n, tparams[n].grad) for n in names])
    if after_backward is not None:
        after_backward()
    opt.step()
    return {
        "step": step,
        "loss": loss.detach(),
        "ref_total": ref_total,
        "ref_layers": ref_layers,
        "local_total": loc_total,
        "local_layers": loc_layers,
    }


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(port, timeout=10.0):
    with _NO_PROXY.open(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def port_closed(port, within_s=5.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
        except OSError:
            return True
        time.sleep(0.1)
    return False


# ----------------------------------------------------------------------------------------
# parent-side helpers
# ----------------------------------------------------------------------------------------


def parse_metrics(text):
    """[(sample_name, labels, value, family_type)] from Prometheus text exposition."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append((s.name, dict(s.labels), s.value, fam.type))
    return out


def samples(parsed, name, **labels):
    return [s for s in parsed if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]


def value(parsed, name, **labels):
    found = samples(parsed, name, **labels)
    assert len(found) == 1, f"expected exactly one sample {name}{labels or ''}, got {found}"
    return found[0][2]


def number_problems(snap, step, recs_by_rank, world_size, skip=()):
    """Compare a snapshot with the references of `step`. `skip` = {(rank or 'reduced', layer or None)}."""
    problems = []
    where = f"step {step}"
    if snap is None:
        return [f"{where}: no snapshot"]
    if snap["step"] != step:
        problems.append(f"{where}: snapshot.step = {snap['step']!r}")
    ref = recs_by_rank[0][step - 1]
    if ("reduced", None) not in skip and not close(snap["grad_norm"], ref["ref_total"], REL):
        problems.append(f"{where}: grad_norm {snap['grad_norm']!r} != reference {ref['ref_total']!r}")
    lg = snap["layer_grad_norms"]
    if not isinstance(lg, dict) or list(lg) != LAYERS:
        problems.append(f"{where}: layer_grad_norms keys {lg!r}")
    else:
        for layer in LAYERS:
            if ("reduced", layer) in skip:
                continue
            if not close(lg[layer], ref["ref_layers"][layer], REL):
                problems.append(
                    f"{where}: layer {layer} {lg[layer]!r} != reference {ref['ref_layers'][layer]!r}"
                )
    for q in range(world_size):
        loc = recs_by_rank[q][step - 1]
        if (q, None) not in skip and not close(snap["rank_grad_norms"][q], loc["local_total"], REL):
            problems.append(
                f"{where}: rank_grad_norms[{q}] {snap['rank_grad_norms'][q]!r} != twin {loc['local_total']!r}"
            )
        for j, layer in enumerate(LAYERS if snap["rank_layer_grad_norms"] is not None else ()):
            if (q, layer) in skip:
                continue
            got = snap["rank_layer_grad_norms"][q][j]
            if not close(got, loc["local_layers"][layer], REL):
                problems.append(
                    f"{where}: rank_layer_grad_norms[{q}][{layer}] {got!r} != "
                    f"twin {loc['local_layers'][layer]!r}"
                )
    return problems


def _isnonfinite(x):
    return isinstance(x, float) and not math.isfinite(x)


# ========================================================================================
# Non-finite gradients
# ========================================================================================

NONFINITE_STEPS = 7
# step -> (rank, layer, factor); the gradient of that layer's weight is multiplied by factor
INJECT = {3: (1, "blocks.1.fc", float("nan")), 5: (0, "blocks.0.fc", float("inf"))}


def _nonfinite_job(rank, world_size, rank_layers):
    import distmon

    model, twin, ddp, opt = _setup()
    mon = distmon.GradMonitor(ddp, opt, export_every=1, serve="none", rank_layers=rank_layers)
    current = {"step": 0}

    def make_hook(layer):
        def hook(grad):
            plan = INJECT.get(current["step"])
            if plan and plan[0] == rank and plan[1] == layer:
                return grad * plan[2]
            return grad

        return hook

    for layer in {p[1] for p in INJECT.values()}:
        model.get_submodule(layer).weight.register_hook(make_hook(layer))

    recs = []
    for step in range(1, NONFINITE_STEPS + 1):
        current["step"] = step
        saved = copy.deepcopy(model.state_dict()) if step in INJECT else None
        rec = _train_step(rank, step, model, twin, ddp, opt)
        if saved is not None:  # undo the poisoned update so training goes on
            model.load_state_dict(saved)
        rec["loss"] = float(rec["loss"])
        mon.flush()
        rec["snap"] = snapshot_dict(mon.latest())
        recs.append(rec)
    mon.close()
    return recs


@pytest.fixture(scope="module", params=[True, False], ids=["rank_layers", "rank_totals"])
def nonfinite_run(request):
    """With the ranks x layers matrix, the first bad layer is found on the host from it;
    without, each rank finds it on the device and sends it: both must agree."""
    return run_ranks(_nonfinite_job, 2, request.param, timeout=120), request.param


def test_nonfinite_reported_with_rank_and_layer(nonfinite_run):
    recs, rank_layers = nonfinite_run
    _assert_nonfinite_reported(recs, rank_layers, 2)


def test_eight_ranks_figures_exact_and_nan_localized():
    """The same checks on 8 gloo ranks (a tiny model, within the CI budget)."""
    _assert_nonfinite_reported(run_ranks(_nonfinite_job, 8, True, timeout=240), True, 8)


def _assert_nonfinite_reported(recs, rank_layers, world):
    problems = []
    for r in range(world):  # every rank's monitor reports the same
        for rec in recs[r]:
            step, snap = rec["step"], rec["snap"]
            if snap is None or snap["step"] != step:
                problems.append(f"rank {r} step {step}: snapshot {snap and snap['step']!r}")
                continue
            if (snap["rank_layer_grad_norms"] is None) == rank_layers:
                problems.append(
                    f"rank {r} step {step}: rank_layer_grad_norms {snap['rank_layer_grad_norms']!r} "
                    f"with rank_layers={rank_layers}"
                )
            if step in INJECT:
                bad_rank, bad_layer, _ = INJECT[step]
                j = LAYERS.index(bad_layer)
                if snap["nonfinite"] is not True:
                    problems.append(f"rank {r} step {step}: nonfinite = {snap['nonfinite']!r}")
                if snap["nonfinite_ranks"] != [bad_rank]:
                    problems.append(
                        f"rank {r} step {step}: nonfinite_ranks = {snap['nonfinite_ranks']!r}, "
                        f"expected [{bad_rank}]"
                    )
                fnf = snap["first_nonfinite"]
                if fnf is None or tuple(fnf) != (bad_rank, bad_layer):
                    problems.append(
                        f"rank {r} step {step}: first_nonfinite = {fnf!r}, expected {(bad_rank, bad_layer)!r}"
                    )
                if not _isnonfinite(snap["grad_norm"]):
                    problems.append(f"rank {r} step {step}: grad_norm {snap['grad_norm']!r} is finite")
                if not _isnonfinite(snap["layer_grad_norms"].get(bad_layer)):
                    problems.append(f"rank {r} step {step}: layer_grad_norms[{bad_layer}] is finite")
                if not _isnonfinite(snap["rank_grad_norms"][bad_rank]):
                    problems.append(f"rank {r} step {step}: rank_grad_norms[{bad_rank}] is finite")
                if rank_layers and not _isnonfinite(snap["rank_layer_grad_norms"][bad_rank][j]):
                    problems.append(
                        f"rank {r} step {step}: rank_layer_grad_norms[{bad_rank}][{bad_layer}] is finite"
                    )
                # everything else is still measured exactly: the other rank, the other layers
                skip = {("reduced", None), ("reduced", bad_layer), (bad_rank, None), (bad_rank, bad_layer)}
                problems += [f"rank {r}: {p}" for p in number_problems(snap, step, recs, world, skip)]
            else:
                if (
                    snap["nonfinite"] is not False
                    or snap["nonfinite_ranks"] != []
                    or snap["first_nonfinite"] is not None
                ):
                    problems.append(
                        f"rank {r} step {step}: finite step reported "
                        f"{snap['nonfinite']!r} {snap['nonfinite_ranks']!r} "
                        f"{snap['first_nonfinite']!r}"
                    )
                problems += [f"rank {r}: {p}" for p in number_problems(snap, step, recs, world)]
    assert not problems, "\n".join(problems[:30])
    # training went on: the steps after the injections have finite losses
    assert all(math.isfinite(rec["loss"]) for rec in recs[0])


# ========================================================================================
# No host sync on non-export steps, exactly one monitor collective per step
# ========================================================================================

WARMUP, WINDOW, ACCUM_WINDOW = 3, 6, 3  # then ACCUM_WINDOW steps of 2 micro-batches (no_sync)

PROBE_SRC = """
def probe(torch, dist):
    t = torch.ones(3)
    t[0].item()
    t.tolist()
    t.cpu()
    t.numpy()
    float(t[0])
    int(t[0])
    bool(t[0])
    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    dist.all_reduce(torch.ones(1))
"""
PROBE_EXPECTED_SYNCS = {
    "Tensor.item",
    "Tensor.tolist",
    "Tensor.cpu",
    "Tensor.numpy",
    "Tensor.__float__",
    "Tensor.__int__",
    "Tensor.__bool__",
}


def _probe(filename):
    ns = {}
    exec(compile(PROBE_SRC, filename, "exec"), ns)
    return ns["probe"]


def _hostsync_job(rank, world_size):
    import distmon

    model, twin, ddp, opt = _setup()
    # the window below must hold ordinary steps, however slow: exports by step count only,
    # with the time rule on (its vote rides the per-step all-reduce) but an hour away
    mon = distmon.GradMonitor(ddp, opt, export_every=1000, export_interval_s=3600, serve="none")
    recs = []
    for step in range(1, WARMUP + 1):
        recs.append(_train_step(rank, step, model, twin, ddp, opt))
    mon.flush()  # publish the warm-up, so the host thread is idle during the window
    time.sleep(0.3)

    per_step = []
    with SyncRecorder() as rec:
        for step in range(WARMUP + 1, WARMUP + WINDOW + ACCUM_WINDOW + 1):
            accum = 2 if step > WARMUP + WINDOW else 1
            recs.append(_train_step(rank, step, model, twin, ddp, opt, accum=accum))
            per_step.append(len(rec.collectives))
        time.sleep(0.3)  # anything a background thread does on these steps is recorded too
    out = {
        "syncs": rec.describe(rec.syncs),
        "n_syncs": len(rec.syncs),
        "collectives": [n for n, _, _ in rec.collectives],
        "sizes": rec.sizes,
        "collective_stacks": rec.describe(rec.collectives[:4]),
        "per_step": per_step,
    }

    # The monitor worked during the window: flush and check the last step's numbers.
    with SyncRecorder() as rec_flush:
        mon.flush()
        time.sleep(0.2)
    out["flush_syncs"] = [n for n, _, _ in rec_flush.syncs]
    out["snap"] = snapshot_dict(mon.latest())

    # The detector itself: calls from a frame that belongs to distmon are recorded (also
    # from another thread), the same calls from test code are not.
    dm = distmon_dir()
    fake = _probe(os.path.join(dm, "_probe_not_a_real_file.py"))
    user = _probe(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_user_probe.py"))
    with SyncRecorder() as rec_fake:
        fake(torch, dist)
    th_err = []
    with SyncRecorder() as rec_thread:
        t = threading.Thread(target=lambda: th_err.append(fake(torch, dist)), name="probe-thread")
        t.start()
        t.join()
    with SyncRecorder() as rec_user:
        user(torch, dist)
    out["probe"] = {
        "fake_syncs": sorted({n for n, _, _ in rec_fake.syncs}),
        "fake_colls": [n for n, _, _ in rec_fake.collectives],
        "thread_syncs": sorted({n for n, _, _ in rec_thread.syncs}),
        "thread_names": sorted({t for _, t, _ in rec_thread.syncs}),
        "thread_colls": [n for n, _, _ in rec_thread.collectives],
        "user_syncs": [n for n, _, _ in rec_user.syncs],
        "user_colls": [n for n, _, _ in rec_user.collectives],
    }
    out["recs"] = [{k: (float(v) if k == "loss" else v) for k, v in r.items()} for r in recs]
    mon.close()
    return out


@pytest.fixture(scope="module")
def hostsync_run():
    return run_ranks(_hostsync_job, 2, timeout=120)


def test_sync_recorder_catches_distmon_calls_and_only_those(hostsync_run):
    """The instrumentation records distmon-attributed calls and nothing else."""
    for r, out in enumerate(hostsync_run):
        p = out["probe"]
        assert PROBE_EXPECTED_SYNCS <= set(p["fake_syncs"]), (r, p["fake_syncs"])
        assert any("synchronize" in n for n in p["fake_syncs"]), (r, p["fake_syncs"])
        assert p["fake_colls"] == ["dist.all_reduce"], (r, p["fake_colls"])
        assert PROBE_EXPECTED_SYNCS <= set(p["thread_syncs"]), (r, p["thread_syncs"])
        assert p["thread_names"] == ["probe-thread"], (r, p["thread_names"])
        assert p["thread_colls"] == ["dist.all_reduce"], (r, p["thread_colls"])
        assert p["user_syncs"] == [] and p["user_colls"] == [], (r, p["user_syncs"], p["user_colls"])
        # and it sees distmon's real export path: a flush copies to the host
        assert out["flush_syncs"], f"rank {r}: no host read recorded during mon.flush()"


def test_no_host_sync_on_non_export_steps(hostsync_run):
    for r, out in enumerate(hostsync_run):
        assert out["n_syncs"] == 0, (
            f"rank {r}: {out['n_syncs']} host syncs from distmon code on non-export steps:\n{out['syncs']}"
        )


def test_exactly_one_monitor_collective_per_step(hostsync_run):
    """An ordinary step's one collective is an all-reduce of one float (rank 0's export vote),
    whatever the world size and the number of layers."""
    for r, out in enumerate(hostsync_run):
        counts = out["per_step"]
        per_step = [b - a for a, b in zip([0] + counts[:-1], counts)]
        assert per_step == [1] * (WINDOW + ACCUM_WINDOW), (
            f"rank {r}: monitor collectives per step {per_step} (expected one each): "
            f"{out['collectives']}\n{out['collective_stacks']}"
        )
        assert set(out["collectives"]) == {"dist.all_reduce"}, out["collectives"]
        assert all(sizes == [1] for sizes in out["sizes"]), out["sizes"]


SCHEDULE_STEPS, SCHEDULE_EVERY = 12, 4


def _schedule_job(rank, world_size):
    """Per step: distmon's collectives (name, element counts) over three export cycles, with the
    time rule on (an hour away) and with exports by step count only."""
    import distmon

    out = {}
    for interval_s in (3600.0, 0.0):
        model, twin, ddp, opt = _setup()
        mon = distmon.GradMonitor(
            ddp, opt, export_every=SCHEDULE_EVERY, export_interval_s=interval_s, serve="none"
        )
        steps = []
        for step in range(1, SCHEDULE_STEPS + 1):
            with SyncRecorder() as rec:
                _train_step(rank, step, model, twin, ddp, opt)
            steps.append([(n, sizes) for (n, _, _), sizes in zip(rec.collectives, rec.sizes)])
        with SyncRecorder() as rec:
            snap = mon.flush()  # nothing left to gather: every step was exported
        mon.close()
        out[interval_s] = steps, rec.collectives, [float(v) for v in snap.rank_grad_norms]
    return out


def test_export_steps_gather_every_ranks_rows_since_the_last_in_place_of_the_all_reduce():
    """Every export_every-th step sends, in place of the ordinary step's all-reduce, the all-gather
    of the rows of the steps since the last export (export_every rows of every rank of the node:
    all three here) and the job's two fixed-size reductions of the same steps (a SUM of 7
    floats per step, with the vote after them; a MAX of 3 keys per step); the other steps send
    one float (with the time rule's vote) or nothing."""
    world = 3
    for rank, runs in enumerate(run_ranks(_schedule_job, world)):
        for interval_s, (steps, flush_colls, norms) in runs.items():
            width = len(LAYERS) + 2  # the rank's row: its layer sums, errors, valid (+ the vote)
            vote = 1 if interval_s else 0
            width += vote
            for step, colls in enumerate(steps, 1):
                where = (interval_s, rank, step, colls)
                if step % SCHEDULE_EVERY == 0:
                    rows = SCHEDULE_EVERY * width
                    assert colls == [
                        (f"dist.{ALL_GATHER}", [world * rows, rows]),
                        ("dist.all_reduce", [SCHEDULE_EVERY * 7 + vote]),
                        ("dist.all_reduce", [SCHEDULE_EVERY * 3]),
                    ], where
                elif interval_s:
                    assert colls == [("dist.all_reduce", [1])], where
                else:
                    assert colls == [], where
            assert flush_colls == [], (interval_s, rank, flush_colls)
            assert len(norms) == world and all(math.isfinite(v) and v > 0 for v in norms), norms


# ========================================================================================
# HTTP serving
# ========================================================================================

HTTP_STEPS = 5
HTTP_EXPORT_EVERY = 3  # steps 4-5 reach the host only through flush(): the histogram must have all 5
LINGER_S = 2.0
RUN_ID = "acceptance-http-run"


def _http_job(rank, world_size):
    import distmon

    model, twin, ddp, opt = _setup()
    t0 = time.time()
    mon = distmon.GradMonitor(
        ddp,
        opt,
        export_every=HTTP_EXPORT_EVERY,
        serve="rank0",
        port=0,
        addr="127.0.0.1",
        run_id=RUN_ID,
        linger_s=LINGER_S,
    )
    out = {"port": mon.port, "run_id": mon.run_id, "hostname": socket.gethostname()}
    recs = []
    for step in range(1, HTTP_STEPS + 1):
        recs.append(_train_step(rank, step, model, twin, ddp, opt))
    mon.flush()
    out["t0"], out["t1"] = t0, time.time()
    out["snap"] = snapshot_dict(mon.latest())
    out["recs"] = [{k: (float(v) if k == "loss" else v) for k, v in r.items()} for r in recs]
    if rank == 0 and mon.port:
        out["scrape"] = scrape(mon.port)
        port = mon.port
        # close() may linger (serving distmon_run_finished=1) in the foreground or background
        closer = threading.Thread(target=mon.close)
        t_close = time.monotonic()
        closer.start()
        after_close = []
        while closer.is_alive() or time.monotonic() - t_close < LINGER_S + 5:
            try:
                after_close.append(scrape(port, timeout=2)[2])
            except OSError:
                if not closer.is_alive():
                    break
            time.sleep(0.1)
        closer.join()
        out["close_s"] = time.monotonic() - t_close
        out["after_close"] = after_close
        out["stopped"] = port_closed(port, within_s=LINGER_S + 5)
    else:
        mon.close()
    return out


@pytest.fixture(scope="module")
def http_run():
    return run_ranks(_http_job, 2, timeout=120)


def _scraped(http_run):
    out0 = http_run[0]
    assert out0["port"], f"rank 0 does not serve: mon.port = {out0['port']!r}"
    status, ctype, text = out0["scrape"]
    assert status == 200 and ctype.startswith("text/plain"), (status, ctype)
    return out0, parse_metrics(text)


def test_rank0_serves_on_port0_rank1_does_not(http_run):
    assert isinstance(http_run[0]["port"], int) and http_run[0]["port"] > 0, http_run[0]["port"]
    assert http_run[1]["port"] is None, f"rank 1 serves on {http_run[1]['port']}"
    assert http_run[0]["run_id"] == http_run[1]["run_id"] == RUN_ID


def test_scrape_has_global_and_rank_norms(http_run):
    out0, m = _scraped(http_run)
    snap = out0["snap"]
    recs = [o["recs"] for o in http_run]
    assert snap["step"] == HTTP_STEPS
    g = value(m, "distmon_grad_norm")
    assert g == pytest.approx(snap["grad_norm"], rel=1e-6)
    assert close(g, recs[0][-1]["ref_total"], REL), (g, recs[0][-1]["ref_total"])
    assert value(m, "distmon_optimizer_steps_total") == HTTP_STEPS
    rank_samples = samples(m, "distmon_rank_grad_norm")
    assert sorted(s[1]["rank"] for s in rank_samples) == ["0", "1"], rank_samples
    for r in range(2):
        v = value(m, "distmon_rank_grad_norm", rank=str(r))
        assert v == pytest.approx(snap["rank_grad_norms"][r], rel=1e-6)
        assert close(v, recs[r][-1]["local_total"], REL), (r, v, recs[r][-1]["local_total"])
        labels = samples(m, "distmon_rank_grad_norm", rank=str(r))[0][1]
        assert labels["local_rank"] == str(r) and labels["hostname"] == out0["hostname"], labels
    assert value(m, "distmon_run_info", world_size="2") == 1
    assert value(m, "distmon_nonfinite_steps_total") == 0
    assert value(m, "distmon_monitor_errors_total") == 0
    assert value(m, "distmon_run_finished") == 0
    ts = value(m, "distmon_last_step_timestamp_seconds")
    assert out0["t0"] - 1 <= ts <= out0["t1"] + 1, (ts, out0["t0"], out0["t1"])
    for r in range(2):
        assert value(m, "distmon_rank_nonfinite_steps_total", rank=str(r)) == 0


def test_scrape_has_layer_norms(http_run):
    out0, m = _scraped(http_run)
    ref_layers = out0["recs"][-1]["ref_layers"]
    layer_samples = samples(m, "distmon_layer_grad_norm")
    got = {s[1]["layer"]: (s[1]["depth"], s[2]) for s in layer_samples}
    assert sorted(got) == sorted(LAYERS), sorted(got)
    for i, layer in enumerate(LAYERS):
        depth, v = got[layer]
        assert depth == f"{i:04d}", (layer, depth)
        assert v == pytest.approx(out0["snap"]["layer_grad_norms"][layer], rel=1e-6)
        assert close(v, ref_layers[layer], REL), (layer, v, ref_layers[layer])


def test_scrape_has_every_step_in_the_histogram_and_window_max(http_run):
    out0, m = _scraped(http_run)
    norms = [rec["ref_total"] for rec in out0["recs"]]
    assert value(m, "distmon_step_grad_norm_count") == HTTP_STEPS
    assert close(value(m, "distmon_step_grad_norm_sum"), sum(norms), REL)
    buckets = {float(s[1]["le"]): s[2] for s in samples(m, "distmon_step_grad_norm_bucket")}
    expected_le = sorted(mult * 10.0**k for k in range(-4, 5) for mult in (1, 2.5, 5))
    finite_le = sorted(le for le in buckets if math.isfinite(le))
    assert len(finite_le) == len(expected_le) and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(finite_le, expected_le)
    ), finite_le
    assert buckets[math.inf] == HTTP_STEPS
    for le in finite_le:
        assert buckets[le] == sum(1 for n in norms if n <= le), (le, buckets[le], norms)
    assert close(value(m, "distmon_grad_norm_window_max"), max(norms), REL)


def test_every_sample_has_run_id(http_run):
    _, m = _scraped(http_run)
    assert m, "empty scrape"
    missing = [(n, lab) for n, lab, _, _ in m if lab.get("run_id") != RUN_ID]
    assert not missing, missing[:10]
    # no step or pid labels (unbounded cardinality)
    assert not [n for n, lab, _, _ in m if {"step", "pid"} & set(lab)]


def test_close_marks_finished_lingers_and_stops(http_run):
    out0 = http_run[0]
    finished = [value(parse_metrics(t), "distmon_run_finished") for t in out0["after_close"]]
    assert 1 in finished, f"never scraped distmon_run_finished=1 while lingering: {finished}"
    assert out0["stopped"], "the metrics server still accepts connections after close() + linger"


def _port_job(rank, world_size):
    import distmon

    def fresh():
        _, _, ddp, opt = _setup()
        return ddp, opt

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    busy_port = busy.getsockname()[1]
    out = {"busy_port": busy_port}

    ddp, opt = fresh()
    try:  # strict: the taken port is an error at construction
        m = distmon.GradMonitor(
            ddp, opt, serve="rank0", port=busy_port, addr="127.0.0.1", linger_s=0, port_fallback=False
        )
        out["busy_error"] = None
        out["busy_port_got"] = m.port
        m.close()
    except Exception as e:  # noqa: BLE001 - the type is what we check
        out["busy_error"] = (type(e).__name__, str(e), isinstance(e, (OSError, ValueError)))

    import logging

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    said: list[str] = []
    logging.getLogger("distmon").addHandler(Said())
    for label, kwargs in (("fallback", {"port": busy_port}), ("zero", {"port": 0})):  # the default falls back
        said.clear()
        ddp, opt = fresh()
        m = distmon.GradMonitor(
            ddp, opt, serve="rank0", addr="127.0.0.1", linger_s=0, export_every=1, **kwargs
        )
        out.setdefault("said", {})[label] = list(said)
        for step in range(1, 3):
            x, y = make_batch(rank, step)
            opt.zero_grad()
            lm_loss(ddp(x), y).backward()
            opt.step()
        m.flush()
        p = m.port
        try:
            res = scrape(p) if p else None
        except OSError as e:
            res = ("error", repr(e), "")
        m.close()
        out[label] = {"port": p, "scrape": res, "stopped": bool(p) and port_closed(p)}
    busy.close()
    return out


@pytest.fixture(scope="module")
def port_run():
    return run_ranks(_port_job, 1, timeout=90)[0]


def test_port_in_use_raises_a_clear_error_when_strict(port_run):
    err = port_run["busy_error"]
    assert err is not None, f"no error for a taken port; monitor bound {port_run.get('busy_port_got')}"
    name, msg, ok_type = err
    assert ok_type, f"expected OSError/ValueError, got {name}: {msg}"
    assert str(port_run["busy_port"]) in msg, f"error does not name the port: {name}: {msg}"


@pytest.mark.parametrize("label", ["fallback", "zero"])
def test_port_fallback_and_port_zero_serve(port_run, label):
    res = port_run[label]
    assert isinstance(res["port"], int) and res["port"] > 0, res
    if label == "fallback":  # the job goes on, and the warning names both ports
        assert res["port"] != port_run["busy_port"], res
        busy, took = str(port_run["busy_port"]), str(res["port"])
        said = [m for m in port_run["said"]["fallback"] if busy in m and took in m and "in use" in m]
        assert said, port_run["said"]["fallback"]
    assert res["scrape"] and res["scrape"][0] == 200, res["scrape"]
    m = parse_metrics(res["scrape"][2])
    assert value(m, "distmon_optimizer_steps_total") == 2
    assert res["stopped"], "server still up after close() with linger_s=0"


# ========================================================================================
# A failure inside monitor code does not affect training
# ========================================================================================

FAULT_STEPS = 7
FAULT_AT = (3, 4)  # rank 1 only
FAULT_RANK = 1


def _fault_job(rank, world_size):
    import distmon

    torch.manual_seed(0)
    init_state = copy.deepcopy(GPT().state_dict())

    def run(monitored):
        # The data comes from the global RNG, seeded once: the monitor must not disturb it.
        torch.manual_seed(1234 + rank)
        model = GPT()
        model.load_state_dict(init_state)
        twin = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        mon, inj, res = None, None, {"recs": [], "scrapes": {}, "raised": []}
        if monitored:
            mon = distmon.GradMonitor(
                ddp,
                opt,
                export_every=1,
                serve="rank0",
                port=0,
                addr="127.0.0.1",
                linger_s=0,
                run_id="fault-run",
            )
            inj = FailureInjector()
            inj.install()
            res["patched"] = inj.patched
        for step in range(1, FAULT_STEPS + 1):
            idx = torch.randint(0, VOCAB, (4, 7))
            if inj is not None:
                inj.active = rank == FAULT_RANK and step in FAULT_AT
                before = inj.raised
            rec = _train_step(rank, step, model, twin, ddp, opt, batch=(idx[:, :-1], idx[:, 1:]))
            rec["loss"] = float(rec["loss"])
            if inj is not None:
                inj.active = False
                res["raised"].append(inj.raised - before)
                mon.flush()
                rec["snap"] = snapshot_dict(mon.latest())
                if rank == 0 and step in (2, FAULT_STEPS):
                    res["scrapes"][step] = scrape(mon.port)[2]
            res["recs"].append(rec)
        if mon is not None:
            inj.uninstall()
            mon.close()
        return res

    return {"plain": run(False), "monitored": run(True)}


@pytest.fixture(scope="module")
def fault_run():
    return run_ranks(_fault_job, 2, timeout=120)


def test_failure_injection_fired(fault_run):
    res = fault_run[FAULT_RANK]["monitored"]
    for step in FAULT_AT:
        assert res["raised"][step - 1] >= 1, (
            f"the injected failure never fired at step {step} (patched: {res['patched']}); "
            "adapt FailureInjector to distmon's current math module"
        )
    assert sum(fault_run[0]["monitored"]["raised"]) == 0


def test_failures_inside_distmon_leave_the_losses_unchanged(fault_run):
    for r in range(2):
        plain = [rec["loss"] for rec in fault_run[r]["plain"]["recs"]]
        mon = [rec["loss"] for rec in fault_run[r]["monitored"]["recs"]]
        assert mon == plain, f"rank {r}: losses differ\nunmonitored {plain}\nmonitored   {mon}"


def test_failures_are_counted_and_measuring_resumes(fault_run):
    scrapes = fault_run[0]["monitored"]["scrapes"]
    before = value(parse_metrics(scrapes[2]), "distmon_monitor_errors_total")
    after = value(parse_metrics(scrapes[FAULT_STEPS]), "distmon_monitor_errors_total")
    assert before == 0, before
    assert after >= len(FAULT_AT), f"distmon_monitor_errors_total = {after} after {len(FAULT_AT)} failures"
    assert value(parse_metrics(scrapes[FAULT_STEPS]), "distmon_optimizer_steps_total") == FAULT_STEPS
    recs = [fault_run[r]["monitored"]["recs"] for r in range(2)]
    problems = []
    for r in range(2):
        for rec in recs[r]:
            if rec["step"] in FAULT_AT:
                continue  # figures of a step whose measurement failed are not specified
            problems += [f"rank {r}: {p}" for p in number_problems(rec["snap"], rec["step"], recs, 2)]
    assert not problems, "\n".join(problems[:30])
