"""The rank side of tests/test_resume.py: a 2-rank DDP job checkpointed with torch.distributed.checkpoint.

``python -m torch.distributed.run --nproc-per-node 2 tests/jobs/resume_job.py MODE OUT``

- ``full``: 70 steps, a checkpoint at step 30 (model, optimizer and the monitor, a ``Stateful``,
  saved together with ``dcp.save``), log ``OUT/full.jsonl``;
- ``killed``: the same into ``OUT/resumed.jsonl`` (checkpoint ``OUT/ckpt-killed``), every rank
  SIGKILLed after step 40: nothing of distmon's gets to run;
- ``resume``: a new job loads ``OUT/ckpt-killed`` (``dcp.load``) into a new model, optimizer and
  monitor and trains steps 31..70, appending to ``OUT/resumed.jsonl``;
- ``resume0``: a new job loads the checkpoint the ``full`` job's rank 0 alone saved at step 27, off
  the export schedule, as nanoGPT saves (``torch.save`` of the model, the optimizer and
  ``mon.state_dict()`` on the master process only; rank 0 also saves, and drops, one at steps 7,
  13 and 20, keeping the one of step 20), and trains steps 28..70 into ``OUT/resumed0.jsonl``.

Every batch is a function of (step, rank) alone, so a resumed run sees the data an uninterrupted
one saw. Step 57's loss is scaled up 1,000x on every rank (after the detectors' 50-step warm-up): a spike.
"""

import os
import signal
import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_harness import leave  # noqa: E402

import distmon  # noqa: E402

STEPS, CKPT_AT, KILL_AT, SPIKE_AT, BATCH = 70, 30, 40, 57, 8
RANK0_AT, RANK0_DROPPED = 27, (7, 13, 20)
mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(
    OrderedDict(inp=nn.Linear(8, 32), act=nn.Tanh(), hid=nn.Linear(32, 32), out=nn.Linear(32, 4))
)
model = DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
log = os.path.join(out, {"full": "full.jsonl", "resume0": "resumed0.jsonl"}.get(mode, "resumed.jsonl"))
mon = distmon.GradMonitor(
    model, opt, export_every=10, serve="none", log_path=log, batch_size=BATCH, linger_s=0
)


class Checkpoint:
    """Model and optimizer as torch.distributed.checkpoint wants them (a Stateful of their own)."""

    def state_dict(self):
        model_sd, opt_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": opt_sd}

    def load_state_dict(self, sd):
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


ckpt = os.path.join(out, "ckpt-full" if mode == "full" else "ckpt-killed")
first = 1
if mode == "resume":
    state = {"app": Checkpoint(), "distmon": mon}
    dcp.load(state, checkpoint_id=ckpt)
    first = mon.step + 1
elif mode == "resume0":
    saved = torch.load(os.path.join(out, f"ckpt-rank0-{RANK0_AT}.pt"), weights_only=False)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    mon.load_state_dict(saved["distmon"])
    first = mon.step + 1

for step in range(first, STEPS + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    loss = (model(x) - y).pow(2).mean() * (1000.0 if step == SPIKE_AT else 1.0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == CKPT_AT and mode in ("full", "killed"):
        dcp.save({"app": Checkpoint(), "distmon": mon}, checkpoint_id=ckpt)
    if mode == "full" and rank == 0 and step in (RANK0_AT, *RANK0_DROPPED):  # nanoGPT's checkpoint
        saved = {"model": net.state_dict(), "optimizer": opt.state_dict(), "distmon": mon.state_dict()}
        if step in (RANK0_AT, 20):
            torch.save(saved, os.path.join(out, f"ckpt-rank0-{step}.pt"))
    if step == KILL_AT and mode == "killed":
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

mon.close()
leave(0)
