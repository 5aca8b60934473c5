"""What every source of measurements is, what it hands its sums to, and the backward order of layers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..compat import compiled_autograd_on, ddp_localized, in_compiled_autograd, queue_callback, uncompiled

logger = logging.getLogger("distmon")

__all__ = [
    "Source",
    "backward_positions",
    "OrderLearner",
    "first_device",
    "uncompiled",
    "compiled_autograd_on",
    "in_compiled_autograd",
    "COMPILED_AUTOGRAD",
]

# Why a model trained with compiled autograd is refused (and a backward under it not measured).
COMPILED_AUTOGRAD = (
    "compiled autograd traces the backward hooks distmon measures gradients in (DDP's comm hook, "
    "which its python_reducer calls once per parameter; FSDP2's reduce-scatters; the gradients' "
    "accumulation hooks): distmon cannot measure them exactly there and will not serve figures it "
    "did not measure. Keep torch.compile for the forward (its figures are exact) and leave "
    "compiled autograd off (torch._dynamo.config.compiled_autograd = False, "
    "torch._dynamo.config.optimize_ddp != 'python_reducer') for a monitored model"
)


class Source(Protocol):
    """Where distmon reads each rank's local and reduced gradients (DDP, FSDP2, one process).

    Built with the :class:`~distmon.step.backward.BackwardSums` it hands its sums to (its
    ``receiver``) and checked by its constructor (which raises for a model
    it cannot measure) before anything is installed; :meth:`install` registers its hooks,
    :meth:`remove` takes them out again. ``group`` is the process group its ranks reduce over
    (None in one process: where the monitor's own collective runs), ``in_parts`` whether each
    rank holds only a part of the reduced gradient (shards, a pipeline stage: the job's figures
    are the sum of every rank's counted parts, :mod:`distmon.layout.placements`), ``local_figures`` whether it
    measures each rank's local gradient (not FSDP2 before torch 2.9), and ``divide_factor_set``
    whether the reduction is not the ranks' mean. Every source reads gradients in backward,
    before any loss scale was divided out or any clipping done.
    """

    module: torch.nn.Module
    group: dist.ProcessGroup | None
    world_size: int
    device: torch.device
    in_parts: bool
    # per tracked parameter (the grouping's order): whether this rank's part of its reduced
    # gradient counts in the job's figures (None: the layout is not in parts, every part does)
    counted: Sequence[bool] | None
    dp_rank: int  # this rank's place among the data-parallel ranks (a label: dp_rank)
    meshes: tuple[object, ...]  # the device meshes its wrappers use (coordinates come from them)
    divide_factor_set: bool
    local_figures: bool
    # whether each parameter's .grad holds its whole reduced gradient on every rank when the
    # optimizer step begins (one process, DDP): what the precursor's oscillation rule reads
    whole_grads: bool

    def install(self) -> None: ...

    def remove(self) -> None: ...

    def read_at_step(self) -> None:
        """Measure gradients that are read when the step's figures are first needed (not in backward)."""
        ...

    def read_pending(self) -> None:
        """Read now what a backward finished outside autograd left to read (a pipeline stage's FSDP)."""
        ...


def first_device(module: torch.nn.Module) -> torch.device:
    """The device of the module's first parameter (the CPU if it has none)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def backward_positions(first_seen: Mapping[int, Hashable], n_layers: int) -> list[float]:
    """Each layer's position in backward order, from the sort key it was first seen with.

    Layers not seen yet sort last (position ``n_layers``).

    Example:
        >>> backward_positions({2: (0, 1), 0: (1, 0)}, 3)
        [1.0, 3.0, 0.0]
    """
    positions = [float(n_layers)] * n_layers
    for rank, layer in enumerate(sorted(first_seen, key=first_seen.__getitem__)):
        positions[layer] = float(rank)
    return positions


class OrderLearner:
    """Learns each layer's position in backward order from the first backward: the order in which
    its parameters' gradients are accumulated (a post-accumulate-grad hook on each), told to
    ``on_order`` when that backward ends; the hooks are then removed, so no step after pays.

    The order of DDP's buckets is no such order: tensor parallelism under DDP re-registers its
    parameters last, and a NaN must be named where backward first met it. Those parameters
    (``_st_info``: DDP rebuilds them as DTensors in a hook before the forward) are accumulated
    when backward ends, whatever their place: their layers are placed by model order instead,
    just after the next layer in model order that backward reached.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> told = []
        >>> learner = OrderLearner(list(net.parameters()), [0, 0, 1, 1], 2, told.append)
        >>> learner.install(); net(torch.ones(1, 2)).sum().backward(); told
        [[1.0, 0.0]]
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layers: Sequence[int],
        n_layers: int,
        on_order: Callable[[list[float]], None],
    ) -> None:
        self._params, self._n_layers, self._on_order = list(params), n_layers, on_order
        self._layer_of = {id(p): layer for p, layer in zip(params, layers)}
        self._late = {layer for p, layer in zip(params, layers) if ddp_localized(p)}
        self._first_seen: dict[int, int] = {}
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        self._handles = [p.register_post_accumulate_grad_hook(self._seen) for p in self._params]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _seen(self, param: torch.Tensor) -> None:
        try:
            if not self._first_seen:
                queue_callback(self._done)
            self._first_seen.setdefault(self._layer_of[id(param)], len(self._first_seen))
        except Exception:  # an order is a nicety: never a failure in the user's backward
            logger.debug("distmon: backward order not learned", exc_info=True)
            self.remove()

    def _done(self) -> None:
        self.remove()
        try:
            self._on_order(self._positions())
        except Exception:
            logger.debug("distmon: backward order not told", exc_info=True)

    def _positions(self) -> list[float]:
        late, n = self._late, self._n_layers
        seen = {layer: i for layer, i in self._first_seen.items() if layer not in late}
        positions = backward_positions(seen, n)
        for layer in late:
            after = next((k for k in range(layer + 1, n) if k in seen), None)
            anchor = positions[after] if after is not None else -1.0
            # between the anchor and the layer backward reaches after it; the nearer, the sooner
            positions[layer] = anchor + 0.5 + ((after if after is not None else n) - layer) / (2 * n + 2)
        return positions
