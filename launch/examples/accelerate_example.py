"""distmon in an accelerate training loop: ``GradMonitor`` on what ``accelerator.prepare`` returned.

A small MLP classifier on CPU, with gradient accumulation (``accelerator.accumulate``) and
clipping (``accelerator.clip_grad_norm_``); distmon serves its gradient figures on
http://127.0.0.1:9290/metrics and skips any optimizer step whose gradient is non-finite::

    torchrun --nproc-per-node 2 launch/examples/accelerate_example.py    # 2 CPU ranks (gloo DDP)
    python launch/examples/accelerate_example.py                          # one process

(``accelerate launch --cpu`` starts a single process on a machine without GPUs; torchrun
starts the ranks asked for.) The norm distmon serves is the one ``clip_grad_norm_`` returns:
before clipping. ``tests/test_framework_hf.py`` runs this file under torchrun and checks every
figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.isfile(os.path.join(_REPO_ROOT, "distmon", "__init__.py")) and _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

import distmon  # noqa: E402

MAX_GRAD_NORM = 0.3


class Classifier(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def prepare(steps: int = 10) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, object]:
    """``accelerator.prepare(model, optimizer, dataloader)``: 2 micro-batches of 4 per step.

    The dataloader holds ``steps`` optimizer steps' worth of batches on every rank.

    Example:
        >>> accelerator, model, optimizer, loader = prepare(steps=1)  # doctest: +SKIP
        >>> len(loader)                                                # doctest: +SKIP
        2
    """
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    n = steps * 2 * 4 * accelerator.num_processes
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randint(4, (n,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def train(
    accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, loader
) -> list[float]:
    """One pass over ``loader``; returns the gradient norm of each optimizer step (before clipping)."""
    norms = []
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
            optimizer.step()
            optimizer.zero_grad()
    return norms


def main(argv: list[str] | None = None) -> tuple[nn.Module, list[float]]:
    """Train (with distmon unless ``--no-distmon``); returns the model and the step norms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--port", type=int, default=9290, help="metrics port (0: any free one)")
    parser.add_argument("--no-distmon", action="store_true", help="the same training, unmonitored")
    args = parser.parse_args(argv)
    accelerator, model, optimizer, loader = prepare(args.steps)
    monitor = (
        contextlib.nullcontext()
        if args.no_distmon
        else distmon.GradMonitor(model, optimizer, guard="skip", port=args.port)
    )
    with monitor:
        norms = train(accelerator, model, optimizer, loader)
    return model, norms


if __name__ == "__main__":
    main()
