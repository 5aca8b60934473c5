"""What every source of measurements is, and the backward order of layers they report."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
import torch.distributed as dist

__all__ = ["Source", "backward_positions"]


class Source:
    """The protocol every source follows (the package docstring says how the monitor drives it).

    Class attributes hold the defaults a source overrides when they differ: every rank holds
    the whole reduced gradient (``shard_ranks`` None), what is read still carries any loss scale
    (``reads_in_backward``), and the reduction is the ranks' mean (``divide_factor_set`` False).
    """

    module: torch.nn.Module
    group: dist.ProcessGroup | None
    world_size: int
    device: torch.device
    reads_in_backward: bool = True
    shard_ranks: list[int] | None = None
    divide_factor_set: bool = False


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
