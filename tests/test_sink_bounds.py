"""A stuck sink never holds training: a JSONL log that stops accepting writes, callbacks that block.

The JSONL log and the ``on_anomaly`` callbacks run on threads of their own behind bounded
queues, so the publisher thread, the host buffers it frees and the export steps that need
one never wait on them. Measured here on 2 real gloo ranks: the same job's steps with healthy
sinks and with a log on a FIFO nobody reads (standing in for a hung network mount: writes
block once the pipe's 64 KiB are full) plus one callback that sleeps 20 s per event and one
that blocks forever. Before, both ranks froze at the step whose export found no free host
buffer.
"""

import json
import os
import statistics
import threading
import time

import pytest
import torch
from ddp_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, EVERY, NAN_STEP = 150, 5, 20


def _train(ddp, opt, mon, rank):
    """STEPS steps (a NaN on rank 1 at NAN_STEP: every later step is an event); each step's wall time."""
    times = []
    for step in range(1, STEPS + 1):
        t0 = time.perf_counter()
        x = torch.randn(32, 64)
        if rank == 1 and step == NAN_STEP:
            x[0, 0] = float("nan")
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mon.close()
    return times, time.perf_counter() - t0


def _job(rank, world, workdir):
    import distmon

    torch.manual_seed(0)
    out = {}
    for case in ("healthy", "stuck"):
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        log = os.path.join(workdir, f"{case}.jsonl")
        reader = None
        if case == "stuck" and rank == 0:
            os.mkfifo(log)
            reader = os.open(log, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read: the pipe fills
        mon = distmon.GradMonitor(
            ddp, opt, serve="none", log_path=log, export_every=EVERY, export_interval_s=0, linger_s=0
        )
        if case == "stuck":
            mon.on_anomaly(lambda event, snap: time.sleep(20))
            mon.on_anomaly(lambda event, snap: threading.Event().wait())  # never returns
        times, close_s = _train(ddp, opt, mon, rank)
        out[case] = {"times": times, "close_s": close_s}
        if reader is not None:
            out[case]["fifo_bytes"] = len(os.read(reader, 1 << 20))
    return out


@pytest.mark.slow
@pytest.mark.serial  # step times compared: run alone
def test_a_stuck_log_and_blocking_callbacks_add_no_time_to_training_steps(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        healthy, stuck = out["healthy"], out["stuck"]
        print(  # the README's figures: python -m pytest -s tests/test_sink_bounds.py
            f"rank {rank}: step ms median/max healthy "
            f"{1e3 * statistics.median(healthy['times']):.2f}/{1e3 * max(healthy['times']):.1f}, stuck "
            f"{1e3 * statistics.median(stuck['times']):.2f}/{1e3 * max(stuck['times']):.1f}; "
            f"close s healthy {healthy['close_s']:.2f}, stuck {stuck['close_s']:.2f}"
        )
        assert len(stuck["times"]) == STEPS
        h_med, s_med = statistics.median(healthy["times"]), statistics.median(stuck["times"])
        # steps take a few ms: a wait on a stuck sink (20 s, forever) would show at once
        assert max(stuck["times"]) < max(healthy["times"]) + 1.0, (rank, max(stuck["times"]))
        assert s_med < 2 * h_med + 0.005, (rank, s_med, h_med)
        # close waits for the sinks at most SINK_WAIT_S (10 s) and stops them in 2 more
        assert stuck["close_s"] < 16.0, (rank, stuck["close_s"])
        assert healthy["close_s"] < 5.0, (rank, healthy["close_s"])
    # the stuck log did block: the pipe holds part of what the healthy run's log holds
    assert 0 < results[0]["stuck"]["fifo_bytes"] < os.path.getsize(tmp_path / "healthy.jsonl") / 2
    with open(tmp_path / "healthy.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))


@pytest.mark.serial  # offering must take < 0.5 s: run alone
def test_a_sink_that_falls_behind_drops_beyond_its_capacity_counted_never_blocking():
    """In process: a sink blocked on its first batch takes no more than its capacity; the rest is counted."""
    from distmon.errors import ErrorCounter
    from distmon.export.sinks import SinkWorker

    gate, seen, errors = threading.Event(), [], ErrorCounter()
    worker = SinkWorker("test sink", lambda snaps: (gate.wait(), seen.extend(snaps)), errors, capacity=10)
    t0 = time.perf_counter()
    for i in range(20):
        worker.offer([i, i])  # 40 snapshots offered, 10 fit
    offered_s = time.perf_counter() - t0
    assert not worker.drain(0.2)  # still stuck: drain gives up in time
    gate.set()
    assert worker.drain(5.0)
    worker.stop(5.0)
    assert offered_s < 0.5
    assert seen == [i for i in range(5) for _ in range(2)]
    assert worker.dropped == errors.count == 30
