"""Start-up is all or nothing on every rank; what a monitor leaves behind, before and after close().

One 2-rank gloo job walks through the cases, each on the same DDP model:

* options that shape the collective or the rows (export cadence, grouping, layer cap,
  rank_layers, batch_size, activations, guard) set differently on the two ranks: every rank
  raises the same ``ValueError`` naming the option and each value's ranks (before, the job
  hung or a rank aborted at the first collective);
* an unusable ``log_path`` (a path under a regular file) or ``file_sd_dir``, an option that is
  bad on one rank only (``DISTMON_EXPORT_EVERY`` in rank 1's environment): every rank raises
  the same error naming distmon, the option and the path; no rank keeps a comm hook, an
  optimizer hook, a thread or its port; catching the error and training on finishes;
* a monitor built afterwards on the same model works, and another one after it closed
  (distmon's own hook slot is taken over, not refused as "someone else's hook");
* ``clip_grad_norm_`` after ``close()`` raises instead of clipping by nothing;
* an ``optimizer.step()`` without a backward is not a real-looking number: the snapshot is
  invalid with a NaN norm, the served gauge keeps the last measured value;
* errors counted on rank 0 after its last published step (its JSONL log on ``/dev/full``,
  a full disk) are in the served ``distmon_monitor_errors_total`` at the end.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn
from ddp_harness import free_port, run_ranks
from helpers import scrape_metrics
from torch.nn.parallel import DistributedDataParallel as DDP

import distmon

pytestmark = pytest.mark.slow  # real ranks or servers: not in the fast tier


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: DDP, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
    return norms


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _leftovers(model: DDP, opt: torch.optim.Optimizer) -> dict:
    hooks = getattr(model, "_comm_hooks", [])
    return {
        "comm_hook_source": [getattr(state, "source", "foreign") for _, state in hooks],
        "optimizer_hooks": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
        "step_shadowed": "step" in vars(opt),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("distmon")),
    }


def _scrape(port: int) -> dict[str, float]:
    """The samples labelled by run_id alone (the cluster-wide ones), by name."""
    return {n: v for n, labels, v in scrape_metrics(port) if not labels.keys() - {"run_id"}}


def _job(rank: int, world: int, workdir: str) -> dict:
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    a_file = os.path.join(workdir, "a-file")
    if rank == 0:
        open(a_file, "w").close()
    port = free_port() if rank == 0 else 0
    out: dict = {"failures": {}}
    cases = {
        "log_path": dict(log_path=os.path.join(a_file, "run.jsonl")),
        "file_sd_dir": dict(file_sd_dir=os.path.join(a_file, "sd")),
        "env_on_one_rank": dict(),
    }
    for case, options in cases.items():
        if case == "env_on_one_rank" and rank == 1:
            os.environ["DISTMON_EXPORT_EVERY"] = "ten"
        torch.distributed.barrier()
        try:
            distmon.GradMonitor(model, opt, serve="rank0", port=port, linger_s=0, **options)
            error = None
        except Exception as e:  # noqa: BLE001 - the type and message are what is checked
            error = (type(e).__name__, str(e))
        os.environ.pop("DISTMON_EXPORT_EVERY", None)
        out["failures"][case] = {
            "error": error,
            "leftovers": _leftovers(model, opt),
            "port_free": _port_free(port) if rank == 0 else True,
            "trained": len(_train(model, opt, rank, 3)),
        }

    # options that shape the collective or the rows, set differently on the two ranks
    out["differ"] = {}
    for case, (options, env) in DIFFER.items():
        for name, values in env.items():
            os.environ[name] = values[rank]
        torch.distributed.barrier()
        try:
            distmon.GradMonitor(model, opt, serve="none", **{k: v[rank] for k, v in options.items()})
            error = None
        except Exception as e:  # noqa: BLE001 - the type and message are what is checked
            error = (type(e).__name__, str(e))
        for name in env:
            os.environ.pop(name)
        out["differ"][case] = {
            "error": error,
            "leftovers": _leftovers(model, opt),
            "trained": len(_train(model, opt, rank, 3)),
        }

    # a working monitor on the same model, then another one after it closed
    mons = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mon = distmon.GradMonitor(model, opt, serve="none", export_every=2)
        ref = _train(model, opt, rank, 4)
        snap = mon.flush()
        mon.close()
        mons.append(
            {
                "step": snap.step,
                "norm": snap.grad_norm,
                "ref": ref[-1],
                "warnings": [str(w.message) for w in caught if "distmon" in str(w.message)],
            }
        )
        try:
            mon.clip_grad_norm_(1.0)
            mons[-1]["clip_after_close"] = None
        except RuntimeError as e:
            mons[-1]["clip_after_close"] = str(e)
    out["monitors"] = mons
    out["after_close"] = _leftovers(model, opt)

    # an optimizer step without a backward; then a full disk under the JSONL log
    mon = distmon.GradMonitor(
        model, opt, serve="rank0", port=0, export_every=5, linger_s=0, log_path="/dev/full"
    )
    ref = _train(model, opt, rank, 4)
    opt.step()  # step 5: no backward
    snap5 = mon.flush()
    out["no_backward"] = {
        "step": snap5.step,
        "valid": snap5.valid,
        "norm": snap5.grad_norm,
        "nonfinite": snap5.nonfinite,
        "rank_norms": snap5.rank_grad_norms,
        "ref_step4": ref[-1],
        "served": _scrape(mon.port) if rank == 0 else None,
    }
    _train(model, opt, rank, 5)  # steps 6-10: published at step 10, the sink fails again
    mon.flush()
    out["served"] = _scrape(mon.port) if rank == 0 else None
    out["errors_counted"] = mon._run.errors.count
    mon.close()
    return out


# case -> ({option: (rank 0's, rank 1's)}, {env variable: (rank 0's, rank 1's)}); the text the
# error must hold. Before, each of these hung the job or aborted a rank at the first collective.
DIFFER = {
    "export_every": ({}, {"DISTMON_EXPORT_EVERY": ("3", "5")}),
    "export_interval_s": ({}, {"DISTMON_EXPORT_INTERVAL_S": ("0", "0.001")}),
    "rank_layers": ({"rank_layers": (True, False)}, {}),
    "groups": ({"groups": (None, [(r".*", "all")])}, {}),
    "max_layers": ({"max_layers": (128, 1)}, {}),
    "batch_size": ({"batch_size": (None, 8)}, {}),
    "activations": ({"activations": (None, True)}, {}),
    "guard": ({"guard": (None, "skip")}, {}),
}
DIFFER_SAYS = {
    "export_every": "export_every (DISTMON_EXPORT_EVERY) is 3 on ranks 0, 5 on ranks 1",
    "export_interval_s": "export_interval_s (DISTMON_EXPORT_INTERVAL_S) is 0.0 on ranks 0, 0.001 on ranks 1",
    "rank_layers": "rank_layers is True on ranks 0, False on ranks 1",
    # the job's reading of its layout (census.py) finds it first: the same parameter, another layer
    "groups": "options differ between ranks: groups puts parameter '0.weight'",
    "max_layers": "max_layers is 128 on ranks 0, 1 on ranks 1",
    "batch_size": "batch_size is None on ranks 0, given on ranks 1",
    "activations": "activations is None on ranks 0, watched modules 3 [",
    "guard": "guard is None on ranks 0, skip on ranks 1",
}


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory) -> list[dict]:
    return run_ranks(_job, 2, str(tmp_path_factory.mktemp("lifecycle")), timeout=180)


CLEAN = {"comm_hook_source": [], "optimizer_hooks": 0, "step_shadowed": False, "threads": []}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,option,kind,bad_rank",
    [
        ("log_path", "log_path", "OSError", 0),
        ("file_sd_dir", "file_sd_dir", "OSError", 0),
        ("env_on_one_rank", "DISTMON_EXPORT_EVERY", "ValueError", 1),
    ],
)
def test_a_start_up_failure_on_one_rank_fails_every_rank_and_leaves_nothing(
    lifecycle, case, option, kind, bad_rank
):
    errors = [res["failures"][case]["error"] for res in lifecycle]
    assert errors[0] is not None and errors[0] == errors[1], errors  # the same error on every rank
    name, message = errors[0]
    assert kind in name or (kind == "OSError" and name in ("FileExistsError", "NotADirectoryError")), name
    assert (
        "distmon: GradMonitor did not start" in message
        and option in message
        and f"rank {bad_rank} " in message
    ), message
    for res in lifecycle:
        assert res["failures"][case]["leftovers"] == CLEAN
        assert res["failures"][case]["port_free"], "the failed monitor kept its port"
        assert res["failures"][case]["trained"] == 3  # caught the error and trained on: no hang


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DIFFER))
def test_options_that_differ_between_ranks_fail_every_rank_alike_naming_them(lifecycle, case):
    errors = [res["differ"][case]["error"] for res in lifecycle]
    assert errors[0] is not None and errors[0] == errors[1], errors  # the same error on every rank
    name, message = errors[0]
    assert name == "ValueError" and "distmon: GradMonitor did not start on any rank" in message, errors
    assert DIFFER_SAYS[case] in message, message
    for res in lifecycle:
        assert res["differ"][case]["leftovers"] == CLEAN
        assert res["differ"][case]["trained"] == 3  # caught the error and trained on: no hang


@pytest.mark.slow
def test_a_model_can_be_monitored_again_after_close(lifecycle):
    for res in lifecycle:
        for mon in res["monitors"]:
            assert mon["step"] == 4 and math.isclose(mon["norm"], mon["ref"], rel_tol=1e-5), mon
            assert mon["warnings"] == []  # one optimizer steps the whole model
            assert "closed" in mon["clip_after_close"] and "clip_grad_norm_" in mon["clip_after_close"]
        # the closed monitors left distmon's inert hook slot (DDP cannot drop a hook) and nothing else
        assert res["after_close"] == dict(CLEAN, comm_hook_source=[None])


@pytest.mark.slow
def test_a_step_without_backward_is_invalid_and_not_served(lifecycle):
    for res in lifecycle:
        nb = res["no_backward"]
        assert nb["step"] == 5 and nb["valid"] is False and nb["nonfinite"] is False
        assert math.isnan(nb["norm"]) and all(math.isnan(n) for n in nb["rank_norms"])
    nb = lifecycle[0]["no_backward"]
    assert nb["served"]["distmon_optimizer_steps_total"] == 5  # the step happened...
    assert math.isclose(
        nb["served"]["distmon_grad_norm"], nb["ref_step4"], rel_tol=1e-5
    )  # ...was not measured


@pytest.mark.slow
def test_errors_counted_after_the_last_published_step_are_served(lifecycle):
    served, counted = lifecycle[0]["served"], lifecycle[0]["errors_counted"]
    assert counted == 2  # the JSONL sink failed at both publications (steps 5 and 10)
    assert served["distmon_monitor_errors_total"] == counted + lifecycle[1]["errors_counted"]


class _Died(RuntimeError):
    pass


def _dying_job(rank: int, world: int) -> dict:
    """Rank 1 raises inside ``with GradMonitor(...)`` after step 5 of 10 (before the export);
    rank 0 goes on to its own end 2 s later without another step, as a job torn down does."""
    model = DDP(_net())
    twin = copy.deepcopy(model.module)  # this rank's local gradient, unreduced
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    began = time.monotonic()
    try:
        with distmon.GradMonitor(model, opt, serve="none", export_every=10, export_interval_s=0) as mon:
            for step in range(5):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
                twin.load_state_dict(model.module.state_dict())
                twin.zero_grad()
                twin(x).pow(2).mean().backward()
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            own = torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()]).item()
            if rank == 1:
                raise _Died("a rank's own failure")
            time.sleep(2.0)
            raise _Died("torn down")
    except _Died:
        closed_after = time.monotonic() - began
    snap = mon.latest()
    return {
        "closed_after": closed_after,
        "step": snap.step,
        "valid": snap.valid,
        "rank_valid": snap.rank_valid,
        "rank_grad_norms": snap.rank_grad_norms,
        "own": own,
    }


def test_a_rank_that_raises_closes_at_once_with_its_own_figures_only():
    """close(finished=False) issues no collective (the other ranks may be anywhere): the steps
    since the last export are exported with this rank's figures, the others' NaN (the global
    figures are this rank's own reduced ones: measured, valid)."""
    for rank, out in enumerate(run_ranks(_dying_job, 2, timeout=120)):
        assert out["closed_after"] < (10.0 if rank == 1 else 12.0), out
        assert out["step"] == 5 and out["valid"], out
        assert out["rank_valid"] == [r == rank for r in range(2)], out
        other = out["rank_grad_norms"][1 - rank]
        mine = out["rank_grad_norms"][rank]
        assert math.isnan(other), out
        assert abs(mine - out["own"]) <= 1e-5 * out["own"], out


def _finally_job(rank: int, world: int) -> dict:
    """Rank 1 raises at step 3 inside ``try: ... finally: mon.close()`` (not a ``with``), while rank
    0 goes on into step 3's backward, where DDP's all-reduce (through distmon's comm hook) waits for
    rank 1 until rank 1's process group is gone."""
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = distmon.GradMonitor(model, opt, serve="none", export_every=10, export_interval_s=0)
    began, closed_after, failure = time.monotonic(), None, ""
    try:
        try:
            for step in range(1, 6):
                if rank == 1 and step == 3:
                    raise _Died("a rank's own failure")
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            mon.close()
            closed_after = time.monotonic() - began
    except RuntimeError as e:  # rank 1: its own; rank 0: the reduction's, once rank 1 was gone
        failure = str(e)
    return {"closed_after": closed_after, "failure": failure, "step": mon.latest().step}


def test_close_in_a_finally_block_while_an_exception_propagates_gathers_with_no_one():
    """A ``finally: mon.close()`` on a rank that failed must not start the close's gather: its peer is
    blocked in the step's all-reduce and never joins it (before: rank 1 waited there until the process
    group's timeout). Rank 0's reduction error reads as the reduction's, naming a failed peer."""
    dying, waiting = run_ranks(_finally_job, 2, timeout=60)[::-1]
    assert dying["closed_after"] < 10.0 and "a rank's own failure" in dying["failure"], dying
    assert dying["step"] == 2, dying
    assert "DDP's gradient all-reduce failed" in waiting["failure"], waiting
    assert "not distmon's" in waiting["failure"] and "peer rank failed" in waiting["failure"], waiting
