"""The ways of monitoring gradients the benchmark compares, each attached to its own DDP copy."""

import argparse
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from . import distmon_internals
from .measure import SelfTimer, cpu_s
from .results import Health


class Approach:
    """One way of monitoring gradients, attached to its own DDP model copy."""

    name = "?"
    label = "?"
    reports = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.timer = SelfTimer()

    def attach(self, ddp, opt, names: list[str]) -> None:  # noqa: ANN001
        self.ddp, self.opt, self.names = ddp, opt, names
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]

    def after_backward(self) -> None:
        pass

    def state(self) -> Any:
        """What the approach keeps between steps (for the memory column)."""
        return None

    def periodic(self) -> tuple[float, int]:
        """(CPU seconds of one run of the own work done every N steps, N), amortized into own code."""
        return 0.0, 1

    def sample_periodic(self) -> None:
        """Make sure the periodic work was timed at least once (outside the profiler)."""

    def health(self, world: int) -> Health | None:
        """The latest global norm it computed, to check against the others (None: it has none)."""
        return None

    def close(self) -> None:
        pass


class Baseline(Approach):
    name, label = "baseline", "bare DDP (no monitoring)"
    reports = "nothing"


class Distmon(Approach):
    name, label = "distmon", "distmon, defaults"
    reports = (
        "global + per-layer norms (<=128 layers), every rank's local norm and rank x layer matrix, "
        "non-finite (rank, layer), spike/vanishing/outlier detectors; host copy every 10 steps"
    )
    options: dict[str, Any] = {}

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        import distmon

        self.mon = distmon.GradMonitor(ddp, opt, serve="none", **self.options)
        self.export_times: list[float] = []
        self.uninstrumented = distmon_internals.instrument(self.mon, self.timer, self.export_times)
        self.n_layers = len(self.mon.layers)

    def state(self):
        return distmon_internals.kept_state(self.mon)

    def periodic(self) -> tuple[float, int]:
        """(mean CPU seconds of one export, export_every)."""
        mean = statistics.mean(self.export_times) if self.export_times else 0.0
        return mean, self.mon.config.export_every

    def sample_periodic(self) -> None:
        if not self.export_times:  # no export among the steps run so far: time one, of the pending rows
            self.mon.flush()

    def health(self, world: int) -> Health:
        snap = self.mon.flush()
        return Health(
            step=snap.step if snap else None,
            grad_norm=snap.grad_norm if snap else None,
            errors=distmon_internals.error_count(self.mon),
            n_layers=len(snap.layer_grad_norms) if snap else 0,
            nonfinite=snap.nonfinite if snap else None,
        )

    def close(self):
        self.mon.close()


class DistmonOwnReduction(Distmon):
    """distmon's path on NCCL (DDP keeps its own reduction, no comm hook), taken on gloo too."""

    name, label = "distmon-own-reduction", "distmon, defaults, DDP's own reduction (its NCCL path)"

    def attach(self, ddp, opt, names):  # noqa: ANN001
        with distmon_internals.own_reduction():
            super().attach(ddp, opt, names)


class DistmonDetailed(Distmon):
    name, label = "distmon-detailed", "distmon, most detailed"
    reports = (
        "as distmon, with every parameter its own layer (no cap), rank x layer matrix, host copy every step"
    )
    options = dict(export_every=1, rank_layers=True, groups=lambda n, p: n, max_layers=100000)


class DistmonActivations(Distmon):
    name, label = "distmon-activations", "distmon, + activations"
    reports = "as distmon, with forward activation statistics of every block on every step"
    options = dict(activations=True, activation_every=1)


class DistmonTensorBoard(Distmon):
    """distmon's defaults with a TensorBoard tracker (issue #43): rank 0's sink thread writes every
    step's figures to an event file in a temporary directory, removed when the copy closes."""

    name, label = "distmon-tensorboard", "distmon, defaults + TensorBoard tracker"
    reports = (
        "as distmon, and every step's figures (global, per-layer, per-rank, flags, scores) written to "
        "a TensorBoard event file by rank 0, on a thread of its own"
    )

    def attach(self, ddp, opt, names):  # noqa: ANN001
        self.logdir = tempfile.mkdtemp(prefix="distmon-bench-tb-")
        self.options = {"tracker": f"tensorboard:{self.logdir}"}
        super().attach(ddp, opt, names)

    def close(self):
        super().close()
        shutil.rmtree(self.logdir, ignore_errors=True)


class WandbWatch(Approach):
    """``wandb.watch(model, log="gradients")`` as its users run it: on rank 0, where the run is (an
    offline run in a temporary directory), its histograms committed with the step's row."""

    name, label = "wandb-watch", 'wandb.watch(model, log="gradients"), offline run'
    reports = (
        "per-parameter 64-bin histograms of rank 0's local gradients (tensor hooks, before DDP's "
        "reduction) every --hist-freq steps, in W&B's history (offline run)"
    )

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        import torch.distributed as dist

        self.run, self.steps, self.freq = None, 0, self.args.hist_freq
        if dist.get_rank() != 0:
            return
        import wandb

        self.dir = tempfile.mkdtemp(prefix="distmon-bench-wandb-")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="distmon-bench", dir=self.dir, mode="offline")
        self.run.watch(ddp.module, log="gradients", log_freq=self.freq)

    def after_backward(self):
        if self.run is None:
            return
        self.steps += 1
        if self.steps % self.freq == 0:  # the row holding this step's histograms, committed
            t = cpu_s()
            self.run.log({})
            self.timer.add("commit", cpu_s() - t)

    def close(self):
        if self.run is not None:
            self.run.finish()
            shutil.rmtree(self.dir, ignore_errors=True)


class _TensorHooks(Approach):
    """Peers that work through per-parameter ``register_hook`` handles."""

    handles: tuple = ()  # set by attach()

    def close(self):
        for h in self.handles:
            h.remove()


class Tutorial(_TensorHooks):
    name, label = "tutorial", "tutorial: register_hook + grad.norm().item()"
    reports = "per-parameter local norms (host floats, every step)"

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        self.norms: dict[str, float] = {}
        timer = self.timer

        def make(name):  # noqa: ANN001
            def hook(grad):  # noqa: ANN001
                t = cpu_s()
                self.norms[name] = grad.norm().item()
                timer.add("hook", cpu_s() - t)

            return hook

        self.handles = [p.register_hook(make(n)) for n, p in zip(names, self.params)]


class WandbHist(_TensorHooks):
    name, label = "wandb-hist", "wandb.watch-style histograms"
    reports = "per-parameter 64-bin histograms of local gradients (host), every N steps"
    every_step = False

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        freq = 1 if self.every_step else self.args.hist_freq
        self.freq = freq
        self.hists: dict[str, tuple] = {}
        timer = self.timer

        def make(name):  # noqa: ANN001
            count = [0]

            def hook(grad):  # noqa: ANN001  (wandb: log_track_update, then log_tensor_stats)
                t = cpu_s()
                count[0] += 1
                if count[0] >= freq:
                    count[0] = 0
                    flat = grad.detach().reshape(-1)
                    tmin, tmax = flat.min().item(), flat.max().item()
                    hist = flat.histc(bins=64, min=tmin, max=tmax).cpu()
                    self.hists[name] = (hist, tmin, tmax)
                timer.add("hook", cpu_s() - t)

            return hook

        self.handles = [p.register_hook(make(n)) for n, p in zip(names, self.params)]

    def state(self):
        return [h for h, _, _ in self.hists.values()]


class WandbHistEvery(WandbHist):
    name, label = "wandb-hist-1", "wandb.watch-style histograms, every step"
    reports = "per-parameter 64-bin histograms of local gradients (host), every step"
    every_step = True


def _vendored_grad_norm(module, norm_type, group_separator="/"):  # noqa: ANN001
    """Lightning 2.x ``grad_norm``, verbatim algorithm, used only when Lightning is not installed."""
    import torch

    norm_type = float(norm_type)
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": p.grad.data.norm(norm_type)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def lightning_grad_norm() -> tuple[Callable, str]:
    """Lightning's ``grad_norm`` (``lightning`` or ``pytorch_lightning``), else a vendored copy; and which."""
    try:
        import lightning
        from lightning.pytorch.utilities import grad_norm

        return grad_norm, f"lightning {lightning.__version__}"
    except Exception:
        pass
    try:
        import pytorch_lightning
        from pytorch_lightning.utilities import grad_norm

        return grad_norm, f"pytorch_lightning {pytorch_lightning.__version__}"
    except Exception:
        return (
            _vendored_grad_norm,
            "NOT INSTALLED: vendored copy of its grad_norm (pip install pytorch-lightning)",
        )


class Lightning(Approach):
    name, label = "lightning", "Lightning grad_norm"
    reports = "per-parameter norms of reduced gradients + total (device tensors), every step"

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        self.fn, self.source = lightning_grad_norm()
        self.out = {}

    def after_backward(self):
        t = cpu_s()
        self.out = self.fn(self.ddp.module, 2)
        self.timer.add("grad_norm", cpu_s() - t)

    def state(self):
        return list(self.out.values())


class HandWritten(Approach):
    name, label = "hand-written", "hand-written best effort"
    reports = "per-parameter norms of reduced gradients (device), every step"

    def after_backward(self):
        import torch
        import torch.distributed as dist

        t = cpu_s()
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).square_()
        dist.all_reduce(sq)
        self.sq = sq
        self.timer.add("foreach_norm+all_reduce", cpu_s() - t)

    def state(self):
        return getattr(self, "sq", None)

    def health(self, world: int) -> Health | None:
        """The global norm from its all-reduced squares: an independent computation of distmon's."""
        if getattr(self, "sq", None) is None:
            return None
        return Health(grad_norm=math.sqrt(float(self.sq.sum()) / world))


class AllreduceHook(Approach):
    """Reference, not a peer: DDP with torch's own ``allreduce_hook`` as its comm hook (what a
    Python comm hook costs by itself: a Python call and a Python future per bucket, the division
    a pass of its own)."""

    name, label = "allreduce-hook", "DDP's own allreduce_hook (no monitoring)"
    reports = "nothing (a Python comm hook that does DDP's reduction)"

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)


class ClipItem(Approach):
    name, label = "clip-item", "clip_grad_norm_(...).item() every step"
    reports = "the global norm of the reduced gradients (host float, every step: one host sync)"

    def after_backward(self):
        import torch

        t = cpu_s()
        # a bound no gradient reaches: the norm is computed and the (unit) scale applied, nothing clipped
        self.norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm=1e30).item()
        self.timer.add("clip_grad_norm_+item", cpu_s() - t)


class HookRead(Approach):
    """Reference, not a peer: the floor's one fused read, done where distmon reads.

    A comm hook that reads each local bucket once (``_foreach_norm`` over views of it, made
    once per bucket buffer) and then all-reduces it: what a single in-place read costs inside
    the backward pass, with its cache state and its competition for memory, next to the
    floor timed alone after the step.
    """

    name, label = "hook-read", "reference: one read of each local bucket in a comm hook"
    reports = "per-parameter local norms (device), every step: one read of the gradients where distmon reads"

    def attach(self, ddp, opt, names):  # noqa: ANN001
        super().attach(ddp, opt, names)
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        timer = self.timer
        views: dict[tuple[int, int], list] = {}
        self.norms: dict[int, list] = {}

        def hook(state, bucket):  # noqa: ANN001  (no annotations: DDP checks them)
            t = cpu_s()
            key = (bucket.index(), bucket.buffer().data_ptr())
            v = views.get(key)
            if v is None:
                v = views[key] = bucket.gradients()
            self.norms[bucket.index()] = torch._foreach_norm(v)
            timer.add("bucket read", cpu_s() - t)
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)

    def state(self):
        return self.norms


APPROACHES: list[type[Approach]] = [
    Baseline,
    Distmon,
    DistmonOwnReduction,
    DistmonDetailed,
    DistmonActivations,
    DistmonTensorBoard,
    Tutorial,
    WandbHist,
    WandbHistEvery,
    WandbWatch,
    Lightning,
    HandWritten,
    HookRead,
    AllreduceHook,
    ClipItem,
]
# what a run measures unless told (--approaches): the CPU modes' peers, the GPU preset's (issue #35)
# (the trackers' rows need tensorboard and wandb: the `bench` extra; run them with --approaches)
DEFAULT = [
    a.name
    for a in APPROACHES
    if a not in (DistmonOwnReduction, AllreduceHook, ClipItem, DistmonTensorBoard, WandbWatch)
]
GPU = [
    a.name
    for a in (Baseline, Distmon, DistmonDetailed, DistmonActivations, AllreduceHook, HandWritten, ClipItem)
]
LABELS = {a.name: a.label for a in APPROACHES}
REPORTS = {a.name: a.reports for a in APPROACHES}


def label(name: str, hist_freq: int) -> str:
    """An approach's label in the tables.

    Example:
        >>> label("wandb-hist", 100), label("distmon", 100)
        ('wandb.watch-style histograms, every 100 steps', 'distmon, defaults')
    """
    if name == "wandb-hist":
        return f"wandb.watch-style histograms, every {hist_freq} steps"
    if name == "wandb-watch":
        return f'wandb.watch(model, log="gradients"), every {hist_freq} steps, offline run'
    return LABELS.get(name, name)
