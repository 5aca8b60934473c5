#!/usr/bin/env python3
"""What do distmon's forward activation hooks cost a forward pass? Watched against unwatched, interleaved.

    python benchmarks/activation_overhead.py            # 5M GPT of benchmarks/overhead.py, 40 rounds

One process, the same model and batch: each round times one forward with the hooks of
``GradMonitor(model, opt, activations=True, activation_every=1)`` live (every block watched on
every step: the worst case; the default is every ``export_every`` steps) and one with them
off (the same hooks, inactive), in a balanced order (ABBA). Reports the median per-round
difference in ms and as a fraction of the forward.
"""

import argparse
import statistics
import sys
import time

from overheadbench.distmon_internals import activation_watch
from overheadbench.paths import use_checkout
from overheadbench.runner import round_order
from overheadbench.sizes import SIZES

use_checkout()  # this checkout's distmon and launch/model.py


def main(argv=None) -> int:  # noqa: ANN001
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="5M", choices=[s for s in SIZES if s != "2k-tensors"])
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    import torch
    from model import GPT, GPTConfig

    import distmon

    torch.set_num_threads(1)
    shape = dict(SIZES[args.size])
    batch = shape.pop("batch")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = distmon.GradMonitor(model, opt, serve="none", activations=True, activation_every=1)
    watch = activation_watch(mon)  # the benchmark switches the hooks on and off by hand
    x = torch.randint(0, shape["vocab"], (batch, shape["seq_len"]))
    on, off = [], []
    with torch.no_grad():
        for r in range(args.rounds + 2):
            for active in [(False, True)[i] for i in round_order(r, 2)]:
                watch.active = active
                t = time.perf_counter()
                model(x)
                (on if active else off).append(time.perf_counter() - t)
            watch.close_step(torch.empty(watch.columns))  # reset the buffer, as a step's end does
    mon.close()
    on, off = on[2:], off[2:]
    diff = statistics.median(a - b for a, b in zip(on, off)) * 1e3
    base = statistics.median(off) * 1e3
    print(
        f"{args.size} GPT ({len(watch.names)} blocks watched), batch {batch}x{shape['seq_len']}, torch "
        f"{torch.__version__}, 1 thread: forward {base:.1f} ms unwatched; watched +{diff:.2f} ms "
        f"({100 * diff / base:.2f}%), median of {args.rounds} interleaved rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
