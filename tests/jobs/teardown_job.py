"""One rank of a gloo DDP job that ends right after a step through distmon's comm hook.

``python -m torch.distributed.run --nproc-per-node 2 tests/jobs/teardown_job.py``

distmon measures a few steps and is closed; one more step runs through its comm hook (it stays
on the DDP model after ``close()``: DDP's reduction, started by the hook, a Python continuation
on the all-reduce's future). The main thread then keeps the GIL (a switch interval of 1,000 s)
and the script ends with a line in stdout's buffer, written while the interpreter finalizes.
gloo's worker thread has yet to release that step's all-reduce and continuation, each under the
GIL; before issue #39's fix it often did so after the interpreter began to finalize, and Python
ended the thread through a C++ destructor: ``terminate called without an active exception``,
SIGABRT (``tests/test_teardown.py``).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import distmon  # noqa: E402

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mon = distmon.GradMonitor(model, opt, serve="none", export_every=5)
for _ in range(6):
    model(torch.randn(8, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
mon.close()
sys.setswitchinterval(1000.0)  # from here the main thread gives the GIL up only when it blocks
model(torch.randn(8, 8)).pow(2).mean().backward()
print(f"rank {dist.get_rank()} ends")  # buffered: written while the interpreter finalizes
