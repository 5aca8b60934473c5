"""What distmon does and says when the job fails (issue #39): messages that point at the failure, not
at distmon, and an exit that never waits on a peer that is not exiting.

- A program that died of an uncaught exception: the exit notice says it died and that distmon
  closed the monitor, and asks for no ``close()`` (the script may well call it: the exception
  skipped it).
- A gradient reduction that fails inside distmon's DDP comm hook (a peer rank died: gloo's
  "Connection closed by peer"): the error names the reduction and a failed peer, not distmon,
  keeps the original as ``__cause__``, whether it comes through the hook's future (the usual
  way), is raised by the wrapped hook itself, or by the wait of a profiled reduction.
- A rank exiting without ``close()`` gathers with the others only once every rank is exiting
  (``meet_at_exit``, through the job's store): all in, they gather; one that waited in vain
  closes alone, and so does every rank after it, consistently.
"""

from __future__ import annotations

import logging
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from distmon.setup import lifecycle
from distmon.setup.lifecycle import ExitGuard, meet_at_exit
from distmon.sources.ddp import HookSlot, _bucket_future, monitor_hook

PEER_DIED = "Connection closed by peer [127.0.0.1]:4242"


def _says_the_reduction_failed(error: BaseException) -> None:
    text = str(error)
    assert "all-reduce failed" in text or "reduction (comm hook" in text, text
    assert "not distmon's" in text and "peer rank failed" in text and PEER_DIED in text, text


def test_an_uncaught_exception_s_exit_notice_says_the_program_died_and_asks_for_no_close(monkeypatch, caplog):
    closed = []
    guard = ExitGuard(lambda *how: closed.append(how), rank=1, world=2, key="test")
    guard.disarm()  # run by hand below, not at this interpreter's exit
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom"), raising=False)
    with caplog.at_level(logging.WARNING, logger="distmon"):
        guard._at_exit()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "rank 1" in said[0] and "died" in said[0] and "closed" in said[0], said
    assert "close()" not in said[0], said  # the script may call it: the exception skipped it
    assert closed == [(False, False, 30.0)]  # not finished, no gather


class _FailedWork:
    """A gloo work whose peer died: its future holds the error, its wait raises it."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_exception(RuntimeError(PEER_DIED))

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> None:
        raise RuntimeError(PEER_DIED)


class _Bucket:
    """A one-bucket stand-in for DDP's ``GradBucket``: what ``_bucket_future`` asks of it."""

    def buffer(self) -> torch.Tensor:
        return torch.zeros(4)

    def index(self) -> int:
        return 0


def test_a_failed_all_reduce_reads_as_the_reduction_s_failure_not_distmon_s():
    fut = _bucket_future(_FailedWork(), _Bucket())
    with pytest.raises(RuntimeError) as raised:
        fut.wait()
    _says_the_reduction_failed(raised.value)


def test_a_wrapped_hook_that_raises_reads_as_the_reduction_s_failure_with_its_cause():
    def dying_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        raise RuntimeError(PEER_DIED)

    with pytest.raises(RuntimeError) as raised:
        monitor_hook(HookSlot(None, dying_hook, None), bucket=None)
    _says_the_reduction_failed(raised.value)
    assert "dying_hook" in str(raised.value)
    assert str(raised.value.__cause__) == PEER_DIED


def test_a_profiled_reduction_s_failed_wait_reads_as_the_reduction_s_failure():
    slot = HookSlot(None, None, None)
    slot.profiled = [_FailedWork()]
    with pytest.raises(RuntimeError) as raised:
        slot.wait_profiled()
    _says_the_reduction_failed(raised.value)
    assert str(raised.value.__cause__) == PEER_DIED


def _meet(store: dist.Store, monkeypatch, arrivals: list[float], timeout_s: float) -> list[tuple[bool, bool]]:
    """Each rank of ``arrivals`` (its delay, s) meets at exit on ``store``, on a thread of its own."""
    monkeypatch.setattr(lifecycle, "default_store", lambda: store)
    out: list[tuple[bool, bool]] = [(False, False)] * len(arrivals)

    def rank(r: int) -> None:
        threading.Event().wait(arrivals[r])
        out[r] = meet_at_exit("exit/test", world=len(arrivals), timeout_s=timeout_s)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_ranks_that_all_exit_gather(monkeypatch):
    assert _meet(dist.HashStore(), monkeypatch, [0.0, 0.3, 0.1], timeout_s=10.0) == [(True, True)] * 3


def test_a_rank_whose_peer_never_exits_closes_alone_after_its_wait(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(lifecycle, "default_store", lambda: store)
    assert meet_at_exit("exit/test", world=2, timeout_s=0.3) == (False, False)
    # the peer exits later: every rank is in, but the first one closed alone: no gather for it either
    assert meet_at_exit("exit/test", world=2, timeout_s=0.3) == (True, False)


def test_without_a_store_a_rank_closes_alone(monkeypatch):
    def gone() -> dist.Store:
        raise RuntimeError("Connection refused")  # the store's host, rank 0, already exited

    monkeypatch.setattr(lifecycle, "default_store", gone)
    assert meet_at_exit("exit/test", world=2, timeout_s=5.0) == (False, False)
