"""distmon in a Lightning Fabric loop: ``GradMonitor`` on what ``fabric.setup`` returned.

A small MLP regression on CPU ranks, with DDP or FSDP2 (``ModelParallelStrategy``: each linear
layer and the root ``fully_shard``-ed), gradient accumulation (``fabric.no_backward_sync``) and
clipping (``fabric.clip_gradients``); distmon serves its gradient figures on
http://127.0.0.1:9290/metrics and skips any optimizer step whose gradient is non-finite. The
distmon part is three lines::

    import distmon
    monitor = distmon.GradMonitor(model, optimizer, guard="skip")   # after fabric.setup
    ...                                                             # the training loop
    monitor.close()

Run it::

    torchrun --nproc-per-node 2 launch/examples/fabric_example.py --strategy ddp
    torchrun --nproc-per-node 2 launch/examples/fabric_example.py --strategy fsdp

The norm distmon serves is the one ``fabric.clip_gradients`` returns: before clipping.
``tests/test_framework_fabric.py`` runs this file's functions under torchrun and checks every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import lightning as L
import torch
from torch import nn

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.isfile(os.path.join(_REPO_ROOT, "distmon", "__init__.py")) and _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

import distmon  # noqa: E402

MAX_GRAD_NORM = 0.3
ACCUMULATION = 2
MICRO_BATCH = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def _shard(model: nn.Module, device_mesh: object) -> nn.Module:
    """ModelParallelStrategy's ``parallelize_fn``: FSDP2 over the data-parallel mesh dimension."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def setup(strategy: str) -> tuple[L.Fabric, nn.Module, torch.optim.Optimizer]:
    """``fabric.setup`` of the model and an AdamW on every rank of the torchrun job (gloo on CPU).

    Example:
        >>> fabric, model, optimizer = setup("ddp")  # doctest: +SKIP
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        chosen: object = ModelParallelStrategy(
            parallelize_fn=_shard, data_parallel_size=world, tensor_parallel_size=1
        )
    else:
        chosen = "ddp" if world > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=chosen)
    fabric.launch()
    with fabric.init_module(empty_init=False):
        model = _net()
    model = fabric.setup(model)  # FSDP2: the optimizer is made from the sharded parameters
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * step + micro)
    return torch.randn(MICRO_BATCH, 9, generator=g) * (1 + rank), torch.randn(MICRO_BATCH, 3, generator=g)


def train(
    fabric: L.Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    poison: tuple[int, int] | None = None,
    before_clip=None,
) -> list[float]:
    """``steps`` optimizer steps of :data:`ACCUMULATION` micro-batches; returns the norms
    ``fabric.clip_gradients`` reported. ``poison=(step, rank)``: that rank's loss is NaN in the
    step's last micro-batch. ``before_clip(step)`` runs after the step's backwards."""
    norms = []
    for step in range(1, steps + 1):
        for micro in range(ACCUMULATION):
            x, y = batch(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATION - 1):
                loss = nn.functional.mse_loss(model(x), y) / ACCUMULATION
                if poison == (step, fabric.global_rank) and micro == ACCUMULATION - 1:
                    loss = loss * float("nan")
                fabric.backward(loss)
        if before_clip is not None:
            before_clip(step)
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_GRAD_NORM, error_if_nonfinite=False)
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def main(argv: list[str] | None = None) -> tuple[nn.Module, list[float]]:
    """Train (with distmon unless ``--no-distmon``); returns the model and the step norms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", type=int, default=9290, help="metrics port (0: any free one)")
    parser.add_argument("--no-distmon", action="store_true", help="the same training, unmonitored")
    args = parser.parse_args(argv)
    fabric, model, optimizer = setup(args.strategy)
    monitor = (
        contextlib.nullcontext()
        if args.no_distmon
        else distmon.GradMonitor(model, optimizer, guard="skip", port=args.port)
    )
    with monitor:
        norms = train(fabric, model, optimizer, args.steps)
    return model, norms


if __name__ == "__main__":
    main()
