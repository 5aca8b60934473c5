"""DISTMON_DISABLE: distmon off without a code change (docs/options.md#turning-distmon-off).

A disabled ``GradMonitor(...)`` installs no hook, binds no port, starts no thread, writes no log
and issues no collective during training; the job trains bit-identically to the same job without
distmon; its methods answer as documented; the job's rank 0 says once on stderr that it is off.
Ranks that disagree on the switch are refused on every rank, in the one collective the switch
costs at construction.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder, free_port, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import distmon
from distmon.compat import ddp_comm_hooks

STEPS = 6


class _Records(logging.Handler):
    """The distmon logger's records, as a list of messages."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger("distmon").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a real bind, as a second server would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _model(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(net)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, clip) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        model(x).pow(2).mean().backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Every place a monitor installs a hook, counted."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    modules = list(model.modules())
    return {
        "comm hook": len(ddp_comm_hooks(model)),
        "forward hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules),
        "backward hooks": sum(len(m._backward_hooks) for m in modules),
        "grad hooks": sum(p._post_accumulate_grad_hooks is not None for p in model.parameters()),
        "optimizer hooks": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
        "global optimizer hooks": len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks),
    }


def _disabled_job(rank: int, world: int, port: int, tmp: str) -> dict:
    # the same job twice in one process: without distmon (torch's clip), then with a disabled
    # monitor (its clip_grad_norm_ in place of torch's, as a script using distmon has it)
    bare_model, bare_opt = _model(rank)
    torch_clip = lambda n: torch.nn.utils.clip_grad_norm_(bare_model.parameters(), n)  # noqa: E731
    bare = _train(rank, bare_model, bare_opt, clip=torch_clip)
    model, opt = _model(rank)

    os.environ["DISTMON_DISABLE"] = "1"
    records, threads = _Records(), set(threading.enumerate())
    log_path, sd_dir = os.path.join(tmp, f"run{rank}.jsonl"), os.path.join(tmp, f"sd{rank}")
    with SyncRecorder() as at_build:
        mon = distmon.GradMonitor(
            model,
            opt,
            serve="all",
            port=port,
            log_path=log_path,
            file_sd_dir=sd_dir,
            guard="skip",
            activations=True,
            update_ratio=True,
        )
    hooks = _hooks(model, opt)
    events = []
    mon.on_anomaly(lambda event, snap: events.append(event))
    with SyncRecorder() as training:
        params = _train(rank, model, opt, clip=mon.clip_grad_norm_)
        answers = {
            "latest": mon.latest(),
            "flush": mon.flush(),
            "step": mon.step,
            "port": mon.port,
            "url": mon.metrics_url,
            "state": mon.state_dict(),
            "disabled": mon.disabled,
            "rank": mon.rank,
            "world": mon.world_size,
        }
        mon.load_state_dict({"anything": 1})
        mon.close()
    dist.barrier()
    return {
        "identical": all(torch.equal(a, b) for a, b in zip(bare, params)),
        "collectives at construction": [n for n, _, _ in at_build.collectives],
        "collectives in training": [n for n, _, _ in training.collectives + training.syncs],
        "hooks": hooks,
        "new threads": [t.name for t in set(threading.enumerate()) - threads],
        "port free": _port_free(port + rank),
        "files": [p for p in (log_path, sd_dir) if os.path.exists(p)],
        "said": [m for m in records.messages if "distmon: off" in m],
        "events": events,
        "answers": answers,
    }


@pytest.mark.slow
def test_disabled_job_trains_bit_identically_with_no_port_hook_thread_log_or_collective(tmp_path):
    """2 gloo ranks, DDP, a disabled monitor with every option that would install something (an
    endpoint per rank on a fixed port, a log, a file_sd target, a guard, activation hooks, update
    ratios): parameters bit-identical to the job without distmon, the port free, nothing installed."""
    port = free_port()
    out = run_ranks(_disabled_job, 2, port, str(tmp_path))
    for rank, r in enumerate(out):
        assert r["identical"], rank
        assert r["collectives at construction"] == ["dist.all_reduce"], r  # the switch, agreed once
        assert r["collectives in training"] == [], r
        assert set(r["hooks"].values()) == {0}, r["hooks"]
        assert r["new threads"] == [], r
        assert r["port free"], f"rank {rank}: port {port + rank} is bound"
        assert r["files"] == [], r["files"]
        assert r["events"] == []
        answers = r["answers"]
        assert answers["latest"] is None and answers["flush"] is None and answers["step"] == 0
        assert answers["port"] is None and answers["url"] is None and answers["disabled"] is True
        assert answers["state"] == {"version": 2, "disabled": True}
        assert (answers["rank"], answers["world"]) == (rank, 2)
    assert [len(r["said"]) for r in out] == [1, 0]  # one stderr line per job, from its rank 0
    assert "DISTMON_DISABLE=1 on every rank of the job's 2" in out[0]["said"][0]


def _disagreeing_job(rank: int, world: int, port: int) -> dict:
    if rank == 0:
        os.environ["DISTMON_DISABLE"] = "1"
    model, opt = _model(rank)
    try:
        distmon.GradMonitor(model, opt, port=port, serve="all")
        refused = None
    except ValueError as e:
        refused = str(e)
    left = {"port free": _port_free(port + rank), "hooks": _hooks(model, opt)}
    os.environ.pop("DISTMON_DISABLE", None)  # alike on every rank now: the monitor starts
    with distmon.GradMonitor(model, opt, serve="none", export_every=2) as mon:
        _train(rank, model, opt, clip=mon.clip_grad_norm_)
    return {"refused": refused, **left, "step": mon.latest().step}


@pytest.mark.slow
def test_ranks_that_disagree_on_the_off_switch_are_refused_on_every_rank():
    """DISTMON_DISABLE=1 on rank 0 only: the same ValueError on both ranks, naming each value and its
    ranks, nothing left bound or installed; set alike, the same ranks then start a monitor."""
    port = free_port()
    out = run_ranks(_disagreeing_job, 2, port)
    messages = {r["refused"] for r in out}
    assert len(messages) == 1 and None not in messages, messages
    assert "DISTMON_DISABLE is '1' on rank 0, unset on rank 1" in messages.pop()
    for r in out:
        assert r["port free"] and set(r["hooks"].values()) == {0}, r
        assert r["step"] == STEPS


def test_one_process_disabled_monitor_answers_as_documented(monkeypatch):
    """In one process: no hook, no thread, the documented answers, torch's clip, a state that a
    monitor turned on starts afresh from, and a value that is no boolean refused."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monkeypatch.setenv("DISTMON_DISABLE", "true")
    threads = set(threading.enumerate())
    mon = distmon.GradMonitor(net, opt, log_path="/nonexistent/dir/run.jsonl")  # not even opened
    assert set(threading.enumerate()) == threads and mon.disabled
    assert all(p._post_accumulate_grad_hooks is None for p in net.parameters())
    net(torch.ones(2, 4)).sum().backward()
    twin = copy.deepcopy(net)
    for p, q in zip(net.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert torch.equal(mon.clip_grad_norm_(1.0), expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), twin.parameters()))
    opt.step()
    assert (mon.latest(), mon.flush(), mon.step, mon.port) == (None, None, 0, None)
    state = mon.state_dict()
    mon.close()
    monkeypatch.setenv("DISTMON_DISABLE", "0")
    on = distmon.GradMonitor(net, opt, serve="none", export_every=1)
    on.load_state_dict(state)  # starts afresh: steps from 1
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert on.flush().step == 1 and on.flush().resumed_from is None
    on.close()
    monkeypatch.setenv("DISTMON_DISABLE", "maybe")
    with pytest.raises(ValueError, match="DISTMON_DISABLE is 'maybe' on rank 0"):
        distmon.GradMonitor(net, opt)
