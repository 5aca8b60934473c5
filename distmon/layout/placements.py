"""Where every gradient lives: which part of each parameter's reduced gradient this rank holds,
whether that part counts in the job's figures, and this rank's place in each parallel dimension.

The job's reduced figures must count every distinct shard of every parameter exactly once. A
rank's part of a parameter's reduced gradient is a *replica* along the mesh dimensions where
the parameter is replicated (``Replicate`` placements, DDP's group, HSDP's replicate dimension,
a group the user declares with ``replicated_over=``) and a distinct *shard* along the others
(``Shard`` placements: FSDP's shard dimension, tensor parallelism, experts; pipeline stages hold
disjoint parameters; a group declared with ``distinct_over=``). So a part counts on exactly one
replica: the one at coordinate 0 of every dimension it is replicated over. Each rank adds up the
sums of squares of its counted parts, and one SUM all-reduce over the job gives the exact figures
(:mod:`distmon.step.exchange`). This is the reading of the object passed; the job confirms it at
start-up against the values the ranks hold (:mod:`distmon.layout.census`).

Coordinates name a rank's place for people (per-rank series labels, the rank a NaN began on) and
for the rank-outlier detector, which compares only ranks that hold the same shards: the same
tensor-parallel, pipeline and expert coordinates, a different data-parallel one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..compat import root_mesh, spec_of

if TYPE_CHECKING:  # for annotations only: imported where used
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Coordinates",
    "counts",
    "copy_reason",
    "copy_dimension",
    "part_position",
    "coordinates",
    "spec_of",
    "declared_group",
    "COORD_LABELS",
]

COORD_LABELS = ("dp_rank", "tp_rank", "pp_stage", "ep_rank")


@dataclass(frozen=True)
class Coordinates:
    """A rank's place in the job: its data-parallel rank, tensor-parallel rank, pipeline stage and
    expert-parallel rank (None where the job has no such dimension).

    Example:
        >>> c = Coordinates(dp=1, tp=0, pp=2)
        >>> c.labels(), c.peers()
        ({'dp_rank': '1', 'tp_rank': '0', 'pp_stage': '2', 'ep_rank': ''}, (0, 2, None))
    """

    dp: int = 0
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None

    def labels(self) -> dict[str, str]:
        """The per-rank series labels (bounded: ranks in each dimension; "" where the job has none)."""
        values = (self.dp, self.tp, self.pp, self.ep)
        return {k: "" if v is None else str(v) for k, v in zip(COORD_LABELS, values)}

    def peers(self) -> tuple[int | None, int | None, int | None]:
        """What ranks that hold the same shards share (all but the data-parallel coordinate)."""
        return (self.tp, self.pp, self.ep)


PP_DIMS = ("pp",)  # mesh dimensions whose slices hold different parameters (pipeline stages)


def copy_dimension(meshes: Sequence[object], distinct: Collection[int] = ()) -> str | None:
    """The dimension of the root mesh along which this rank's part is inferred to be a copy, or None.

    The part is taken to be a copy along a dimension of the root mesh that ``meshes`` (a
    parameter's own and its wrapper's) do not span, where this rank is not at coordinate 0 (a
    module left out of tensor parallelism repeats over that dimension, say), pipeline dimensions
    apart (stages hold different parameters). A dimension is spanned when a rank along it from
    this one is in one of ``meshes``, or in ``distinct`` (a ``distinct_over=`` group: its ranks
    hold different parts). The job's reading at start-up (:mod:`distmon.layout.census`) checks the
    inference against the values the ranks hold.
    """
    root = root_mesh(meshes[0])
    if any(m is root for m in meshes):
        return None
    members = {r for m in meshes for r in m.mesh.flatten().tolist()} | set(distinct)
    coord = root.get_coordinate()
    me = dist.get_rank()
    names = root.mesh_dim_names or ()
    for dim in range(root.ndim):
        if dim < len(names) and names[dim] in PP_DIMS:
            continue
        line = root.mesh[tuple(slice(None) if i == dim else c for i, c in enumerate(coord))].tolist()
        spanned = any(r in members for r in line if r != me)
        if not spanned and coord[dim] != 0:
            return names[dim] if dim < len(names) else f"#{dim}"
    return None


def copy_reason(
    param: torch.Tensor,
    *,
    replicated: tuple[int, str] | None = None,
    mesh: DeviceMesh | None = None,
    distinct: Collection[int] = (),
) -> str:
    """Why this rank's part of ``param``'s reduced gradient is a copy counted on another rank, or ""
    where it counts in the job's figures.

    It counts at coordinate 0 of every mesh dimension where the parameter is replicated: its own
    ``Replicate`` placements, the dimensions of the root mesh its mesh (or ``mesh``, the device
    mesh of the wrapper that holds it) does not span (:func:`copy_dimension`; ``distinct``: ranks
    declared to hold different parts), and at rank 0 of the group over which something else
    replicates it (``replicated``: this rank's rank there and the group's description: DDP's
    group, a declared one). ``Partial`` placements are refused: a partial sum's local sum of
    squares says nothing about the whole.

    Example:
        >>> copy_reason(torch.ones(2), replicated=(1, "DDP's process group"))
        "rank 1 of DDP's process group (its rank 0 counts it)"
    """
    spec = spec_of(param)
    if spec is not None and any(placement.is_partial() for placement in spec.placements):
        raise ValueError(
            "distmon: a parameter placed as Partial has no local part whose sum of squares is "
            "its own; distmon measures Shard and Replicate placements: use FSDP2 over the data-parallel "
            "dimension, which turns such gradients whole before the optimizer steps (as torchtitan does)"
        )
    if replicated is not None and replicated[0] != 0:
        return f"rank {replicated[0]} of {replicated[1]} (its rank 0 counts it)"
    meshes = [m for m in (spec.mesh if spec is not None else None, mesh) if m is not None]
    along = copy_dimension(meshes, distinct) if meshes else None
    if along is not None:
        return f"it repeats along mesh dimension {along!r}, which its device mesh does not span"
    if spec is not None:
        names = spec.mesh.mesh_dim_names or ()
        for dim, placement in enumerate(spec.placements):
            if placement.is_replicate() and spec.mesh.get_local_rank(dim) != 0:
                where = names[dim] if dim < len(names) else f"#{dim}"
                return f"its placement is Replicate over mesh dimension {where!r}"
    return ""


def counts(
    param: torch.Tensor,
    *,
    replicated_rank: int | None = None,
    mesh: DeviceMesh | None = None,
    distinct: Collection[int] = (),
) -> bool:
    """Whether this rank's part of ``param``'s reduced gradient counts in the job's figures:
    :func:`copy_reason` finds no reason it is a copy (``replicated_rank``: this rank's rank in a
    group over which something else replicates it).

    Example:
        >>> counts(torch.nn.Parameter(torch.ones(2))), counts(torch.ones(2), replicated_rank=1)
        (True, False)
    """
    replicated = (replicated_rank, "a group") if replicated_rank is not None else None
    return not copy_reason(param, replicated=replicated, mesh=mesh, distinct=distinct)


def part_position(param: torch.Tensor) -> tuple:
    """Where this rank's part of ``param`` sits in the whole: its global shape and, per mesh
    dimension of its placements, the shard it holds (-1 where it is replicated). Ranks that hold
    one position of a parameter hold copies, or different values, of one part; different
    positions are different parts whatever their values.

    Example:
        >>> part_position(torch.ones(2, 3))
        ((2, 3),)
    """
    spec = spec_of(param)
    if spec is None:
        return (tuple(param.shape),)
    # a strided shard (FSDP2 over tensor parallelism) is a shard that is_shard() does not name
    shards = tuple(
        -1 if placement.is_replicate() else spec.mesh.get_local_rank(dim)
        for dim, placement in enumerate(spec.placements)
    )
    return (tuple(spec.shape), tuple(type(p).__name__ for p in spec.placements), shards)


def declared_group(
    name: str, declared: Mapping[str, dist.ProcessGroup]
) -> tuple[str, dist.ProcessGroup] | None:
    """The ``replicated_over=`` entry whose pattern matches parameter ``name`` (first match), or None.

    Example:
        >>> declared_group("experts.0.w1", {r"^experts\\.": "g"})
        ('^experts\\\\.', 'g')
    """
    for pattern, group in declared.items():
        if re.search(pattern, name):
            return pattern, group
    return None


def coordinates(
    params: Sequence[torch.Tensor], *, stage: int | None, dp_rank: int, meshes: Sequence[object] = ()
) -> Coordinates | None:
    """This rank's coordinates in a job of several parallel dimensions (None for data parallelism
    alone: its per-rank series keep their labels). Tensor- and expert-parallel coordinates come
    from the meshes' dimensions named ``tp`` and ``ep`` (the parameters' and their wrappers'),
    the pipeline stage from the stage, the data-parallel rank from the caller.

    Example:
        >>> coordinates([], stage=None, dp_rank=3) is None
        True
    """
    specs = [s for s in map(spec_of, params) if s is not None]
    named = mesh_coordinates([s.mesh for s in specs] + [root_mesh(m) for m in meshes])
    tp, ep = named.get("tp"), named.get("ep")
    if tp is None and ep is None and stage is None:
        return None
    return Coordinates(dp=dp_rank, tp=tp, pp=stage, ep=ep)


def mesh_coordinates(meshes: Sequence[object]) -> dict[str, int]:
    """This rank's coordinate along each named dimension of ``meshes`` (and of their root meshes).

    Example:
        >>> mesh_coordinates([])
        {}
    """
    coords: dict[str, int] = {}
    for m in [m for given in meshes for m in (given, root_mesh(given))]:
        for dim, name in enumerate(m.mesh_dim_names or ()):
            coords.setdefault(name, m.get_local_rank(dim))
    return coords
