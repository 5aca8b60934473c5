"""Lightning with distmon: a small regression, monitored by ``DistmonCallback``.

DDP on two CPU processes (gloo), Lightning's automatic optimization with gradient clipping::

    torchrun --nproc-per-node 2 launch/examples/lightning_example.py
    torchrun --nproc-per-node 2 launch/examples/lightning_example.py --manual   # manual optimization
    torchrun --nproc-per-node 2 launch/examples/lightning_example.py --fsdp2    # ModelParallelStrategy
    python launch/examples/lightning_example.py                                  # one process

Rank 0 serves the gradient norms (before clipping) on http://127.0.0.1:9290/metrics; the
``DISTMON_*`` variables set the other options (``DISTMON_LOG_PATH=steps.jsonl`` writes every
step). ``guard="skip"`` refuses an optimizer step whose gradient is not finite, on every rank.
The model logs Lightning's own norm (``grad_norm``) next to distmon's.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from distmon.integrations.lightning import DistmonCallback

CLIP = 0.5


class Regressor(L.LightningModule):
    """Automatic optimization: Lightning runs backward, clips to ``gradient_clip_val`` and steps."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # after backward, before Lightning clips: the norm distmon serves
        self.log("grad_norm", grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ManualRegressor(Regressor):
    """Manual optimization: backward, clipping and the optimizer step written out."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.log("grad_norm", grad_norm(self, norm_type=2)["grad_2.0_norm_total"])
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # the norm is logged in training_step, before the clipping


class ShardedRegressor(Regressor):
    """FSDP2 under ``ModelParallelStrategy``: each ``Linear`` and the whole net are ``fully_shard``-ed."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning's grad_norm cannot read sharded (DTensor) gradients; torch's total norm can
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.log("grad_norm", norm.full_tensor())


def dataset(n: int = 320) -> TensorDataset:
    """A fixed noisy linear target."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g))


def train(
    *, manual: bool = False, fsdp2: bool = False, steps: int = 10, callbacks: list[L.Callback] | None = None
) -> L.LightningModule:
    """Fit a fresh model for ``steps`` optimizer steps on this job's processes; returns the model."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = ShardedRegressor() if fsdp2 else ManualRegressor() if manual else Regressor()
    strategy = "ddp" if world > 1 else "auto"
    if fsdp2:
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=None if manual else CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=8))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manual", action="store_true", help="manual optimization")
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 (ModelParallelStrategy)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    train(manual=args.manual, fsdp2=args.fsdp2, steps=args.steps, callbacks=[DistmonCallback(guard="skip")])


if __name__ == "__main__":
    main()
