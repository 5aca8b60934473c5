"""The rank side of tests/test_framework_deepspeed.py's grid: DeepSpeed engines with and without distmon.

``torchrun --nproc-per-node 2 tests/jobs/deepspeed_job.py OUT [NAME ...]`` runs, in one process
per rank, every configuration of :func:`grid` (or those named), each built and trained by
``launch/examples/deepspeed_example.py`` (``build``, ``train``) in these runs:

- ``plain``: the configuration's ``steps`` steps without distmon;
- ``monitored``: the same with ``GradMonitor(engine, optimizer)`` logging every step, and the
  references below;
- ``nan_guard``: ``guard="skip"``, rank :data:`NAN_RANK`'s loss NaN in step ``nan_step`` (one
  step more after it);
- ``nan_deepspeed`` (main grid): the same without a guard: what DeepSpeed does on its own.

References, from DeepSpeed and autograd, never from distmon (taken after each step's last
backward, before ``engine.step()``):

- reduced: ``deepspeed.utils.safe_get_full_grad(p)`` of every parameter (DeepSpeed gathers
  its partitions), as float64 sums of squares per layer; DeepSpeed's own
  ``engine.get_global_grad_norm()`` after the step;
- local: a tensor hook on every parameter adds each micro-batch's gradient (what autograd hands
  DeepSpeed) into a float64 sum, per layer, reset at each step.

Then (all configurations run) :func:`refusals`: what distmon refuses at construction.

Each rank saves ``OUT/deepspeed-rank{r}.pt`` (configuration -> run -> results, and ``refusals``);
rank 0 writes each monitored run's JSONL to ``OUT/{name}-{run}.jsonl``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "launch", "examples"), TESTS_DIR]

from helpers import LocalGrads, flat, layer_of, layer_sq  # noqa: E402

NAN_RANK = 1
EXPORT_EVERY = 8  # several exports (all-gathers) per run
MAIN = {"main": True, "steps": 40, "nan_step": 20}  # the acceptance grid's runs
EXTRA = {"main": False, "steps": 12, "nan_step": 6}  # shorter runs for the other configurations


def grid() -> list[dict[str, object]]:
    """Every configuration: ZeRO 0-3 x fp32/bf16 x accumulation 1/4 (the main grid), and ZeRO 1-3
    in bf16 with fp32 gradient accumulation, and ZeRO 0-2 with DeepSpeed MoE (ZeRO-3 refuses it)."""
    main = [
        dict(stage=s, precision=p, accumulation=a, moe=False, **MAIN)
        for s, p, a in itertools.product(range(4), ("fp32", "bf16"), (1, 4))
    ]
    accum = [
        dict(stage=s, precision="bf16-fp32acc", accumulation=a, moe=False, **EXTRA)
        for s, a in itertools.product(range(1, 4), (1, 4))
    ]
    moe = [
        dict(stage=s, precision="fp32", accumulation=a, moe=True, **EXTRA)
        for s, a in itertools.product(range(3), (1, 4))
    ]
    return main + accum + moe


def name(cfg: dict[str, object]) -> str:
    """``z2-bf16-acc4``, ``z1-fp32-acc1-moe``."""
    return f"z{cfg['stage']}-{cfg['precision']}-acc{cfg['accumulation']}" + ("-moe" if cfg["moe"] else "")


def is_expert(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True) is False


class GradsAtBoundary:
    """Float64 per-layer sums of squares (``helpers.layer_sq``) of each step's reduced (DeepSpeed's
    gathered, read at the accumulation boundary) and local (``helpers.LocalGrads``: autograd's,
    summed over the micro-batches) gradients, and DeepSpeed's own norm of the step."""

    def __init__(self, engine: object) -> None:
        from deepspeed.utils import safe_get_full_grad

        self.engine, self.full_grad = engine, safe_get_full_grad
        self.named = list(engine.module.named_parameters())
        self.layers = list(dict.fromkeys(layer_of(n) for n, _ in self.named))
        self.experts = sorted({layer_of(n) for n, p in self.named if is_expert(p)})
        self.local = LocalGrads(self.named)  # this step's local gradient so far, per parameter
        self.steps: list[dict[str, object]] = []

    def on_boundary(self, step: int) -> None:
        """After the step's last backward, before ``engine.step()`` (a collective per parameter)."""
        if self.steps:
            self._after_step(self.steps[-1])
        full = {n: self.full_grad(p).double().reshape(-1) for n, p in self.named}
        grads = self.local.take()
        self.steps.append(
            {
                "step": step,
                "reduced": layer_sq(full.items(), self.layers),
                "local": layer_sq(((n, grads[n]) for n, _ in self.named if n in grads), self.layers),
                # whole vectors, to check the method: the ranks' locals average to the reduced one
                "reduced_vector": torch.cat(list(full.values())),
                "local_vector": torch.cat([grads[n].reshape(-1) for n, _ in self.named]),
            }
        )

    def _after_step(self, record: dict[str, object]) -> None:
        norm = self.engine.get_global_grad_norm()
        record["deepspeed_norm"] = None if norm is None else float(norm)
        record["applied"] = bool(self.engine.was_step_applied())

    def finish(self) -> None:
        if self.steps:
            self._after_step(self.steps[-1])


def gathered(engine: object) -> contextlib.AbstractContextManager:
    """Where the engine's parameters are whole: ZeRO-3 gathers its partitions for the block."""
    import deepspeed

    params = list(engine.module.parameters())
    return (
        deepspeed.zero.GatheredParameters(params)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )


def flat_params(engine: object) -> torch.Tensor:
    """Every parameter as the model holds it (ZeRO-3's gathered), flattened into one float64 copy."""
    with gathered(engine):
        return flat(engine.module.parameters())


class Snapshots:
    """The parameters after each of the given steps, and whether DeepSpeed applied each step
    (``engine.step()`` wrapped on the instance)."""

    def __init__(self, engine: object, steps: set[int]) -> None:
        self.engine, self.wanted, self.taken = engine, steps, {}
        self.applied: list[bool] = []
        self.lrs: list[float] = []  # the learning rate after each step
        self._step, self._inner = 0, engine.step
        engine.step = self.step

    def step(self, *args: object, **kwargs: object) -> object:
        boundary = self.engine.is_gradient_accumulation_boundary()
        result = self._inner(*args, **kwargs)
        if boundary:
            self._step += 1
            self.applied.append(bool(self.engine.was_step_applied()))
            self.lrs.append(self.engine.get_lr()[0])
            if self._step in self.wanted:
                self.taken[self._step] = flat_params(self.engine)
        return result


def run(cfg: dict[str, object], kind: str, out: str) -> dict[str, object]:
    """One run of ``cfg``: ``plain``, ``monitored``, ``nan_guard`` or ``nan_deepspeed``."""
    import deepspeed_example as example

    import distmon

    ds_cfg = example.config(
        cfg["stage"],
        bf16=cfg["precision"] != "fp32",
        accumulation=cfg["accumulation"],
        fp32_accumulation=cfg["precision"] == "bf16-fp32acc",
    )
    engine, optimizer = example.build(ds_cfg, moe=cfg["moe"])
    nan, nan_step = kind.startswith("nan"), cfg["nan_step"]
    steps = nan_step + 1 if nan else cfg["steps"]
    snaps = Snapshots(engine, {nan_step - 1, nan_step})
    refs = GradsAtBoundary(engine) if kind == "monitored" else None
    monitor = None
    if kind != "plain":
        options: dict[str, object] = {"serve": "none", "export_every": EXPORT_EVERY}
        if dist.get_rank() == 0:
            options["log_path"] = os.path.join(out, f"{name(cfg)}-{kind}.jsonl")
        if kind == "nan_guard":
            options["guard"] = "skip"
        if kind == "monitored":  # the gradient noise scale on: this rank's samples per step
            options["batch_size"] = example.MICRO_BATCH * cfg["accumulation"]
        monitor = distmon.GradMonitor(engine, optimizer, **options)
    start = time.perf_counter()
    example.train(
        engine,
        steps,
        poison=(nan_step, NAN_RANK) if nan else None,
        on_boundary=refs.on_boundary if refs is not None else None,
    )
    seconds = time.perf_counter() - start
    if monitor is not None:
        monitor.close()
    if refs is not None:
        refs.finish()
    result = {
        "params": flat_params(engine),
        "snapshots": snaps.taken,
        "applied": snaps.applied,
        "lrs": snaps.lrs,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "seconds": seconds,
        "monitor_errors": monitor._run.errors.count if monitor is not None else 0,
    }
    if refs is not None:
        result.update(steps=refs.steps, layers=refs.layers, experts=refs.experts)
    engine.destroy()
    return result


def refusals() -> dict[str, str]:
    """What distmon refuses at construction, and says: case -> the error's type and message."""
    import deepspeed_example as example

    import distmon

    def fp16() -> tuple:
        from unittest import mock

        from deepspeed.accelerator import get_accelerator

        cfg = example.config(2)
        cfg["fp16"] = {"enabled": True}
        # DeepSpeed builds no fp16 engine on a CPU without oneDNN fp16 (AMD EPYC: "Type fp16 is not
        # supported on your device"); built here only for distmon to refuse it, no step taken, as
        # on the GPUs that train in fp16
        with mock.patch.object(type(get_accelerator()), "is_fp16_supported", lambda self: True):
            return example.build(cfg)

    def offload() -> tuple:
        cfg = example.config(2)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # the client AdamW on the host
        return example.build(cfg)

    engine, optimizer = example.build(example.config(2))
    other = torch.optim.AdamW(engine.module.parameters())
    cases = {
        "fp16": lambda: distmon.GradMonitor(*fp16(), serve="none"),
        "offload": lambda: distmon.GradMonitor(*offload(), serve="none"),
        "another optimizer": lambda: distmon.GradMonitor(engine, other, serve="none"),
        "comm_hook": lambda: distmon.GradMonitor(engine, optimizer, serve="none", comm_hook=print),
        "distinct_over": lambda: distmon.GradMonitor(
            engine, optimizer, serve="none", distinct_over={"fc": dist.group.WORLD}
        ),
        # what a user has in hand next to the optimizer: measured as the engine that holds it
        "the engine's module": lambda: distmon.GradMonitor(engine.module, optimizer, serve="none"),
    }
    said = {}
    for case, build in cases.items():
        try:
            build().close()
            said[case] = "built"
        except Exception as e:
            said[case] = f"{type(e).__name__}: {e}"
    with distmon.GradMonitor(engine, optimizer, serve="none") as mon:
        try:
            distmon.GradMonitor(engine, optimizer, serve="none").close()
            said["a second monitor"] = "built"
        except Exception as e:
            said["a second monitor"] = f"{type(e).__name__}: {e}"
        try:  # DeepSpeed clips itself (gradient_clipping): refused, saying so (docs/frameworks.md)
            mon.clip_grad_norm_(1.0)
            said["clip_grad_norm_"] = "clipped"
        except Exception as e:
            said["clip_grad_norm_"] = f"{type(e).__name__}: {e}"
    return said


def main(out: str, names: list[str]) -> None:
    from ddp_harness import leave

    results: dict[str, dict[str, object]] = {}
    for cfg in grid():
        if names and name(cfg) not in names:
            continue
        kinds = ["plain", "monitored", "nan_guard"] + (["nan_deepspeed"] if cfg["main"] else [])
        results[name(cfg)] = {"config": cfg, **{kind: run(cfg, kind, out) for kind in kinds}}
        # after every configuration: a job that fails later still leaves what it measured
        torch.save(results, os.path.join(out, f"deepspeed-rank{dist.get_rank()}.pt"))
    if not names:
        results["refusals"] = refusals()
        torch.save(results, os.path.join(out, f"deepspeed-rank{dist.get_rank()}.pt"))
    dist.barrier()
    leave(0)  # results are written: no interpreter finalization (see ddp_harness.leave)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
