"""Forward activation statistics: each watched module's output RMS and max-abs, and where a NaN began.

Forward hooks on the watched modules (``activations=``), live only on activation steps
(every ``activation_every`` steps): each call adds its output's fp32 sum of squares and
element count to a device buffer and keeps the largest absolute value, and the first module
in forward order whose output is non-finite is noted, all with device ops (no host sync).
When the step closes, the buffer becomes the row's activation columns (RMS, max-abs per
module, the first non-finite module) and is reset. The hooks skip calls made inside backward
(activation checkpointing recomputes forwards there: counted once), are excluded from
``torch.compile`` graphs (``torch.compiler.disable``: a graph break at each watched module
on activation steps only matters when compiling), and are removed by ``close()``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from ..compat import graph_task_id
from ..errors import ErrorCounter
from ..layout.grouping import plain_name
from .sums import sq_sums

__all__ = ["ActivationWatch", "select_modules"]

ActivationSpec = bool | Sequence[type | str] | None


def select_modules(model: torch.nn.Module, spec: ActivationSpec) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``activations=`` names, in model order.

    ``True``: each child of the model's first ``ModuleList`` (a transformer's blocks), else each
    top-level child. A list: module types (``nn.TransformerEncoderLayer``) and/or regular
    expressions matched against qualified names (``r"blocks\\.\\d+$"``).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.ReLU()]))
        >>> [name for name, _ in select_modules(net, True)]
        ['1.0']
        >>> [name for name, _ in select_modules(net, [torch.nn.Linear])]
        ['0']
    """
    # the model's own names: wrappers (torch.compile, checkpointing) never rename a module
    named = [(plain_name(name), m) for name, m in model.named_modules() if not _is_wrapper(m)]
    if spec is True:
        for name, m in named:
            if isinstance(m, torch.nn.ModuleList) and len(m):
                return [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(m)]
        return list(model.named_children())
    types = tuple(s for s in spec if isinstance(s, type))
    patterns = [re.compile(s) for s in spec if isinstance(s, str)]

    def watched(name: str, m: torch.nn.Module) -> bool:
        return bool(types) and isinstance(m, types) or any(p.search(name) for p in patterns)

    return [(name, m) for name, m in named if name and watched(name, m)]


def _is_wrapper(m: torch.nn.Module) -> bool:
    """A wrapper module (torch.compile's, a checkpoint's): its wrapped module is watched instead."""
    return type(m).__name__ in ("OptimizedModule", "CheckpointWrapper", "FullyShardedDataParallel")


def validate_activations(spec: object) -> None:
    """Raise ``ValueError``/``TypeError`` for an ``activations=`` value that cannot select modules."""
    if spec is None or isinstance(spec, bool):
        return
    if not isinstance(spec, (list, tuple)) or not spec:
        raise TypeError(
            f"distmon: activations must be True, or a non-empty list of module types and/or name "
            f"patterns, got {spec!r}"
        )
    for s in spec:
        if isinstance(s, str):
            try:
                re.compile(s)
            except re.error as e:
                raise ValueError(
                    f"distmon: activations pattern {s!r} is not a regular expression: {e}; fix the pattern "
                    "(Python's re syntax)"
                ) from e
        elif not (isinstance(s, type) and issubclass(s, torch.nn.Module)):
            raise TypeError(
                f"distmon: activations entries must be nn.Module types or name patterns, got {s!r}"
            )


def _first_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (list, tuple)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


class ActivationWatch:
    """The hooks and the device buffer of the watched modules' output statistics.

    Each step's statistics go to the step row's ``act`` columns (:class:`distmon.step.rows.StepRow`):
    RMS per module, max-abs per module, then the index of the first module (forward order)
    whose output was non-finite (-1 if none). ``active`` is set by the schedule for the steps
    whose forwards are watched.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> watched = select_modules(net, True)
        >>> watch = ActivationWatch(watched, device=torch.device("cpu"), errors=ErrorCounter())
        >>> watch.install(); watch.active = True; _ = net(torch.ones(1, 2))
        >>> out = torch.empty(3); watch.close_step(out); watch.remove(); out[2].item()   # no NaN: -1
        -1.0
    """

    def __init__(
        self, modules: Sequence[tuple[str, torch.nn.Module]], *, device: torch.device, errors: ErrorCounter
    ):
        self.names = [name for name, _ in modules]
        self.modules = [m for _, m in modules]
        self.n = len(modules)
        self.active = False
        self._errors = errors
        f32 = dict(dtype=torch.float32, device=device)
        self._sq = torch.zeros(self.n, **f32)
        self._count = torch.zeros(self.n, **f32)
        self._absmax = torch.zeros(self.n, **f32)
        # the first module whose output was non-finite this step (-1: none); hooks run in forward
        # order, so the first to find it unset is the first in forward order
        self.first_module = torch.full((), -1.0, **f32)
        self.none = torch.full((), -1.0, **f32)  # what a step that was not watched sends
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        for i, m in enumerate(self.modules):
            self._handles.append(m.register_forward_hook(self._hook(i)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int) -> Callable[[torch.nn.Module, object, object], None]:
        @torch.compiler.disable
        def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
            if not self.active or graph_task_id() != -1:
                return  # not an activation step, or a checkpoint's recomputation inside backward
            try:
                out = _first_tensor(output)
                if out is None or not out.is_floating_point():
                    return
                x = out.detach()
                if not x.numel():
                    return
                self._sq[index] += sq_sums([x])[0]  # fp32 accumulation, no fp32 copy of x
                self._count[index] += x.numel()
                lo, hi = torch.aminmax(x)  # one pass, no |x| copy
                peak = torch.maximum(-lo, hi).float()
                bad = ~torch.isfinite(peak)
                self._absmax[index] = torch.maximum(self._absmax[index], torch.where(bad, math.inf, peak))
                first = bad & (self.first_module < 0)
                self.first_module.copy_(torch.where(first, float(index), self.first_module))
            except Exception:
                self._errors.record("activation hook")

        return hook

    def close_step(self, out: torch.Tensor) -> None:
        """Write this step's statistics into ``out`` (``columns`` floats) and reset the buffer."""
        n = self.n
        torch.sqrt(self._sq / self._count, out=out[:n])  # 0/0: NaN for a module not called
        out[n : 2 * n].copy_(torch.where(self._count > 0, self._absmax, math.nan))
        out[2 * n].copy_(self.first_module)
        self.reset()

    def reset(self) -> None:
        """Forget this step's statistics (when written, or in their place when the step failed)."""
        self._sq.zero_()
        self._count.zero_()
        self._absmax.zero_()
        self.first_module.fill_(-1.0)
