"""Resume from a checkpoint (#30): ``mon.state_dict()`` / ``mon.load_state_dict()``.

In process (fast): a state round-trips; a run resumed at step 30 reports steps 31..60 with the
step numbers, detector scores and events of the uninterrupted run; ``torch.distributed.checkpoint``'s
lr-0 ``optimizer.step()`` (it initializes an empty optimizer's state while loading) is not a
step; states that cannot be mapped are refused by name, another world size is mapped.

On 2 gloo ranks (slow, ``tests/jobs/resume_job.py``): a DDP job checkpointed with ``dcp.save`` at
step 30 and SIGKILLed at step 40, resumed by a new job with ``dcp.load`` to step 70: its figures,
scores, events and noise scale on steps 31..70 are those of an uninterrupted run within float32
rounding (DDP's first-iteration buckets differ from its rebuilt ones, so distmon's fp32 sums
run in another order), and the log reads as one run with a restart.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import distmon
from distmon.report.log_reader import read_log

ROOT = Path(__file__).resolve().parents[1]
STEPS, CKPT_AT, SPIKE_AT = 60, 30, 55


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train(log: str, steps: range, state: dict | None = None, ckpt_at: int | None = None, **options) -> dict:
    """Train ``steps`` (a batch per step number), logging every step; the checkpoint taken at ``ckpt_at``."""
    net, opt = _model()
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    mon = distmon.GradMonitor(net, opt, serve="none", export_every=10, log_path=log, **options)
    if state is not None:
        mon.load_state_dict(state["distmon"])
    ckpt: dict = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)  # noise targets: a norm that stays level
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        loss = (net(x) - y).pow(2).mean() * (1000.0 if step == SPIKE_AT else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == ckpt_at:  # as torch.save would keep it: copies
            ckpt = {"model": copy.deepcopy(net.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
            ckpt["distmon"] = copy.deepcopy(mon.state_dict())
    mon.close()
    return ckpt


def _close(a: object, b: object, rel: float) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * abs(b)


def _rows(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def test_a_resumed_run_goes_on_as_if_it_had_never_stopped(tmp_path):
    full, resumed = str(tmp_path / "full.jsonl"), str(tmp_path / "resumed.jsonl")
    ckpt = _train(full, range(1, STEPS + 1), ckpt_at=CKPT_AT)
    _train(resumed, range(CKPT_AT + 1, STEPS + 1), state=ckpt)
    a, b = _rows(full), _rows(resumed)
    assert sorted(b) == list(range(CKPT_AT + 1, STEPS + 1))  # step numbers continue
    assert b[CKPT_AT + 1]["resumed_from"] == CKPT_AT and b[CKPT_AT + 2]["resumed_from"] is None
    assert [e["kind"] for e in a[SPIKE_AT]["events"]] == ["spike"]  # the spike is judged, armed
    for step in b:  # one process, the same gradients in the same order: the same numbers
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
        assert b[step]["scores"] == a[step]["scores"], step
        assert b[step]["events"] == a[step]["events"], step


def test_without_the_state_the_detector_starts_cold(tmp_path):
    """What the state carries matters: a monitor that did not load it judges the spike against nothing."""
    full, cold = str(tmp_path / "full.jsonl"), str(tmp_path / "cold.jsonl")
    _train(full, range(1, STEPS + 1), ckpt_at=CKPT_AT)
    _train(cold, range(CKPT_AT + 1, STEPS + 1))  # the same batches, the monitor not resumed
    a, c = _rows(full), _rows(cold)
    assert a[SPIKE_AT]["events"] and not c[SPIKE_AT - CKPT_AT]["events"]  # steps restart at 1, unarmed


def test_state_round_trips_and_is_plain_data():
    net, opt = _model()
    with distmon.GradMonitor(net, opt, serve="none", export_every=5) as mon:
        for _ in range(12):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        state = mon.state_dict()
    assert state["step"] == 12 and state["version"] == 2
    json.dumps(state)  # lists and numbers (NaN where the median window is not full)
    net2, opt2 = _model()
    with distmon.GradMonitor(net2, opt2, serve="none", export_every=5) as again:
        again.load_state_dict(state)
        assert again.step == 12
        back = again.state_dict()
    assert json.dumps(back, sort_keys=True) == json.dumps(state, sort_keys=True)
    # a state written before version 2 (the detector's "spiking" was "held") still loads
    old = {**state, "version": 1, "detector": dict(state["detector"])}
    old["detector"]["held"] = old["detector"].pop("spiking")
    net3, opt3 = _model()
    with distmon.GradMonitor(net3, opt3, serve="none", export_every=5) as third:
        third.load_state_dict(old)
        assert json.dumps(third.state_dict(), sort_keys=True) == json.dumps(state, sort_keys=True)


def test_state_dict_at_any_step_issues_no_collective_and_changes_nothing(one_rank, tmp_path):
    """A checkpoint saved by rank 0 alone calls ``state_dict()`` on one rank: no collective in it
    (one rank cannot call one alone), and the run goes on exactly as if it had not been called."""
    from ddp_harness import SyncRecorder
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(log: str, calls: set[int]) -> list[dict]:
        net, opt = _model()
        model = DDP(net)
        mon = distmon.GradMonitor(model, opt, serve="none", export_every=10, log_path=log, linger_s=0)
        states = []
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
            ((model(x) - y).pow(2).mean() * (1000.0 if step == SPIKE_AT else 1.0)).backward()
            opt.step()
            opt.zero_grad()
            if step in calls:
                with SyncRecorder() as rec:
                    states.append(mon.state_dict())
                assert not rec.collectives, (step, rec.describe(rec.collectives))
                assert states[-1]["step"] == step
        mon.close()
        return states

    plain, called = str(tmp_path / "plain.jsonl"), str(tmp_path / "called.jsonl")
    run(plain, set())
    states = run(called, {3, 7, 10, 13, 27, 30, 33, 52})
    a, b = (
        {
            step: {k: v for k, v in row.items() if k not in ("timestamp", "run_id")}
            for step, row in _rows(p).items()
        }
        for p in (plain, called)
    )
    assert a == b and [e["kind"] for e in a[SPIKE_AT]["events"]] == ["spike"]
    assert states[2]["detector"]["updates"] == 10 and states[3]["detector"]["updates"] == 13


def test_torch_distributed_checkpoints_lr0_step_before_the_load_is_no_step():
    """``get_state_dict`` on an empty optimizer steps it once at lr 0 with zero gradients (torch's
    ``_init_optim_state``), as ``dcp.load`` does on resume: no training step, the next is state + 1."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _model()
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        state = {**mon.state_dict(), "step": 30}
    net2, opt2 = _model()
    with distmon.GradMonitor(net2, opt2, serve="none", export_every=5) as mon2:
        get_state_dict(net2, opt2)  # the optimizer's state is initialized: opt2.step() at lr 0
        mon2.load_state_dict(state)
        net2(torch.randn(4, 8)).sum().backward()
        opt2.step()
        assert mon2.step == 31
        assert mon2.flush().valid and mon2.latest().step == 31


def test_states_that_cannot_be_mapped_are_refused_and_another_world_size_is_mapped(caplog):
    net, opt = _model()
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        state = mon.state_dict()
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with distmon.GradMonitor(other, torch.optim.SGD(other.parameters(), lr=0.1), serve="none") as m:
        with pytest.raises(
            ValueError,
            match=r"layers are not this monitor's \(3 vs 2; "
            r"first difference #2: '4' in the state, 'none' here",
        ):
            m.load_state_dict(state)
    net, opt = _model()
    with distmon.GradMonitor(net, opt, serve="none") as m:
        with pytest.raises(ValueError, match="newer distmon"):
            m.load_state_dict({**state, "version": 99})
        with pytest.raises(ValueError, match="takes what GradMonitor.state_dict"):
            m.load_state_dict({"step": 3})
        with pytest.raises(ValueError, match="median_window"):
            m.load_state_dict({**state, "detector": {**state["detector"], "history": [0.0] * 3}})
        with caplog.at_level(logging.WARNING, logger="distmon"):
            m.load_state_dict({**state, "world_size": 4, "step": 7})
        assert "rank-outlier scales start afresh (state from 4 ranks, now 1)" in caplog.text
        assert m.step == 7
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="after this monitor measured 1 training steps"):
            m.load_state_dict(state)


@pytest.mark.slow
def test_a_ddp_job_killed_and_resumed_with_torch_distributed_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env["OMP_NUM_THREADS"] = "1"
    from ddp_harness import free_port

    for mode, rc in (("full", 0), ("killed", 1), ("resume", 0)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node=2"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        cmd += [str(ROOT / "tests" / "jobs" / "resume_job.py"), mode, str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert (proc.returncode == 0) == (rc == 0), f"{mode}: {proc.returncode}\n{proc.stderr[-4000:]}"
    full = _rows(str(tmp_path / "full.jsonl"))
    lines, cut = [], []  # the kill may land while the exporter writes: the line it cut stays on its own
    for number, text in enumerate(open(tmp_path / "resumed.jsonl")):
        try:
            lines.append(json.loads(text))
        except ValueError:
            cut.append(number)
    at = next(i for i, row in enumerate(lines) if row["resumed_from"] is not None)
    assert cut in ([], [at]), (cut, at)  # at most the killed job's last line, just before the resumed job's
    assert lines[at]["resumed_from"] == 30 and lines[at - 1]["step"] >= 30  # the killed job got past 30
    resumed = {row["step"]: row for row in lines[at:]}
    assert sorted(resumed) == list(range(31, 71))

    for step, row in resumed.items():
        ref = full[step]
        assert row["valid"] and row["events"] == ref["events"], step
        assert _close(row["grad_norm"], ref["grad_norm"], 1e-6), step
        assert all(_close(x, y, 1e-6) for x, y in zip(row["rank_grad_norms"], ref["rank_grad_norms"])), step
        assert all(_close(row["scores"][k], ref["scores"][k], 1e-4) for k in ref["scores"]), step
        assert _close(row["gradient_noise_scale"], ref["gradient_noise_scale"], 1e-5), step
    assert [e["kind"] for e in resumed[57]["events"]] == ["spike"]
    assert math.isfinite(float(resumed[40]["gradient_noise_scale"]))  # the EMAs went on: cold, NaN until 51
    log = read_log(str(tmp_path / "resumed.jsonl"))
    assert log.run_count == 1 and log.run.restarts == [(30, at + len(cut) + 1)]
    assert list(log.run.steps) == list(range(1, 71))


@pytest.mark.slow
def test_a_checkpoint_saved_by_rank_0_alone_off_the_export_schedule(tmp_path):
    """nanoGPT's pattern: only the master process builds and saves the checkpoint, with
    ``mon.state_dict()``, at steps off (7, 13, 27) and on (20) the export schedule: the job runs
    through (no collective, no hang, no abort), and a job resumed from step 27 goes on as the
    uninterrupted one: the same figures and events; the detectors' scores as judged from step 27,
    the noise scale as of the export before it (step 20)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env["OMP_NUM_THREADS"] = "1"
    from ddp_harness import free_port

    for mode in ("full", "resume0"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node=2"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        cmd += [str(ROOT / "tests" / "jobs" / "resume_job.py"), mode, str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{mode}: {proc.returncode}\n{proc.stderr[-4000:]}"
    full, resumed = _rows(str(tmp_path / "full.jsonl")), _rows(str(tmp_path / "resumed0.jsonl"))
    assert sorted(resumed) == list(range(28, 71)) and resumed[28]["resumed_from"] == 27
    for step, row in resumed.items():
        ref = full[step]
        assert row["valid"] and row["events"] == ref["events"], step
        assert _close(row["grad_norm"], ref["grad_norm"], 1e-6), step
        assert all(_close(x, y, 1e-6) for x, y in zip(row["rank_grad_norms"], ref["rank_grad_norms"])), step
        # steps 28..30 are judged in a run of their own (the median reference is its start's)
        rel = 1e-2 if step <= 30 else 1e-4
        assert all(_close(row["scores"][k], ref["scores"][k], rel) for k in ref["scores"]), step
    assert [e["kind"] for e in resumed[57]["events"]] == ["spike"]
    # what the state holds: the reduced-figure detector through step 27, what needs every rank's
    # figures (the noise scale, the rank-outlier scales) as of the export before it
    at27, at20 = (
        torch.load(tmp_path / f"ckpt-rank0-{s}.pt", weights_only=False)["distmon"] for s in (27, 20)
    )
    assert at27["step"] == 27 and at27["detector"]["updates"] == 27 and at27["detector"]["rank_updates"] == 20
    assert json.dumps(at27["noise"]) == json.dumps(at20["noise"])  # NaN equal to NaN
    assert json.dumps(at27["detector"]["dev_var"]) == json.dumps(at20["detector"]["dev_var"])
    assert math.isfinite(resumed[40]["gradient_noise_scale"])


@pytest.mark.slow
@pytest.mark.parametrize("fw", ["lightning", "hf"])
def test_the_shipped_callbacks_resume_with_the_framework_s_checkpoint(fw, tmp_path):
    """Lightning's ``ckpt_path=`` and the Trainer's ``resume_from_checkpoint=`` bring the monitor's
    state back through ``DistmonCallback``: steps 21..40 as in the uninterrupted fit."""
    pytest.importorskip("lightning" if fw == "lightning" else "transformers")
    from ddp_harness import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node=2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += [str(ROOT / "tests" / "jobs" / "resume_frameworks_job.py"), fw, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    full, resumed = _rows(str(tmp_path / f"{fw}-full.jsonl")), _rows(str(tmp_path / f"{fw}-resumed.jsonl"))
    assert sorted(full) == list(range(1, 41)) and sorted(resumed) == list(range(21, 41))
    assert resumed[21]["resumed_from"] == 20
    for step, row in resumed.items():
        ref = full[step]
        assert row["valid"] and row["events"] == ref["events"], step
        assert _close(row["grad_norm"], ref["grad_norm"], 1e-6), step
        assert all(_close(row["scores"][k], ref["scores"][k], 1e-4) for k in ref["scores"]), step
        assert _close(row["gradient_noise_scale"], ref["gradient_noise_scale"], 1e-5), step
    if fw == "lightning":  # its noise scale is meaningful from step 20 on: it went on, not cold again
        assert math.isfinite(float(resumed[25]["gradient_noise_scale"]))
