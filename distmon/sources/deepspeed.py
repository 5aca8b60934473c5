"""DeepSpeed (the engine ``deepspeed.initialize`` returns, ZeRO stages 0-3) as a source of measurements.

The engine reduces and steps by itself: ``engine.backward`` reduces the gradients at the
accumulation boundary (stages 0 and 1) or as backward produces them (stages 2 and 3), and
``engine.step`` clips them (``gradient_clipping``), checks them for an overflow and steps its
optimizer. distmon reads each figure where DeepSpeed holds it:

- **the step**: the engine's optimizer step at an accumulation boundary (``_take_model_step``,
  which ``engine.step`` calls once per optimizer step, whoever calls ``engine.step``: the user,
  accelerate's ``backward``, the Hugging Face Trainer) is what distmon monitors in place of the
  optimizer (:class:`EngineStep`, a torch optimizer whose one ``step()`` is that step). Its
  pre-hooks begin the training step before DeepSpeed clips or checks anything. A step DeepSpeed
  skips itself (its overflow check; ``engine.was_step_applied()`` False) is recorded as skipped,
  like a ``GradScaler``'s (``skip_reason`` "scaler"). A step the guard refuses is still taken by
  DeepSpeed, without the update: its torch optimizer's ``step`` is not called and its LR
  scheduler not stepped, as on its own overflow (gradients cleared, ``skipped_steps`` counted,
  ``was_step_applied()`` False).
- **reduced** (what the optimizer steps with, before clipping), read when the step begins, in
  one fused pass: stage 0 every rank's reduced ``p.grad`` (``BF16_Optimizer``: its fp32
  accumulation ``_hp_grad``); stages 1 and 2 this rank's partition, as the fragments of its
  parameters (``_hp_mapping``: what ``deepspeed.utils.safe_get_full_grad`` gathers); stage 3
  this rank's gradient partitions, views of one flat buffer. Partitions are distinct on every
  rank: their per-layer sums are added up in the step's one collective.
- **local** (this rank's gradient before the reduction), where one reduction input holds the
  step's local gradient. Stage 0 and stage 1 reduce at the boundary: the accumulated gradients
  are read as the reduction begins (``engine.allreduce_gradients``). Stages 2 and 3, and 1 with
  ``overlap_comm``, reduce each gradient as backward produces it: it is read there (a tensor
  hook, before DeepSpeed takes it), which holds the step's local gradient when the step has one
  micro-batch; with gradient accumulation no input holds it and the step's local figures are
  NaN (``rank_valid`` False), as with FSDP2's reduce-scatter on every micro-batch.

Expert parameters (DeepSpeed MoE: ``allreduce=False``, reduced over their ``group_name``'s
expert-data-parallel group) count once per expert: at stages 1-3 each rank's partition of them
is its own; at stage 0 every rank of an expert-data-parallel group holds the same reduced
gradient, counted on its first rank. Layer names are module names, the same on every rank: an
expert layer's figure covers that local expert on every expert-parallel rank.

Refused at construction, never measured wrongly: fp16 (the loss scale is DeepSpeed's, and fp16
does not run where distmon is tested), ZeRO-Offload, DeepSpeed's tensor or pipeline parallelism
(``mpu``, ``PipelineEngine``), sequence parallelism, ZenFlow, DeepCompile, and an engine that
Lightning drives (its DeepSpeed strategy runs on CUDA GPUs only: not verified).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import groups as ds_groups
from torch.utils.hooks import RemovableHandle

from ..compat import queue_callback
from ..errors import logger
from ..layout.grouping import Grouping
from ..step.backward import BackwardSums
from ..step.sums import Runs, sq_sums
from .base import OrderLearner, first_device
from .grad_sums import GradSums

__all__ = ["DeepSpeedSource", "EngineStep", "engine_counts"]

_MISSING = object()


def _is_expert(p: torch.nn.Parameter) -> bool:
    """A DeepSpeed MoE expert parameter: reduced over its expert-data-parallel group, not all ranks."""
    return getattr(p, "allreduce", True) is False


def _refusal(engine: DeepSpeedEngine) -> str | None:
    """Why distmon cannot measure this engine exactly (None: it can)."""
    if type(engine.module).__name__ == "_LightningModuleWrapperBase":
        from .models import LIGHTNING_DEEPSPEED

        return LIGHTNING_DEEPSPEED
    if engine.optimizer is None:
        return "the engine has no optimizer (deepspeed.initialize without one trains nothing)"
    if engine.fp16_enabled():
        return (
            "fp16 is not supported yet: DeepSpeed keeps the loss scale in its optimizer, and distmon "
            'has not been verified with it. Train in bf16 or fp32 ("bf16": {"enabled": true})'
        )
    offloaded = [engine.zero_offload_optimizer(), engine.zero_offload_param()]
    if any(o is not None and str(getattr(o.device, "value", o.device)) != "none" for o in offloaded):
        return (
            "ZeRO-Offload (offload_optimizer / offload_param) moves the gradients distmon reads to the host"
        )
    dp = engine.data_parallel_group
    if engine.mpu is not None or (dp is not None and dist.get_world_size(dp) != dist.get_world_size()):
        return "DeepSpeed's tensor or pipeline parallelism (mpu=, PipelineModule) is not supported yet"
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        return "sequence parallelism (sequence_parallel_size > 1) is not supported yet"
    if getattr(engine, "zenflow", False) or engine.is_deepcompile_enabled():
        return "ZenFlow and DeepCompile reduce gradients on their own schedule"
    if engine.zero_optimization_stage() > 3:
        return f"unknown ZeRO stage {engine.zero_optimization_stage()}"
    return None


class _Fragments:
    """Stages 1 and 2: this rank's partition of the reduced gradient, parameter by parameter.

    Each parameter with a part in this rank's partition has DeepSpeed's ``_hp_mapping``; its
    gradient fragment (``get_lp_grad_fragment``, DeepSpeed's averaged gradients) exists from
    the boundary's reduction until the step. One fused pass over the fragments.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layer_of: Sequence[int],
        *,
        device: torch.device,
        seqs: Iterator[int],
    ) -> None:
        kept = [
            (p, layer) for p, layer in zip(params, layer_of) if getattr(p, "_hp_mapping", None) is not None
        ]
        self._params = [p for p, _ in kept]
        self._runs = Runs(tuple(layer for _, layer in kept), seq=next(seqs), device=device)

    def read(self) -> tuple[Runs, list[torch.Tensor]]:
        grads = [p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group) for p in self._params]
        return self._runs, sq_sums(grads) if grads else []


class _Partitions:
    """Stage 3: this rank's partitions of the reduced gradients, views of one flat buffer.

    The views are made once (the buffer lives as long as the optimizer; a new one, after
    ``reload_states``, is laid out again).
    """

    def __init__(
        self,
        optimizer: DeepSpeedZeroOptimizer_Stage3,
        params: Sequence[torch.nn.Parameter],
        layer_of: Sequence[int],
        *,
        device: torch.device,
        seqs: Iterator[int],
    ) -> None:
        self._optimizer, self._params, self._layer_of = optimizer, list(params), list(layer_of)
        self._device, self._seqs = device, seqs
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._runs: Runs | None = None
        self._layout()  # raises here, at construction, if DeepSpeed's layout is not the one known

    def _layout(self) -> None:
        opt = self._optimizer
        by_id = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition  # ds_id -> view of the buffer
        kept = [
            (by_id[p.ds_id], layer)
            for p, layer in zip(self._params, self._layer_of)
            if getattr(p, "ds_id", None) in by_id and by_id[p.ds_id].numel()
        ]
        # one view per partition, not one per run of a layer's adjacent partitions: fp32 sums along
        # a long view drift (2,000 small tensors merged into runs of ~65K elements read 2e-6 off,
        # one view each 3e-8); a parameter's own partition is as long as a view gets
        self._views = [view for view, _ in kept]
        self._runs = Runs(tuple(layer for _, layer in kept), seq=next(self._seqs), device=self._device)
        self._flat = opt.grad_partitions_flat_buffer

    def read(self) -> tuple[Runs, list[torch.Tensor]]:
        if self._optimizer.grad_partitions_flat_buffer is not self._flat:
            self._layout()
        assert self._runs is not None
        return self._runs, sq_sums(self._views) if self._views else []


class _InBackward:
    """Local gradients read as backward produces them (a tensor hook on each parameter), before
    DeepSpeed copies them into its reduction buckets: the step's local gradient when the step has
    one backward; with gradient accumulation at stages 2/3 (a reduction every micro-batch) each
    micro-batch's, whose sums are no norm but say whether this rank's gradient went non-finite."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layer_of: Sequence[int],
        *,
        receiver: BackwardSums,
        device: torch.device,
        seqs: Iterator[int],
    ) -> None:
        self.receiver, self.device, self._seqs = receiver, device, seqs
        self._params, self._layer_of = list(params), list(layer_of)
        self._handles: list[RemovableHandle] = []
        self._runs: dict[tuple[int, ...], Runs] = {}
        self._slots: list[int] = []
        self._sums: list[torch.Tensor] = []
        self._in_backward = False
        self._measuring = False
        self.backwards = 0  # backwards since the last step
        self.reads: list[tuple[Runs, list[torch.Tensor]]] = []  # each backward's local sums, this step

    def install(self) -> None:
        self._handles = [
            p.register_hook(functools.partial(self._seen, i)) for i, p in enumerate(self._params)
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def new_step(self) -> None:
        self.backwards, self.reads = 0, []

    def _seen(self, slot: int, grad: torch.Tensor) -> None:
        if not self.receiver.active:
            return
        try:
            if not self._in_backward:
                self._in_backward = True
                self._slots, self._sums = [], []
                self._measuring = True
                queue_callback(self._backward_done)
            if self._measuring:
                self._slots.append(slot)
                self._sums.append(sq_sums([grad])[0])
        except Exception:
            self._measuring = False
            self.receiver.fail("DeepSpeed gradient hook (local gradients)", reduced=False)

    def _backward_done(self) -> None:
        self._in_backward = False
        self.backwards += 1
        if not self._measuring:  # a failure in this backward: the step has no local figures
            self.reads.clear()
            return
        key = tuple(self._slots)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = Runs(
                tuple(self._layer_of[s] for s in key), seq=next(self._seqs), device=self.device
            )
        self.reads.append((runs, self._sums))


class EngineStep(torch.optim.Optimizer):
    """A DeepSpeed engine's optimizer step, one per training step, as a torch optimizer.

    ``engine.step()`` calls it at each accumulation boundary; step pre- and post-hooks, and a
    guard's shadowing ``step``, work on it as on any optimizer. Its ``param_groups`` hold the
    engine's trainable parameters (it steps them all); it has no state. ``step_was_skipped``:
    DeepSpeed skipped the update (its overflow check). ``taken``: ``step()`` ran this time.
    """

    def __init__(self, engine: DeepSpeedEngine, take: Callable[[object], object]) -> None:
        super().__init__([p for p in engine.module.parameters() if p.requires_grad], {})
        self.engine, self._take = engine, take
        self.step_was_skipped = False
        self.taken = False

    def step(self, lr_kwargs: object = None) -> None:  # type: ignore[override]
        self.taken = True
        self._take(lr_kwargs)
        self.step_was_skipped = not self.engine.was_step_applied()


def _refuse(engine: DeepSpeedEngine) -> None:
    """Raises why distmon cannot measure this engine exactly, if it cannot."""
    why = _refusal(engine)
    if why is not None:
        raise ValueError(
            f"distmon: this DeepSpeed engine cannot be measured exactly: {why}. Use a configuration "
            "docs/frameworks.md lists (ZeRO 0-3, bf16 or fp32, no offload, DeepSpeed's data parallelism)"
        )


def engine_counts(
    engine: DeepSpeedEngine, params: Sequence[torch.nn.Parameter]
) -> list[tuple[bool, str, bool]]:
    """What the job's start-up reading is told of an engine's parameters (``census.py``): per
    parameter, whether this rank counts it, why not (a copy counted on another rank), and whether it
    is an expert (distinct over its expert-parallel group, as DeepSpeed MoE declares it). At ZeRO-3
    every rank's module holds empty placeholders alike. Raises for an engine that cannot be measured.
    """
    _refuse(engine)
    out = []
    for p in params:
        first = DeepSpeedSource._first_holder(p)
        group = "its expert-data-parallel group" if _is_expert(p) else "DeepSpeed's data-parallel group"
        out.append((first, "" if first else f"a copy over {group} (its rank 0 counts it)", _is_expert(p)))
    return out


class DeepSpeedSource:
    """Measurements of a model trained by a DeepSpeed engine (ZeRO stages 0-3, fp32 or bf16).

    ``GradMonitor.clip_grad_norm_`` is refused on it (:attr:`CLIP_REFUSAL`): the engine clips
    inside ``engine.step()``, and at stages 1-3 no ``p.grad`` holds the gradient to clip.

    Built on the engine, it refuses what it cannot measure exactly; :meth:`install` shadows the
    engine's ``_take_model_step`` (and ``allreduce_gradients`` where the local gradient is read
    there) on the instance, :meth:`remove` takes them out again. ``optimizers`` are what the
    monitor's step hooks go on: the engine's own step (:meth:`steps`).

    Example:
        >>> engine, opt, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)  # doctest: +SKIP
        >>> mon = distmon.GradMonitor(engine, opt)                                         # doctest: +SKIP
    """

    CLIP_REFUSAL = (
        "clip_grad_norm_ on a DeepSpeed engine: DeepSpeed clips inside engine.step() (at ZeRO "
        "stages 1-3 no p.grad holds the gradient to clip): set gradient_clipping in the DeepSpeed "
        "config, which clips by the norm distmon serves"
    )

    divide_factor_set = False
    local_figures = True
    whole_grads = False  # stages 1-3 partition it; stage 0 and bf16 keep it where distmon does not read
    counted = None  # DeepSpeed's own partitions: nothing of distmon's placement rules to check

    def __init__(self, engine: DeepSpeedEngine, *, receiver: BackwardSums, grouping: Grouping) -> None:
        _refuse(engine)
        if "_take_model_step" in vars(engine):
            raise RuntimeError(
                "distmon: this DeepSpeed engine is already measured by an open GradMonitor (or its "
                "_take_model_step was replaced); close() it before building another"
            )
        self.engine, self.module, self.receiver = engine, engine.module, receiver
        self.device = first_device(engine.module)
        self.group = dist.group.WORLD  # every rank of the job is a data-parallel rank (mpu refused)
        self.world_size = dist.get_world_size()
        self.dp_rank, self.meshes = dist.get_rank(), ()
        opt = engine.optimizer
        params, layer_of = list(grouping.params), list(grouping.param_layer)
        experts = any(map(_is_expert, params))
        seqs = itertools.count()  # the run sets of one fold (local and reduced alike): distinct seqs
        self._reduced: _Fragments | _Partitions | GradSums
        if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
            self.in_parts = True
            self._reduced = _Partitions(opt, params, layer_of, device=self.device, seqs=seqs)
        elif isinstance(opt, DeepSpeedZeroOptimizer):
            self.in_parts = True
            self._reduced = _Fragments(params, layer_of, device=self.device, seqs=seqs)
        else:  # stage 0, or BF16_Optimizer (ZeRO-1 in bf16 with fp32 accumulation): every rank holds it all
            attr = "_hp_grad" if isinstance(opt, BF16_Optimizer) else "grad"
            self.in_parts = experts  # experts: each expert-data-parallel group holds its own
            kept = [i for i, p in enumerate(params) if not self.in_parts or self._first_holder(p)]
            self._reduced = GradSums(
                [params[i] for i in kept], [layer_of[i] for i in kept], self.device, seqs=seqs, attr=attr
            )
        # where the local gradient is read: as the boundary's reduction begins, or in backward
        reduces_in_backward = getattr(opt, "partition_gradients", False) or getattr(
            opt, "overlap_comm", False
        )
        self._at_reduction: GradSums | None = None
        self._in_backward: _InBackward | None = None
        if isinstance(opt, DeepSpeedZeroOptimizer_Stage3) or reduces_in_backward:
            self._in_backward = _InBackward(
                params, layer_of, receiver=receiver, device=self.device, seqs=seqs
            )
        else:
            attr = "_hp_grad" if isinstance(opt, BF16_Optimizer) else "grad"
            self._at_reduction = GradSums(params, layer_of, self.device, seqs=seqs, attr=attr)
        self._local: tuple[Runs, list[torch.Tensor]] | None = None  # read as the reduction began
        self._order = OrderLearner(params, layer_of, len(grouping.layers), receiver.set_layer_order)
        # DeepSpeed's own methods, bound: what the instance attributes :meth:`install` sets call
        self._take, self._allreduce = engine._take_model_step, engine.allreduce_gradients
        self.optimizers = (EngineStep(engine, self._take),)
        self._installed: list[str] = []
        self._told_summed = False  # said why the per-rank figures are NaN (gradient accumulation)

    @staticmethod
    def _first_holder(p: torch.nn.Parameter) -> bool:
        """Stage 0 with experts: whether this rank counts ``p``'s reduced gradient (the first rank
        of the group that holds the same one: all ranks for dense parameters, the parameter's
        expert-data-parallel group for an expert's)."""
        if not _is_expert(p):
            return dist.get_rank() == 0
        return dist.get_rank(ds_groups._get_expert_data_parallel_group(p.group_name)) == 0

    def steps(self, given: Sequence[torch.optim.Optimizer]) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers the monitor hooks: the engine's step, whose optimizer ``given`` must be."""
        basic = self.engine.basic_optimizer
        if any(opt is not basic for opt in given):
            raise ValueError(
                "distmon: GradMonitor(engine, optimizer) on a DeepSpeed engine takes the optimizer "
                "deepspeed.initialize returned with it (or accelerate's/the Trainer's wrapper of it); "
                "got another optimizer"
            )
        return self.optimizers

    # -- hooks ------------------------------------------------------------------------------
    def install(self) -> None:
        engine = self.engine
        self._order.install()
        engine._take_model_step = self._take_model_step
        self._installed.append("_take_model_step")
        if self._at_reduction is not None:
            engine.allreduce_gradients = self._allreduce_gradients
            self._installed.append("allreduce_gradients")
        if self._in_backward is not None:
            self._in_backward.install()

    def remove(self) -> None:
        self._order.remove()
        for name in self._installed:
            vars(self.engine).pop(name, None)
        self._installed.clear()
        if self._in_backward is not None:
            self._in_backward.remove()

    def _allreduce_gradients(self, *args: object, **kwargs: object) -> object:
        """The engine's reduction, after reading the local gradients it reduces at a boundary."""
        engine = self.engine
        if self.receiver.active and engine.is_gradient_accumulation_boundary():
            try:
                assert self._at_reduction is not None
                self._local = self._at_reduction.read()
            except Exception:
                self._local = None
                self.receiver.fail("DeepSpeed reduction (local gradients)", reduced=False)
        return self._allreduce(*args, **kwargs)

    def _take_model_step(self, lr_kwargs: object = None) -> None:
        """The engine's optimizer step, through :class:`EngineStep` (its hooks, the guard)."""
        step = self.optimizers[0]
        step.taken = step.step_was_skipped = False
        try:
            step.step(lr_kwargs)
        finally:
            if not step.taken:  # the guard refused it: DeepSpeed steps without the update
                self._step_without_update(lr_kwargs)

    def _step_without_update(self, lr_kwargs: object) -> None:
        """DeepSpeed's step (gradients cleared, counters advanced), its optimizer and LR scheduler
        not stepped: what DeepSpeed does on an overflow."""
        engine = self.engine
        basic, scheduler = engine.basic_optimizer, engine.lr_scheduler
        own_step = vars(basic).get("step", _MISSING)
        basic.step = lambda *args, **kwargs: None
        engine.lr_scheduler = None
        try:
            self._take(lr_kwargs)
        finally:
            engine.lr_scheduler = scheduler
            if own_step is _MISSING:
                del basic.step
            else:
                basic.step = own_step
        if engine.was_step_applied():  # an overflow counted it already
            engine._step_applied = False
            engine.skipped_steps += 1

    # -- reads ------------------------------------------------------------------------------
    def read_at_step(self) -> None:
        """The step begins: hand over the local sums of the step's reduction input (if measured)
        and read this rank's part of the reduced gradient."""
        receiver = self.receiver
        local, self._local = self._local, None
        locals_ = [local] if local is not None else []
        if self._in_backward is not None:
            mine = self._in_backward
            failed = len(mine.reads) < mine.backwards  # a backward whose reading failed: none exact
            locals_ = [] if failed else mine.reads
            mine.new_step()
        if not receiver.active:
            return
        try:
            reduced = self._reduced.read()
        except Exception:
            receiver.fail("DeepSpeed reduced gradients")
            return
        if reduced is None and not locals_:
            return  # no gradient at all: nothing measured, the step is invalid
        receiver.begin_backward()
        for runs, sums in locals_:
            if runs.layer_ids:
                receiver.add_local(runs, sums)
        if reduced is not None and reduced[0].layer_ids:  # else this rank counts no part: adds nothing
            receiver.add_reduced(*reduced)
        receiver.end_backward(scaled=False)  # DeepSpeed's bf16/fp32 gradients carry no loss scale
        if not locals_:
            receiver.local_unmeasured()
        elif len(locals_) > 1:  # several micro-batches, each reduced: their sums name a NaN's rank
            receiver.local_summed()
            self._tell_summed(len(locals_))

    def _tell_summed(self, backwards: int) -> None:
        """Say once per run (rank 0: every rank has the same configuration) why this configuration's
        per-rank figures are NaN: documented, but NaN series with no word at run time read as a fault."""
        if self._told_summed or self.dp_rank != 0:
            return
        self._told_summed = True
        engine = self.engine
        overlap = engine.zero_optimization_stage() < 2 and getattr(engine.optimizer, "overlap_comm", False)
        logger.warning(
            "distmon: DeepSpeed reduces each micro-batch's gradients as backward produces them (ZeRO "
            "stage %d%s) and this step had %d micro-batches (gradient accumulation): no single reduction "
            "input holds a step's local gradient, so per-rank local figures (distmon_rank_grad_norm, "
            "the rank outlier scores) are NaN on such steps; a rank whose gradient goes non-finite is "
            "still named, and the global and per-layer figures stay exact. For per-rank figures: one "
            "micro-batch per step, or ZeRO stage 0 or 1 without overlap_comm",
            engine.zero_optimization_stage(),
            " with overlap_comm" if overlap else "",
            backwards,
        )

    def read_pending(self) -> None:
        """Nothing: every figure is read when the step begins."""
