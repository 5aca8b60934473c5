"""Layout parts that one in-process gloo rank can check (fast tier): the first-step check's direct
norm of low-precision DTensor gradients, and the local and reduced reads of parameters the model
reduces itself next to DDP. The 4-rank layouts they serve are in ``test_layouts_moe.py``."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from helpers import close
from torch import nn

import distmon
from distmon.layout.verify import DirectNorm


def test_the_direct_norm_of_bf16_dtensor_gradients_is_float64(one_rank: None) -> None:
    """``get_total_norm`` keeps the gradients' dtype: a bf16 square is ~0.3% off, beyond the
    check's 1e-3, which then refused correct bf16 layouts (and clip_grad_norm_ raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    named = []
    for i in range(3):
        p = nn.Parameter(distribute_tensor(torch.randn(64, 16, dtype=torch.bfloat16), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(64, 16, dtype=torch.bfloat16), mesh, [Shard(0)])
        named.append((f"w{i}", p))
    want = sum(float(p.grad.to_local().double().pow(2).sum()) for _, p in named)
    assert close(DirectNorm(named, declared={}, stage_group=None)(), want, 1e-9)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.experts = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.tanh(self.dense(x)))


def test_parameters_the_model_reduces_are_read_before_and_after_its_reduction(one_rank: None) -> None:
    """Next to DDP, a parameter DDP ignores is reduced by the model's own code after backward (here
    halved, as averaging two equal copies would): its local figure is the gradient backward made,
    its reduced figure the one the optimizer steps with."""
    torch.manual_seed(0)
    net = Net()
    net._ddp_params_and_buffers_to_ignore = ["experts.weight", "experts.bias"]
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    kw = {"serve": "none", "export_every": 1000, "export_interval_s": 0}
    with distmon.GradMonitor(ddp, opt, replicated_over={r"^experts\.": dist.group.WORLD}, **kw) as mon:
        for step in range(3):
            ddp(torch.randn(8, 4)).pow(2).mean().backward()
            local = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in net.experts.parameters()))
            for p in net.experts.parameters():  # the model's own reduction, after backward
                p.grad.mul_(0.5)
            opt.step()
            opt.zero_grad()
            snap = mon.flush()
            layers = list(snap.layer_grad_norms)
            assert close(snap.layer_grad_norms["experts"], local / 2), (step, snap.layer_grad_norms)
            assert close(snap.rank_layer_grad_norms[0][layers.index("experts")], local), step
