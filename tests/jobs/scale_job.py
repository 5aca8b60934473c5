"""The rank side of tests/test_scale.py: a DDP job with distmon at its defaults, under torchrun
agents that stand for nodes.

``python -m torch.distributed.run --nnodes N --nproc-per-node 2 ... tests/jobs/scale_job.py OUT``

Records every collective distmon's exchange issues while the job trains (``torch.distributed``'s
functions wrapped here, called from ``distmon/step/exchange.py``; DDP's own reduction never passes
through them): its name and the bytes of the tensors it is handed and hands back. Each rank
writes ``OUT/rank{r}.json`` with those and its last snapshot's view (the ranks its rows hold).
"""

import atexit
import json
import os
import sys

# the interpreter's finalization can abort on torch's gloo threads (tests/ddp_harness.py: leave)
atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import distmon  # noqa: E402

STEPS = 40  # four exports at the default export_every (10)
out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
mon = distmon.GradMonitor(ddp, opt, port=0, linger_s=0)  # every other option at its default

calls: list[tuple[str, int, int]] = []  # (function, bytes handed over, bytes handed back)
recording = False


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _from_exchange() -> bool:
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(os.path.join("distmon", "exchange.py")):
            return True
        frame = frame.f_back
    return False


def _watch(name: str, collective) -> None:
    def wrapper(*args, **kwargs):
        if recording and _from_exchange():
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "all_reduce":
                calls.append((name, _bytes(tensors[0]), _bytes(tensors[0])))
            else:  # all_gather_single(output, input)
                calls.append((name, _bytes(tensors[1]), _bytes(tensors[0])))
        return collective(*args, **kwargs)

    setattr(dist, name, wrapper)


_watch("all_reduce", dist.all_reduce)
for name in ("all_gather_single", "all_gather_into_tensor"):
    if hasattr(dist, name):
        _watch(name, getattr(dist, name))

g = torch.Generator().manual_seed(1 + rank)
recording = True
for _ in range(STEPS):
    loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
recording = False
snap = mon.flush()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "rank": rank,
            "world": world,
            "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "steps": STEPS,
            "calls": calls,
            "ranks": snap.ranks,
            "node": snap.node,
            "rank_grad_norms": snap.rank_grad_norms,
            "world_size": snap.world_size,
        },
        f,
    )
mon.close()
dist.destroy_process_group()
