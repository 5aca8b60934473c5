"""The first-step check of a layout: distmon's reading of it against the job's norm counted by value.

distmon adds up, over the job, the parts of the reduced gradient each rank counts (``placements.py``,
confirmed at start-up by :mod:`distmon.layout.census`). Once, on the first step whose figures are finite
and measured on every rank, when the optimizer step begins, that sum is taken again from the
gradients as they are then (each rank's counted parts, one all-reduce over the job) and computed
another way that shares none of the reading's assumptions (:class:`JobNorm`): every rank's
gradient parts, whatever it counts, each distinct (parameter, position, value) once over the
whole job (:func:`distmon.layout.census.distinct_sq`): copies of one gradient are bitwise equal,
distinct parts are not. A group, a stage or a copy distmon misread (a declaration that does not
hold, a wrapper it does not know) shows as a difference: the figures are then refused (invalid,
the error counted and logged), never served. Both read the same gradients: a loop that clipped
them after distmon measured them in backward (Lightning's ``gradient_clip_val``,
``torch.nn.utils.clip_grad_norm_``) changes both alike, not the verdict. Every rank computes the
same two numbers (all-reduced) and so the same verdict. It costs one host sync and a few
collectives, once, on every rank at the same point.

:class:`DirectNorm` is the norm as torchtitan's ``clip_grad_norm_`` computes it, placement-aware:
what ``clip_grad_norm_`` checks its figure against, and clips a step distmon could not measure by.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from ..compat import rank_part, spec_of
from .census import digest, distinct_sq
from .placements import declared_group, part_position

__all__ = ["DirectNorm", "JobNorm", "LayoutCheck", "agrees", "refusal"]

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

    ``named``: this rank's tracked parameters and their names; ``declared``: the patterns of
    ``replicated_over=`` and ``distinct_over=`` (their placement is the very thing to check: those
    gradients are counted by value, :func:`distmon.layout.census.distinct_sq`); ``stage_group``: the
    pipeline group (one rank of every stage), None without stages.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        declared: Collection[str],
        stage_group: dist.ProcessGroup | None,
    ) -> None:
        self.named, self.declared, self.stage_group = list(named), dict.fromkeys(declared), stage_group
        self._slots = [digest(name, part_position(p)) for name, p in self.named]

    def __call__(self) -> float:
        from torch.distributed.tensor import DTensor

        by_mesh: dict[int, list[torch.Tensor]] = {}
        part = torch.zeros((), dtype=torch.float64, device=_device(self.named))
        slots: list[int] = []
        parts: list[torch.Tensor] = []  # the declared gradients, this rank's parts: counted by value
        for (name, p), slot in zip(self.named, self._slots):
            g = p.grad
            if g is None:
                continue
            if declared_group(name, self.declared) is not None:
                slots.append(slot)
                parts.append(g.to_local() if isinstance(g, DTensor) else g)
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
        shared = distinct_sq(slots, parts, dist.group.WORLD) if self.declared else 0.0
        return float(part) + shared  # the one host sync (and the declared ones' above)


class JobNorm:
    """The job's squared global norm counted by value: every rank's tracked gradients, whatever it
    counts, each distinct (parameter, position, value) once over ``group`` (collectives; once)."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup) -> None:
        self.params = [p for _, p in named]
        self.group = group
        self._slots = [digest(name, part_position(p)) for name, p in named]

    def __call__(self) -> float:
        grads = [None if p.grad is None else rank_part(p.grad) for p in self.params]
        return distinct_sq(self._slots, grads, self.group)


class LayoutCheck:
    """The job's squared global norm twice, from the gradients as they are now: as distmon's reading
    of the layout adds it up (each rank's ``counted`` parts, one SUM all-reduce over ``group``, the
    job) and counted by value (:class:`JobNorm`). Collectives on every rank, once.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        counted: Sequence[bool],
        group: dist.ProcessGroup,
    ) -> None:
        self.params, self.counted, self.group = [p for _, p in named], list(counted), group
        self.reference = JobNorm(named, group)

    def __call__(self) -> tuple[float, float]:
        """(distmon's reading, the job's norm counted by value), squared."""
        read = torch.zeros((), dtype=torch.float64, device=self.params[0].device if self.params else "cpu")
        for p, counts in zip(self.params, self.counted):
            if counts and p.grad is not None:
                read += _sq(rank_part(p.grad))  # this rank's part
        dist.all_reduce(read, group=self.group)
        return float(read), self.reference()


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
        f"reads the layout is {ours:.6g}, the job's counted by value (every rank's gradients, each "
        f"distinct part once) {direct:.6g}. distmon misread where this model's gradients live: a "
        "replicated_over= or distinct_over= declaration that does not hold (copies declared distinct "
        "count twice, distinct parts declared copies once), or a wrapper it does not know: every "
        "figure is now reported invalid, none served"
    )
