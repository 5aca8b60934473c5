"""distmon with DeepSpeed: ``GradMonitor`` on what ``deepspeed.initialize`` returned.

A small regression network trains with a client ``torch.optim.AdamW`` under ZeRO stage 0-3,
in fp32 or bf16, with gradient accumulation and DeepSpeed's own clipping
(``gradient_clipping``); distmon serves its gradient figures on
http://127.0.0.1:9290/metrics and skips any optimizer step whose gradient is non-finite
(``guard="skip"``: DeepSpeed then takes the step without the update, as on its own overflow)::

    torchrun --nproc-per-node 2 launch/examples/deepspeed_example.py --stage 2 --bf16
    torchrun --nproc-per-node 2 launch/examples/deepspeed_example.py --stage 3 --accumulation 4
    curl -s 127.0.0.1:9290/metrics | grep ^distmon_                       # while it runs

On a machine without a GPU DeepSpeed runs on its CPU accelerator over gloo (install it with
``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``; ``bash launch/install.sh --test`` does).
The norm distmon serves is the one DeepSpeed clips by (``engine.get_global_grad_norm()`` at
stages 1-3; DeepSpeed reports none at stage 0 in fp32). ``tests/test_framework_deepspeed.py``
runs this file's functions under torchrun and checks every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.isfile(os.path.join(_REPO_ROOT, "distmon", "__init__.py")) and _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

import distmon  # noqa: E402

IN, HIDDEN, OUT = 7, 13, 5  # odd sizes: ZeRO's partitions cut parameters in two
MICRO_BATCH = 3
MAX_GRAD_NORM = 1.0


class Net(nn.Module):
    """Input layer, LayerNorm, a hidden layer (DeepSpeed's MoE with one expert per rank if
    ``moe``), output layer."""

    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        if moe:
            from deepspeed.moe.layer import MoE

            world = dist.get_world_size()
            self.hidden = MoE(
                hidden_size=HIDDEN,
                expert=nn.Linear(HIDDEN, HIDDEN),
                num_experts=world,
                ep_size=world,
                k=1,
                min_capacity=0,  # micro-batches of a few tokens
            )
        else:
            self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.inp(x)))
        h = self.hidden(h)
        if isinstance(h, tuple):  # MoE: (output, load-balancing loss, expert counts)
            h = h[0]
        return self.out(torch.relu(h))


def config(stage: int, *, bf16: bool = False, accumulation: int = 1, fp32_accumulation: bool = False) -> dict:
    """The DeepSpeed config: ZeRO ``stage``, ``bf16`` (optionally with fp32 gradient
    accumulation: DeepSpeed's ``BF16_Optimizer`` at stage 1), clipping at :data:`MAX_GRAD_NORM`,
    a warm-up learning rate schedule."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": MAX_GRAD_NORM,
        "zero_optimization": {"stage": stage},
        # a learning rate that changes every step (DeepSpeed steps it with the optimizer)
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 100}},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if fp32_accumulation:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def init_distributed() -> None:
    """torch.distributed from torchrun's environment (gloo without CUDA), before DeepSpeed uses it."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def build(cfg: dict, *, moe: bool = False, seed: int = 0) -> tuple[object, object]:
    """``deepspeed.initialize`` on a fresh :class:`Net` and a client AdamW: ``(engine, optimizer)``.

    Example:
        >>> engine, optimizer = build(config(2, bf16=True))  # doctest: +SKIP
    """
    import deepspeed

    init_distributed()
    torch.manual_seed(seed)
    net = Net(moe)
    params: object = net.parameters()
    if moe:  # experts in param groups of their own, as DeepSpeed's MoE asks
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(params), "name": "dense"}
        )
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=cfg)
    return engine, optimizer


def batch(rank: int, step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of ``step`` on ``rank``: inputs (scaled by rank: each rank's gradient
    its own) and targets, the same in every run."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 1_009 * step + micro)
    x = torch.randn(MICRO_BATCH, IN, generator=g) * (1 + rank)
    return x.to(dtype), torch.randn(MICRO_BATCH, OUT, generator=g)


def train(engine: object, steps: int, *, poison: tuple[int, int] | None = None, on_boundary=None) -> None:
    """``steps`` optimizer steps of ``engine.backward`` / ``engine.step`` per micro-batch.

    ``poison=(step, rank)``: that rank's loss is NaN in the step's first micro-batch.
    ``on_boundary(step)`` is called after each step's last backward, before its ``engine.step()``.
    """
    rank = dist.get_rank()
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for step in range(1, steps + 1):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(rank, step, micro, dtype)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            if poison == (step, rank) and micro == 0:
                loss = loss * float("nan")
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and on_boundary is not None:
                on_boundary(step)
            engine.step()


def main(argv: list[str] | None = None) -> object:
    """Train (with distmon unless ``--no-distmon``); returns the engine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", type=int, default=9290, help="metrics port (0: any free one)")
    parser.add_argument("--no-distmon", action="store_true", help="the same training, unmonitored")
    args = parser.parse_args(argv)
    engine, optimizer = build(config(args.stage, bf16=args.bf16, accumulation=args.accumulation))
    monitor = (
        contextlib.nullcontext()
        if args.no_distmon
        else distmon.GradMonitor(engine, optimizer, guard="skip", port=args.port)
    )
    with monitor:
        train(engine, args.steps)
    return engine


if __name__ == "__main__":
    main()
