"""What the monitor asks of an ordinary step and of an export step, on real DDP ranks.

No host sync: on non-export steps distmon performs no host sync (the test fails if ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()`` or a synchronize is called from monitor code on such a
step) and issues exactly one collective of its own per optimizer step, an all-reduce of one
float (``ddp_harness.SyncRecorder``; on plain steps and on steps of two micro-batches with
``no_sync()``; a meta-test proves the recorder sees distmon-attributed calls, from any thread,
and ignores the same calls from user code).

The collective schedule (issue #28): an export step sends, in place of the ordinary step's
all-reduce, the gather of its node's rows of the steps since the last export and the job's two
fixed-size reductions of those steps; no collective grows with the number of ranks.
"""

import math
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder, distmon_dir, run_ranks
from ddp_twin import LAYERS, plain_recs, setup, train_step
from helpers import snapshot_dict

from distmon.compat import ALL_GATHER

pytestmark = pytest.mark.slow  # real ranks: not in the fast tier


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

    model, twin, ddp, opt = setup()
    # the window below must hold ordinary steps, however slow: exports by step count only,
    # with the time rule on (its vote rides the per-step all-reduce) but an hour away
    mon = distmon.GradMonitor(ddp, opt, export_every=1000, export_interval_s=3600, serve="none")
    recs = []
    for step in range(1, WARMUP + 1):
        recs.append(train_step(rank, step, model, twin, ddp, opt))
    mon.flush()  # publish the warm-up, so the host thread is idle during the window
    time.sleep(0.3)

    per_step = []
    with SyncRecorder() as rec:
        for step in range(WARMUP + 1, WARMUP + WINDOW + ACCUM_WINDOW + 1):
            accum = 2 if step > WARMUP + WINDOW else 1
            recs.append(train_step(rank, step, model, twin, ddp, opt, accum=accum))
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
    out["recs"] = plain_recs(recs)
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
NODES = (0, 0, 1)  # each rank's node (torchrun's GROUP_RANK): two nodes, of two ranks and of one


def _schedule_job(rank, world_size):
    """Per step: distmon's collectives (name, element counts) over three export cycles, with the
    time rule on (an hour away) and with exports by step count only; the ranks on the nodes of
    NODES, as torchrun's agents would set them."""
    import distmon

    node = NODES[rank]
    os.environ.update(
        GROUP_RANK=str(node),
        LOCAL_RANK=str(NODES[:rank].count(node)),
        LOCAL_WORLD_SIZE=str(NODES.count(node)),
    )
    out = {}
    for interval_s in (3600.0, 0.0):
        model, twin, ddp, opt = setup()
        mon = distmon.GradMonitor(
            ddp, opt, export_every=SCHEDULE_EVERY, export_interval_s=interval_s, serve="none"
        )
        steps = []
        for step in range(1, SCHEDULE_STEPS + 1):
            with SyncRecorder() as rec:
                train_step(rank, step, model, twin, ddp, opt)
            steps.append([(n, sizes) for (n, _, _), sizes in zip(rec.collectives, rec.sizes)])
        with SyncRecorder() as rec:
            snap = mon.flush()  # nothing left to gather: every step was exported
        mon.close()
        out[interval_s] = steps, rec.collectives, [float(v) for v in snap.rank_grad_norms]
    return out


def test_an_export_step_gathers_its_node_s_rows_and_reduces_the_job_in_two_fixed_size_all_reduces():
    """Every export_every-th step sends, in place of the ordinary step's all-reduce, the all-gather
    over its node of the rows of the steps since the last export (export_every rows of each rank
    of the node: two ranks' on node 0, never the job's; node 1's one rank gathers nothing) and
    the job's two
    fixed-size reductions of the same steps (a SUM of 7 floats per step, with the vote after them;
    a MAX of 3 keys per step); the other steps send one float (with the time rule's vote) or
    nothing."""
    world = len(NODES)
    for rank, runs in enumerate(run_ranks(_schedule_job, world)):
        node_ranks = NODES.count(NODES[rank])
        for interval_s, (steps, flush_colls, norms) in runs.items():
            width = len(LAYERS) + 2  # the rank's row: its layer sums, errors, valid (+ the vote)
            vote = 1 if interval_s else 0
            width += vote
            for step, colls in enumerate(steps, 1):
                where = (interval_s, rank, step, colls)
                if step % SCHEDULE_EVERY == 0:
                    rows = SCHEDULE_EVERY * width
                    # a node of one rank has nothing to gather
                    gather = [(f"dist.{ALL_GATHER}", [node_ranks * rows, rows])] if node_ranks > 1 else []
                    assert colls == [
                        *gather,
                        ("dist.all_reduce", [SCHEDULE_EVERY * 7 + vote]),
                        ("dist.all_reduce", [SCHEDULE_EVERY * 3]),
                    ], where
                elif interval_s:
                    assert colls == [("dist.all_reduce", [1])], where
                else:
                    assert colls == [], where
            assert flush_colls == [], (interval_s, rank, flush_colls)
            # a node's snapshot holds its own ranks' norms (#28)
            assert len(norms) == node_ranks and all(math.isfinite(v) and v > 0 for v in norms), norms
