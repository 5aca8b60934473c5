"""What ``run_ranks`` (tests/ddp_harness.py) promises the tests that call it.

Its ranks are forked from a fork server, started by the first call in a pytest process, that
imported torch once. Two things a rank would otherwise take from that server rather than from
the calling test, as a spawned rank did: the environment (the calling test's, as it is at the
call) and where its output goes (the calling test's stderr, which pytest shows on a failure).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist
from ddp_harness import RankFailure, run_ranks

pytestmark = pytest.mark.slow

PROBE = "RANK_HARNESS_PROBE"  # not DISTMON_*: run_ranks clears those in every rank


def _variable(rank: int, world_size: int, name: str) -> str | None:
    # no rank leaves before the other is through init_process_group (its peer would read a closed
    # connection): a job without a collective does not wait by itself
    dist.barrier()
    return os.environ.get(name)


def _fail_on_rank_1(rank: int, world_size: int, word: str) -> int:
    print(f"{word}: stdout of rank {rank}", flush=True)
    sys.stderr.write(f"{word}: stderr of rank {rank}\n")
    dist.barrier()  # as in _variable: rank 1's failure, not its peer's broken init, is reported
    assert rank == 0, f"{word}: rank {rank} fails"
    return rank


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    """The fork server started (if no test of this process did yet) outside the tests below, as
    it is for most tests: its stdout and stderr are not theirs."""
    run_ranks(_variable, 1, PROBE)


def test_a_rank_sees_the_environment_of_the_call(monkeypatch):
    monkeypatch.delenv(PROBE, raising=False)
    assert run_ranks(_variable, 2, PROBE) == [None, None]
    monkeypatch.setenv(PROBE, "set after the server started")
    assert run_ranks(_variable, 2, PROBE) == ["set after the server started"] * 2
    monkeypatch.delenv(PROBE)
    assert run_ranks(_variable, 2, PROBE) == [None, None]


def test_a_failing_rank_s_output_reaches_the_calling_test(capfd):
    with pytest.raises(RankFailure, match="probe: rank 1 fails"):
        run_ranks(_fail_on_rank_1, 2, "probe")
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"probe: stdout of rank {rank}" in err and f"probe: stderr of rank {rank}" in err, err
