"""One rank of a gloo DDP job that ends right after a step through distmon's comm hook.

``python -m torch.distributed.run --nproc-per-node 2 tests/jobs/teardown_job.py [close|exit]``

distmon measures a few steps and is closed; one more step runs through its comm hook (it stays
on the DDP model after ``close()``: DDP's reduction, started by the hook, a Python continuation
on the all-reduce's future). The main thread then keeps the GIL (a switch interval of 1,000 s)
and the script ends with a line in stdout's buffer, written while the interpreter finalizes.
gloo's worker thread has yet to release that step's all-reduce and continuation, each under the
GIL; before issue #39's fix it often did so after the interpreter began to finalize, and Python
ended the thread through a C++ destructor: ``terminate called without an active exception``,
SIGABRT (``tests/test_teardown.py``).

``close`` / ``exit``: the job ends right after ``GradMonitor.close()``, or with the monitor
closed by distmon's exit handler, every thread but the training thread scheduled only when it
is idle (``ddp_harness.gloo_s_threads_last``): gloo's thread drops the exchange's last
collectives late, as on a loaded machine; before the wait for it (``distmon/step/release.py``)
24 and 24 of 30 such rank processes aborted (``benchmarks/exit_aborts.py``).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]
from ddp_harness import gloo_s_threads_last  # noqa: E402

import distmon  # noqa: E402

END = sys.argv[1] if len(sys.argv) > 1 else "step"
dist.init_process_group("gloo")
if END != "step":
    gloo_s_threads_last()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mon = distmon.GradMonitor(model, opt, serve="none", export_every=5 if END == "step" else 4)
for _ in range(6 if END == "step" else 11):
    model(torch.randn(8, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if END == "exit":
    sys.exit(0)  # distmon's exit handler closes the monitor
mon.close()
if END == "close":
    sys.exit(0)
sys.setswitchinterval(1000.0)  # from here the main thread gives the GIL up only when it blocks
model(torch.randn(8, 8)).pow(2).mean().backward()
print(f"rank {dist.get_rank()} ends")  # buffered: written while the interpreter finalizes
