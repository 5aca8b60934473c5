"""FSDP2 (``fully_shard``, 1-D or HSDP 2-D mesh) as a source of measurements.

Two points, read where FSDP2 itself holds the two gradients:

- **local**: the flat reduce-scatter input of each FSDP unit, before the reduce-scatter.
  distmon wraps the unit's reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``,
  chaining whatever comm was there: the default or the user's own). The input is laid out
  ``(shard world, per-rank chunk)``, each parameter a column range of zero-padded dim-0
  chunks, so a parameter's sum of squares is that of its columns: padding adds nothing.
  A pre-division FSDP applies for fp16 reductions is multiplied back in.
- **reduced**: the sharded ``p.grad`` the optimizer steps with, read when the backward that
  reduce-scattered it ends (an autograd callback queued after FSDP's own): every divide factor
  (``AVG``, ``PREMUL_SUM``, ``set_gradient_divide_factor``), the HSDP all-reduce and any
  accumulation are in it, and no clipping a framework does before the step. Each rank has a
  shard; the per-layer sums of its shard ride the step's one collective, and the reduced
  figures are their sum over the ranks of one shard group (HSDP replicas hold identical
  shards: counted once).

Refused at construction, never measured wrongly: several parameter groups in one unit
(per-parameter meshes via ``shard_placement_fn``), a shard group of one rank on a job of several
(no reduce-scatter to read: use DDP; a world of one is measured as one process), and on torch
2.6-2.8, which has no custom reduce-scatter, the per-rank local figures (:data:`LOCAL_REFUSED`:
the backward's end is then noticed in ``post_backward``; the reduced figures are exact). Units
may shard over different meshes (experts over their own), a mesh may be a slice of the job (a
pipeline stage's ranks, tensor parallelism's data-parallel slice):
which shards count is decided per parameter from its placements (``layout.counts``).
A unit reduce-scatters only the parameters that have a gradient (an unused one is left out):
which ones, distmon notes as FSDP's ``post_backward`` begins, and measures the input laid
out for them. A unit that reduce-scatters on every micro-batch (FSDP2's default under
gradient accumulation) holds no single input with the step's local gradient: that step's
local figures are NaN (``rank_valid`` False), not an error; the reduced ones are exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import FSDPModule

from .. import compat
from ..errors import logger
from ..layout.grouping import Grouping
from ..step.backward import BackwardSums
from ..step.sums import Runs, sq_sums
from .base import COMPILED_AUTOGRAD, backward_positions, in_compiled_autograd
from .grad_sums import GradSums

if TYPE_CHECKING:
    from ..compat import FSDPParamGroup

__all__ = ["FSDPSource", "LOCAL_REFUSED"]

# said at construction on torch 2.6-2.8 (compat.FSDP_LOCAL_FIGURES); %s: torch's version
LOCAL_REFUSED = (
    "distmon: torch %s hands FSDP2's reduce-scatter input to no hook (FSDPModule."
    "set_custom_reduce_scatter, torch >= 2.9), the one place a rank's local gradient is whole: "
    "FSDP2's per-rank local figures are not measured (Snapshot.rank_grad_norms, "
    "rank_layer_grad_norms, rank_valid and rank_outlier_scores are empty; no distmon_rank_grad_norm "
    "or distmon_rank_outlier_score; batch_size= is refused). The global and per-layer figures are exact"
)


@dataclass
class _UnitLayout(Runs):
    """How one unit's reduce-scatter input splits into runs: each rank's chunk, run by run.

    The input is ``shard world`` chunks end to end, each holding every parameter's dim-0 shard
    (zero-padded) in the same order; a run is one layer's adjacent parameters inside a chunk.
    A run's sum of squares over the whole input is the sum of its pieces in every chunk: the
    pieces are contiguous (a strided column view of all chunks at once reads 7x slower on CPU),
    cut by one ``split`` and summed by one fused call; ``layer_ids`` repeats per chunk.
    """

    split_sizes: list[int]  # pieces covering the whole input: runs and untracked parameters
    pick: list[int]  # the pieces that are runs
    per_rank: int  # elements of one rank's chunk


_Comm = compat.fsdp_reduce_scatter_base()  # FSDP2's reduce-scatter comm interface (torch >= 2.9)


class _MeasuringReduceScatter(_Comm):
    """A unit's reduce-scatter comm that measures its input, then calls the inner comm (which allocates)."""

    def __init__(self, inner: _Comm, source: FSDPSource, unit: int) -> None:
        self.inner = inner
        self.source = source
        self.unit = unit

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOp | ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.source.measure_local(self.unit, input_tensor)
        return self.inner(output_tensor, input_tensor, group, op, async_op=async_op)


def _present(pgroup: FSDPParamGroup) -> tuple[bool, ...]:
    """Which of the unit's trainable parameters its next reduce-scatter holds (FSDP's own test).

    As ``FSDPParamGroup.post_backward`` picks them: an accumulated or a fresh unsharded
    gradient, or any trainable parameter when unused ones are reduce-scattered as zeros.
    """
    zeros = getattr(pgroup, "reduce_scatter_unused_params", False)
    return tuple(
        compat.fsdp_param_unsharded(fp)
        and (
            fp.unsharded_accumulated_grad is not None
            or fp.unsharded_param.grad is not None
            or (zeros and fp.unsharded_param.requires_grad)
        )
        for fp in pgroup.fsdp_params
        if fp.sharded_param.requires_grad
    )


class _NotingPostBackward:
    """A unit's ``post_backward`` that first notes which parameters its reduce-scatter will hold."""

    def __init__(self, inner: Callable[..., None], source: FSDPSource, unit: int) -> None:
        self.inner = inner
        self.source = source
        self.unit = unit

    def __call__(self, *args: object, **kwargs: object) -> None:  # FSDP's own arguments, passed on
        self.source.note_present(self.unit)
        return self.inner(*args, **kwargs)


class FSDPSource:
    """Measurements of a model sharded with FSDP2's ``fully_shard``.

    The constructor refuses, naming the way out, what it cannot measure exactly.

    Example:
        >>> source = FSDPSource(model, receiver=sums, grouping=grouping)   # doctest: +SKIP
        >>> source.install(); ...; source.remove()                         # doctest: +SKIP
    """

    in_parts = True  # each rank holds shards: the job's figures are the sum of every rank's counted ones
    whole_grads = False

    def __init__(
        self, model: torch.nn.Module, *, receiver: BackwardSums, grouping: Grouping, counted: Sequence[bool]
    ) -> None:
        self.module, self.counted = model, counted
        self.units: list[tuple[FSDPModule, FSDPParamGroup]] = []
        for name, m in model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            groups = compat.fsdp_param_groups(m)
            if len(groups) > 1:
                raise ValueError(
                    f"distmon: FSDP module {name or '<root>'!r} has {len(groups)} parameter groups "
                    "(shard_placement_fn with per-parameter meshes); distmon measures one group per "
                    "fully_shard call: shard those parameters in a fully_shard call of their own"
                )
            if groups:
                self.units.append((m, groups[0]))
        if not self.units:
            raise ValueError(
                "distmon: no fully_shard module holds parameters in this model: pass the model "
                "fully_shard was applied to"
            )
        # each unit's shard group (units may shard over different meshes: experts over theirs)
        self._shard_world = [compat.fsdp_reduce_scatter_group(g).size() for _, g in self.units]
        if min(self._shard_world) < 2:  # a world of one is measured as one process (source_for)
            raise ValueError(
                "distmon: an FSDP unit's shard group has one rank on a job of several (nothing is "
                "reduce-scattered, so no rank's local gradient can be read): shard over two or more "
                "ranks, or use DistributedDataParallel, which distmon measures where its backward ends"
            )
        # set_gradient_divide_factor: the reduced gradient is no longer the ranks' mean
        self.divide_factor_set = any(compat.fsdp_divide_factor_set(g) for _, g in self.units)
        # torch < 2.9 hands distmon no reduce-scatter input: no per-rank local figures
        self.local_figures = compat.FSDP_LOCAL_FIGURES
        if not self.local_figures:
            logger.warning(LOCAL_REFUSED, torch.__version__)
        self.group = dist.group.WORLD  # the job: every rank adds its counted shards
        self.world_size = dist.get_world_size()
        self.device = self.units[0][1].device
        first = self.units[0][1].mesh_info.mesh
        # the rank's place in its FSDP mesh, row-major over HSDP's (replicate, shard) dimensions
        coordinate = tuple(first.get_coordinate() or [0])
        self.dp_rank = int(torch.arange(first.mesh.numel()).reshape(first.mesh.shape)[coordinate])
        self.meshes = tuple({id(g.mesh_info.mesh): g.mesh_info.mesh for _, g in self.units}.values())
        self.receiver = receiver
        self._seqs = itertools.count()  # the run sets' seq numbers, local and reduced alike
        self._layouts: list[_UnitLayout] = []
        # (unit, present parameters) -> layout, for a reduce-scatter without every parameter
        self._subsets: dict[tuple[int, tuple[bool, ...]], _UnitLayout] = {}
        self._present: dict[int, tuple[bool, ...]] = {}  # per unit, noted as its post_backward began
        self._repeated = False  # a unit reduce-scattered twice this step: no local figures
        self._queued = False  # this backward's end is awaited
        self._pending = False  # ... by read_pending: its post-backward ran outside autograd
        self._told_repeated = False
        self._inner: list[_Comm] = []
        self._post_backward: list[_NotingPostBackward] = []
        self._seen: dict[int, None] = {}  # units reduce-scattered in this step, in that order
        self._order: tuple[int, ...] = ()  # the backward order of the units, as last told to the schedule
        self._grads: GradSums | None = None
        self._pre: dict[tuple[int, torch.dtype], float | None] = {}
        for _, g in self.units:
            if isinstance(vars(g).get("post_backward"), _NotingPostBackward):  # removed at close
                raise RuntimeError(
                    "distmon: this FSDP model is already measured by an open GradMonitor; close() it "
                    "before building another"
                )
        self._slot_of = {id(p): i for i, p in enumerate(grouping.params)}
        self._param_layer = grouping.param_layer
        self._layouts = [self._layout(i) for i in range(len(self.units))]
        # parameters no unit manages (fully_shard(..., ignored_params=...): experts the model's own
        # code reduces after backward) are read by another source, alongside (sources/__init__.py)
        managed = {id(fp.sharded_param) for _, g in self.units for fp in g.fsdp_params}
        self.outside = [p for p in grouping.params if id(p) not in managed]
        # the reduced read: the shards this rank counts (HSDP's other replicas and TP's replicated
        # parameters off coordinate 0 hold copies counted elsewhere)
        kept = [i for i, c in enumerate(counted) if c and id(grouping.params[i]) in managed]
        self._grads = GradSums(
            [grouping.params[i] for i in kept],
            [grouping.param_layer[i] for i in kept],
            self.device,
            seqs=self._seqs,
        )
        self._n_layers = len(grouping.layers)

    def _layout(self, unit: int, present: tuple[bool, ...] | None = None) -> _UnitLayout:
        """The reduce-scatter input's runs, with every trainable parameter or those ``present``."""
        pgroup = self.units[unit][1]
        trainable = [fp for fp in pgroup.fsdp_params if fp.sharded_param.requires_grad]
        columns: list[list[int]] = []  # [start, stop, layer]
        cursor = 0
        for i, fp in enumerate(trainable):
            if present is not None and not present[i]:
                continue  # no gradient this backward: not in the input
            n = fp.padded_sharded_param_size.numel()
            slot = self._slot_of.get(id(fp.sharded_param))
            layer = -1 if slot is None else self._param_layer[slot]
            if columns and columns[-1][2] == layer and columns[-1][1] == cursor:
                columns[-1][1] += n  # adjacent and of the same layer: one view
            else:
                columns.append([cursor, cursor + n, layer])
            cursor += n
        pick = [i for i, c in enumerate(columns) if c[2] >= 0]
        world, n = self._shard_world[unit], len(columns)
        ids = tuple(columns[i][2] for _ in range(world) for i in pick)
        return _UnitLayout(
            layer_ids=ids,
            seq=next(self._seqs),
            device=self.device,
            split_sizes=[b - a for a, b, _ in columns] * world,
            pick=[r * n + i for r in range(world) for i in pick],
            per_rank=cursor,
        )

    def _pre_factor(self, unit: int, reduce_dtype: torch.dtype) -> float | None:
        """FSDP's division of the input before the reduce-scatter (fp16 reductions), as torch computes it."""
        key = (unit, reduce_dtype)
        if key not in self._pre:
            self._pre[key] = compat.fsdp_pre_divide_factor(
                self.units[unit][1], reduce_dtype, self.device.type
            )
        return self._pre[key]

    def install(self) -> None:
        # until a backward shows the order of the units' reduce-scatters: model order
        self.receiver.set_layer_order([float(i) for i in range(self._n_layers)])
        self._inner, self._post_backward = [], []
        for i, (m, g) in enumerate(self.units):
            if self.local_figures:
                inner = compat.fsdp_reduce_scatter_comm(g)
                self._inner.append(inner)
                m.set_custom_reduce_scatter(_MeasuringReduceScatter(inner, self, i))
            # FSDP calls it on the instance (its autograd function, its final callback)
            g.post_backward = _NotingPostBackward(g.post_backward, self, i)
            self._post_backward.append(g.post_backward)

    def remove(self) -> None:
        for (_, g), noting in zip(self.units, self._post_backward):
            if vars(g).get("post_backward") is noting:
                del g.post_backward
        for (m, g), inner in zip(self.units, self._inner):
            comm = compat.fsdp_reduce_scatter_comm(g)
            if isinstance(comm, _MeasuringReduceScatter) and comm.source is self:
                m.set_custom_reduce_scatter(inner)

    def note_present(self, unit: int) -> None:
        """Note which parameters the unit's coming reduce-scatter holds (its post_backward begins).

        Before torch 2.9 there is no reduce-scatter to wrap: a unit that is about to reduce
        starts the backward here instead, and its end reads the shards as it does from 2.9.
        """
        pgroup = self.units[unit][1]
        try:
            present = _present(pgroup)
            if self.local_figures:
                self._present[unit] = present
            elif pgroup.reduce_grads and any(present) and self.receiver.active:
                self._begin_backward()
                self._seen[unit] = None
        except Exception:
            self._present.pop(unit, None)  # unknown: a short input is then not measured
            self.receiver.fail(
                "FSDP post_backward (parameters with gradients)", reduced=not self.local_figures
            )

    def _begin_backward(self) -> None:
        """A unit reduces its gradients: the receiver's backward begins; its end reads the shards."""
        if in_compiled_autograd():
            raise RuntimeError(f"distmon: {COMPILED_AUTOGRAD}")
        self.receiver.begin_backward()
        if not self._queued:
            if compat.graph_task_id() != -1:  # read the shards once the backward assigned them
                compat.queue_callback(self._backward_done)
            else:  # FSDP's post-backward run outside autograd (a pipeline stage's last one)
                self._pending = True
            self._queued = True

    def measure_local(self, unit: int, flat: torch.Tensor) -> None:
        """Sums of squares of one unit's local gradients, from its reduce-scatter input."""
        receiver = self.receiver
        if not receiver.active:
            return
        try:
            self._begin_backward()
            if unit in self._seen:  # reduce-scatter on every micro-batch: see read_at_step
                self._repeated = True
                return
            self._seen[unit] = None
            layout = self._layouts[unit]
            if flat.numel() != layout.per_rank * self._shard_world[unit]:  # some parameters had no gradient
                present = self._present.get(unit)
                layout = self._subsets.get((unit, present)) if present is not None else None
                if layout is None and present is not None:
                    layout = self._subsets[(unit, present)] = self._layout(unit, present)
                if layout is None or flat.numel() != layout.per_rank * self._shard_world[unit]:
                    raise RuntimeError(
                        "distmon: an FSDP unit's reduce-scatter input does not match its parameters "
                        "with gradients: its local figures are not measured (the global ones stay exact); "
                        "report it with your torch version and the unit's fully_shard arguments"
                    )
            if not layout.layer_ids:
                return
            pieces = flat.split(layout.split_sizes)
            sums = sq_sums([pieces[i] for i in layout.pick])
            pre = self._pre_factor(unit, flat.dtype)
            if pre not in (None, 1):
                compat.foreach_mul_(sums, float(pre) ** 2)
            receiver.add_local(layout, sums)
        except Exception:
            receiver.fail("FSDP reduce-scatter (local gradients)", reduced=False)

    def _tell_order(self, units: tuple[int, ...]) -> None:
        """Each layer's position in backward order: its unit's reduce-scatter, then reverse model order."""
        first: dict[int, tuple[int, int]] = {}
        for pos, unit in enumerate(units):
            for layer in self._layouts[unit].layer_ids:
                # inside one unit, later layers first: backward reaches them first
                first.setdefault(layer, (pos, -layer))
        self.receiver.set_layer_order(backward_positions(first, self._n_layers))

    def read_pending(self) -> None:
        """A backward whose reduce-scatters ran outside autograd: read its shards now."""
        if self._pending:
            self._pending = False
            self._backward_done()

    def read_at_step(self) -> None:
        """The step begins: a unit reduce-scattered twice leaves no local figures; learn the order."""
        self.read_pending()
        receiver = self.receiver
        seen, self._seen = tuple(self._seen), {}
        if not self.local_figures:
            receiver.local_unmeasured()  # not a failure: refused at construction
        if self._repeated:
            self._repeated = False
            receiver.local_unmeasured()  # only the first micro-batch was read: not even non-finite
            if not self._told_repeated:
                self._told_repeated = True
                logger.warning(
                    "distmon: FSDP reduce-scatters gradients on every micro-batch: no single "
                    "reduce-scatter input holds a step's local gradient, so per-rank local figures "
                    "are NaN on such steps (the global and per-layer figures stay exact). For them, "
                    "call set_requires_gradient_sync(False) on all micro-batches but the last"
                )
        if seen and seen != self._order:
            self._order = seen
            try:
                self._tell_order(seen)
            except Exception:
                receiver.fail("FSDP backward order", local=False, reduced=False)

    def _backward_done(self) -> None:
        """This rank's shard of the reduced gradient, per layer, once the backward's reduce-scatters
        (and HSDP's all-reduce) assigned it: the gradient the optimizer would step with, before any
        clipping between backward and step."""
        self._queued = False
        receiver = self.receiver
        try:
            read = self._grads.read()  # None: no shard this rank counts has a gradient
            if read is not None:
                receiver.add_reduced(*read)
            receiver.end_backward(scaled=True)  # before scaler.unscale_: in loss-scaled units
        except Exception:
            receiver.fail("FSDP sharded gradients (reduced)", local=False)
