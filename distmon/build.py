"""What a monitor is made of, built in order: on every rank before the ranks agree, and after.

:func:`build_rank` builds everything that can fail on one rank, nothing installed, from the
options ``GradMonitor`` validated once (``config.py``): the layer groups, the sums the source
hands over (``backward.py``), the source (``sources/``), the row plan (``rows.py``), the opt-in
features, the detector and the noise scale, and the step tracker (``tracker.py``). Once every rank agreed,
:func:`build_exports` builds the exporters and the export thread that feeds them.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._version import __version__
from .backward import BackwardSums
from .config import MonitorConfig, features
from .decode import RowDecoder
from .detectors import DetectorConfig, DetectorDecoder, DeviceDetector
from .errors import ErrorCounter
from .export_thread import ExportThread
from .grouping import Grouping, build_grouping
from .guard import StepHooks
from .hostinfo import RankInfo, restart_count
from .layout import Coordinates, coordinates
from .lifecycle import Prepared, served_ranks, stage_layers
from .loss_scale import LossScale
from .noise_scale import NoiseScale
from .prometheus_exporter import GradCollector, MetricsAggregate
from .ring import ExportBatch
from .rows import RowPlan
from .sinks import NonfiniteNotice, Sink, SinkWorker
from .snapshot import Snapshot
from .sources import PipelineSource, first_device, pipeline_stage, source_for, trained_module
from .tracker import StepTracker
from .verify import DirectNorm, LayoutCheck

__all__ = ["Built", "Hooks", "build_rank", "build_exports", "as_tuple", "unwrap_optimizer"]

ExportQueue = queue.Queue[ExportBatch | None]


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
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks"):
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
    tracker: StepTracker
    loss_scale: LossScale
    agreed: dict[str, str]
    coords: Coordinates | None  # this rank's place in each parallel dimension (several of them)
    direct: DirectNorm  # the job's global norm from placements alone (checks; clipping an invalid step)


def pipeline_layers(
    model: torch.nn.Module,
    cfg: MonitorConfig | None,
    failure: Exception | None,
    *,
    me: RankInfo,
    group: dist.ProcessGroup | None,
) -> tuple[str, ...] | None:
    """A pipeline stage's job: every stage's layers, agreed by all ranks (None for other models).

    Each stage holds its own layers; the rows hold every stage's, in pipeline order. Called on
    every rank before anything else is built, with the validated options (or why they failed:
    ``cfg`` None); a failure on any rank raises alike on every one.
    """
    stage = pipeline_stage(model)
    if stage is None:
        return None
    names = None
    try:
        if cfg is None:
            raise failure  # type: ignore[misc]  # set whenever cfg is not
        if cfg.activations:
            raise ValueError(
                "distmon: activations= is not supported with pipeline stages yet (each stage watches "
                "other modules)"
            )
        if stage.num_stages != stage.group_size:
            raise ValueError(
                f"distmon: this rank's pipeline stage is one of {stage.num_stages} stages on "
                f"{stage.group_size} ranks: interleaved schedules (several stages per rank) are not "
                "supported yet (distmon measures one stage per rank); use one stage per rank "
                "(ScheduleGPipe, Schedule1F1B)"
            )
        names = build_grouping(trained_module(model), cfg.groups, max_layers=1 << 30).layers
    except Exception as e:
        failure = e
    return stage_layers(me, stage=stage.stage_index, layers=names, failure=failure, group=group)


def build_rank(
    model: torch.nn.Module,
    optimizer: object,
    cfg: MonitorConfig,
    *,
    errors: ErrorCounter,
    exports: ExportQueue,
    layers: tuple[str, ...] | None = None,
) -> Built:
    """The source and the step tracker of one rank, from its validated options ``cfg`` (raises what
    is wrong, naming the option).

    The tracker hands its exports to ``exports``; the export thread that reads it is built later.
    ``layers``: the job's layers, when this rank's module holds some of them (a pipeline stage).
    """
    optimizers = _optimizers(optimizer)
    module = trained_module(model)
    grouping = build_grouping(module, cfg.groups, cfg.max_layers, layers=layers)
    n_layers, device = len(grouping.layers), first_device(module)
    loss_scale = LossScale(cfg.scaler, cfg.loss_scale, device, optimizers)
    # a pipeline's backward runs through the stages from the last: each rank knows only its
    # own, so non-finite attribution orders the job's layers the other way round from the model
    fixed = [float(n_layers - 1 - i) for i in range(n_layers)] if layers is not None else None
    sums = BackwardSums(
        n_layers=n_layers, device=device, loss_scale=loss_scale, errors=errors, fixed_order=fixed
    )
    stage = pipeline_stage(model)
    source = source_for(
        model,
        receiver=sums,
        grouping=grouping,
        comm_hook=cfg.comm_hook,
        comm_state=cfg.comm_state,
        replicated_over=cfg.replicated_over,
        stage=stage,
    )
    if stage is not None:  # the schedule scales the stage's gradients: followed
        source = PipelineSource(source, stage, sums)
    if hasattr(source, "steps"):  # a DeepSpeed engine steps its optimizer itself: hooked there
        optimizers = source.steps(optimizers)
    extra = features(cfg, source, grouping, errors)
    watched = tuple(extra.watch.names) if extra.watch else ()
    plan = RowPlan.build(
        n_layers=n_layers,
        world=source.world_size,
        rank_layers=cfg.rank_layers,
        partial=source.partial,
        vote=source.group is not None and cfg.export_interval_s > 0,
        batch=extra.batch_of_step is not None,
        watched=len(watched),
        detector=cfg.detect is not False,
        update_ratio=extra.ratio is not None,
    )
    det_cfg = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
    direct = DirectNorm(
        list(zip(grouping.param_names, grouping.params)),
        declared=cfg.replicated_over or {},
        stage_group=stage.group if stage is not None else None,
    )
    tracker = StepTracker(
        plan,
        sums=sums,
        source=source,
        group=source.group,
        export_every=cfg.export_every,
        export_interval_s=cfg.export_interval_s,
        errors=errors,
        export=exports.put,
        partial=source.partial,
        detector=DeviceDetector(det_cfg, plan, device) if cfg.detect is not False else None,
        noise=NoiseScale(plan, alpha=cfg.gns_alpha, device=device) if extra.batch_of_step else None,
        batch_size=extra.batch_of_step,
        activations=extra.watch,
        activation_every=cfg.activation_every or cfg.export_every,
        update_ratio=extra.ratio,
        check=LayoutCheck(direct, source.counted) if source.counted is not None else None,
    )
    agreed = cfg.agreed(grouping.layers, watched)
    coords = coordinates(
        grouping.params,
        stage=stage.stage_index if stage is not None else None,
        dp_rank=source.dp_rank,
        meshes=source.meshes,
    )
    return Built(
        coords=coords,
        cfg=cfg,
        optimizers=optimizers,
        grouping=grouping,
        plan=plan,
        tracker=tracker,
        loss_scale=loss_scale,
        agreed=agreed,
        direct=direct,
    )


def build_exports(
    built: Built,
    *,
    prepared: Prepared,
    me: RankInfo,
    peers_info: tuple[RankInfo, ...],
    run_id: str,
    exports: ExportQueue,
    callbacks: Callable[[Sequence[Snapshot]], None],
    errors: ErrorCounter,
) -> tuple[ExportThread, MetricsAggregate | None]:
    """The exporters of this rank (its endpoint's collector, its JSONL log, the ``on_anomaly``
    ``callbacks``) and the export thread that decodes rows for them; the aggregate, if it serves."""
    cfg, tracker = built.cfg, built.tracker
    inline: list[Sink] = []
    aggregate = None
    if prepared.server is not None:
        cluster, served = served_ranks(cfg.serve, me, peers_info)
        aggregate = MetricsAggregate(
            run_id=run_id,
            world_size=len(peers_info),
            version=__version__,
            serve=cfg.serve,
            cluster=cluster,
            ranks=served,
            window_s=cfg.window_s,
            rank=me.rank,
            restart=restart_count(),
            own_errors=errors.value,
        )
        prepared.server.attach(GradCollector(aggregate))
        inline.append(aggregate.add)
    if me.rank == 0:  # one line for the job, from the rank that writes its log
        inline.append(NonfiniteNotice())
    workers = [SinkWorker("on_anomaly callbacks", callbacks, errors, want=_has_events)]
    if prepared.log is not None:
        workers.append(SinkWorker("JSONL log", prepared.log, errors, close=prepared.log.close))
    detect = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
    coords = [info.coords for info in peers_info]
    if tracker.judge.detector is not None and any(coords):  # rank outliers: like against like
        groups: dict[tuple[int | None, ...], list[int]] = {}
        for info in peers_info:
            groups.setdefault(info.coords.peers() if info.coords else (), []).append(info.rank)
        tracker.judge.detector.compare_within(list(groups.values()))
    decoder = RowDecoder(
        built.plan,
        layers=built.grouping.layers,
        run_id=run_id,
        order=tracker.sums.order,
        detector=DetectorDecoder(detect, built.grouping.layers) if cfg.detect is not False else None,
        watched=tracker.activations.names if tracker.activations else (),
        coords=coords if any(coords) else None,
        restart=restart_count(),
    )
    thread = ExportThread(decoder, queue=exports, inline=inline, workers=workers, errors=errors)
    return thread, aggregate


class Hooks:
    """Everything a monitor hooks into training: the optimizers' step hooks (and the guard), the
    activation hooks, the source's hooks; removed together.

    :meth:`install` (before the ranks agree: all or nothing, what it installed is removed if it
    fails) installs what can be removed again; :meth:`commit` (once every rank started) the
    source, whose DDP comm hook cannot be unregistered.
    """

    def __init__(self, built: Built) -> None:
        cfg, self.tracker = built.cfg, built.tracker
        self.steps = StepHooks(
            self.tracker,
            optimizers=built.optimizers,
            verdict_column=built.plan.verdict_column,
            guard=cfg.guard,
            schedulers=as_tuple(cfg.lr_scheduler or ()),
            scaler=cfg.scaler,
        )

    def install(self) -> None:
        self.steps.install()
        try:
            if self.tracker.activations is not None:
                self.tracker.activations.install()
        except BaseException:
            self.remove()
            raise

    def commit(self) -> None:
        self.tracker.source.install()

    def remove(self) -> None:
        self.tracker.source.remove()
        self.steps.remove()
        if self.tracker.activations is not None:
            self.tracker.activations.remove()


def _has_events(snap: Snapshot) -> bool:
    return bool(snap.events)
