"""What a monitor is made of, built in order: on every rank before the ranks agree, and after.

:func:`read_rank` reads what can fail on one rank alone, from the options ``GradMonitor``
validated once (``config.py``): the optimizers and the model's reading of the layout
(``sources.read_layout``). The job then reads
its layout as a whole (``census.py``). :func:`build_rank` builds everything else that can fail,
nothing installed: the layer groups, the sums the source hands over (``backward.py``), the
source (``sources/``), the row plan (``rows.py``), the opt-in features, the detector and the
noise scale, and the step schedule (``schedule.py``). Once every rank agreed,
:func:`build_exports` builds the exporters and the export thread that feeds them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from .._version import __version__
from ..compat import has_step_hooks, rank_part
from ..errors import ErrorCounter
from ..export.decode import RowDecoder
from ..export.export_thread import ExportThread
from ..export.sinks import AnomalyCallbacks, NonfiniteNotice, SinkWorker
from ..export.trackers import tracker_workers
from ..layout.census import JobLayout, RankParts, digest
from ..layout.grouping import Grouping, build_grouping
from ..layout.placements import Coordinates, coordinates, declared_group, part_position
from ..layout.verify import DirectNorm, LayoutCheck
from ..serve.prometheus_exporter import GradCollector, MetricsAggregate
from ..snapshot import Snapshot
from ..sources import (
    LayoutReading,
    PipelineSource,
    Source,
    first_device,
    pipeline_stage,
    read_layout,
    source_for,
    trained_module,
)
from ..step.backward import BackwardSums
from ..step.loss_scale import LossScale
from ..step.optimizer_hooks import StepHooks
from ..step.ring import ExportQueue
from ..step.rows import RowPlan
from ..step.schedule import StepSchedule
from ..verdicts.detectors import DetectorConfig, DeviceDetector, EventFinder
from ..verdicts.noise_scale import NoiseScale
from ..verdicts.precursor import PrecursorDetector
from .config import MonitorConfig, features
from .hostinfo import Nodes, RankInfo, restart_count
from .lifecycle import Opened, served_ranks

if TYPE_CHECKING:  # for annotations only: imported where used
    from ..compat import PipelineStage

__all__ = [
    "Built",
    "Inputs",
    "Hooks",
    "read_rank",
    "build_rank",
    "build_exports",
    "as_tuple",
    "unwrap_optimizer",
]


def as_tuple(value: object) -> tuple:
    """A list or tuple as a tuple, anything else as a tuple of one."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def unwrap_optimizer(opt: object) -> torch.optim.Optimizer:
    """The torch optimizer that steps, under a framework's wrapper (``.optimizer``, ``._optimizer``).

    accelerate's ``AcceleratedOptimizer`` (what the HF Trainer hands out) subclasses
    ``torch.optim.Optimizer`` without calling its ``__init__`` (it has no step hooks) and steps
    its ``.optimizer``; Lightning's ``LightningOptimizer`` steps its ``._optimizer``.

    Example:
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> class Wrapper:
        ...     optimizer = sgd
        >>> unwrap_optimizer(Wrapper()) is sgd
        True
    """
    seen = opt
    for _ in range(8):  # wrappers of wrappers, but never a cycle
        if has_step_hooks(opt):
            return opt
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    raise TypeError(
        f"distmon: optimizer must be a torch.optim.Optimizer (or a list of them), or a wrapper of one "
        f"with .optimizer; got {type(seen).__name__}, which is "
        + (
            "an Optimizer whose __init__ was not called (no step hooks) and that wraps none: pass the "
            "optimizer it steps"
            if isinstance(seen, torch.optim.Optimizer)
            else "neither"
        )
    )


def _optimizers(given: object) -> tuple[torch.optim.Optimizer, ...]:
    optimizers = as_tuple(given)
    if not optimizers:
        raise ValueError("distmon: pass the optimizer (or a list of optimizers) that steps the model")
    return tuple(unwrap_optimizer(opt) for opt in optimizers)


class Built(NamedTuple):
    """What one rank builds before the ranks agree: everything that can fail, nothing installed."""

    cfg: MonitorConfig
    optimizers: tuple[torch.optim.Optimizer, ...]  # the torch optimizers that step (unwrapped)
    grouping: Grouping
    plan: RowPlan
    schedule: StepSchedule
    loss_scale: LossScale
    agreed: dict[str, str]
    coords: Coordinates | None  # this rank's place in each parallel dimension (several of them)
    direct: DirectNorm  # the job's global norm from placements alone (checks; clipping an invalid step)
    node_ranks: tuple[int, ...]  # the ranks (of the source's group) whose rows this rank holds: its node's


class Inputs(NamedTuple):
    """What one rank reads of itself before the job's layout is read: what can fail on one rank
    alone (options, optimizers, the model's reading of the layout), nothing built."""

    cfg: MonitorConfig
    optimizers: tuple[torch.optim.Optimizer, ...]
    model: torch.nn.Module | PipelineStage  # what is measured: a stage, a DDP or FSDP2 model, a module
    stage: PipelineStage | None  # the pipeline stage, if the model is one
    module: torch.nn.Module  # the module the optimizer steps
    reading: LayoutReading  # how the model reads the layout (sources.read_layout)
    parts: RankParts  # what this rank tells the job at start-up (census.read_job)


def read_rank(model: torch.nn.Module, optimizer: object, cfg: MonitorConfig) -> Inputs:
    """The optimizers and the model's reading of the layout on this rank, with its validated options
    ``cfg`` (raises what is wrong, naming the option)."""
    stage = pipeline_stage(model)
    if stage is not None:
        if cfg.activations or cfg.precursor:
            raise ValueError(
                f"distmon: {'activations=' if cfg.activations else 'precursor='} is not supported with "
                "pipeline stages yet (each stage watches other modules): leave it out on a "
                "pipeline-parallel job"
            )
        if stage.num_stages != stage.group_size:
            raise ValueError(
                f"distmon: this rank's pipeline stage is one of {stage.num_stages} stages on "
                f"{stage.group_size} ranks: interleaved schedules (several stages per rank) are not "
                "supported yet (distmon measures one stage per rank); use one stage per rank "
                "(ScheduleGPipe, Schedule1F1B)"
            )
    optimizers = _optimizers(optimizer)
    module = trained_module(model)
    own = build_grouping(module, cfg.groups, max_layers=1 << 30)  # the job's cap applies to the union
    meta = [name for name, p in zip(own.param_names, own.params) if p.is_meta]
    if meta:
        raise ValueError(
            f"distmon: parameters {meta[:3]} are on the meta device (no values yet): build GradMonitor "
            "after the model's weights are materialized and initialized (to_empty(), init_weights())"
        )
    reading = read_layout(
        model,
        grouping=own,
        replicated_over=cfg.replicated_over,
        distinct_over=cfg.distinct_over,
        stage=stage,
        job=cfg.job_group,
    )
    unstaged = None
    if stage is None and "torch.distributed.pipelining.stage" in sys.modules:
        unstaged = (
            f"distmon: this rank's {type(module).__name__} holds parameters that other ranks do not (a "
            "pipeline stage), and torch.distributed.pipelining is in use, but no PipelineStage holds "
            "the module passed: the schedule divides its gradients (scale_grads) where distmon could "
            "not follow. Pass the PipelineStage, or build GradMonitor after it (distmon finds the "
            "stage that holds the module passed, plain, DDP- or FSDP2-wrapped)"
        )
    parts = RankParts(
        names=own.param_names,
        tensors=[rank_part(p) for p in own.params],
        positions=[part_position(p) for p in own.params],
        layer_of=[own.layers[i] for i in own.param_layer],
        layers=own.layers,
        counted=reading.counted,
        why=reading.why,
        declared=reading.declared,
        undeclared=reading.undeclared,
        plain=reading.plain,
        unstaged=unstaged,
        stage=stage.stage_index if stage is not None else None,
        distinct=_distinct_groups(own.param_names, cfg.distinct_over),
    )
    return Inputs(
        cfg=cfg, optimizers=optimizers, model=model, stage=stage, module=module, reading=reading, parts=parts
    )


def _distinct_groups(names: Sequence[str], distinct_over: dict | None) -> tuple[int, ...]:
    """Per parameter, a digest of the ranks of the group it is declared ``distinct_over`` (0: none)."""
    if not distinct_over:
        return ()
    digests = {id(g): digest(tuple(dist.get_process_group_ranks(g))) for g in distinct_over.values()}
    matched = (declared_group(name, distinct_over) for name in names)
    return tuple(digests[id(m[1])] if m is not None else 0 for m in matched)


def build_rank(
    planned: Inputs,
    job: JobLayout,
    *,
    errors: ErrorCounter,
    exports: ExportQueue,
    nodes: Nodes | None = None,
    node_group: dist.ProcessGroup | None = None,
) -> Built:
    """The source and the step schedule of one rank, on the layout the job confirmed (raises what is
    wrong, naming the option). The schedule hands its exports to ``exports``; the export thread
    that reads it is built later. ``nodes``: where the job's ranks run (its rows hold its node's
    ranks'; None: every rank's), ``node_group`` their group (``hostinfo.node_group``).
    """
    cfg, optimizers, module, stage = planned.cfg, planned.optimizers, planned.module, planned.stage
    # a pipeline stage, or any job whose ranks hold different layers: the rows hold every part's
    layers = job.layers if stage is not None or job.parts > 1 else None
    grouping = build_grouping(module, cfg.groups, cfg.max_layers, layers=layers)
    n_layers, device = len(grouping.layers), first_device(module)
    loss_scale = LossScale(cfg.scaler, cfg.loss_scale, device, optimizers)
    # a pipeline's backward runs through the stages from the last: each rank knows only its
    # own, so non-finite attribution orders the job's layers the other way round from the model
    fixed = [float(n_layers - 1 - i) for i in range(n_layers)] if layers is not None else None
    sums = BackwardSums(
        n_layers=n_layers, device=device, loss_scale=loss_scale, errors=errors, fixed_order=fixed
    )
    source = source_for(
        planned.model,
        receiver=sums,
        grouping=grouping,
        comm_hook=cfg.comm_hook,
        comm_state=cfg.comm_state,
        stage=stage,
        reading=planned.reading,
        counted=job.counted,
    )
    if stage is not None:  # the schedule scales the stage's gradients: followed
        source = PipelineSource(source, stage, sums)
    if hasattr(source, "steps"):  # a DeepSpeed engine steps its optimizer itself: hooked there
        optimizers = source.steps(optimizers)
    extra = features(cfg, source, grouping, errors, optimizers=optimizers)
    watched = tuple(extra.watch.names) if extra.watch else ()
    node_ranks = ranks_on_node(nodes, source)
    plan = RowPlan.build(
        n_layers=n_layers,
        world=source.world_size,
        node_size=len(node_ranks),
        rank_layers=cfg.rank_layers and source.local_figures,
        in_parts=source.in_parts,
        vote=source.group is not None and cfg.export_interval_s > 0,
        batch=extra.batch_of_step is not None,
        watched=len(watched),
        detector=cfg.detect is not False,
        update_ratio=extra.ratio is not None,
        attention=extra.attention.n if extra.attention else 0,
        oscillation=extra.cosine is not None,
    )
    det_cfg = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
    named = list(zip(grouping.param_names, grouping.params))
    direct = DirectNorm(
        named,
        declared=[*(cfg.replicated_over or ()), *(cfg.distinct_over or ())],
        stage_group=stage.group if stage is not None else None,
    )
    schedule = StepSchedule(
        plan,
        sums=sums,
        source=source,
        group=source.group,
        export_every=cfg.export_every,
        export_interval_s=cfg.export_interval_s,
        errors=errors,
        exports=exports,
        in_parts=source.in_parts,
        detector=DeviceDetector(det_cfg, plan, device, node_ranks) if cfg.detect is not False else None,
        noise=NoiseScale(plan, alpha=cfg.gns_alpha, device=device) if extra.batch_of_step else None,
        batch_size=extra.batch_of_step,
        activations=extra.watch,
        activation_every=cfg.activation_every or cfg.export_every,
        update_ratio=extra.ratio,
        attention=extra.attention,
        cosine=extra.cosine,
        precursor=(
            PrecursorDetector.of(
                extra.precursor,
                blocks=extra.attention.n if extra.attention else 0,
                oscillation=extra.cosine is not None,
                device=device,
            )
            if extra.precursor is not None
            else None
        ),
        check=LayoutCheck(named, source.counted, source.group) if source.counted is not None else None,
        node_ranks=node_ranks,
        node_group=gather_group(source.group, node_ranks, node_group),
    )
    agreed = cfg.agreed(grouping.layers, watched, tuple(extra.attention.names) if extra.attention else ())
    coords = coordinates(
        grouping.params,
        stage=stage.stage_index if stage is not None else job.part if job.parts > 1 else None,
        dp_rank=source.dp_rank,
        meshes=source.meshes,
    )
    return Built(
        coords=coords,
        cfg=cfg,
        optimizers=optimizers,
        grouping=grouping,
        plan=plan,
        schedule=schedule,
        loss_scale=loss_scale,
        agreed=agreed,
        direct=direct,
        node_ranks=node_ranks,
    )


def ranks_on_node(nodes: Nodes | None, source: Source) -> tuple[int, ...]:
    """The ranks of the source's group on this rank's node (all of them when the group is not the
    job's, whose nodes ``nodes`` describes)."""
    world = source.world_size
    if source.group is None:
        return (0,)
    rank = dist.get_rank(source.group)
    if nodes is None or len(nodes.index) != world:
        return tuple(range(world))
    return nodes.ranks_of(nodes.index[rank])


def gather_group(
    group: dist.ProcessGroup | None, node_ranks: tuple[int, ...], node_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """Over which group an export gathers the rows of ``node_ranks``: none when the rank is alone on
    its node, the source's ``group`` when all its ranks are on this node, else the job's
    ``node_group`` (``hostinfo.node_group``: the same ranks, the source's group having the job's)."""
    if group is None or len(node_ranks) == 1:
        return None
    if len(node_ranks) == dist.get_world_size(group):
        return group
    return node_group


def build_exports(
    built: Built,
    *,
    opened: Opened,
    me: RankInfo,
    peers: tuple[RankInfo, ...],
    run_id: str,
    exports: ExportQueue,
    callbacks: AnomalyCallbacks,
    errors: ErrorCounter,
) -> tuple[ExportThread, MetricsAggregate | None]:
    """The exporters of this rank (its endpoint's collector, its JSONL log, the ``on_anomaly``
    ``callbacks``, its trackers) and the export thread that decodes rows for them; the aggregate,
    if it serves. ``peers``: every rank of the job, in rank order."""
    cfg, schedule = built.cfg, built.schedule
    aggregate = None
    if opened.server is not None:
        cluster, served = served_ranks(cfg.serve, me, peers)
        aggregate = MetricsAggregate(
            run_id=run_id,
            world_size=len(peers),
            version=__version__,
            serve=cfg.serve,
            cluster=cluster,
            ranks=served,
            window_s=cfg.window_s,
            rank=me.rank,
            restart=restart_count(),
            own_errors=errors.value,
        )
        opened.server.attach(GradCollector(aggregate))
    workers = [SinkWorker("on_anomaly callbacks", callbacks, errors, want=_has_events)]
    if opened.log is not None:
        workers.append(SinkWorker("JSONL log", opened.log, errors, close=opened.log.close))
    workers += tracker_workers(opened.trackers, errors)  # tracker= (global rank 0's)
    detect = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
    coords = [info.coords for info in peers]
    if schedule.judge.detector is not None and any(coords):  # rank outliers: like against like
        groups: dict[tuple[int | None, ...], list[int]] = {}
        for info in peers:
            groups.setdefault(info.coords.peers() if info.coords else (), []).append(info.rank)
        schedule.judge.detector.compare_within(list(groups.values()))
        schedule.exchange.cross.compare_within(list(groups.values()))
    decoder = RowDecoder(
        built.plan,
        layers=built.grouping.layers,
        run_id=run_id,
        order=schedule.sums.order,
        detector=EventFinder(detect, built.grouping.layers) if cfg.detect is not False else None,
        watched=schedule.activations.names if schedule.activations else (),
        coords=coords if any(coords) else None,
        local_figures=schedule.source.local_figures,
        restart=restart_count(),
        node_ranks=built.node_ranks,
        node=me.node_index,
        attended=schedule.attention.names if schedule.attention else (),
        precursor=schedule.judge.precursor.cfg if schedule.judge.precursor else None,
    )
    # the job's one line on stderr for a non-finite step: from rank 0, which writes its log
    notice = NonfiniteNotice() if me.rank == 0 else None
    thread = ExportThread(
        decoder, queue=exports, aggregate=aggregate, notice=notice, workers=workers, errors=errors
    )
    return thread, aggregate


class Hooks:
    """Everything a monitor hooks into training: the optimizers' step hooks (and the guard), the
    activation and attention hooks, the source's hooks; removed together.

    :meth:`install` (before the ranks agree: all or nothing, what it installed is removed if it
    fails) installs what can be removed again; :meth:`commit` (once every rank started) the
    source, whose DDP comm hook cannot be unregistered.
    """

    def __init__(self, built: Built) -> None:
        cfg, self.schedule = built.cfg, built.schedule
        self.optimizer_hooks = StepHooks(
            self.schedule,
            optimizers=built.optimizers,
            verdict_column=built.plan.verdict_column,
            guard=cfg.guard,
            schedulers=as_tuple(cfg.lr_scheduler or ()),
            scaler=cfg.scaler,
        )

    def install(self) -> None:
        self.optimizer_hooks.install()
        try:
            for watch in (self.schedule.activations, self.schedule.attention):
                if watch is not None:
                    watch.install()
        except BaseException:
            self.remove()
            raise

    def commit(self) -> None:
        self.schedule.source.install()

    def remove(self) -> None:
        self.schedule.source.remove()
        self.optimizer_hooks.remove()
        for watch in (self.schedule.activations, self.schedule.attention):
            if watch is not None:
                watch.remove()


def _has_events(snap: Snapshot) -> bool:
    return bool(snap.events)
