"""What a 2-rank DDP job serves over HTTP, and the endpoint's port, close and linger.

A real HTTP scrape of rank 0's /metrics (``serve="rank0"``, port 0), parsed with
prometheus_client's parser, against the snapshot and the float64 references (``ddp_twin``):
global, per-layer and per-rank norms, the histogram of every step's norm and the window max,
``run_id`` on every sample; rank 1 serves nothing; ``close()`` serves
``distmon_run_finished=1`` while it lingers, then stops. Ports: a taken port raises a clear error
with ``port_fallback=False``; by default it warns, naming both ports, and serves elsewhere; port 0
serves on an ephemeral port.
"""

import logging
import math
import socket
import threading
import time

import pytest
from ddp_harness import run_ranks
from ddp_twin import LAYERS, REL, plain_recs, port_closed, setup, train_step
from helpers import (
    close,
    http_get,
    lm_loss,
    make_batch,
    metrics_url,
    parse_samples,
    sample_value,
    snapshot_dict,
)


def scrape(port, timeout=10.0):
    """(status, Content-Type, body) of a real scrape of rank 0's endpoint."""
    return http_get(metrics_url(port), timeout)


def matching(parsed, name, **labels):
    """The samples ``name`` whose labels include ``labels``."""
    return [s for s in parsed if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]


pytestmark = pytest.mark.slow  # real ranks: not in the fast tier


HTTP_STEPS = 5
HTTP_EXPORT_EVERY = 3  # steps 4-5 reach the host only through flush(): the histogram must have all 5
LINGER_S = 2.0
RUN_ID = "acceptance-http-run"


def _http_job(rank, world_size):
    import distmon

    model, twin, ddp, opt = setup()
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
        recs.append(train_step(rank, step, model, twin, ddp, opt))
    mon.flush()
    out["t0"], out["t1"] = t0, time.time()
    out["snap"] = snapshot_dict(mon.latest())
    out["recs"] = plain_recs(recs)
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
    return out0, parse_samples(text)


def test_rank0_serves_on_port0_rank1_does_not(http_run):
    assert isinstance(http_run[0]["port"], int) and http_run[0]["port"] > 0, http_run[0]["port"]
    assert http_run[1]["port"] is None, f"rank 1 serves on {http_run[1]['port']}"
    assert http_run[0]["run_id"] == http_run[1]["run_id"] == RUN_ID


def test_scrape_has_global_and_rank_norms(http_run):
    out0, m = _scraped(http_run)
    snap = out0["snap"]
    recs = [o["recs"] for o in http_run]
    assert snap["step"] == HTTP_STEPS
    g = sample_value(m, "distmon_grad_norm")
    assert g == pytest.approx(snap["grad_norm"], rel=1e-6)
    assert close(g, recs[0][-1]["ref_total"], REL), (g, recs[0][-1]["ref_total"])
    assert sample_value(m, "distmon_optimizer_steps_total") == HTTP_STEPS
    rank_samples = matching(m, "distmon_rank_grad_norm")
    assert sorted(s[1]["rank"] for s in rank_samples) == ["0", "1"], rank_samples
    for r in range(2):
        v = sample_value(m, "distmon_rank_grad_norm", rank=str(r))
        assert v == pytest.approx(snap["rank_grad_norms"][r], rel=1e-6)
        assert close(v, recs[r][-1]["local_total"], REL), (r, v, recs[r][-1]["local_total"])
        labels = matching(m, "distmon_rank_grad_norm", rank=str(r))[0][1]
        assert labels["local_rank"] == str(r) and labels["hostname"] == out0["hostname"], labels
    assert sample_value(m, "distmon_run_info", world_size="2") == 1
    assert sample_value(m, "distmon_nonfinite_steps_total") == 0
    assert sample_value(m, "distmon_monitor_errors_total") == 0
    assert sample_value(m, "distmon_run_finished") == 0
    ts = sample_value(m, "distmon_last_step_timestamp_seconds")
    assert out0["t0"] - 1 <= ts <= out0["t1"] + 1, (ts, out0["t0"], out0["t1"])
    for r in range(2):
        assert sample_value(m, "distmon_rank_nonfinite_steps_total", rank=str(r)) == 0


def test_scrape_has_layer_norms(http_run):
    out0, m = _scraped(http_run)
    ref_layers = out0["recs"][-1]["ref_layers"]
    layer_samples = matching(m, "distmon_layer_grad_norm")
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
    assert sample_value(m, "distmon_step_grad_norm_count") == HTTP_STEPS
    assert close(sample_value(m, "distmon_step_grad_norm_sum"), sum(norms), REL)
    buckets = {float(s[1]["le"]): s[2] for s in matching(m, "distmon_step_grad_norm_bucket")}
    expected_le = sorted(mult * 10.0**k for k in range(-4, 5) for mult in (1, 2.5, 5))
    finite_le = sorted(le for le in buckets if math.isfinite(le))
    assert len(finite_le) == len(expected_le) and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(finite_le, expected_le)
    ), finite_le
    assert buckets[math.inf] == HTTP_STEPS
    for le in finite_le:
        assert buckets[le] == sum(1 for n in norms if n <= le), (le, buckets[le], norms)
    assert close(sample_value(m, "distmon_grad_norm_window_max"), max(norms), REL)


def test_every_sample_has_run_id(http_run):
    _, m = _scraped(http_run)
    assert m, "empty scrape"
    missing = [(n, lab) for n, lab, _ in m if lab.get("run_id") != RUN_ID]
    assert not missing, missing[:10]
    # no step or pid labels (unbounded cardinality)
    assert not [n for n, lab, _ in m if {"step", "pid"} & set(lab)]


def test_close_marks_finished_lingers_and_stops(http_run):
    out0 = http_run[0]
    finished = [sample_value(parse_samples(t), "distmon_run_finished") for t in out0["after_close"]]
    assert 1 in finished, f"never scraped distmon_run_finished=1 while lingering: {finished}"
    assert out0["stopped"], "the metrics server still accepts connections after close() + linger"


def _port_job(rank, world_size):
    import distmon

    def fresh():
        _, _, ddp, opt = setup()
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
    m = parse_samples(res["scrape"][2])
    assert sample_value(m, "distmon_optimizer_steps_total") == 2
    assert res["stopped"], "server still up after close() with linger_s=0"
