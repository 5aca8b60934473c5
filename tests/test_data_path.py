"""The data path of the global norm, hop by hop, is what the code does (#40).

``distmon/step/data_path.py`` holds the hop tables docs/how-it-works.md renders: per hop, the chain
of calls that takes the number there, outermost first. On 2 gloo ranks a DDP job and an FSDP2 job
run a few steps, an export and a scrape under a profiler that records, for every call into
distmon on every thread, its chain of distmon callers up to the first caller outside distmon
(torch, the optimizer, a thread's start, Prometheus' client). Every hop's chain must be one of
those chains exactly, on its thread: a function put between two hops, renamed or moved fails
this test, and the tables stay the trace of a real step. The fast checks: each path has at most
12 hops, and every function a chain names exists.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import threading

import pytest
import torch
from ddp_harness import free_port, run_ranks
from helpers import scrape_metrics

import distmon
from distmon.step.data_path import PATHS

THREADS = {"training": "MainThread", "distmon-export": "distmon-export", "HTTP worker": "distmon-http-worker"}


def _distmon_functions() -> set[str]:
    """The qualified name of every function and method of the package."""
    names: set[str] = set()
    for mod in pkgutil.walk_packages(distmon.__path__, "distmon."):
        if mod.name.startswith("distmon.integrations") or mod.name.endswith(("__main__", "deepspeed")):
            continue
        module = importlib.import_module(mod.name)
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != mod.name:
                continue
            if inspect.isfunction(obj):
                names.add(obj.__qualname__)
            elif inspect.isclass(obj):
                methods = {n: getattr(v, "__func__", v) for n, v in vars(obj).items()}  # static, class
                names |= {f"{obj.__qualname__}.{n}" for n, v in methods.items() if inspect.isfunction(v)}
    return names


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_has_at_most_12_hops_of_functions_that_exist(path):
    hops = PATHS[path]
    assert len(hops) <= 12, f"the {path} path has {len(hops)} hops"
    known = _distmon_functions()
    missing = [call for hop in hops for call in hop.calls if call not in known]
    assert missing == [], f"{path}: no such function {missing}"


def _traced_job(rank: int, world_size: int, kind: str, port: int) -> set[tuple[str, tuple[str, ...]]]:
    """A few steps of ``kind`` (DDP or FSDP2), an export and a scrape, profiled: the (thread, chain)
    of every call into distmon on the training thread from step 2 on (step 1 builds DDP's buckets)
    and on every thread distmon starts."""
    root = distmon.__path__[0]
    seen: set[tuple[str, tuple[str, ...]]] = set()

    def profile(frame, event, arg):  # noqa: ARG001 (the profiler's signature)
        if event != "call" or not frame.f_code.co_filename.startswith(root) or frame.f_code.co_name[0] == "<":
            return
        chain = []
        while frame is not None and frame.f_code.co_filename.startswith(root):
            if not frame.f_code.co_name.startswith("<"):  # a comprehension's frame (Python < 3.12)
                chain.append(frame.f_code.co_qualname)
            frame = frame.f_back
        seen.add((threading.current_thread().name, tuple(reversed(chain))))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if kind == "DDP":
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    threading.setprofile(profile)  # threads started from now on: the export thread, HTTP workers
    mon = distmon.GradMonitor(model, opt, export_every=4, serve="rank0", port=port, linger_s=0)
    for step in range(1, 5):
        if step == 2:
            sys.setprofile(profile)
        (model(torch.randn(4, 8)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.flush()
    if mon.port is not None:
        scrape_metrics(mon.port)
    sys.setprofile(None)
    threading.setprofile(None)
    mon.close()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_hop_table_is_the_trace_of_a_real_step(path):
    seen = run_ranks(_traced_job, 2, path, free_port(), timeout=180)[0]  # rank 0 serves
    chains = {chain for _, chain in seen}
    for i, hop in enumerate(PATHS[path], 1):
        threads = {thread for thread, chain in seen if chain == hop.calls}
        near = sorted({chain for chain in chains if chain[-1:] == hop.calls[-1:]})
        shown = " > ".join(hop.calls)
        assert threads, f"{path} hop {i}: no call chain {shown}; the calls that end there: {near}"
        assert THREADS[hop.thread] in threads, f"{path} hop {i} ran on {threads}, not {hop.thread}"
