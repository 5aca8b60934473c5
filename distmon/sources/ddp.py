"""DDP as a source of measurements: one comm hook that reads every bucket around the user's hook.

For each bucket the hook reads the *local* gradients before the user's hook runs (the default
reduction scales the buffer in place, and with ``gradient_as_bucket_view=True`` that buffer
is ``p.grad``), calls the user's hook, and reads the *reduced* result in a callback on its
future. Reduced gradients are identical on every rank, so global and per-layer norms need no
collective. The hook issues no collective of its own: the monitor's collective waits for the
optimizer step, when DDP's reduction, and every collective the user's hook started from its
callbacks, is complete.

No ``from __future__ import annotations`` here: DDP inspects the ``bucket`` annotation of a
Python comm hook when it is registered, and a string annotation fails that check.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compat import real_flat, reduced_bucket
from ..grouping import Grouping
from ..sums import Runs, sparse_sq_sum, sq_sums
from .base import OrderLearner, Receiver, first_device

__all__ = [
    "DDPSource",
    "BucketLayout",
    "BucketLayouts",
    "HookSlot",
    "monitor_hook",
    "ddp_allreduce_hook",
    "RUN_SLACK",
    "CommHook",
]

# A DDP comm hook: ``hook(state, bucket) -> Future`` (``state``: whatever its author chose)
CommHook = Callable[[object, dist.GradBucket], torch.futures.Future]

# A run may grow to its largest parameter plus this many elements. Fused norms accumulate in
# fp32 along a view (on CPU sequentially: 4e-5 relative error over 1.5M elements, against 5e-8
# for the same bytes in 1,000 pieces), so a run is kept about as short as the parameters it
# holds: a weight keeps its bias, thousands of small tensors become runs of ~64K elements.
RUN_SLACK = 1 << 16


def ddp_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's own reduction written as a comm hook: scale by 1/size, sum over ``process_group``.

    DDP without a hook multiplies a dense gradient by ``1/size`` as it copies it into the
    bucket (a sparse one it divides), then all-reduces with SUM. torch's ``allreduce_hook``
    divides the dense bucket instead, which differs in the last bit whenever the size is not a
    power of two. distmon wraps this hook by default, so a monitored run's gradients are
    bit-identical to an unmonitored one's, over DDP's own process group.

    Example:
        >>> ddp.register_comm_hook(ddp.process_group, ddp_allreduce_hook)   # doctest: +SKIP
    """
    return _bucket_future(_allreduce(process_group, bucket), bucket.buffer())


def _allreduce(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> dist.Work:
    """:func:`ddp_allreduce_hook`'s arithmetic, its all-reduce started; the work returned."""
    buffer = bucket.buffer()
    if buffer.is_sparse:
        buffer.div_(process_group.size())
    else:
        buffer.mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True)


def _bucket_future(work: dist.Work, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The future a comm hook returns for ``work``, the all-reduce of ``buffer``: the reduced bucket."""
    return work.get_future().then(lambda fut: reduced_bucket(fut.value()[0], buffer))


@dataclass
class BucketLayout(Runs):
    """How one bucket's flat buffer splits into runs of tracked parameters.

    A run is the parameters of one layer that sit end to end in the buffer (a module's weight
    and bias, say; at most :data:`RUN_SLACK` elements beyond its largest parameter): one view,
    one sum. The fused kernel's cost, and the fold's, grow with the number of views. A sparse
    bucket (one ``nn.Embedding(sparse=True)`` weight, say) has no views: its gradient is
    measured as a whole.
    """

    split_sizes: list[int]  # chunks covering the whole flat buffer: runs, untracked parameters, gaps
    pick: list[int] | None  # chunk indices that are runs; None = all chunks
    sparse: bool = False
    # the runs whose reduced part this rank counts (None: all, every rank holds the whole reduced
    # gradient of a DDP model that is the whole job), as a run set of their own
    counted: Runs | None = None
    counted_pick: list[int] | None = None  # indices into the runs' views

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The runs' views of a flat tensor laid out like the bucket (DDP's buffer or a hook's result)."""
        chunks = real_flat(flat).split(self.split_sizes)
        return list(chunks) if self.pick is None else [chunks[i] for i in self.pick]

    def measure(self, flat: torch.Tensor, views: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Sums of squares of the runs of ``flat`` (``views`` of it when already made)."""
        if self.sparse:
            return [sparse_sq_sum(flat)]
        return sq_sums(views if views is not None else self.views(flat))

    def measure_counted(
        self, flat: torch.Tensor, views: list[torch.Tensor] | None = None
    ) -> tuple[Runs, list[torch.Tensor]] | None:
        """The counted runs and their sums of squares (the reduced side's share); None if none count."""
        if self.counted is None or self.counted_pick is None:
            return self, self.measure(flat, views)
        if not self.counted_pick:
            return None
        views = views if views is not None else self.views(flat)
        return self.counted, sq_sums([views[i] for i in self.counted_pick])


class BucketLayouts:
    """The layouts of DDP's buckets, cached.

    DDP hands out the same live buffer object every step once its buckets are rebuilt, and a
    buffer's parameters never change while it lives: a layout and its views of the buffer are
    cached against that object, so a step creates no views. A cached view keeps its buffer's
    memory alive, so an entry whose buffer was not handed to the hook in the latest backward
    (DDP's first-iteration buckets, once it has rebuilt them) is dropped at that backward's
    end: old gradient memory is never pinned. Buckets are rebuilt after DDP's first iteration
    and ``bucket.index()`` changes meaning, so on a miss the layout is found by the identity of
    the bucket's parameters.

    Example:
        >>> layouts = BucketLayouts(grouping, torch.device("cpu"))   # doctest: +SKIP
        >>> layout, views, buffer = layouts.layout(bucket)  # in a comm hook  # doctest: +SKIP
    """

    def __init__(
        self,
        grouping: Grouping,
        device: torch.device,
        counted: Sequence[bool] | None = None,
    ) -> None:
        self.device = device
        self.counted = counted  # per tracked slot: its reduced part counts here (None: all do)
        self._seqs = itertools.count()
        self.slot_of = {id(p): i for i, p in enumerate(grouping.params)}
        self.param_layer = grouping.param_layer
        self._layouts: dict[tuple[int, ...], BucketLayout] = {}
        self._by_buffer: dict[int, tuple[torch.Tensor, BucketLayout, list[torch.Tensor]]] = {}
        self._seen: set[int] = set()  # buffers handed over in this backward

    @property
    def cached_buffers(self) -> int:
        """How many bucket buffers have cached views (those of the latest backward)."""
        return len(self._by_buffer)

    def layout(self, bucket: dist.GradBucket) -> tuple[BucketLayout, list[torch.Tensor] | None, torch.Tensor]:
        """The bucket's layout, its runs' views of the bucket's buffer (None if sparse), and the buffer."""
        buffer = bucket.buffer()
        key = id(buffer)
        self._seen.add(key)
        hit = self._by_buffer.get(key)
        if hit is not None and hit[0] is buffer:
            return hit[1], hit[2], buffer
        params = bucket.parameters()
        pkey = tuple(map(id, params))
        found = self._layouts.get(pkey)
        if found is None:
            found = self._layouts[pkey] = self._build(bucket, params)
        if found.sparse:  # a new sparse tensor every backward: nothing to cache
            return found, None, buffer
        views = found.views(buffer)
        self._by_buffer[key] = (buffer, found, views)
        return found, views, buffer

    def end_backward(self) -> None:
        """Drop the cached views of buffers this backward did not use (DDP has let them go)."""
        for key in self._by_buffer.keys() - self._seen:
            del self._by_buffer[key]
        self._seen.clear()

    def _build(self, bucket: dist.GradBucket, params: list[torch.Tensor]) -> BucketLayout:
        flat = bucket.buffer()
        if flat.is_sparse:  # DDP gives every sparse gradient a bucket of its own
            slots = [self.slot_of.get(id(p)) for p in params]
            ids = tuple(self.param_layer[s] for s in slots if s is not None)
            counts = self.counted is None or all(self.counted[s] for s in slots if s is not None)
            return BucketLayout(
                layer_ids=ids,
                layers=torch.tensor(ids, dtype=torch.int64, device=self.device),
                seq=next(self._seqs),
                split_sizes=[],
                pick=None,
                sparse=True,
                counted=None if counts else Runs((), torch.zeros(0, dtype=torch.int64), seq=next(self._seqs)),
                counted_pick=None if counts else [],
            )
        flat = real_flat(flat)  # a complex bucket (torch < 2.10) in real elements, as the views are
        base, itemsize = flat.data_ptr(), flat.element_size()
        # [size, layer, largest parameter, counted]; layer -1: untracked or gap
        chunks: list[list[int]] = []
        cursor = 0
        for p, g in zip(params, bucket.gradients()):
            offset = (g.data_ptr() - base) // itemsize
            if offset < cursor:
                raise RuntimeError("distmon: overlapping gradient views in a DDP bucket")
            if offset > cursor:
                chunks.append([offset - cursor, -1, 0, 0])
            slot = self.slot_of.get(id(p))
            layer = -1 if slot is None else self.param_layer[slot]
            count = 1 if slot is None or self.counted is None or self.counted[slot] else 0
            # a complex parameter lies in the (real) buffer as its real view: twice its numel
            n = p.numel() * (2 if p.is_complex() else 1)
            run = chunks[-1] if chunks else None
            if (
                layer >= 0
                and run
                and run[1] == layer
                and run[3] == count
                and run[0] + n <= max(run[2], n) + RUN_SLACK
            ):
                run[0] += n  # right after a parameter of the same layer: one run
                run[2] = max(run[2], n)
            else:
                chunks.append([n, layer, n, count])
            cursor = offset + n
        if cursor < flat.numel():
            chunks.append([flat.numel() - cursor, -1, 0, 0])
        pick = [i for i, c in enumerate(chunks) if c[1] >= 0]
        ids = [chunks[i][1] for i in pick]
        counted_pick = [k for k, i in enumerate(pick) if chunks[i][3]]
        counted = None
        if len(counted_pick) < len(pick):  # some runs are copies counted on another rank
            counted_ids = tuple(ids[k] for k in counted_pick)
            counted = Runs(
                counted_ids,
                torch.tensor(counted_ids, dtype=torch.int64, device=self.device),
                seq=next(self._seqs),
            )
        return BucketLayout(
            layer_ids=tuple(ids),
            layers=torch.tensor(ids, dtype=torch.int64, device=self.device),
            seq=next(self._seqs),
            split_sizes=[c[0] for c in chunks],
            pick=None if len(pick) == len(chunks) else pick,
            counted=counted,
            counted_pick=counted_pick if counted is not None else None,
        )


class HookSlot:
    """What distmon registers with a DDP model, once: the source measuring now and the hook it wraps.

    DDP accepts one comm hook per model and cannot remove it. When a monitor closes, its
    source leaves the slot (the wrapper then only calls the user's hook); a new monitor on the
    same model takes the slot over instead of registering a second hook.
    """

    __slots__ = ("source", "inner_hook", "inner_state", "profiled")

    def __init__(self, source: "DDPSource | None", inner_hook: CommHook, inner_state: object) -> None:
        self.source = source
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.profiled: list[dist.Work] = []  # this backward's all-reduces issued under torch.profiler

    def start(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Call the inner hook; DDP's own reduction issued under ``torch.profiler`` is completed
        (``Work.wait()``) before the backward returns.

        gloo marks a work's future complete (what DDP waits for) before it ends the work's
        profiler event on its worker thread: a profiler window the training loop closes right
        after ``backward()`` is then torn down while that thread still writes into it, a heap
        corruption that kills the process later (torch 2.13; a pipeline job with DDP stages and
        windows closing after the schedule's step: the soak test crashed ~5 runs out of 5).
        ``Work.wait()`` returns only once the work has ended its event.
        """
        if self.inner_hook is ddp_allreduce_hook and torch._C._autograd._profiler_enabled():
            try:
                if not self.profiled:  # the first of this backward: complete them all when it ends
                    torch.autograd.Variable._execution_engine.queue_callback(self.wait_profiled)
            except RuntimeError:  # not inside a backward: DDP's reduction as it is
                pass
            else:
                work = _allreduce(self.inner_state, bucket)
                self.profiled.append(work)
                return _bucket_future(work, bucket.buffer())
        return self.inner_hook(self.inner_state, bucket)

    def wait_profiled(self) -> None:
        """Complete the all-reduces :meth:`start` issued under the profiler (when a backward ends)."""
        works, self.profiled = self.profiled, []
        for work in works:
            work.wait()


def monitor_hook(slot: HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Measure the local bucket, run the user's hook, measure its reduced result.

    Every monitor failure is caught inside the source; the user's hook, its process group and
    its result are never altered.

    Example:
        >>> ddp.register_comm_hook(HookSlot(source, ddp_allreduce_hook, ddp.process_group),
        ...                        monitor_hook)                                 # doctest: +SKIP
    """
    source = slot.source
    measure_reduced = source.measure_local(bucket) if source is not None else None
    fut = slot.start(bucket)
    return fut if measure_reduced is None else fut.then(measure_reduced)


def _registered_slot(model: DistributedDataParallel) -> HookSlot | None:
    """distmon's slot on ``model``, None if it has no comm hook; raise if it has someone else's."""
    hooks = getattr(model, "_comm_hooks", [])
    if not hooks:
        return None
    hook, state = hooks[0]
    if hook is monitor_hook and isinstance(state, HookSlot):
        if state.source is not None:
            raise RuntimeError(
                "distmon: this DDP model is already measured by an open GradMonitor; "
                "close() it before building another"
            )
        return state
    raise RuntimeError(
        f"distmon: the DDP model already has a comm hook ({getattr(hook, '__qualname__', hook)}, registered "
        "by you, or by DDP(mixed_precision=...)); DDP accepts one. Pass your hook as "
        "GradMonitor(..., comm_hook=hook, comm_state=state) and distmon wraps it."
    )


class DDPSource:
    """Measurements of a ``DistributedDataParallel`` model, taken in its comm hook.

    The constructor checks that the model's comm hook can be wrapped (raises for someone
    else's hook or an open monitor); :meth:`install` registers the hook, or takes over the slot
    a closed monitor left on the model; :meth:`remove` leaves the slot.

    Example:
        >>> source = DDPSource(ddp, receiver=sums, grouping=grouping)   # doctest: +SKIP
        >>> source.install(); ...; source.remove()                      # doctest: +SKIP
    """

    divide_factor_set = False
    local_figures = True

    def __init__(
        self,
        model: DistributedDataParallel,
        *,
        receiver: Receiver,
        grouping: Grouping,
        comm_hook: CommHook | None = None,
        comm_state: object = None,
        counted: Sequence[bool] | None = None,
    ) -> None:
        self.model = model
        self.module = model.module
        # counted: DDP is one dimension of a larger job (tensor parallelism, a pipeline stage):
        # every rank adds the parts it counts, over the job's default group; else the job is
        # DDP's group, on whose every rank the reduced gradient is whole
        self.partial, self.counted = counted is not None, counted
        self.group: dist.ProcessGroup = dist.group.WORLD if self.partial else model.process_group
        self.world_size = self.group.size()
        self.device = first_device(model.module)
        self.receiver = receiver
        self._existing = _registered_slot(model)  # raises for someone else's hook or an open monitor
        # No hook given: DDP's own arithmetic, over DDP's own group (not WORLD: a DDP replica on
        # a subgroup must stay one). A hook given is called exactly as the user wrote it.
        self.inner_hook = comm_hook or ddp_allreduce_hook
        self.inner_state = comm_state if comm_hook is not None else model.process_group
        self.layouts = BucketLayouts(grouping, self.device, counted)
        # the layers' backward order, from the gradients' accumulation in the first backward
        self._order = OrderLearner(
            grouping.params, grouping.param_layer, len(grouping.layers), receiver.set_layer_order
        )
        self.dp_rank = model.process_group.rank()
        mesh = getattr(model, "device_mesh", None)
        self.meshes = (mesh,) if mesh is not None else ()

    def install(self) -> None:
        self._order.install()
        slot = self._existing
        if slot is None:
            self.model.register_comm_hook(HookSlot(self, self.inner_hook, self.inner_state), monitor_hook)
        else:
            slot.inner_hook, slot.inner_state, slot.source = self.inner_hook, self.inner_state, self

    def remove(self) -> None:
        self._order.remove()
        hooks = getattr(self.model, "_comm_hooks", [])
        if hooks and isinstance(hooks[0][1], HookSlot) and hooks[0][1].source is self:
            hooks[0][1].source = None

    def read_at_step(self) -> None:
        """Nothing: DDP's buckets were measured in backward."""

    def read_pending(self) -> None:
        """Nothing: DDP's buckets were measured in backward."""

    def measure_local(self, bucket: dist.GradBucket) -> Callable[[torch.futures.Future], object] | None:
        """Measure the bucket's local gradients; returns the callback that measures the reduced ones.

        None when inactive, on failure or for a bucket with nothing tracked (the hook then passes
        the user's future through).
        """
        receiver = self.receiver
        if not receiver.active:
            return None
        try:
            receiver.begin_backward()
            layout, views, buffer = self.layouts.layout(bucket)
            if not layout.layer_ids:
                return None  # no tracked parameter in this bucket: nothing to measure either side
            receiver.add_local(layout, layout.measure(buffer, views))
            return self._reduced_side(layout, views, buffer)
        except Exception:
            receiver.fail("comm hook (local gradients)")
            return None
        finally:
            try:  # whatever failed above, nothing reaches the backward
                if bucket.is_last():
                    self.layouts.end_backward()
                    receiver.end_backward()
            except Exception:
                receiver.fail("comm hook (end of backward)")

    def _reduced_side(
        self, layout: BucketLayout, views: list[torch.Tensor] | None, buffer: torch.Tensor
    ) -> Callable[[torch.futures.Future], object]:
        receiver = self.receiver

        def measure_reduced(fut: torch.futures.Future) -> object:
            result = fut.value()  # the user's hook failing is the user's error: let it raise
            try:
                flat = result[0] if isinstance(result, (list, tuple)) else result
                # an in-place hook (the default reduction) reduced DDP's own views: reuse them
                same = (
                    views is not None and flat.data_ptr() == buffer.data_ptr() and flat.dtype == buffer.dtype
                )
                counted = layout.measure_counted(flat, views if same else None)
                if counted is not None:
                    receiver.add_reduced(*counted)
            except Exception:
                receiver.fail("comm hook (reduced gradients)", local=False)
            return result

        return measure_reduced
