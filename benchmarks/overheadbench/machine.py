"""The machine and software a run measured on, for the report."""

import os
import platform
import subprocess

from .paths import REPO
from .results import Machine


def machine_info(cuda: bool, backend: str, world: int) -> Machine:
    """CPU, cores, torch, Python, backend, ranks, threads, GPU, load, distmon version and git commit."""
    import torch

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = Machine(
        cpu=cpu,
        cores=os.cpu_count(),
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        backend=backend,
        world_size=world,
        threads_per_rank=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if cuda else None,
        load_avg_start=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )
    try:
        import distmon

        info.distmon = distmon.__version__
    except Exception:
        pass
    try:
        info.git = subprocess.run(
            ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        pass
    return info
