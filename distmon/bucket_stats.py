"""Per-layer sums of squares taken from DDP buckets, before and after the reduction.

Buckets are rebuilt after DDP's first iteration and ``bucket.index()`` changes meaning, so the
cache of a bucket's layout is keyed by the identity of the parameters it holds. Each bucket's
per-parameter sums are added straight into a caller's per-layer device tensor: no host sync,
no allocation beyond the fused kernel's own outputs, nothing left to fold at the step's end.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import norms
from .grouping import Grouping

__all__ = ["BucketLayout", "BucketStats"]


@dataclass
class BucketLayout:
    """How one bucket's flat buffer splits into tracked parameters."""

    split_sizes: list[int]  # chunks covering the whole flat buffer, gaps included
    pick: Optional[list[int]]  # chunk indices that are tracked parameters; None = all chunks
    param_pick: Optional[list[int]]  # indices into bucket.gradients() of tracked ones; None = all
    layers: torch.Tensor  # device int64: layer of each picked chunk
    stage: torch.Tensor  # device fp32 scratch, one value per picked chunk

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat tensor laid out like the bucket (a hook's new result)."""
        chunks = flat.split(self.split_sizes)
        return list(chunks) if self.pick is None else [chunks[i] for i in self.pick]

    def grad_views(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tracked ones among DDP's per-parameter views of the bucket (``bucket.gradients()``)."""
        return grads if self.param_pick is None else [grads[i] for i in self.param_pick]


class BucketStats:
    """Bucket layouts of the tracked parameters, and the fused sums of squares of a bucket.

    :meth:`record` adds the sums of squares of a bucket's parameters into a per-layer tensor
    (the tracker's local or reduced layer sums). Parameters that DDP never hands over (ignored
    by DDP) add nothing.
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

    def layout(self, bucket: dist.GradBucket) -> tuple[BucketLayout, list[torch.Tensor]]:
        """The bucket's cached layout and per-parameter views of its buffer.

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
            return hit[1], hit[2]
        params = bucket.parameters()
        pkey = tuple(map(id, params))
        found = self._layouts.get(pkey)
        if found is None:
            found = self._layouts[pkey] = self._build(bucket, params)
        views = found.grad_views(bucket.gradients())
        self._by_buffer[key] = (weakref.ref(buffer, lambda _ref: self._by_buffer.pop(key, None)),
                                found, views)
        return found, views

    def _build(self, bucket: dist.GradBucket, params: list[torch.Tensor]) -> BucketLayout:
        flat = bucket.buffer()
        base, itemsize = flat.data_ptr(), flat.element_size()
        split_sizes: list[int] = []
        pick: list[int] = []
        param_pick: list[int] = []
        layers: list[int] = []
        cursor = 0
        for pos, (p, g) in enumerate(zip(params, bucket.gradients())):
            offset = (g.data_ptr() - base) // itemsize
            if offset < cursor:
                raise RuntimeError("distmon: overlapping gradient views in a DDP bucket")
            if offset > cursor:
                split_sizes.append(offset - cursor)
            slot = self.slot_of.get(id(p))
            if slot is not None:
                pick.append(len(split_sizes))
                param_pick.append(pos)
                layers.append(self._param_layer_host[slot])
                self._param_pos[slot] = (bucket.index(), pos)
            split_sizes.append(g.numel())
            cursor = offset + g.numel()
        if cursor < flat.numel():
            split_sizes.append(flat.numel() - cursor)
        self._update_layer_order()
        return BucketLayout(
            split_sizes=split_sizes,
            pick=None if pick == list(range(len(split_sizes))) else pick,
            param_pick=None if param_pick == list(range(len(params))) else param_pick,
            layers=torch.tensor(layers, dtype=torch.int64, device=self.device),
            stage=torch.zeros(len(layers), dtype=torch.float32, device=self.device),
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

    def record(self, layout: BucketLayout, views: list[torch.Tensor], layer_sq: torch.Tensor) -> None:
        """Add the sums of squares of a bucket's per-parameter ``views`` into their layers of ``layer_sq``.

        ``index_add_`` rather than a 0/1 matmul, because ``NaN * 0`` would spread one bad
        parameter's NaN into every layer.
        """
        if views:
            norms.sq_norms(views, layout.stage)
            layer_sq.index_add_(0, layout.layers, layout.stage)
