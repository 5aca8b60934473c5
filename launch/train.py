#!/usr/bin/env python3
"""distmon demo trainer: a small GPT trained with DDP on self-generated data, monitored by distmon.

Run it::

    torchrun --nproc-per-node 2 launch/train.py              # ~300-step demo, CPU or GPU
    torchrun --nproc-per-node 2 launch/train.py --nan-step 120 --nan-rank 1
    python launch/train.py --nproc 2                          # starts torchrun itself
    python launch/train.py --preset tiny --steps 50           # one process, no torchrun
    python launch/train.py --list-layers                      # layer names for the fault flags

The backend is NCCL when CUDA is available (one GPU per process, from LOCAL_RANK) and
gloo otherwise.  The data is a synthetic second-order Markov token stream (see
``launch/model.py``): every rank learns the same "grammar" from its own shard, so the
loss falls from ln(vocab) towards the grammar's entropy within a few hundred steps.

Fault injection (for trying distmon's detectors and alerts) acts on the *local*
gradient of the chosen rank, before DDP's all-reduce, the way a real fault would:

* ``--nan-step``/``--spike-step`` register a tensor hook (``Parameter.register_hook``)
  on the chosen layer's parameters.  Autograd runs such a hook on the incoming gradient
  before it is accumulated into ``.grad``; DDP's reducer (and distmon's comm hook) see
  the modified local gradient, and the all-reduce spreads it to every rank.
  ``--spike-until U`` keeps the spike on through step U (a sustained explosion).
* ``--corrupt-rank`` scales that rank's loss before ``backward()`` (a bad data shard:
  that rank's whole gradient is off by the factor).
* ``--hang-step`` stops the loop (sleeping) on all ranks, or on ``--hang-rank`` only (its
  peers then wait in that step's all-reduce, as behind a hung or lost machine): the processes
  stay alive and keep answering scrapes, which is what distmon's "training stalled" alert is for.

Step numbers are distmon's: step S is the S-th optimizer step (the first is 1).
``--min-step-s`` makes every step last at least that long (the loop sleeps the rest), so
a fault's step number maps to a predictable time even on a busy machine (end-to-end
tests of the alerts rely on it).

The demo turns on three figures that are off by default (each block's activations, the
update-to-weight ratios and the divergence precursor, with its oscillation rule at the
schedule's peak rate), so that every panel of the dashboard
has data. Monitoring settings not given on the command line come from distmon's defaults and its
``DISTMON_*`` environment variables (``DISTMON_SERVE``, ``DISTMON_PORT``,
``DISTMON_ADDR``, ``DISTMON_RUN_ID``, ``DISTMON_FILE_SD_DIR`` ...).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# The repository's own distmon wins when this file is run from a checkout
# (`torchrun launch/train.py` puts launch/, not the repository root, on sys.path).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_REPO_ROOT, "distmon", "__init__.py")) and _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

try:  # run as a script (launch/ on sys.path) or imported as launch.train
    from model import GPT, GPTConfig, MarkovTokenStream, layer_names, layer_parameters, num_params
except ImportError:  # pragma: no cover - depends on how the module is imported
    from launch.model import GPT, GPTConfig, MarkovTokenStream, layer_names, layer_parameters, num_params

try:  # guarded so that --no-monitor works even where distmon is missing or broken
    import distmon
except Exception as exc:  # noqa: BLE001 - any import failure just disables the monitor
    distmon = None
    _DISTMON_IMPORT_ERROR: Exception | None = exc
else:
    _DISTMON_IMPORT_ERROR = None


# Model/batch sizes per preset; explicit flags override single fields.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1M params: tests and smoke runs.
    "tiny": dict(vocab=128, seq_len=64, d_model=64, n_layers=2, n_heads=2, batch_size=8, lr=3e-3),
    # ~0.8M params: the default demo, a few steps per second on 2 CPU cores.
    "small": dict(vocab=256, seq_len=128, d_model=128, n_layers=4, n_heads=4, batch_size=16, lr=2e-3),
    # ~21M params: closer to a real model's layer mix (use a GPU, or be patient).
    "20m": dict(vocab=4096, seq_len=256, d_model=512, n_layers=6, n_heads=8, batch_size=8, lr=6e-4),
}
DEFAULT_PRESET = "small"
SIZE_FIELDS = ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "batch_size", "lr")


# --------------------------------------------------------------------------- arguments


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where there is none or the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a small GPT with DDP on synthetic data, monitored by distmon.",
        epilog="Run under torchrun, e.g. `torchrun --nproc-per-node 2 launch/train.py`; "
        "plain `python launch/train.py` runs a single process.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps to run")
    g.add_argument("--seed", type=int, default=0, help="seed for the model init and the synthetic grammar")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help="model/batch size preset (tiny ~0.1M, small ~0.8M, 20m ~21M params); "
        "the size flags below override single fields",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per micro-batch per rank (default: from preset)",
    )
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: from preset)")
    g.add_argument("--d-model", type=int, default=None, help="model width (default: from preset)")
    g.add_argument("--n-layers", type=int, default=None, help="transformer blocks (default: from preset)")
    g.add_argument("--n-heads", type=int, default=None, help="attention heads (default: from preset)")
    g.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: from preset)")
    g.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default: from preset)")
    g.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (all but the last under DDP no_sync())",
    )
    g.add_argument("--print-every", type=int, default=10, help="progress line every N steps (rank 0)")
    g.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="throttle: each optimizer step takes at least this many seconds (the loop "
        "sleeps the rest), so a step number maps to a predictable time and CPU use stays low",
    )
    g.add_argument("--list-layers", action="store_true", help="print the model's layer names and exit")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run this many processes under torchrun (a private rendezvous on a free local "
        "port); ignored when already started by torchrun",
    )

    m = p.add_argument_group("monitoring (unset options: distmon defaults / DISTMON_* env)")
    m.add_argument("--no-monitor", action="store_true", help="train without distmon")
    m.add_argument(
        "--export-every",
        type=int,
        default=None,
        help="steps between distmon host exports (default: env DISTMON_EXPORT_EVERY, else 10)",
    )
    m.add_argument(
        "--serve",
        choices=("rank0", "node", "all", "none"),
        default=None,
        help="which ranks serve /metrics (default: env DISTMON_SERVE, else node)",
    )
    m.add_argument(
        "--port",
        type=int,
        default=None,
        help="metrics port, 0 = ephemeral (default: env DISTMON_PORT, else 9290)",
    )
    m.add_argument(
        "--addr",
        default=None,
        help="metrics bind address, 0.0.0.0 for remote scrapes (default: env DISTMON_ADDR, else 127.0.0.1)",
    )
    m.add_argument(
        "--log-path",
        default=None,
        help="JSONL file of snapshots, written by rank 0 (default: env DISTMON_LOG_PATH, else none)",
    )
    m.add_argument(
        "--linger",
        type=float,
        default=None,
        help="seconds to keep serving metrics after training ends (default: env DISTMON_LINGER_S, else 30)",
    )
    m.add_argument(
        "--guard",
        choices=("skip", "raise"),
        default=None,
        help="distmon guard: skip optimizer steps with a non-finite or spiking gradient "
        "(holding the LR schedule back too), or raise; costs one host sync per step",
    )

    f = p.add_argument_group("fault injection (step S = the S-th optimizer step, first is 1)")
    f.add_argument(
        "--nan-step", type=int, default=None, help="put a NaN into a layer's local gradient at step S"
    )
    f.add_argument("--nan-rank", type=int, default=0, help="rank whose gradient gets the NaN")
    f.add_argument(
        "--nan-layer",
        default=None,
        help="layer for the NaN (default: the middle block's mlp.fc1; see --list-layers)",
    )
    f.add_argument(
        "--spike-step", type=int, default=None, help="multiply a layer's gradient by --spike-factor at step S"
    )
    f.add_argument(
        "--spike-until",
        type=int,
        default=None,
        help="last step of the spike: steps --spike-step..U all get it, a sustained explosion "
        "(default: --spike-step only)",
    )
    f.add_argument("--spike-factor", type=float, default=100.0, help="gradient multiplier for --spike-step")
    f.add_argument("--spike-layer", default=None, help="layer to spike (default: the middle block's mlp.fc1)")
    f.add_argument("--spike-rank", type=int, default=None, help="rank to spike (default: all ranks)")
    f.add_argument(
        "--corrupt-rank",
        type=int,
        default=None,
        help="rank with a bad data shard: its loss (hence its gradient) is scaled",
    )
    f.add_argument("--corrupt-scale", type=float, default=10.0, help="loss scale on --corrupt-rank")
    f.add_argument("--corrupt-from", type=int, default=1, help="first step of the corruption")
    f.add_argument(
        "--crash-step",
        type=int,
        default=None,
        help="--crash-rank raises at step S, on the job's first attempt only (torchrun --max-restarts "
        "then restarts every worker, which resume from --checkpoint-dir)",
    )
    f.add_argument("--crash-rank", type=int, default=0, help="rank that fails at --crash-step")
    f.add_argument(
        "--hang-step",
        type=int,
        default=None,
        help="all ranks (or --hang-rank) hang (sleep forever) before step S; metrics keep being served",
    )
    f.add_argument(
        "--hang-rank",
        type=int,
        default=None,
        help="the one rank that hangs at --hang-step; the others wait for it in that step's "
        "all-reduce (default: every rank hangs)",
    )
    c = p.add_argument_group("checkpoints (a job started again with the same directory resumes)")
    c.add_argument(
        "--checkpoint-dir",
        default=None,
        help="every --checkpoint-every steps save the model, optimizer, LR schedule and distmon's state "
        "(mon.state_dict()) here; at start, resume from what it holds",
    )
    c.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse flags and fill the size fields the user left unset from ``--preset``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "d_model",
        "n_layers",
        "n_heads",
        "vocab",
        "grad_accum",
        "print_every",
        "checkpoint_every",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.d_model % args.n_heads:
        parser.error(f"--d-model ({args.d_model}) must be divisible by --n-heads ({args.n_heads})")
    if args.guard and args.no_monitor:
        parser.error("--guard needs the monitor (drop --no-monitor)")
    if args.export_every is not None and args.export_every < 1:
        parser.error("--export-every must be >= 1")
    if not (math.isfinite(args.min_step_s) and args.min_step_s >= 0):
        parser.error("--min-step-s must be a number >= 0")
    if args.spike_until is not None:
        if args.spike_step is None:
            parser.error("--spike-until needs --spike-step")
        if args.spike_until < args.spike_step:
            parser.error(f"--spike-until ({args.spike_until}) must be >= --spike-step ({args.spike_step})")
    if args.hang_rank is not None and args.hang_step is None:
        parser.error("--hang-rank needs --hang-step")
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The :class:`GPTConfig` the flags describe."""
    return GPTConfig(
        vocab=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )


def build_model(args: argparse.Namespace, device: torch.device | str | None = None) -> GPT:
    """Build the GPT described by ``args`` (seeded by ``args.seed``) on ``device``.

    ``device="meta"`` builds it without allocating memory (for checking layer names).
    """
    torch.manual_seed(args.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return GPT(model_config(args))


def default_fault_layer(args: argparse.Namespace) -> str:
    """Default target of --nan-layer/--spike-layer: the middle block's MLP up-projection."""
    return f"blocks.{args.n_layers // 2}.mlp.fc1"


def validate_faults(args: argparse.Namespace, model: nn.Module, world_size: int) -> None:
    """Check the fault-injection flags at startup; exit with a clear message if wrong.

    Fills ``args.nan_layer``/``args.spike_layer`` with the default layer when unset.
    """
    valid = layer_names(model)

    def fail(msg: str) -> None:
        print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    for flag in ("nan", "spike"):
        layer = getattr(args, f"{flag}_layer")
        if layer is None:
            setattr(args, f"{flag}_layer", default_fault_layer(args))
        elif layer not in valid:
            listing = "\n".join(f"  {name}" for name in valid)
            fail(f"unknown layer {layer!r} for --{flag}-layer. Valid layer names:\n{listing}")
    for flag in ("nan_step", "spike_step", "hang_step", "corrupt_from", "crash_step"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1 (steps count from 1)")
    for flag in ("nan_rank", "spike_rank", "corrupt_rank", "crash_rank", "hang_rank"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < world_size:
            fail(f"--{flag.replace('_', '-')} {value} is not a rank of this job (world size {world_size})")
    if not math.isfinite(args.spike_factor) or not math.isfinite(args.corrupt_scale):
        fail("--spike-factor and --corrupt-scale must be finite (use --nan-step for NaNs)")


# --------------------------------------------------------------------------- fault injection


class FaultInjector:
    """Applies the fault-injection flags to this rank's local gradients.

    NaN and spike faults are tensor hooks on the target layer's parameters: autograd
    calls them with the gradient flowing into the parameter *before* it is accumulated
    into ``.grad`` and before DDP's reducer copies it into a bucket, so the fault is in
    this rank's local gradient and reaches the others only through the all-reduce.
    With ``--grad-accum`` the hook acts on every micro-batch of the step, so the step's
    accumulated gradient is NaN, or exactly ``factor`` times what it would have been.
    """

    def __init__(self, model: nn.Module, args: argparse.Namespace, rank: int) -> None:
        self.step = 0  # the optimizer step being computed (1-based), set by the loop
        self.args = args
        self.rank = rank
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.descriptions: list[str] = []
        if args.nan_step is not None:
            self.descriptions.append(
                f"NaN into {args.nan_layer} on rank {args.nan_rank} at step {args.nan_step}"
            )
            if rank == args.nan_rank:
                self._hook(model, args.nan_layer, self._nan_hook)
        if args.spike_step is not None:
            who = "all ranks" if args.spike_rank is None else f"rank {args.spike_rank}"
            until = self.spike_until
            when = (
                f"step {args.spike_step}" if until == args.spike_step else f"steps {args.spike_step}-{until}"
            )
            self.descriptions.append(
                f"gradient x{args.spike_factor:g} in {args.spike_layer} on {who} at {when}"
            )
            if args.spike_rank is None or rank == args.spike_rank:
                self._hook(model, args.spike_layer, self._spike_hook)
        if args.corrupt_rank is not None:
            self.descriptions.append(
                f"rank {args.corrupt_rank}'s loss x{args.corrupt_scale:g} from step {args.corrupt_from} "
                "(bad shard)"
            )
        if args.hang_step is not None:
            who = "all ranks hang" if args.hang_rank is None else f"rank {args.hang_rank} hangs"
            self.descriptions.append(f"{who} before step {args.hang_step}")
        if args.crash_step is not None:
            self.descriptions.append(
                f"rank {args.crash_rank} fails at step {args.crash_step} (first attempt only)"
            )

    def _hook(self, model: nn.Module, layer: str, fn: Any) -> None:
        for _, param in layer_parameters(model, layer):
            self.handles.append(param.register_hook(fn))

    def _nan_hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.step != self.args.nan_step:
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")  # one bad element, as an overflow would leave
        return grad

    @property
    def spike_until(self) -> int | None:
        """Last step of the spike (``--spike-until``, default ``--spike-step``)."""
        a = self.args
        return a.spike_step if a.spike_until is None else a.spike_until

    def _spike_hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self.args.spike_step <= self.step <= self.spike_until:
            return None
        return grad * self.args.spike_factor

    def loss_scale(self) -> float:
        """Factor on this rank's loss for the current step (``--corrupt-*``)."""
        a = self.args
        if a.corrupt_rank == self.rank and self.step >= a.corrupt_from:
            return a.corrupt_scale
        return 1.0

    def should_hang(self) -> bool:
        a = self.args
        return a.hang_step == self.step and a.hang_rank in (None, self.rank)

    def crash(self) -> None:
        """``--crash-step``: this rank fails now, unless torchrun already restarted the job."""
        a = self.args
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.rank == a.crash_rank and self.step == a.crash_step:
            raise RuntimeError(f"--crash-step: rank {self.rank} fails at step {self.step} (injected)")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


# --------------------------------------------------------------------------- distributed setup


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a rendezvous that binds it a few seconds later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out (``bind`` to port 0,
    every outgoing connection's local port) cannot take it in the meantime. A port from the
    ephemeral range can: a rendezvous port drawn with ``bind(0)`` before a multi-node job
    started was taken by one of its hundreds of connections, once in many test runs.

        >>> 1024 <= free_port() < 65536
        True
    """
    high = _ephemeral_floor()
    low = max(1024, high - 16384)
    rng = random.Random()  # its own generator: a script's torch/random seed must not repeat ports
    for _ in range(200 if low < high else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out itself (Linux: ip_local_port_range; elsewhere IANA's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def torchrun_command(
    nproc: int,
    train_args: Sequence[str],
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_conf: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The ``python -m torch.distributed.run`` command that runs this trainer on ``nproc`` processes.

    Without ``rdzv_endpoint``, a private c10d rendezvous on a free local port, so several jobs
    can share a machine.

    Example:
        >>> torchrun_command(2, ["--steps", "5"], rdzv_endpoint="127.0.0.1:1234")[3:7]
        ['--nnodes', '1', '--nproc-per-node', '2']
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint or f"127.0.0.1:{free_port()}",
    ]
    if rdzv_id:
        cmd += ["--rdzv-id", rdzv_id]
    if rdzv_conf:
        cmd += ["--rdzv-conf", rdzv_conf]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + [os.path.abspath(__file__), *train_args]


def init_distributed() -> DistContext:
    """Join the process group torchrun describes; a plain ``python launch/train.py`` joins none.

    NCCL with one GPU per process (``LOCAL_RANK``) when CUDA is available, else gloo. Without
    torchrun the model trains in this one process, without DDP, and distmon measures the
    plain module (its single-process mode).
    """
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return DistContext(0, 0, 1, "none", torch.device("cuda", 0) if cuda else torch.device("cpu"))
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        **({"device_id": device} if backend == "nccl" else {}),
    )
    return DistContext(rank, local_rank, world_size, backend, device)


def shutdown_distributed() -> None:
    """Destroy the process group, avoiding a gloo shutdown deadlock.

    ``train()`` has returned, so the DDP model -- whose C++ Reducer holds a reference
    to the process group -- is unreachable; ``gc.collect()`` frees it (and any
    reference cycles) *while the group is still registered*.  The group's last
    reference then goes away inside ``destroy_process_group()``, whose binding releases
    the GIL while the gloo worker threads are joined.  The other order (group
    destroyed first, DDP freed later) can hang forever on torch 2.13 + gloo: the
    Reducer's destructor joins the worker threads while holding the GIL, and a worker
    still releasing a finished all_reduce of a Python-visible tensor needs the GIL.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- monitor plumbing


def make_monitor(
    args: argparse.Namespace,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any = None,
    world_size: int = 1,
) -> distmon.GradMonitor:
    """``distmon.GradMonitor`` with only the options the user set (None: library default/env).

    On 2+ ranks the gradient noise scale is on, in tokens: this rank's tokens per step.
    """
    if distmon is None:
        raise SystemExit(
            f"train.py: error: distmon is not usable ({_DISTMON_IMPORT_ERROR}); run with --no-monitor"
        )
    options = {
        "export_every": args.export_every,
        "serve": args.serve,
        "port": args.port,
        "addr": args.addr,
        "log_path": args.log_path,
        "linger_s": args.linger,
        "guard": args.guard,
        "lr_scheduler": sched if args.guard else None,
        "batch_size": args.batch_size * args.seq_len * args.grad_accum if world_size > 1 else None,
        "activations": True,  # each transformer block's output, every export_every steps
        "update_ratio": True,  # |update| / |weights| per layer, every export_every steps
        # each attention block's logit bound, and consecutive gradients' cosine against the schedule's
        # peak rate: warned on before the loss diverges
        "precursor": distmon.PrecursorConfig(peak_lr=args.lr),
    }
    return distmon.GradMonitor(model, opt, **{k: v for k, v in options.items() if v is not None})


@dataclass
class AnomalyLog:
    """Anomaly events seen by the trainer, from ``on_anomaly`` callbacks and snapshots."""

    seen: dict[tuple, distmon.AnomalyEvent] = field(default_factory=dict)
    pending: list[distmon.AnomalyEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: distmon.AnomalyEvent, *_: Any) -> None:
        """Record ``event`` once; also the ``on_anomaly`` callback ``fn(event, snapshot)``."""
        key = (event.kind, event.step, event.rank, event.layer)
        with self.lock:
            if key not in self.seen:
                self.seen[key] = event
                self.pending.append(event)

    def add_snapshot(self, snap: distmon.Snapshot) -> None:
        for event in snap.events:
            self.add(event)

    def take_pending(self) -> list[distmon.AnomalyEvent]:
        with self.lock:
            out, self.pending = self.pending, []
        return out


def describe_event(event: distmon.AnomalyEvent) -> str:
    """One readable line for a distmon ``AnomalyEvent``."""
    parts = [f"anomaly {event.kind} at step {event.step}"]
    if event.rank >= 0:  # -1: cluster-wide
        parts.append(f"rank {event.rank}")
    if event.layer:  # "": whole model
        parts.append(f"layer {event.layer}")
    text = f"value {event.value:.4g}"
    if math.isfinite(event.threshold):
        text += f" (threshold {event.threshold:.4g})"
    parts.append(text)
    return "  ".join(parts)


def report_events(events: list[distmon.AnomalyEvent], say: Any, limit: int = 5) -> None:
    """Print up to ``limit`` events, then one line counting the rest by kind."""
    for event in events[:limit]:
        say("  ! " + describe_event(event))
    rest = Counter(e.kind for e in events[limit:])
    if rest:
        say("  ! ... and " + ", ".join(f"{n} more {k}" for k, n in sorted(rest.items())))


# --------------------------------------------------------------------------- training


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (decay on matrices only) with linear warmup then cosine decay to 10%."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, min(20, args.steps // 10))

    def factor(i: int) -> float:  # i = optimizer steps taken so far
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def resume(
    args: argparse.Namespace, model: nn.Module, opt: Any, sched: Any, mon: Any, data: MarkovTokenStream
) -> int:
    """The first step to train: 1, or the step after ``--checkpoint-dir``'s checkpoint, loaded.

    The model, optimizer and LR schedule come back as saved, the monitor counts on from the
    checkpoint's step with what its detectors had learned (``mon.load_state_dict``), and this
    rank's data stream is drawn forward to where it was, so the resumed run sees the same batches.
    """
    path = os.path.join(args.checkpoint_dir, "latest.pt") if args.checkpoint_dir else None
    if path is None or not os.path.exists(path):
        return 1
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    if mon is not None and ckpt.get("distmon"):
        mon.load_state_dict(ckpt["distmon"])
    for _ in range(ckpt["step"] * args.grad_accum):
        data.batch(args.batch_size, args.seq_len)
    return ckpt["step"] + 1


def save_checkpoint(
    args: argparse.Namespace, step: int, model: nn.Module, opt: Any, sched: Any, mon: Any, rank: int
) -> None:
    """Every rank: the monitor's state (its flush is a collective); rank 0 writes ``latest.pt`` atomically."""
    state = mon.state_dict() if mon is not None else None
    if rank != 0:
        return
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    path = os.path.join(args.checkpoint_dir, "latest.pt")
    ckpt = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(ckpt | {"scheduler": sched.state_dict(), "distmon": state}, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint whole


def _fmt_norm(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def train(args: argparse.Namespace, ctx: DistContext) -> dict[str, Any]:
    """Build the model, optimizer, data and monitor; train; print and return a summary."""
    is_main = ctx.rank == 0

    def say(*parts: Any) -> None:
        if is_main:
            print(*parts, flush=True)

    model = build_model(args).to(ctx.device)
    injector = FaultInjector(model, args, ctx.rank)
    distributed = dist.is_initialized()
    ddp = (
        DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
        if distributed
        else model  # one process: the plain module, measured by distmon as it is
    )
    opt, sched = make_optimizer(model, args)
    data = MarkovTokenStream(
        args.vocab, grammar_seed=args.seed, stream_seed=args.seed * 100_003 + ctx.rank + 1
    )

    mon = None if args.no_monitor else make_monitor(args, ddp, opt, sched, ctx.world_size)
    first_step = resume(args, model, opt, sched, mon, data)
    anomalies = AnomalyLog()
    if mon is not None:
        mon.on_anomaly(anomalies.add)
    run_id = mon.run_id if mon is not None else os.environ.get("TORCHELASTIC_RUN_ID", "-")

    n_params = num_params(model)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * ctx.world_size
    say(
        f"distmon demo: world_size {ctx.world_size}  backend {ctx.backend}  device {ctx.device.type}  "
        f"run_id {run_id}"
    )
    say(
        f"model: GPT preset {args.preset}  vocab {args.vocab}  seq_len {args.seq_len}  d_model "
        f"{args.d_model}  "
        f"n_layers {args.n_layers}  n_heads {args.n_heads}  params {n_params / 1e6:.2f}M ({n_params:,})"
    )
    say(
        f"data: synthetic 2nd-order Markov stream, one shard per rank; loss starts near "
        f"{math.log(args.vocab):.2f} (uniform), floor ~{data.entropy:.2f} nats"
    )
    say(
        f"batch: {args.batch_size} seqs x {args.seq_len} tokens x {args.grad_accum} micro-batch(es) x "
        f"{ctx.world_size} rank(s) = {tokens_per_step} tokens/step; {args.steps} steps, lr {args.lr:g}"
    )
    url = mon.metrics_url if mon is not None else None
    if mon is None:
        say("monitor: off (--no-monitor)")
    else:
        say(f"monitor: distmon {distmon.__version__}; metrics " + (url or "not served by rank 0"))
    for line in injector.descriptions:
        say(f"fault injection: {line}")
    if first_step > 1:
        say(f"resumed from {args.checkpoint_dir} at step {first_step - 1}")

    params = [p for p in model.parameters()]
    loss_acc = torch.zeros(2, device=ctx.device, dtype=torch.float64)  # (sum of losses, count)
    first_loss = last_loss = None
    grad_norm: float | None = None
    t0 = t_last = time.perf_counter()
    step_last = step = first_step - 1
    try:
        with mon if mon is not None else contextlib.nullcontext():
            for step in range(first_step, args.steps + 1):
                t_step = time.perf_counter()
                injector.step = step
                injector.crash()
                if injector.should_hang():
                    if args.hang_rank is None:
                        serving = f" and keeps serving {url}" if url else ""
                        say(
                            f"--hang-step {step}: the training loop hangs here on all ranks (sleeping); "
                            f"the process stays up{serving}. Ctrl-C to stop."
                        )
                    else:  # said by the rank that hangs, which need not be rank 0
                        print(
                            f"--hang-step {step}: rank {ctx.rank} hangs here (sleeping), the other ranks "
                            "wait for it in this step's all-reduce; the processes stay up. Ctrl-C to stop.",
                            flush=True,
                        )
                    while True:
                        time.sleep(3600)
                opt.zero_grad(set_to_none=True)
                scale = injector.loss_scale()
                for micro in range(args.grad_accum):
                    x, y = (
                        t.to(ctx.device, non_blocking=True) for t in data.batch(args.batch_size, args.seq_len)
                    )
                    sync = micro == args.grad_accum - 1
                    with contextlib.nullcontext() if sync or not distributed else ddp.no_sync():
                        _, loss = ddp(x, y)
                        (loss * (scale / args.grad_accum)).backward()
                    loss_acc[0] += loss.detach()  # unscaled loss, kept on device
                    loss_acc[1] += 1
                opt.step()
                sched.step()
                if args.checkpoint_dir and step % args.checkpoint_every == 0:
                    save_checkpoint(args, step, model, opt, sched, mon, ctx.rank)

                if step == first_step or step % args.print_every == 0 or step == args.steps:
                    # Same schedule on every rank: the loss all_reduce is a collective.
                    if distributed:
                        dist.all_reduce(loss_acc)
                    last_loss = float(loss_acc[0] / loss_acc[1])
                    loss_acc.zero_()
                    if first_loss is None:
                        first_loss = last_loss
                    now = time.perf_counter()
                    rate = (step - step_last) / max(now - t_last, 1e-9)
                    t_last, step_last = now, step
                    snap = mon.latest() if mon is not None else None
                    if mon is None:  # no monitor: norm of the reduced gradients, here and now
                        grads = [p.grad for p in params if p.grad is not None]
                        grad_norm = float(
                            torch.linalg.vector_norm(
                                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
                            )
                        )
                        norm_txt = _fmt_norm(grad_norm)
                    elif snap is None:
                        norm_txt = "-"
                    else:
                        grad_norm = snap.grad_norm
                        norm_txt = _fmt_norm(grad_norm) + ("" if snap.step == step else f" (@{snap.step})")
                        anomalies.add_snapshot(snap)
                    line = (
                        f"step {step:>{len(str(args.steps))}}/{args.steps}  loss {last_loss:.4f}  "
                        f"grad_norm {norm_txt}  lr {sched.get_last_lr()[0]:.2e}  {rate:.1f} steps/s"
                    )
                    if snap is not None and math.isfinite(snap.gradient_noise_scale):
                        line += f"  noise_scale {snap.gradient_noise_scale:,.0f} tok"
                    if snap is not None and snap.nonfinite:
                        first = snap.first_nonfinite
                        line += "  NONFINITE" + (f" (first: rank {first[0]} {first[1]})" if first else "")
                    if snap is not None and snap.skipped:
                        line += "  (step skipped by guard)"
                    if url:
                        line += f"  metrics {url}"
                    if mon is not None:
                        line += f"  run_id={run_id}"
                    say(line)
                    report_events(anomalies.take_pending(), say)
                if args.min_step_s > 0:  # --min-step-s: sleep the rest of the step's time
                    time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - t_step)))
            elapsed = time.perf_counter() - t0
            if url and mon.config.linger_s:
                say(
                    f"training done; metrics stay up until Prometheus scraped the finish "
                    f"(at most {mon.config.linger_s:g}s; --linger 0 to skip)"
                )
        # The monitor is closed here (its final export is done).
        if mon is not None:
            snap = mon.latest()
            if snap is not None:
                anomalies.add_snapshot(snap)
                grad_norm = snap.grad_norm
        report_events(anomalies.take_pending(), say)
        kinds = Counter(e.kind for e in anomalies.seen.values())
        say(
            f"done: {step} steps in {elapsed:.1f}s ({step / max(elapsed, 1e-9):.1f} steps/s)  "
            f"loss {first_loss:.4f} -> {last_loss:.4f}  final grad_norm {_fmt_norm(grad_norm)}  "
            + (
                "anomalies: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none")
                if mon is not None
                else "monitor off"
            )
        )
        return {
            "steps": step,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "elapsed_s": elapsed,
            "grad_norm": grad_norm,
            "world_size": ctx.world_size,
            "run_id": run_id,
            "anomalies": dict(kinds),
        }
    finally:
        injector.remove()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo; returns a summary dict (identical on all ranks except ``anomalies``)."""
    args = parse_args(argv)
    if args.list_layers:
        for name in layer_names(build_model(args, device="meta")):
            print(name)
        return {}
    # Check the flags against the model's layer names before joining the process group.
    launching = args.nproc is not None and "RANK" not in os.environ
    world_size = args.nproc if launching else int(os.environ.get("WORLD_SIZE", "1"))
    validate_faults(args, build_model(args, device="meta"), world_size)
    if launching:  # become torchrun, with the same flags but --nproc
        given = list(sys.argv[1:] if argv is None else argv)
        rest = [
            a
            for i, a in enumerate(given)
            if not (a == "--nproc" or a.startswith("--nproc=") or (i > 0 and given[i - 1] == "--nproc"))
        ]
        raise SystemExit(subprocess.call(torchrun_command(args.nproc, rest)))

    ctx = init_distributed()
    try:
        return train(args, ctx)
    except BaseException as exc:
        # Drop the finished frames' locals (the DDP model) before shutting down.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if distmon is not None and isinstance(exc, distmon.GradientAnomalyError):  # --guard raise
            print(f"train.py: stopped: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)
        raise
