"""The first-step check of a layout: distmon's reading of it against a direct, placement-aware norm.

distmon adds up, over the job, the parts of the reduced gradient each rank counts (``layout.py``).
Once, on the first step whose figures are finite and measured on every rank, when the optimizer
step begins, that sum is taken again from the gradients as they are then (each rank's counted
parts, one all-reduce) and computed another way, as torchtitan's ``clip_grad_norm_`` computes
it. Both read the same gradients: a loop that clipped them after distmon measured them in
backward (Lightning's ``gradient_clip_val``, ``torch.nn.utils.clip_grad_norm_``) changes both
alike, not the verdict. The other way: the norm of every DTensor
gradient of this rank's model part from DTensor's own placement rules (``full_tensor()``, one
mesh at a time), plus the plain gradients every rank of the part holds alike, summed over the
pipeline stages; parameters declared ``replicated_over`` a group, whose placement is the very
thing to check, are gathered from every rank as (name, sum of squares, sum) and counted once per
distinct value: copies of one gradient are bitwise equal, distinct gradients are not. A layout
distmon misread (a declaration that does not hold, a wrapper it does not know) shows as a
difference: the figures are then refused (invalid, the error counted and logged), never served.
It costs one host sync and a few collectives, once, on every rank at the same point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import hostinfo
from .layout import declared_group, spec_of

__all__ = ["DirectNorm", "LayoutCheck", "agrees", "refusal"]

TOLERANCE = 1e-3  # fp32 sums in different orders agree far closer; a misread layout far less


def agrees(measured_sq: float, direct_sq: float) -> bool:
    """Whether two sums of squares (or two norms) of the same gradient agree to float32 rounding.

    Example:
        >>> agrees(4.0, 4.000001), agrees(4.0, 8.0)
        (True, False)
    """
    return abs(measured_sq - direct_sq) <= TOLERANCE * max(abs(measured_sq), abs(direct_sq), 1e-30)


class DirectNorm:
    """The job's squared global gradient norm, computed from placements alone (collectives; once).

    ``named``: this rank's tracked parameters and their names; ``declared``: ``replicated_over``;
    ``stage_group``: the pipeline group (one rank of every stage), None without stages.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        declared: dict[str, dist.ProcessGroup],
        stage_group: dist.ProcessGroup | None,
    ) -> None:
        self.named, self.declared, self.stage_group = list(named), declared, stage_group

    def __call__(self) -> float:
        from torch.distributed.tensor import DTensor

        by_mesh: dict[int, list[torch.Tensor]] = {}
        part = torch.zeros((), dtype=torch.float64, device=_device(self.named))
        names: list[str] = []
        stats: list[torch.Tensor] = []  # per declared gradient (sum of squares, sum): copies are equal
        for name, p in self.named:
            g = p.grad
            if g is None:
                continue
            if declared_group(name, self.declared) is not None:
                local = (g.to_local() if isinstance(g, DTensor) else g).double()
                names.append(name)
                stats.append(torch.stack([local.pow(2).sum(), local.sum()]))
                continue
            spec = spec_of(p)
            if not isinstance(g, DTensor) and spec is not None:  # a parameter DDP localized
                g = DTensor.from_local(g, spec.mesh, spec.placements, run_check=False)
            if isinstance(g, DTensor):
                by_mesh.setdefault(id(g.device_mesh), []).append(g)
            else:  # every rank of this model part holds it alike (DDP reduced it)
                part += _sq(g)
        for grads in by_mesh.values():  # torchtitan's way: DTensor's own rules, one mesh at a time
            # get_total_norm, in float64: it keeps the gradients' dtype (a bf16 square: 0.4% off, > TOLERANCE)
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            full = norm.full_tensor() if isinstance(norm, DTensor) else norm
            part += full.to(part) ** 2
        if self.stage_group is not None:
            dist.all_reduce(part, group=self.stage_group)
        shared = 0.0
        if self.declared:  # every rank's declared gradients, each distinct one counted once
            declared = list(zip(names, map(tuple, torch.stack(stats).tolist()))) if stats else []
            everyone: list[list[tuple[str, tuple[float, float]]]] = hostinfo.exchange(declared, dist.group.WORLD)
            shared = sum(sq for _, (sq, _) in {entry for told in everyone for entry in told})
        return float(part) + shared  # the one host sync (and the declared ones' copy above)


class LayoutCheck:
    """The job's squared global norm twice, from the gradients as they are now: as distmon's reading
    of the layout adds it up (each rank's ``counted`` parts, one SUM all-reduce over the job) and
    placement-aware (``direct``). Collectives on every rank, once.
    """

    def __init__(self, direct: DirectNorm, counted: Sequence[bool]) -> None:
        self.direct, self.counted = direct, list(counted)

    def __call__(self) -> tuple[float, float]:
        """(distmon's reading, the placement-aware norm), squared."""
        read = torch.zeros((), dtype=torch.float64, device=_device(self.direct.named))
        for (_, p), counts in zip(self.direct.named, self.counted):
            if counts and p.grad is not None:
                read += _sq(getattr(p.grad, "_local_tensor", p.grad))  # this rank's part
        dist.all_reduce(read)
        return float(read), self.direct()


def _sq(grad: torch.Tensor) -> torch.Tensor:
    """A plain gradient's float64 sum of squares: a sparse one's coalesced values (duplicates
    summed), a complex one's real and imaginary parts."""
    g = grad.coalesce().values() if grad.is_sparse else grad
    return torch.view_as_real(g).double().pow(2).sum() if g.is_complex() else g.double().pow(2).sum()


def _device(named: Sequence[tuple[str, torch.nn.Parameter]]) -> torch.device:
    return next((p.device for _, p in named), torch.device("cpu"))


def refusal(read_sq: float, direct_sq: float) -> str:
    """Why figures are refused after the first-step check found them wrong."""
    ours, direct = math.sqrt(max(read_sq, 0.0)), math.sqrt(max(direct_sq, 0.0))
    return (
        f"distmon: the first-step check of the parallel layout failed: the global norm as distmon "
        f"reads the layout is {ours:.6g}, the placement-aware one {direct:.6g}. "
        "distmon misread where this model's gradients live (a replicated_over= declaration that does "
        "not hold, or a wrapper it does not know): every figure is now reported invalid, none served"
    )
