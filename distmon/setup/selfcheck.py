"""``python -m distmon check``: a one-process self-check of an install, in a few seconds.

It builds a monitor on a small model in this process (no ``torch.distributed``, no endpoint, no
log), trains three steps, and prints the snapshot of the last one: the install imports, hooks,
measures and exports. ``DISTMON_*`` variables are set aside for the check (it builds its own
monitor); one that is set is named, ``DISTMON_DISABLE`` with what it does to your jobs.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys

__all__ = ["run_check"]


def run_check() -> int:
    """Build, train three steps, print the snapshot; 0 when the figures are the expected ones.

    Example:
        >>> run_check()  # doctest: +ELLIPSIS
        distmon ... on torch ... (Python ...): ok
        ...
        0
    """
    import torch

    import distmon

    set_aside = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DISTMON_")}
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        with distmon.GradMonitor(net, opt, serve="none", export_every=1) as mon:
            for _ in range(3):
                net(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            snap = mon.flush()
    finally:
        os.environ.update(set_aside)
    ok = snap is not None and snap.step == 3 and snap.valid and math.isfinite(snap.grad_norm)
    print(
        f"distmon {distmon.__version__} on torch {torch.__version__} (Python {platform.python_version()}): "
        f"{'ok' if ok else 'FAILED'}"
    )
    shown = ("step", "grad_norm", "layer_grad_norms", "valid", "nonfinite", "world_size")
    print(json.dumps({k: getattr(snap, k) for k in shown} if snap is not None else None))
    for name, value in sorted(set_aside.items()):
        said = " (GradMonitor does nothing where it is set)" if name == "DISTMON_DISABLE" else ""
        print(f"note: {name}={value} is set here{said}; the check set it aside", file=sys.stderr)
    return 0 if ok else 1
