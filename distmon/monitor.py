"""GradMonitor: the composition root. Wires the parts together; starts on every rank or on none.

Each rank builds everything that can fail (``build.py``: options, source, row plan, tracker),
the ranks agree (``lifecycle.py``), then every rank builds its exporters and installs its hooks;
or every rank releases what it prepared and raises the same error. Clipping is ``clip.py``'s,
the shutdown ``lifecycle.py``'s.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
from torch.distributed import ProcessGroup

from . import hostinfo, options
from .activations import ActivationSpec
from .build import Hooks, build_exports, build_rank, node_group, read_rank
from .census import alone, read_job
from .clip import Clipper
from .config import GuardMode, MonitorConfig, Scheduler, ServeMode
from .detectors import DetectorConfig
from .errors import ErrorCounter
from .export_thread import SINK_WAIT_S
from .file_sd import target_host
from .grouping import GroupSpec
from .guard import GradientAnomalyError, warn_uncovered
from .hostinfo import RankInfo
from .lifecycle import EXIT_GATHER_S, ExitGuard, Prepared, agree, announce, prepare, shut_down
from .resume import load_monitor_state, monitor_state
from .ring import ExportBatch
from .sinks import AnomalyCallbacks
from .snapshot import AnomalyEvent, Snapshot
from .sources import CommHook, enclosing, first_device, process_group, trained_module

__all__ = ["GradMonitor", "GradientAnomalyError"]


class GradMonitor:
    """Always-on gradient monitor for a DDP model (or a single process's module), served to Prometheus.

    Measures every step's local and reduced gradients on the device, where the job keeps them
    (DDP: two fused reads where the backward ends, inside a comm hook wrapping ``comm_hook``
    where one is needed; FSDP2: around its reduce-scatter; a plain module in a single process:
    its gradients when the backward ends), hooks the optimizers' ``step`` to begin and end
    each training step, and exports host snapshots every ``export_every`` steps from a
    background thread. Build it on every rank, after ``DDP(...)`` and the optimizers, and close
    it on every rank (or use it as a context manager). Construction is all or nothing on every
    rank: if anything fails on any rank (an option, a port, the log file, the file_sd
    directory), every rank releases what it prepared and raises the same error, naming the
    rank, the option and the path.

    Every option after ``optimizer`` is keyword-only and declared once, in ``distmon/options.py``
    (these entries are rendered from it): one not given is read from its ``DISTMON_*`` variable if
    it has one, else takes its default; all are validated here, before anything is installed.

    Args:
        model: the ``DistributedDataParallel`` model (it may have a comm hook already: pass
            that as ``comm_hook``, DDP accepts one), an FSDP2 model, a pipeline stage (its
            ``PipelineStage``, or the stage's module: distmon finds the stage that holds it), a
            tensor-parallel module, or in a single process the plain module. Whatever it is, the
            job is the default process group (``job_group`` says otherwise), and its layout is
            read from every rank at construction (docs/layouts.md).
        optimizer: the optimizer that steps the model, or a list of them: a training step is
            one backward and one ``step()`` of each.
        {options}

    Example:
        A single process trains a plain module (on DDP: ``GradMonitor(DDP(net), opt)``,
        on every rank):

        >>> net = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> with GradMonitor(net, opt, serve="none") as mon:
        ...     for _ in range(3):
        ...         net(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        >>> snap = mon.latest()
        >>> snap.step, round(snap.grad_norm, 3)   # d(sum of 2 outputs)/d(w, b): [2, 2, 2, 2, 2]
        (3, 4.472)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        comm_hook: CommHook | None = None,
        comm_state: object = None,
        replicated_over: dict[str, ProcessGroup] | None = None,
        distinct_over: dict[str, ProcessGroup] | None = None,
        job_group: ProcessGroup | None = None,
        export_every: int | None = None,
        export_interval_s: float | None = None,
        groups: GroupSpec = None,
        max_layers: int | None = None,
        rank_layers: bool | None = None,
        serve: ServeMode | None = None,
        port: int | None = None,
        addr: str | None = None,
        port_fallback: bool | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        basic_auth_file: str | None = None,
        run_id: str | None = None,
        log_path: str | None = None,
        file_sd_dir: str | None = None,
        linger_s: float | None = None,
        window_s: float | None = None,
        detect: bool | DetectorConfig | None = None,
        guard: GuardMode | None = None,
        lr_scheduler: Scheduler | Sequence[Scheduler] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        loss_scale: float | None = None,
        batch_size: float | Callable[[], float] | None = None,
        gns_alpha: float | None = None,
        activations: ActivationSpec = None,
        activation_every: int | None = None,
        update_ratio: bool | None = None,
    ) -> None:
        self._closed = True  # until every rank has started
        # The options, validated once (an environment variable may fail on one rank only: the
        # error is raised on every rank once they meet, below).
        cfg: MonitorConfig | None = None
        failure: Exception | None = None
        try:
            cfg = MonitorConfig.from_options(
                comm_hook=comm_hook,
                comm_state=comm_state,
                replicated_over=replicated_over,
                distinct_over=distinct_over,
                job_group=job_group,
                export_every=export_every,
                export_interval_s=export_interval_s,
                groups=groups,
                max_layers=max_layers,
                rank_layers=rank_layers,
                serve=serve,
                port=port,
                addr=addr,
                port_fallback=port_fallback,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls_client_ca=tls_client_ca,
                basic_auth_file=basic_auth_file,
                run_id=run_id,
                log_path=log_path,
                file_sd_dir=file_sd_dir,
                linger_s=linger_s,
                window_s=window_s,
                detect=detect,
                guard=guard,
                lr_scheduler=lr_scheduler,
                scaler=scaler,
                loss_scale=loss_scale,
                batch_size=batch_size,
                gns_alpha=gns_alpha,
                activations=activations,
                activation_every=activation_every,
                update_ratio=update_ratio,
            )
        except Exception as e:
            failure = e
        # the object that holds what was passed (a stage's module: its PipelineStage), measured as if passed
        model = enclosing(model)
        # the job: where its ranks read the layout and agree (a rank whose options failed meets the
        # others over the group it was given)
        group = process_group(cfg.job_group if cfg is not None else job_group)
        me = hostinfo.local_rank_info(group, first_device(trained_module(model)))
        me, nodes = hostinfo.nodes_of(me, group)  # every rank, whatever happened: a collective
        self._errors = ErrorCounter()
        exports: queue.Queue[ExportBatch | None] = queue.Queue()
        # Everything that can fail, on this rank: read, then (once the job read its layout) built,
        # bound, hooked where it can be undone.
        planned, built, hooks, proposal, prepared = None, None, None, None, Prepared()
        try:
            if cfg is not None:
                planned = read_rank(model, optimizer, cfg)
        except Exception as e:
            failure = e
        # every rank, whatever happened to it: the layout read from the whole job (collectives)
        parts, job = (planned.parts if planned is not None else None), None
        try:
            job = read_job(parts, group) if group is not None else parts and alone(parts)
        except Exception as e:
            failure = e
        try:
            if failure is None and job is not None:  # None: another rank failed (agree() raises its error)
                if job.refusal is not None:
                    raise job.refusal
                built = build_rank(planned, job, errors=self._errors, exports=exports, nodes=nodes)
                proposal = hostinfo.resolve_run_id(built.cfg.run_id)  # rank 0's run id wins
                prepared = prepare(built.cfg, me, proposal)
                hooks = Hooks(built)
                hooks.install()  # all or nothing
        except Exception as e:
            failure = e
            hooks = None
        try:
            peers = agree(
                replace(me, coords=built and built.coords),
                proposal,
                endpoint=prepared.endpoint,
                failure=failure,
                group=group,
                agreed=built and built.agreed,
            )
        except BaseException:
            if hooks is not None:
                hooks.remove()
            prepared.release()
            raise
        assert built is not None and hooks is not None  # agree() raised on every rank if any failed
        try:
            built.tracker.exchange.join_node(node_group(built))
        except BaseException:
            hooks.remove()
            prepared.release()
            raise

        # Every rank is ready: the exporters, the export thread, the hooks. Nothing below raises.
        self.config, tracker = built.cfg, built.tracker
        self.run_id: str = peers[0].run_id or ""
        self.rank: int = me.rank
        self.world_size: int = len(peers)
        self.rank_infos: tuple[RankInfo, ...] = tuple(p.info for p in peers)
        self.layers: tuple[str, ...] = built.grouping.layers
        self._tracker, self._prepared = tracker, prepared
        self._clip = Clipper(
            tracker, params=built.grouping.params, loss_scale=built.loss_scale, direct=built.direct
        )
        self._callbacks = AnomalyCallbacks(self._errors)
        self._export, self._aggregate = build_exports(
            built,
            prepared=prepared,
            me=me,
            peers_info=self.rank_infos,
            run_id=self.run_id,
            exports=exports,
            callbacks=self._callbacks,
            errors=self._errors,
        )
        self._hooks = hooks
        hooks.commit()
        self._closed = False
        # if close() is never called; its key is this monitor's in the job's store (rank 0's nonce)
        self._exit = ExitGuard(
            self._close, rank=me.rank, world=len(peers), key=f"distmon/exit/{peers[0].nonce}"
        )
        warn_uncovered(list(zip(built.grouping.param_names, built.grouping.params)), built.optimizers)
        announce(prepared, peers=peers, run_id=self.run_id, url=self.metrics_url, errors=self._errors)

    # -- public API -------------------------------------------------------------------------
    def on_anomaly(
        self, fn: Callable[[AnomalyEvent, Snapshot], None]
    ) -> Callable[[AnomalyEvent, Snapshot], None]:
        """Call ``fn(event, snapshot)`` for every detector event (usable as a decorator).

        Runs on a thread of its own when the step is exported (up to ``export_every`` steps
        later), behind a bounded queue: a slow callback never holds training (decisions before
        the step: ``guard``). Exceptions are counted and logged once.

        Example:
            >>> @mon.on_anomaly                                       # doctest: +SKIP
            ... def page(event, snap):
            ...     print(event.kind, event.step, event.rank, event.layer)
        """
        self._callbacks.add(fn)
        return fn

    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the monitored parameters, with the norm already measured.

        Call on every rank, after ``backward()`` and before the optimizer step (with a
        ``GradScaler``, before or after ``scaler.unscale_(opt)``, like torch's). No pass over
        the gradients and no host sync, but once (``clip.py`` says why); a closed monitor raises.

        Example:
            >>> scaler.scale(loss).backward()      # doctest: +SKIP
            >>> scaler.unscale_(opt)               # doctest: +SKIP
            >>> norm = mon.clip_grad_norm_(1.0)    # doctest: +SKIP
            >>> scaler.step(opt); scaler.update()  # doctest: +SKIP
        """
        if self._closed:
            raise RuntimeError(
                "distmon: clip_grad_norm_ on a closed GradMonitor (it no longer measures "
                "gradients); use torch.nn.utils.clip_grad_norm_"
            )
        return self._clip(max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def port(self) -> int | None:
        """The port this process serves metrics on, or None if it does not serve (or is closed)."""
        server = self._prepared.server
        return server.port if server and not self._closed else None

    @property
    def metrics_url(self) -> str | None:
        """Where this process serves its metrics (``http(s)://host:port/metrics``), or None."""
        server = self._prepared.server
        return server.url(target_host(self.config.addr)) if server and self.port is not None else None

    @property
    def step(self) -> int:
        """Training steps finished so far (the first is 1): what a snapshot's ``step`` counts."""
        return self._tracker.step

    def latest(self) -> Snapshot | None:
        """The newest exported snapshot (None before the first export). Never blocks.

        Example:
            >>> net = torch.nn.Linear(2, 1)
            >>> mon = GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none")
            >>> mon.latest() is None   # nothing exported yet
            True
            >>> mon.close()
        """
        return self._export.latest

    def state_dict(self) -> dict[str, object]:
        """What the run carries across a restart: its step count, what the detectors and the noise
        scale have learned (``distmon/resume.py``). Plain lists and numbers, alike on every rank.

        Save it with the model and optimizer (``torch.save``; with ``torch.distributed.checkpoint``
        the monitor is itself a ``Stateful``). Call it on every rank at the same point: it exports
        the steps since the last export first, as :meth:`flush` does.

        Example:
            >>> torch.save({"model": model.state_dict(), "distmon": mon.state_dict()}, path)  # doctest: +SKIP
            >>> mon = GradMonitor(model, opt)                                  # doctest: +SKIP
            >>> mon.load_state_dict(torch.load(path)["distmon"])               # doctest: +SKIP
        """
        if self._tracker.measured_steps:  # not for steps that measured nothing (dcp.load's lr-0 step)
            self.flush()
        judge, decoder = self._tracker.judge, self._export.decoder.detector
        return monitor_state(
            step=self.step,
            layers=self.layers,
            world=self.world_size,
            detector=judge.detector,
            noise=judge.noise,
            scaler_run=decoder.scaler_run if decoder else 0,
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume from :meth:`state_dict`'s ``state``: the next step is its step + 1, judged against what
        the run had learned. On every rank, right after building the monitor, before the first step.
        Another model or ``groups=`` is refused (``ValueError``); another world size keeps all but the
        rank-outlier scales."""
        judge, decoder = self._tracker.judge, self._export.decoder
        step, scaler_run = load_monitor_state(
            state,
            counted=self._tracker.measured_steps,
            layers=self.layers,
            world=self.world_size,
            detector=judge.detector,
            noise=judge.noise,
        )
        self._tracker.resume_at(step)
        decoder.resumed_from = step
        if decoder.detector is not None:
            decoder.detector.scaler_run = scaler_run

    def flush(self) -> Snapshot | None:
        """Export every finished step now and wait until the exporters have it (at most 10 s for a sink).

        May synchronize with the device: call it in tests, at evaluation points or at the
        end of training, not every step. Call it on every rank at the same point of the loop:
        the other ranks' figures of the steps since the last export come in one all-gather.
        After ``close()`` it only returns :meth:`latest`.
        """
        if not self._closed:
            self._tracker.export(gather=True)
            self._export.drain(SINK_WAIT_S)
        return self.latest()

    def close(self, finished: bool = True) -> None:
        """Flush, stop measuring, mark the run finished, linger, stop serving. Idempotent.

        Call on every rank at the same point of training (the monitor's per-step collective
        stops with it). ``finished=False`` (used on an exception) skips the clean-finish mark,
        the linger and the all-gather (the other ranks may not be closing: the steps since the
        last export are exported with this rank's figures only, the others' as not measured),
        so the run reads as having died. Called while an exception propagates (in a ``finally``
        or ``except`` block) it closes so too, as a ``with`` block does: a peer still blocked in
        a reduction with this rank never joins a gather, and the job would hang instead of failing.
        Afterwards ``latest()``, ``step`` and ``flush()`` report the final state,
        ``clip_grad_norm_`` raises, and the model trains exactly as without distmon. Never called:
        it runs at exit, said on stderr (``lifecycle.ExitGuard``).
        """
        finished = finished and sys.exc_info()[1] is None
        self._close(finished, gather=finished, timeout_s=None if finished else EXIT_GATHER_S)

    def _close(self, finished: bool, gather: bool, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._exit.disarm()
        try:
            self._tracker.export(gather, timeout_s)
            self._export.drain(SINK_WAIT_S)
        finally:
            self._closed = True
            self._tracker.close()
            self._hooks.remove()
            shut_down(
                self._prepared,
                export=self._export,
                aggregate=self._aggregate,
                cfg=self.config,
                finished=finished,
                errors=self._errors,
            )

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.close(finished=exc_type is None)


# help(GradMonitor) documents every option: its Args entries are rendered from their declarations
GradMonitor.__doc__ = (GradMonitor.__doc__ or "").replace(
    "        {options}\n", options.options_args() + "\n"
)
