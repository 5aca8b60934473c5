"""Per-layer sums of squares taken from DDP buckets, before and after the reduction.

Buckets are rebuilt after DDP's first iteration and ``bucket.index()`` changes meaning, so the
cache of a bucket's layout is keyed by the identity of the parameters it holds. A bucket's
measurement is one fused kernel whose per-parameter sums the caller keeps; :meth:`BucketStats.fold`
turns a whole backward's worth into per-layer sums with two ops, whatever the number of buckets
(small ops are what a step's bookkeeping costs). No host sync, no allocation beyond the fused
kernel's own outputs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import norms
from .grouping import Grouping

__all__ = ["BucketLayout", "BucketStats", "RUN_SLACK"]

# A run may grow to its largest parameter plus this many elements. Fused norms accumulate in
# fp32 along a view (on CPU sequentially: 4e-5 relative error over 1.5M elements, against 5e-8
# for the same bytes in 1,000 pieces), so a run is kept about as short as the parameters it
# holds: a weight keeps its bias, thousands of small tensors become runs of ~64K elements.
RUN_SLACK = 1 << 16


@dataclass
class BucketLayout:
    """How one bucket's flat buffer splits into runs of tracked parameters.

    A run is the parameters of one layer that sit end to end in the buffer (a module's weight
    and bias, say; at most :data:`RUN_SLACK` elements beyond its largest parameter): one view,
    one sum. The fused kernel's cost, and the fold's, grow with the number of views.
    """

    split_sizes: list[int]  # chunks covering the whole flat buffer: runs, untracked parameters, gaps
    pick: Optional[list[int]]  # chunk indices that are runs; None = all chunks
    layer_ids: tuple[int, ...]  # layer of each run
    layers: torch.Tensor  # the same on the device (int64)
    seq: int  # creation order: buckets are folded in this order, whatever order they finish in

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The runs' views of a flat tensor laid out like the bucket (DDP's buffer or a hook's result)."""
        chunks = flat.split(self.split_sizes)
        return list(chunks) if self.pick is None else [chunks[i] for i in self.pick]


@dataclass(frozen=True)
class _FoldPlan:
    """How the run sums of one set of buckets become per-layer sums."""

    order: Optional[list[int]]  # every layer exactly once: the sums in layer order, one stack folds them
    layer_of: torch.Tensor  # otherwise: the layer of each sum, for an index_add
    stage: torch.Tensor  # ...from this scratch


class BucketStats:
    """Bucket layouts of the tracked parameters, and the fused sums of squares of a bucket.

    :meth:`fold` turns the sums of squares of a backward's buckets into a per-layer tensor (the
    tracker's local or reduced layer sums). Parameters that DDP never hands over (ignored by
    DDP) add nothing.

    Example:
        >>> stats = BucketStats(grouping, torch.device("cpu"))           # doctest: +SKIP
        >>> layout, views, _ = stats.layout(bucket)  # in a comm hook     # doctest: +SKIP
        >>> pending = [(layout, norms.sq_sums(views))]                    # doctest: +SKIP
        >>> stats.fold(pending, layer_sq)                                 # doctest: +SKIP
    """

    def __init__(self, grouping: Grouping, device: torch.device) -> None:
        self.device = device
        self.slot_of = {id(p): i for i, p in enumerate(grouping.params)}
        self._param_layer_host = grouping.param_layer
        self.n_layers = len(grouping.layers)
        # position of each layer in backward order (first bucket, first parameter = 0); layers
        # not yet seen in a bucket sort last
        self.layer_order = torch.full((self.n_layers,), float(self.n_layers), device=device)
        self.layer_order_host: list[float] = [float(self.n_layers)] * self.n_layers
        self._param_pos: dict[int, tuple[int, int]] = {}
        self._layouts: dict[tuple[int, ...], BucketLayout] = {}
        self._by_buffer: dict[int, tuple[weakref.ref, BucketLayout, list[torch.Tensor]]] = {}
        # per set of buckets (by seq): their layers end to end, and the stack's scratch
        self._plans: dict[tuple[int, ...], _FoldPlan] = {}
        self._zeros = torch.zeros(self.n_layers, dtype=torch.float32, device=device)

    def layout(self, bucket: dist.GradBucket) -> tuple[BucketLayout, list[torch.Tensor], torch.Tensor]:
        """The bucket's cached layout, its runs' views of the bucket's buffer, and the buffer.

        DDP hands out the same live buffer object every step once its buckets are rebuilt, and
        a buffer's parameters never change while it lives: the entry is keyed by that object
        (a weak reference proves identity) and holds views made once, so a step creates no
        views. The entry is dropped when DDP frees the buffer, so the cached views never keep
        old gradient memory alive. On a miss, layouts are found by parameter identity.
        """
        buffer = bucket.buffer()
        key = id(buffer)
        hit = self._by_buffer.get(key)
        if hit is not None and hit[0]() is buffer:
            return hit[1], hit[2], buffer
        params = bucket.parameters()
        pkey = tuple(map(id, params))
        found = self._layouts.get(pkey)
        if found is None:
            found = self._layouts[pkey] = self._build(bucket, params)
        views = found.views(buffer)
        self._by_buffer[key] = (weakref.ref(buffer, lambda _ref: self._by_buffer.pop(key, None)),
                                found, views)
        return found, views, buffer

    def _build(self, bucket: dist.GradBucket, params: list[torch.Tensor]) -> BucketLayout:
        flat = bucket.buffer()
        base, itemsize = flat.data_ptr(), flat.element_size()
        chunks: list[list[int]] = []  # [size, layer, largest parameter]; layer -1: untracked or gap
        cursor = 0
        for pos, (p, g) in enumerate(zip(params, bucket.gradients())):
            offset = (g.data_ptr() - base) // itemsize
            if offset < cursor:
                raise RuntimeError("distmon: overlapping gradient views in a DDP bucket")
            if offset > cursor:
                chunks.append([offset - cursor, -1, 0])
            slot = self.slot_of.get(id(p))
            layer = -1 if slot is None else self._param_layer_host[slot]
            if slot is not None:
                self._param_pos[slot] = (bucket.index(), pos)
            n = g.numel()
            run = chunks[-1] if chunks else None
            if layer >= 0 and run and run[1] == layer and run[0] + n <= max(run[2], n) + RUN_SLACK:
                run[0] += n  # right after a parameter of the same layer: one run
                run[2] = max(run[2], n)
            else:
                chunks.append([n, layer, n])
            cursor = offset + g.numel()
        if cursor < flat.numel():
            chunks.append([flat.numel() - cursor, -1, 0])
        self._update_layer_order()
        pick = [i for i, (_, layer, _) in enumerate(chunks) if layer >= 0]
        return BucketLayout(
            split_sizes=[size for size, _, _ in chunks],
            pick=None if len(pick) == len(chunks) else pick,
            layer_ids=tuple(chunks[i][1] for i in pick),
            layers=torch.tensor([chunks[i][1] for i in pick], dtype=torch.int64, device=self.device),
            seq=len(self._layouts),
        )

    def _update_layer_order(self) -> None:
        first: dict[int, tuple[int, int]] = {}
        for slot, pos in self._param_pos.items():
            layer = self._param_layer_host[slot]
            if layer not in first or pos < first[layer]:
                first[layer] = pos
        order = sorted(first, key=first.__getitem__)
        values = [float(self.n_layers)] * self.n_layers
        for rank, layer in enumerate(order):
            values[layer] = float(rank)
        self.layer_order_host = values
        self.layer_order.copy_(torch.tensor(values))

    def fold(self, pending: list[tuple[BucketLayout, list[torch.Tensor]]], layer_sq: torch.Tensor) -> None:
        """Write into ``layer_sq`` the per-layer totals of a backward's ``(layout, sums)`` buckets.

        ``pending`` is sorted in place into creation order, so each set of buckets (one before
        DDP's rebuild, one after) has one cached plan whatever order its buckets finished in.
        With the default grouping every layer is usually one run (a module's parameters lie
        end to end in one bucket): then one stack in layer order is the whole fold.
        """
        if not pending:
            layer_sq.zero_()
            return
        if len(pending) > 1:
            pending.sort(key=lambda entry: entry[0].seq)
        key = tuple(layout.seq for layout, _ in pending)
        plan = self._plans.get(key) or self._plan(key, pending)
        sums = [s for _, bucket_sums in pending for s in bucket_sums]
        if plan.order is not None:
            torch.stack([sums[i] for i in plan.order], out=layer_sq)
        else:
            norms.fold_layers(sums, plan.layer_of, plan.stage, self._zeros, layer_sq)

    def _plan(self, key: tuple[int, ...], pending: list[tuple[BucketLayout, list[torch.Tensor]]]) -> _FoldPlan:
        ids = [layer for layout, _ in pending for layer in layout.layer_ids]
        bijective = sorted(ids) == list(range(self.n_layers))
        plan = _FoldPlan(order=sorted(range(len(ids)), key=ids.__getitem__) if bijective else None,
                         layer_of=torch.cat([layout.layers for layout, _ in pending]),
                         stage=torch.zeros(len(ids), device=self.device))
        self._plans[key] = plan
        return plan
