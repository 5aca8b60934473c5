"""A monitor's start, on every rank or on none: read, build, agree, then wire the exporters.

Every rank goes through every collective here, whatever happened to it before (a failure is
kept, not raised), so that a rank whose options fail meets the others and every rank raises
the same error (``lifecycle.agree``):

1. the options validated (:class:`~distmon.setup.config.MonitorConfig`), the object handed over
   resolved to what holds it (a stage's module: its ``PipelineStage``), the job's group;
2. who each rank is and where it runs (``hostinfo``: a collective), the node's group;
3. what this rank reads of itself (``build.read_rank``), the layout read from the whole job
   (``census.read_job``: collectives), what it builds (``build.build_rank``), its endpoint, log
   and target file opened and its removable hooks installed (``lifecycle.prepare``, ``Hooks``);
4. the ranks agree (one collective): all go on, or all release what they opened and raise;
5. the exporters and the export thread (``build.build_exports``), the source's hooks committed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import ErrorCounter
from ..export.export_thread import ExportThread
from ..export.sinks import AnomalyCallbacks
from ..layout.census import alone, read_job
from ..serve.prometheus_exporter import MetricsAggregate
from ..sources import enclosing, first_device, process_group, trained_module
from ..step.clip import Clipper
from ..step.optimizer_hooks import warn_uncovered
from ..step.ring import ExportQueue
from . import hostinfo
from .build import Built, Hooks, build_exports, build_rank, read_rank
from .config import MonitorConfig
from .lifecycle import Opened, Peer, agree, prepare

__all__ = ["Started", "start"]


@dataclass(frozen=True)
class Started:
    """A monitor once every rank started: its parts, wired (what ``GradMonitor`` holds)."""

    built: Built  # the options, the layer groups, the step schedule, ...
    me: hostinfo.RankInfo
    peers: tuple[Peer, ...]  # every rank's, in rank order (the job's)
    opened: Opened  # this rank's endpoint, log and target file
    hooks: Hooks
    export: ExportThread
    aggregate: MetricsAggregate | None  # what this rank's endpoint serves, if it serves
    callbacks: AnomalyCallbacks
    clip: Clipper
    errors: ErrorCounter

    @property
    def run_id(self) -> str:
        return self.peers[0].run_id or ""  # rank 0's proposal


def start(model: torch.nn.Module, optimizer: object, options: Mapping[str, object]) -> Started:
    """Start a monitor of ``model`` and ``optimizer`` with ``options`` (``None``: not given), on every
    rank or on none: raises on every rank alike, naming the rank, the option and the path."""
    cfg: MonitorConfig | None = None
    failure: Exception | None = None
    try:
        cfg = MonitorConfig.from_options(**options)
    except Exception as e:
        failure = e
    model = enclosing(model)  # a stage's module: its PipelineStage, measured as if passed
    # the job: where its ranks read the layout and agree (a rank whose options failed meets the
    # others over the group it was given)
    group = process_group(cfg.job_group if cfg is not None else options.get("job_group"))
    me = hostinfo.local_rank_info(group, first_device(trained_module(model)))
    me, nodes = hostinfo.nodes_of(me, group)  # every rank, whatever happened: a collective
    node_group = hostinfo.node_group(nodes, group)  # only the node's ranks take part
    errors, exports = ErrorCounter(), ExportQueue()
    inputs, built, hooks, proposal, opened = None, None, None, None, Opened()
    try:
        if cfg is not None:
            inputs = read_rank(model, optimizer, cfg)
    except Exception as e:
        failure = e
    # every rank, whatever happened to it: the layout read from the whole job (collectives)
    parts, job = (inputs.parts if inputs is not None else None), None
    try:
        job = read_job(parts, group) if group is not None else parts and alone(parts)
    except Exception as e:
        failure = e
    try:
        if failure is None and job is not None:  # None: another rank failed (agree() raises its error)
            if job.refusal is not None:
                raise job.refusal
            built = build_rank(
                inputs, job, errors=errors, exports=exports, nodes=nodes, node_group=node_group
            )
            proposal = hostinfo.resolve_run_id(built.cfg.run_id)  # rank 0's run id wins
            opened = prepare(built.cfg, me, proposal)
            hooks = Hooks(built)
            hooks.install()  # all or nothing
    except Exception as e:
        failure = e
        hooks = None
    try:
        coords = built.coords if built is not None else None
        peers = agree(
            replace(me, coords=coords),
            proposal,
            endpoint=opened.endpoint,
            failure=failure,
            group=group,
            agreed=built.agreed if built is not None else None,
        )
    except BaseException:
        if hooks is not None:
            hooks.remove()
        opened.release()
        raise
    assert built is not None and hooks is not None  # agree() raised on every rank if any failed
    # Every rank is ready: the exporters, the export thread, the source's hooks. Nothing raises.
    callbacks = AnomalyCallbacks(errors)
    run_id = peers[0].run_id or ""
    export, aggregate = build_exports(
        built,
        opened=opened,
        me=me,
        peers=_infos(peers),
        run_id=run_id,
        exports=exports,
        callbacks=callbacks,
        errors=errors,
    )
    hooks.commit()
    grouping = built.grouping
    warn_uncovered(list(zip(grouping.param_names, grouping.params)), built.optimizers)
    clip = Clipper(built.schedule, params=grouping.params, loss_scale=built.loss_scale, direct=built.direct)
    return Started(
        built=built,
        me=me,
        peers=tuple(peers),
        opened=opened,
        hooks=hooks,
        export=export,
        aggregate=aggregate,
        callbacks=callbacks,
        clip=clip,
        errors=errors,
    )


def _infos(peers: Sequence[Peer]) -> tuple[hostinfo.RankInfo, ...]:
    return tuple(p.info for p in peers)
