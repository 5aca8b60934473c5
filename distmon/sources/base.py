"""What every source of measurements is, what it hands its sums to, and the backward order of layers."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from ..sums import Runs

__all__ = ["Source", "Receiver", "backward_positions", "first_device"]


class Receiver(Protocol):
    """What a source hands its measurements to (:class:`distmon.backward.BackwardSums`).

    Per backward: :meth:`begin_backward`, then any number of :meth:`add_local` and
    :meth:`add_reduced` (one per set of runs: a DDP bucket, an FSDP unit), then
    :meth:`end_backward`. A failure in the source's own code is :meth:`fail`\\ ed (counted,
    logged once; the side it concerns is not measured this step).
    """

    active: bool  # False once the monitor closed: hooks pass through without measuring

    def begin_backward(self) -> None: ...

    def add_local(self, runs: Runs, sums: list[torch.Tensor]) -> None: ...

    def add_reduced(self, runs: Runs, sums: list[torch.Tensor]) -> None: ...

    def end_backward(self, scaled: bool = True, reduced_scaled: bool | None = None) -> None: ...

    def fail(self, site: str, local: bool = True, reduced: bool = True) -> None: ...

    def local_unmeasured(self) -> None: ...

    def set_layer_order(self, positions: list[float]) -> None: ...

    def grads_unscaled(self) -> bool | None: ...


class Source(Protocol):
    """Where distmon reads each rank's local and reduced gradients (DDP, FSDP2, one process).

    Built with its :class:`Receiver` and checked by its constructor (which raises for a model
    it cannot measure) before anything is installed; :meth:`install` registers its hooks,
    :meth:`remove` takes them out again. ``group`` is the process group its ranks reduce over
    (None in one process: where the monitor's own collective runs), ``shard_ranks`` the ranks
    whose shards make up one reduced gradient (a sharded model; None when every rank holds all
    of it), ``reads_in_backward`` whether what it reads still carries a loss scale, and
    ``divide_factor_set`` whether the reduction is not the ranks' mean.
    """

    module: torch.nn.Module
    group: dist.ProcessGroup | None
    world_size: int
    device: torch.device
    reads_in_backward: bool
    shard_ranks: list[int] | None
    divide_factor_set: bool

    def install(self) -> None: ...

    def remove(self) -> None: ...

    def read_at_step(self) -> None:
        """Measure gradients that are read when the step's figures are first needed (not in backward)."""
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
