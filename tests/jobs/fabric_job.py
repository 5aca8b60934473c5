"""The rank side of tests/test_framework_fabric.py: Lightning Fabric (DDP, FSDP2) with and without distmon.

``torchrun --nproc-per-node 2 tests/jobs/fabric_job.py OUT`` runs, per strategy, the functions of
``launch/examples/fabric_example.py``: ``plain`` (no distmon), ``measured`` (``GradMonitor(model,
optimizer)`` on what ``fabric.setup`` returned, logging every step) and ``nan`` (``guard="skip"``,
rank :data:`NAN_RANK`'s loss NaN in step :data:`NAN_STEP`).

References, never from distmon: the norm ``fabric.clip_gradients`` returns (before clipping), and
float64 norms of the reduced gradients copied just before it (DDP's ``p.grad``; FSDP2's sharded
``p.grad``, gathered with ``full_tensor()``), per layer; each rank's local gradient from tensor
hooks (DDP: what autograd hands DDP, summed over the micro-batches).

Each rank saves ``OUT/fabric-{strategy}-rank{r}.pt``; rank 0 writes ``OUT/fabric-{strategy}-{run}.jsonl``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "launch", "examples"), TESTS_DIR]

from helpers import LocalGrads, flat, layer_sq, whole  # noqa: E402

import distmon  # noqa: E402

STEPS = 12
NAN_STEP, NAN_RANK = 6, 1
STRATEGIES = ("ddp", "fsdp")


class GradsBeforeClip:
    """Per step, float64 per-layer sums of squares (``helpers.layer_sq``) of the reduced gradients
    read just before Fabric clips, and (DDP) of the local ones (``helpers.LocalGrads``)."""

    def __init__(self, model: torch.nn.Module, local: bool) -> None:
        self.named = list(model.named_parameters())  # the user's module: the names distmon reports
        self.local = LocalGrads(self.named) if local else None
        self.steps: list[dict[str, dict[str, float]]] = []

    def before_clip(self, step: int) -> None:
        reduced = layer_sq((n, whole(p.grad)) for n, p in self.named)
        sums = self.local.take() if self.local is not None else {}
        local = layer_sq((n, sums[n]) for n, _ in self.named if n in sums)
        self.steps.append({"reduced": reduced, "local": local})


def run(strategy: str, kind: str, out: str) -> dict[str, object]:
    import fabric_example  # Lightning: imported by the ranks, not by the test that reads STEPS here

    fabric, model, optimizer = fabric_example.setup(strategy)
    refs = GradsBeforeClip(model._original_module, local=strategy == "ddp") if kind == "measured" else None
    monitor = None
    if kind != "plain":
        log = os.path.join(out, f"fabric-{strategy}-{kind}.jsonl") if fabric.global_rank == 0 else None
        guard = "skip" if kind == "nan" else None
        monitor = distmon.GradMonitor(
            model, optimizer, serve="none", export_every=4, log_path=log, guard=guard
        )
    steps = []

    def before_clip(step: int) -> None:
        if refs is not None:
            refs.before_clip(step)
        steps.append(flat(model.parameters()))  # the parameters before the step's update

    norms = fabric_example.train(
        fabric,
        model,
        optimizer,
        STEPS,
        poison=(NAN_STEP, NAN_RANK) if kind == "nan" else None,
        before_clip=before_clip,
    )
    if monitor is not None:
        monitor.close()
    return {
        "params": flat(model.parameters()),
        "before": steps,
        "norms": norms,
        "refs": refs.steps if refs is not None else None,
        "module": type(model).__name__,
        "inner": type(model._forward_module).__name__,
        "errors": monitor._run.errors.count if monitor is not None else 0,
        "max_grad_norm": fabric_example.MAX_GRAD_NORM,
    }


def main(out: str) -> None:
    from ddp_harness import leave

    for strategy in STRATEGIES:
        results = {kind: run(strategy, kind, out) for kind in ("plain", "measured", "nan")}
        torch.save(results, os.path.join(out, f"fabric-{strategy}-rank{dist.get_rank()}.pt"))
    dist.barrier()
    leave(0)  # results are written: no interpreter finalization (see ddp_harness.leave)


if __name__ == "__main__":
    main(sys.argv[1])
