"""The CUDA/NCCL path, on a GPU: skipped (not failed) on machines without one, CI included.

The development machines of this project have no GPU, so this module is what a session with
one runs first: figures against a float64 reference on the device, no host sync on ordinary
steps under ``torch.cuda.set_sync_debug_mode("error")`` (distmon's step hooks alone, and whole
DDP training steps: forward, backward, optimizer step, in four settings), a GradScaler on CUDA,
and the demo on one NCCL rank under torchrun. Then ``python benchmarks/overhead.py --gpu``.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import reference_norms

import distmon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()


def reference(net):
    """The float64 norm of the gradients as they are now (helpers.reference_norms)."""
    return reference_norms((n, p.grad) for n, p in net.named_parameters())[0]


def backward(net, opt, scaler, n):
    """An fp16 autocast forward, a scaled backward, unscale_; returns the true gradient norm."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(32, 64, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    return reference(net)


def finish(opt, scaler):
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_single_gpu_figures_with_a_grad_scaler_and_no_host_sync():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    truths = []
    with distmon.GradMonitor(net, opt, scaler=scaler, serve="none", export_every=1000) as mon:
        for n in range(3):
            truths.append(backward(net, opt, scaler, n))
            finish(opt, scaler)
        mon.flush()
        # distmon's own work on these steps must not sync; the test's reference and the
        # scaler's found_inf read do, so only distmon's calls run under the sync check
        tracker = mon._schedule
        for n in range(3, 8):
            truths.append(backward(net, opt, scaler, n))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tracker.before_step()
                tracker.finish_row()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            finish(opt, scaler)
        snap = mon.flush()
    assert snap.step == 8 and snap.valid
    assert abs(snap.grad_norm - truths[-1]) <= 1e-5 * truths[-1], (snap.grad_norm, truths[-1])


def test_one_nccl_rank_under_torchrun_serves_measured_figures():
    proc = subprocess.run(
        [sys.executable, "launch/train.py", "--nproc", "1", "--preset", "tiny", "--steps", "30"]
        + ["--print-every", "10", "--port", "0", "--linger", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend nccl" in proc.stdout and "device cuda" in proc.stdout
    final = re.search(r"final grad_norm ([0-9.]+)", proc.stdout)
    assert final and 0 < float(final.group(1)) < 100, proc.stdout


def test_gpu_uuid_is_nvidia_smi_s():
    from distmon.setup import hostinfo

    info = hostinfo.local_rank_info(None, torch.device("cuda", 0))
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    assert info.gpu_uuid.startswith("GPU-") and info.gpu_uuid in listing, (info.gpu_uuid, listing)


def test_one_rank_nccl_ddp_figures_equal_a_float64_reference():
    import torch.distributed as dist
    from ddp_harness import free_port
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        net = make_net()
        ddp = DDP(net, device_ids=[0])
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        with distmon.GradMonitor(ddp, opt, serve="none", export_every=2) as mon:
            for n in range(6):
                g = torch.Generator(device="cuda").manual_seed(n)
                ddp(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
                true = reference(net)
                opt.step()
                opt.zero_grad()
            snap = mon.flush()
        assert snap.step == 6 and snap.valid and snap.rank_grad_norms[0] == pytest.approx(true, rel=1e-5)
        assert snap.grad_norm == pytest.approx(true, rel=1e-5)
    finally:
        dist.destroy_process_group()


def test_one_rank_nccl_time_rule_vote_reaches_the_host_through_pinned_memory():
    """export_interval_s on NCCL: rank 0's vote goes through the step's all-reduce, a pinned copy
    and an event, read two steps later; snapshots are published by time alone (export_every is
    far away, no flush)."""
    import time

    import torch.distributed as dist
    from ddp_harness import free_port
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        net = make_net()
        ddp = DDP(net, device_ids=[0])
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        with distmon.GradMonitor(ddp, opt, serve="none", export_every=1000, export_interval_s=0.05) as mon:
            for n in range(12):
                g = torch.Generator(device="cuda").manual_seed(n)
                ddp(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.03)
            time.sleep(0.5)  # the publisher thread
            snap = mon.latest()
            assert snap is not None and 6 <= snap.step <= 12, snap and snap.step
            assert snap.valid and snap.monitor_errors == 0
    finally:
        dist.destroy_process_group()


# distmon's settings whose whole DDP steps must never sync the host (issue #35): its defaults
# (DDP's own reduction, no comm hook, on NCCL), its comm hook (a hook of the user's: distmon's
# own reduction wrapped), its most detailed setting (an export every step) and activations
WHOLE_STEP_OPTIONS = {
    "defaults": {},
    "comm hook": {"comm_hook": "ddp_allreduce_hook"},
    "most detailed": {"export_every": 1, "groups": lambda name, p: name, "max_layers": 100000},
    "activations": {"activations": True, "activation_every": 1},
    # the precursor's attention bounds and its oscillation rule (a gradient copy and dot every step)
    "precursor, peak_lr": {"precursor": distmon.PrecursorConfig(peak_lr=1e-4)},
}


@pytest.mark.parametrize("name", list(WHOLE_STEP_OPTIONS))
def test_whole_ddp_steps_never_sync_the_host(name):
    """Forward under bf16 autocast, backward, AdamW step, zero_grad: every step after the warm-up
    (which builds distmon's plans and goes through an export) runs under
    ``set_sync_debug_mode("error")``, export steps included; the figures stay exact."""
    import sys

    import torch.distributed as dist
    from ddp_harness import free_port
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distmon.sources.ddp import ddp_allreduce_hook

    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from model import GPT, GPTConfig

    options = dict(WHOLE_STEP_OPTIONS[name])
    if options.get("comm_hook"):
        options["comm_hook"] = ddp_allreduce_hook
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab=512, seq_len=64, d_model=128, n_layers=3, n_heads=4)).cuda()
        ddp = DDP(net, device_ids=[0], bucket_cap_mb=0.25)  # several buckets
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, 512, (8, 65), device="cuda", generator=g)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = ddp(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with distmon.GradMonitor(ddp, opt, serve="none", **options) as mon:
            hookless = mon._schedule.source.hookless
            assert hookless == (name != "comm hook") and bool(ddp._comm_hooks) == (not hookless)
            for _ in range(12):
                step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(12):
                    step()
                # the last step's gradient, for the reference (outside the checked steps)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = ddp(x[:, :-1], x[:, 1:])
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            true = reference(net)
            opt.step()
            snap = mon.flush()
        assert snap.step == 25 and snap.valid and snap.monitor_errors == 0, snap
        assert snap.grad_norm == pytest.approx(true, rel=1e-5)
        assert snap.rank_grad_norms[0] == pytest.approx(true, rel=1e-5)
    finally:
        dist.destroy_process_group()
