"""DDP as a source of measurements: two fused reads per backward, both where it ends.

The *local* gradients (this rank's, before the reduction) are read once every gradient is in
and before DDP's final callback copies the reduced buckets back into ``p.grad``: with DDP's
default ``gradient_as_bucket_view=False`` every ``p.grad`` still holds its local gradient then
(DDP reduces copies of them in its buckets), so one fused pass reads them all. The *reduced*
gradients are read once that callback has written the reduction's result into ``p.grad``: one
more fused pass, in an autograd callback. Reduced gradients are identical on every rank, so
global and per-layer norms need no collective.

On NCCL, with DDP's own reduction, distmon registers no comm hook (:class:`DDPSource`): the
first output of a marked forward that the backward reaches queues the reads. Elsewhere one comm
hook wraps the user's (:func:`monitor_hook`) and does the local read when it sees the last
bucket; only where ``p.grad`` is the bucket (``gradient_as_bucket_view=True``) or a sparse
gradient that the reduction divides in place is a bucket read in its own hook.

Why not more: on a GPU the host must stay ahead of the device queue. A read per bucket inside
the backward, a Python continuation on each bucket's future and a Python comm hook itself are
host work between the backward's kernel launches, in full where the backward is launch-bound;
two fused reads where it ends cost what the one-process path costs (``plain.py``). No
collective is issued here: the monitor's collective waits for the optimizer step, when DDP's
reduction, and every collective the user's hook started from its callbacks, is complete.

No ``from __future__ import annotations`` here: DDP inspects the ``bucket`` annotation of a
Python comm hook when it is registered, and a string annotation fails that check.
"""

import atexit
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..compat import (
    ddp_comm_hooks,
    ddp_delays_all_reduce,
    ddp_module_parameters,
    find_tensors,
    graph_task_id,
    profiler_enabled,
    queue_callback,
    real_flat,
    reduced_bucket,
)
from ..errors import logger
from ..layout.grouping import Grouping
from ..step.backward import BackwardSums
from ..step.release import RELEASE_S, still_held, wait_released
from ..step.sums import Runs, sparse_sq_sum, sq_sums
from .base import OrderLearner, first_device
from .grad_sums import GradSums

__all__ = [
    "DDPSource",
    "ddp_parameters",
    "sparse_parameters",
    "BucketLayout",
    "BucketLayouts",
    "HookSlot",
    "monitor_hook",
    "ddp_allreduce_hook",
    "RUN_SLACK",
    "HOOKLESS_BACKENDS",
    "CommHook",
    "reduction_error",
]

# A DDP comm hook: ``hook(state, bucket) -> Future`` (``state``: whatever its author chose)
CommHook = Callable[[object, dist.GradBucket], torch.futures.Future]

# A run may grow to its largest parameter plus this many elements. Fused norms accumulate in
# fp32 along a view (on CPU sequentially: 4e-5 relative error over 1.5M elements, against 5e-8
# for the same bytes in 1,000 pieces), so a run is kept about as short as the parameters it
# holds: a weight keeps its bias, thousands of small tensors become runs of ~64K elements.
RUN_SLACK = 1 << 16

# Backends on which distmon leaves DDP's own reduction alone (no comm hook) when it can. Not gloo:
# under torch.profiler its default reduction must be distmon's own, waited when backward ends
# (HookSlot.start); tests put gloo here to run the hookless path on CPU.
HOOKLESS_BACKENDS = {"nccl"}
# Without a comm hook: how many of a forward's outputs (those that need a gradient, in order)
# are marked; a backward that reaches none of them is not read (and said once, at the step).
MARKED_OUTPUTS = 16


def ddp_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's own reduction written as a comm hook: scale by 1/size, sum over ``process_group``.

    ``process_group`` None: the default group, as for torch's own hooks.

    DDP without a hook multiplies a dense gradient by ``1/size`` as it copies it into the
    bucket (a sparse one it divides), then all-reduces with SUM. torch's ``allreduce_hook``
    divides the dense bucket instead, which differs in the last bit whenever the size is not a
    power of two. distmon wraps this hook by default, so a monitored run's gradients are
    bit-identical to an unmonitored one's, over DDP's own process group.

    Example:
        >>> ddp.register_comm_hook(ddp.process_group, ddp_allreduce_hook)   # doctest: +SKIP
    """
    return _bucket_future(_allreduce(process_group, bucket), bucket)


def _allreduce(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> dist.Work:
    """:func:`ddp_allreduce_hook`'s arithmetic, its all-reduce started; the work returned."""
    group = process_group if process_group is not None else dist.group.WORLD  # as torch's hooks take it
    buffer, size = bucket.buffer(), group.size()
    if size > 1:  # on one rank DDP multiplies by 1.0 (x * 1.0 is x, bit for bit): a pass saved
        if buffer.is_sparse:
            buffer.div_(size)
        else:
            buffer.mul_(1.0 / size)
    return dist.all_reduce(buffer, group=group, async_op=True)


def _bucket_future(work: dist.Work, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The future a comm hook returns for ``work``, the all-reduce of ``bucket``: the reduced
    bucket. The work and its continuation are held in :data:`HANDOFF`."""
    reduced = _Reduced(bucket.buffer())
    HANDOFF.hold(bucket.index(), work, reduced)
    return work.get_future().then(reduced)


class _Reduced:
    """The continuation of one bucket's all-reduce (run once, on the backend's thread): the reduced
    bucket. ``ran``: it was called (:class:`Handoff` waits at exit for those).

    A failure is raised as the reduction's: the future's error crosses DDP's C++ reducer as text,
    headed by the frame that raised it, this one; raised as it is, a peer's death reads as an
    error "in distmon" (users looked there first).
    """

    __slots__ = ("buffer", "ran")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.ran = buffer, False

    def __call__(self, fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        self.ran = True
        try:
            result = fut.value()[0]
        except Exception as e:
            raise reduction_error(e, "DDP's gradient all-reduce") from e
        return reduced_bucket(result, self.buffer)


class Handoff:
    """What gloo's worker thread must not be the one to release: the all-reduces distmon's comm
    hook starts and the continuations chained on their futures.

    gloo's worker thread ends each collective by releasing its share of it. Two shares hold
    Python state and are released under the GIL: the work (one started inside a backward keeps
    the thread's state, which holds the ``contextvars.Context`` torch stashes for the backward),
    and the Python continuation (``Future.then``) it ran once the reduction was done. A thread
    that takes the GIL after the interpreter began to finalize is ended by Python
    (``pthread_exit``) through a C++ destructor: ``terminate called without an active
    exception``, SIGABRT, and a clean finish read as a failure. So both, for the latest two
    backwards, are held here and dropped on the training thread when the backward two after
    it starts (DDP's reducer holds its own works until the next backward): gloo's thread only
    ever drops a reference that is not the last. At exit the interpreter waits until it has
    dropped its reference to every continuation it ran: read from the reference count, which
    changes only under the GIL, when that thread runs no Python code and gives the GIL up at once
    (a count kept in the continuation's ``__del__`` was seen by the exiting thread while gloo's
    thread was still inside the destructor, which then aborted).

    Example:
        >>> handoff, reduced, done = Handoff(), _Reduced(torch.zeros(1)), torch.futures.Future()
        >>> done.set_result([torch.zeros(1)]); _ = reduced(done)   # it ran, on "gloo's thread"
        >>> handoff.hold(0, None, reduced); gloo = [reduced]; del reduced
        >>> handoff.wait(0.01), gloo.clear(), handoff.wait(0.01)   # held by gloo, then let go
        (False, None, True)
    """

    def __init__(self) -> None:
        self._buckets: set[int] = set()  # the buckets the backward in progress reduced so far
        self._works: list[dist.Work] = []  # its all-reduces
        self._reduced: list[_Reduced] = []  # and their continuations
        self._works_before: list[dist.Work] = []  # the backward before it
        self._reduced_before: list[_Reduced] = []
        # referenced as each continuation is, by one list and nothing else: the count to compare with
        self._alone = [_Reduced(torch.empty(0))]

    def hold(self, bucket: int, work: dist.Work, reduced: _Reduced) -> None:
        """Keep ``work``, the all-reduce of bucket number ``bucket``, and ``reduced``, its
        continuation (on the training thread)."""
        if bucket in self._buckets:  # a new backward: the one two before it is dropped here
            self._works, self._works_before = self._works_before, self._works
            self._reduced, self._reduced_before = self._reduced_before, self._reduced
            self._works.clear()
            self._reduced.clear()
            self._buckets.clear()
        self._works.append(work)
        self._reduced.append(reduced)
        self._buckets.add(bucket)

    def busy(self) -> bool:
        """Whether something besides this holds a continuation that ran: gloo's thread, until it
        drops it."""
        held = still_held(itertools.chain(self._reduced, self._reduced_before), self._alone[0])
        return any(reduced.ran for reduced in held)

    def wait(self, timeout_s: float) -> bool:
        """Whether gloo's thread dropped every continuation it ran within ``timeout_s``."""
        return wait_released(self.busy, timeout_s)


HANDOFF = Handoff()
# registered when distmon is imported, before the monitor's exit guard: it runs after that guard
atexit.register(HANDOFF.wait, RELEASE_S)


def reduction_error(error: Exception, what: str) -> RuntimeError:
    """``error``, raised by a gradient reduction that distmon's comm hook runs, restated as the
    reduction's: a collective failing is the job's (a peer rank died or left), not the monitor's.

    Example:
        >>> str(reduction_error(RuntimeError("Connection closed by peer"), "DDP's gradient all-reduce"))[:60]
        "DDP's gradient all-reduce failed: RuntimeError: Connection c"
    """
    return RuntimeError(
        f"{what} failed: {type(error).__name__}: {error} (the collective's own error, not distmon's: "
        "distmon's comm hook runs the reduction and only passes its error on. A reduction fails like "
        "this when a peer rank failed or left the job: the first error is in that rank's log)"
    )


def ddp_parameters(model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The trainable parameters DDP reduces: the list it took when built (its module's parameters
    less the names in ``_ddp_params_and_buffers_to_ignore``, which the model's own code reduces)."""
    params = ddp_module_parameters(model)
    if params is None:  # a DDP without the list: its module's, less the ignored names
        ignored = getattr(model, "parameters_to_ignore", set())
        params = [p for name, p in model.module.named_parameters() if name not in ignored]
    return [p for p in params if p.requires_grad]


def sparse_parameters(module: torch.nn.Module) -> set[int]:
    """Ids of the parameters whose gradients are sparse, as DDP decides it (each gets a sparse
    bucket of its own): those of ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    sparse = [m for m in module.modules() if isinstance(m, kinds) and m.sparse]
    return {id(p) for m in sparse for p in m.parameters(recurse=False)}


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

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The runs' views of a flat tensor laid out like the bucket (DDP's buffer, in real elements)."""
        chunks = real_flat(flat).split(self.split_sizes)
        return list(chunks) if self.pick is None else [chunks[i] for i in self.pick]

    def measure(self, flat: torch.Tensor, views: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Sums of squares of the runs of ``flat`` (``views`` of it when already made)."""
        if self.sparse:
            return [sparse_sq_sum(flat)]
        return sq_sums(views if views is not None else self.views(flat))


class BucketLayouts:
    """The layouts of DDP's buckets, cached (for the buckets read inside the comm hook).

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

    def __init__(self, grouping: Grouping, device: torch.device, seqs: Iterator[int] | None = None) -> None:
        self.device = device
        self._seqs = seqs if seqs is not None else itertools.count()
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
            return BucketLayout(
                layer_ids=ids,
                seq=next(self._seqs),
                device=self.device,
                split_sizes=[],
                pick=None,
                sparse=True,
            )
        flat = real_flat(flat)  # a complex bucket (torch < 2.10) in real elements, as the views are
        base, itemsize = flat.data_ptr(), flat.element_size()
        # [size, layer, largest parameter]; layer -1: untracked or gap
        chunks: list[list[int]] = []
        cursor = 0
        for p, g in zip(params, bucket.gradients()):
            offset = (g.data_ptr() - base) // itemsize
            if offset < cursor:
                raise RuntimeError(
                    "distmon: overlapping gradient views in a DDP bucket (a bucket layout distmon does not "
                    "know): report it with your torch version and DDP's arguments"
                )
            if offset > cursor:
                chunks.append([offset - cursor, -1, 0])
            slot = self.slot_of.get(id(p))
            layer = -1 if slot is None else self.param_layer[slot]
            # a complex parameter lies in the (real) buffer as its real view: twice its numel
            n = p.numel() * (2 if p.is_complex() else 1)
            run = chunks[-1] if chunks else None
            if layer >= 0 and run and run[1] == layer and run[0] + n <= max(run[2], n) + RUN_SLACK:
                run[0] += n  # right after a parameter of the same layer: one run
                run[2] = max(run[2], n)
            else:
                chunks.append([n, layer, n])
            cursor = offset + n
        if cursor < flat.numel():
            chunks.append([flat.numel() - cursor, -1, 0])
        pick = [i for i, c in enumerate(chunks) if c[1] >= 0]
        ids = tuple(chunks[i][1] for i in pick)
        return BucketLayout(
            layer_ids=ids,
            seq=next(self._seqs),
            device=self.device,
            split_sizes=[c[0] for c in chunks],
            pick=None if len(pick) == len(chunks) else pick,
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
        if self.inner_hook is ddp_allreduce_hook and profiler_enabled():
            try:
                if not self.profiled:  # the first of this backward: complete them all when it ends
                    queue_callback(self.wait_profiled)
            except RuntimeError:  # not inside a backward: DDP's reduction as it is
                pass
            else:
                work = _allreduce(self.inner_state, bucket)
                self.profiled.append(work)
                return _bucket_future(work, bucket)
        return self.inner_hook(self.inner_state, bucket)

    def wait_profiled(self) -> None:
        """Complete the all-reduces :meth:`start` issued under the profiler (when a backward ends)."""
        works, self.profiled = self.profiled, []
        for work in works:
            try:
                work.wait()
            except Exception as e:
                raise reduction_error(e, "DDP's gradient all-reduce") from e


def monitor_hook(slot: HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Let the source see the bucket, then run the user's hook and return its future untouched.

    No continuation is chained on the future: the reduced gradients are read once, when DDP's
    backward has finished (:meth:`DDPSource.on_bucket`). Every monitor failure is caught inside
    the source; the user's hook, its process group and its result are never altered.

    Example:
        >>> ddp.register_comm_hook(HookSlot(source, ddp_allreduce_hook, ddp.process_group),
        ...                        monitor_hook)                                 # doctest: +SKIP
    """
    source = slot.source
    if source is not None:
        source.on_bucket(bucket)
    try:
        return slot.start(bucket)
    except Exception as e:  # the reduction's own failure (on_bucket never raises)
        hook = getattr(slot.inner_hook, "__qualname__", "the comm hook")
        raise reduction_error(e, f"DDP's gradient reduction (comm hook {hook})") from e


def _registered_slot(model: DistributedDataParallel) -> HookSlot | None:
    """distmon's slot on ``model``, None if it has no comm hook; raise if it has someone else's."""
    hooks = ddp_comm_hooks(model)
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
    """Measurements of a ``DistributedDataParallel`` model: two fused reads per backward.

    Both reads are one fused pass over the gradients, where the backward ends (the device has
    the backward's kernels queued ahead of it there), nothing per bucket:

    - **local**: this rank's gradients before the reduction. With DDP's default
      ``gradient_as_bucket_view=False``, DDP reduces copies of the gradients in its buckets and
      leaves ``p.grad`` alone until its final callback (``finalize_backward``) copies the
      reduced buckets back: once every gradient is in, and before that callback, every
      ``p.grad`` holds its local gradient (summed over any ``no_sync`` micro-batches).
    - **reduced**: ``p.grad`` once ``finalize_backward`` has written the reduction's result
      (the user's hook's) into it: read by an autograd callback queued behind DDP's, before any
      clipping a framework does between backward and step. Reduced gradients are identical on
      every rank, so global and per-layer norms need no collective.

    With DDP's own reduction on NCCL (no ``comm_hook=``), distmon registers **no comm hook**:
    DDP keeps its C++ reduction (no Python call, no Python future per bucket, the division fused
    into the copy into the bucket). A forward hook on the DDP module marks the outputs of a
    forward whose backward DDP reduces; the first of them that backward reaches queues the
    local read, which so runs before DDP's ``finalize_backward`` (queued later in that backward,
    or, ``static_graph``, by the node the outputs feed). Elsewhere distmon wraps the reduction
    in its comm hook (:func:`monitor_hook`, DDP accepts one): a hook of the user's, gloo (whose
    default reduction distmon completes itself under ``torch.profiler``, see
    :meth:`HookSlot.start`), a job DDP is one dimension of, ``gradient_as_bucket_view=True`` and
    sparse gradients. The local read is then done when the hook sees the last bucket, before
    that bucket's reduction; where ``p.grad`` is the bucket (``gradient_as_bucket_view=True``),
    or a sparse gradient the reduction divides in place, each such bucket is read in its own
    hook instead. Nothing is chained on a bucket's future either way, and no collective is
    issued here: the monitor's collective waits for the optimizer step.

    The constructor checks that the model's comm hook can be wrapped (raises for someone
    else's hook or an open monitor); :meth:`install` registers the forward hook, or the comm
    hook or takes over the slot a closed monitor left on the model; :meth:`remove` removes the
    one, leaves the other.

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
        receiver: BackwardSums,
        grouping: Grouping,
        comm_hook: CommHook | None = None,
        comm_state: object = None,
        counted: Sequence[bool] | None = None,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.module = model.module
        # counted: DDP is one dimension of a larger job (tensor parallelism, a pipeline stage):
        # every rank adds the parts it counts, over the job's default group; else the job is
        # DDP's group, on whose every rank the reduced gradient is whole
        self.in_parts, self.counted = counted is not None, counted
        self.whole_grads = not self.in_parts
        self.group: dist.ProcessGroup = dist.group.WORLD if self.in_parts else model.process_group
        self.world_size = self.group.size()
        self.device = first_device(model.module)
        self.receiver = receiver
        self._existing = _registered_slot(model)  # raises for someone else's hook or an open monitor
        # No hook given: DDP's own arithmetic, over DDP's own group (not WORLD: a DDP replica on
        # a subgroup must stay one). A hook given is called exactly as the user wrote it.
        self.inner_hook = comm_hook or ddp_allreduce_hook
        self.inner_state = comm_state if comm_hook is not None else model.process_group
        reduced = {id(p) for p in ddp_parameters(model)}
        slots = [i for i, p in enumerate(grouping.params) if id(p) in reduced]
        sparse = sparse_parameters(model.module) & reduced
        bucket_view = bool(getattr(model, "gradient_as_bucket_view", False))
        self.hookless = (
            comm_hook is None
            and self._existing is None
            and not (self.in_parts or bucket_view or sparse or compiled)
            and not ddp_delays_all_reduce(model)
            # Lightning's manual optimization runs the backward inside DDP's forward (and prepares
            # DDP for it itself): no forward has ended when that backward begins
            and getattr(model.module, "automatic_optimization", True) is not False
            and dist.get_backend(model.process_group) in HOOKLESS_BACKENDS
        )
        seqs = itertools.count()  # the run sets of one backward fold together: distinct seqs
        # buckets read in the comm hook: every bucket when p.grad is the bucket, else sparse ones
        self._every_bucket = bucket_view
        self._sparse_buckets = bool(sparse) and not bucket_view
        self.layouts = BucketLayouts(grouping, self.device, seqs)
        dense = [i for i in slots if id(grouping.params[i]) not in sparse]
        self._local = None if bucket_view or not dense else self._reader(grouping, dense, seqs)
        kept = [i for i in slots if counted is None or counted[i]]  # the parts this rank counts
        self._reduced = self._reader(grouping, kept, seqs)
        self._forward_hook: RemovableHandle | None = None
        self._armed_task = -2  # the backward whose local read is queued (its graph task's id)
        self._read_since_step = True  # a backward was read since the last step began
        self._told_unread = False
        # the layers' backward order, from the gradients' accumulation in the first backward
        self._order = OrderLearner(
            grouping.params, grouping.param_layer, len(grouping.layers), receiver.set_layer_order
        )
        self.dp_rank = model.process_group.rank()
        mesh = getattr(model, "device_mesh", None)
        self.meshes = (mesh,) if mesh is not None else ()

    def _reader(self, grouping: Grouping, slots: list[int], seqs: Iterator[int]) -> GradSums:
        """One fused read of the ``p.grad`` of the parameters in ``slots`` (DDP's are plain tensors)."""
        params = [grouping.params[i] for i in slots]
        return GradSums(params, [grouping.param_layer[i] for i in slots], self.device, part=None, seqs=seqs)

    def install(self) -> None:
        self._order.install()
        if self.hookless:
            # looked up at each call (a benchmark times it), not bound once
            self._forward_hook = self.model.register_forward_hook(lambda m, _, out: self._arm(m, out))
            return
        slot = self._existing
        if slot is None:
            self.model.register_comm_hook(HookSlot(self, self.inner_hook, self.inner_state), monitor_hook)
        else:
            slot.inner_hook, slot.inner_state, slot.source = self.inner_hook, self.inner_state, self

    def remove(self) -> None:
        self._order.remove()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        hooks = ddp_comm_hooks(self.model)
        if hooks and isinstance(hooks[0][1], HookSlot) and hooks[0][1].source is self:
            hooks[0][1].source = None

    def read_at_step(self) -> None:
        """Nothing to read: DDP's gradients were read in backward. Without a comm hook, a step
        whose gradients no marked forward led to is said once (the loop prepared DDP's backward
        itself: its figures are NaN, not valid)."""
        if not self.hookless:
            return
        read, self._read_since_step = self._read_since_step, False
        if read or self._told_unread or not any(p.grad is not None for p in self._reduced.params):
            return
        self._told_unread = True
        logger.warning(
            "distmon: an optimizer step whose DDP backward distmon did not see (no forward of the DDP "
            "model whose backward DDP reduces led to it): its figures are NaN. A loop that prepares "
            "DDP's backward itself (reducer.prepare_for_backward) needs distmon's comm hook: pass "
            "GradMonitor(..., comm_hook=distmon.sources.ddp.ddp_allreduce_hook)"
        )

    def read_pending(self) -> None:
        """Nothing: DDP's gradients were read in backward."""

    # -- without a comm hook: DDP's own reduction ----------------------------------------------
    def _arm(self, model: DistributedDataParallel, output: object) -> None:
        """After a forward whose backward DDP reduces (its own test): mark the outputs, so that the
        first one the backward reaches queues the reads."""
        if not (self.receiver.active and torch.is_grad_enabled() and model.require_backward_grad_sync):
            return
        try:
            # the outputs of one forward share a token: the first backward through them is DDP's
            # reduced one; another through the same graph (retain_graph) is not reduced, not read
            hook = functools.partial(self._backward_begins, [False])
            # the first few that need a gradient (a model's cache of keys and values can be many more)
            marked = itertools.islice((t for t in find_tensors(output) if t.requires_grad), MARKED_OUTPUTS)
            for t in marked:
                t.register_hook(hook)
        except Exception:
            self.receiver.fail("DDP forward hook")

    def _backward_begins(self, used: list[bool], grad: torch.Tensor) -> None:
        """The backward reached a marked output: the first of a backward queues the local read,
        which then runs once every gradient is in, before DDP's finalize_backward (queued later)."""
        try:
            task = graph_task_id()
            if used[0] and task != self._armed_task:
                return  # a second backward through this forward's outputs: DDP does not reduce it
            used[0] = True
            if task != self._armed_task and self.receiver.active:
                self._armed_task = task
                self._queue(self._before_ddp_finalize)
        except Exception:  # a tensor hook that raised would fail the user's backward
            self.receiver.fail("DDP backward hook")

    def _before_ddp_finalize(self) -> None:
        """Among the backward's final callbacks, before DDP's: the local gradients, still in ``p.grad``."""
        self._read_since_step = True
        self._read_local()
        self._queue(self._read_reduced)  # behind DDP's finalize_backward, queued by now

    # -- with the comm hook --------------------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> None:
        """A bucket is about to be reduced (its hook is called next): read what must be read now.

        On an ordinary bucket nothing, unless it is read in the hook (bucket views, a sparse
        gradient); on the last one, every local gradient and the reduced read's queueing.
        Failures are counted, never raised into the backward.
        """
        receiver = self.receiver
        if not receiver.active:
            return
        try:
            last = bucket.is_last()
            if self._every_bucket or (self._sparse_buckets and bucket.buffer().is_sparse):
                self._read_bucket(bucket)
            if last:
                self._backward_end()
        except Exception:
            receiver.fail("comm hook")

    def _read_bucket(self, bucket: dist.GradBucket) -> None:
        """This bucket's local gradients, from its buffer, before the user's hook changes it."""
        receiver = self.receiver
        try:
            receiver.begin_backward()
            layout, views, buffer = self.layouts.layout(bucket)
            if layout.layer_ids:
                receiver.add_local(layout, layout.measure(buffer, views))
        except Exception:
            receiver.fail("comm hook (local gradients)", reduced=False)

    def _backward_end(self) -> None:
        """The last bucket: read the local gradients still in ``p.grad``; queue the reduced read."""
        if self._every_bucket:
            self.layouts.end_backward()
        self._read_local()
        # DDP queues its finalize_backward (which writes the reduced gradients into p.grad) right
        # after this hook returns, or calls it at once when the hooks run inside one of its
        # callbacks (static_graph's first iteration): a callback queued now runs before it or
        # after it, and the one that callback queues in turn runs after it either way
        self._queue(self._queue_reduced_read)

    # -- both ----------------------------------------------------------------------------------
    def _read_local(self) -> None:
        """The backward's local gradients in ``p.grad`` (those not read bucket by bucket): one fused read."""
        receiver = self.receiver
        try:
            receiver.begin_backward()
            if self._local is not None:
                read = self._local.read()
                if read is not None:
                    receiver.add_local(*read)
        except Exception:
            receiver.fail("DDP local gradients", reduced=False)

    def _queue_reduced_read(self) -> None:
        """Among the backward's final callbacks: queue the reduced read behind DDP's finalize."""
        self._queue(self._read_reduced)

    def _queue(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the backward's final callbacks queued so far have run; never raises
        (an autograd callback that raised would fail the user's backward)."""
        try:
            queue_callback(callback)
        except Exception:
            self.receiver.fail("DDP end of backward", local=False)
            try:
                self.receiver.end_backward()
            except Exception:
                self.receiver.fail("DDP end of backward")

    def _read_reduced(self) -> None:
        """The reduced gradients, now in ``p.grad``: one fused read; the backward's sums are all in."""
        receiver = self.receiver
        try:
            read = self._reduced.read()
            if read is not None:
                receiver.add_reduced(*read)
        except Exception:
            receiver.fail("DDP reduced gradients", local=False)
        try:
            receiver.end_backward()
        except Exception:
            receiver.fail("DDP end of backward")
