"""Pure tensor math of the monitor: fused sums of squares, their per-layer fold, the first non-finite layer.

Nothing here knows about DDP, process groups or exporters; every function takes tensors and
returns or writes tensors on the same device, without a host sync.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sq_sums", "fold_layers", "first_nonfinite"]


def sq_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 sum of squares of each tensor, as 0-d tensors (one fused pass over the bytes).

    A sum of squares is non-finite exactly when an element is non-finite (or when the sum
    overflows fp32, i.e. an element above ~1e19: an exploded gradient either way).

    Example:
        >>> [float(s) for s in sq_sums([torch.tensor([3.0, 4.0]), torch.tensor([1.0])])]
        [25.0, 1.0]
    """
    return torch._foreach_powsum(list(tensors), 2, dtype=torch.float32)


def fold_layers(sums: Sequence[torch.Tensor], layer_of: torch.Tensor, stage: torch.Tensor,
                zeros: torch.Tensor, out: torch.Tensor) -> None:
    """Write into ``out`` the per-layer totals of 0-d ``sums`` (``sums[i]`` belongs to layer ``layer_of[i]``).

    Two ops whatever the number of sums: a stack into the preallocated ``stage``, then one
    ``index_add`` from ``zeros`` (shaped like ``out``). ``index_add`` rather than a 0/1 matmul,
    because ``NaN * 0`` would spread one bad parameter's NaN into every layer.

    Example:
        >>> out = torch.empty(2)
        >>> fold_layers([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)],
        ...             torch.tensor([1, 0, 1]), torch.empty(3), torch.zeros(2), out)
        >>> out.tolist()
        [2.0, 5.0]
    """
    torch.stack(list(sums), out=stage)
    torch.index_add(zeros, 0, layer_of, stage, out=out)


def first_nonfinite(layer_sq: torch.Tensor, layer_order: torch.Tensor, out: torch.Tensor) -> None:
    """Write into the 0-d ``out`` the layer index that is non-finite and earliest in ``layer_order``.

    ``layer_order[l]`` is layer l's position in backward order; ``out`` becomes -1 when every
    layer is finite. Done on the device so the answer travels with the step's packed row.

    Example:
        >>> out = torch.empty(())
        >>> first_nonfinite(torch.tensor([1.0, float("nan"), float("inf")]),
        ...                 torch.tensor([0.0, 2.0, 1.0]), out)
        >>> int(out)
        2
    """
    bad = ~torch.isfinite(layer_sq)
    pos, idx = torch.where(bad, layer_order, torch.inf).min(0)
    out.copy_(torch.where(torch.isfinite(pos), idx.to(out.dtype), -1.0))
