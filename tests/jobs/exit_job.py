"""The rank side of tests/test_first_hour.py: a script as a user writes it, under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 tests/jobs/exit_job.py MODE OUT``

- ``forgot``: trains ``STEPS`` steps and ends without ``mon.close()``; rank 0 scrapes its own
  ``/metrics`` from a thread (Prometheus' part), so the exit's linger has someone to wait for;
- ``destroyed``: the same, ending with ``dist.destroy_process_group()`` (as nanoGPT does);
- ``nan``: closes properly; rank 1's gradient of layer ``inp`` is NaN from step ``NAN_STEP``.

References, computed here and never by distmon: the reduced gradient's float64 norm (``p.grad``
before each step) and each rank's local one (tensor hooks on the parameters, before DDP reduces).
Each rank writes ``OUT/ref-rank{r}.json``; rank 0 writes ``OUT/scrapes.txt`` (the last body).
numpy cannot be imported here, as in a fresh environment.
"""

import atexit
import json
import os
import sys
import threading
import time
from collections import OrderedDict

# A script ends; the interpreter then finalizes, where torch 2.13's gloo threads can abort the
# process (tests/ddp_harness.py: leave). Registered first, this runs after distmon's exit handler.
atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))
# A fresh environment has no numpy (the CPU torch build does not bring it): neither may distmon.
sys.modules["numpy"] = None  # type: ignore[assignment]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from helpers import LocalGrads, http_get, reference_norms  # noqa: E402

import distmon  # noqa: E402

STEPS, EXPORT_EVERY, NAN_STEP = 13, 10, 3
mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(OrderedDict(inp=nn.Linear(8, 16), act=nn.Tanh(), out=nn.Linear(16, 4)))
step = 0


def poison(grad):
    bad = mode == "nan" and rank == 1 and step >= NAN_STEP
    return grad * float("nan") if bad else grad


net.inp.weight.register_hook(poison)
local = LocalGrads(net.named_parameters())  # its hooks run after poison
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mon = distmon.GradMonitor(
    model, opt, export_every=EXPORT_EVERY, port=0, log_path=os.path.join(out, "log.jsonl")
)

if rank == 0 and mode != "nan":  # Prometheus' part: scrape every 0.2 s, keep the last body
    url = mon.metrics_url  # None once closed, while the endpoint lingers

    def scrape() -> None:
        while True:
            try:
                body = http_get(url, timeout=2)[2]
                with open(os.path.join(out, "scrapes.tmp"), "w") as f:
                    f.write(body)
                os.replace(
                    os.path.join(out, "scrapes.tmp"), os.path.join(out, "scrapes.txt")
                )  # whole at exit
            except OSError:
                pass
            time.sleep(0.2)

    threading.Thread(target=scrape, daemon=True).start()

refs = {"global": [], "local": []}
g = torch.Generator().manual_seed(rank)
for step in range(1, STEPS + 1):  # noqa: B007 - poison() reads the global step
    x = torch.randn(4, 8, generator=g)
    model(x).pow(2).mean().backward()
    refs["global"].append(reference_norms((n, p.grad) for n, p in net.named_parameters())[0])
    refs["local"].append(reference_norms(local.take().items())[0])
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)

with open(os.path.join(out, f"ref-rank{rank}.json"), "w") as f:
    json.dump(refs, f)
if mode == "nan":
    mon.close()
elif mode == "destroyed":
    dist.destroy_process_group()
# "forgot" and "destroyed": no close(); the script just ends
