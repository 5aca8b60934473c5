"""GradMonitor: the public face of a monitor; its parts are built and wired in ``setup/start.py``.

The constructor starts the monitor on every rank or on none (``setup/start.py``: each rank
builds what can fail, the ranks agree, then the exporters are wired), the methods delegate:
clipping to ``step/clip.py``, the state across restarts to ``verdicts/resume.py``, the shutdown
to ``setup/lifecycle.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from . import options
from .export.export_thread import SINK_WAIT_S
from .export.trackers import TrackerSpec
from .layout.grouping import GroupSpec
from .options import BY_NAME
from .serve.file_sd import target_host
from .setup.config import GuardMode, MonitorConfig, Scheduler, ServeMode
from .setup.hostinfo import RankInfo
from .setup.lifecycle import EXIT_GATHER_S, ExitGuard, announce, shut_down
from .setup.off_switch import agreed_off
from .setup.start import start
from .snapshot import AnomalyEvent, Snapshot
from .sources import CommHook, process_group, trained_module
from .step.activations import ActivationSpec
from .step.optimizer_hooks import GradientAnomalyError
from .verdicts.detectors import DetectorConfig
from .verdicts.precursor import PrecursorConfig
from .verdicts.resume import disabled_state, load_monitor_state, monitor_state

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

    ``DISTMON_DISABLE=1`` on every rank turns it off without a code change: the constructor
    then installs, serves, writes and starts nothing (one small all-reduce at construction agrees
    the switch across ranks; ranks that disagree are refused), and each method says below what
    it does on such a monitor (docs/options.md#turning-distmon-off).

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

    config: MonitorConfig | None  # the options, validated (None when disabled: nothing is read)
    run_id: str  # rank 0's: every series' run_id label
    rank: int  # this process's rank in the job
    world_size: int  # the job's ranks
    rank_infos: tuple[RankInfo, ...]  # who each rank is, in rank order
    layers: tuple[str, ...]  # the layer groups reported, in model order
    disabled: bool  # DISTMON_DISABLE turned it off: it measures, serves and writes nothing

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
        tracker: TrackerSpec | Sequence[TrackerSpec] | None = None,
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
        precursor: bool | PrecursorConfig | None = None,
    ) -> None:
        self._closed = True  # until every rank has started
        # the options as given (None: not given); locals() is evaluated here, in __init__'s scope
        given = {name: value for name, value in locals().items() if name in BY_NAME}
        off = agreed_off(process_group(given.get("job_group")))  # one collective, on every rank
        self.disabled = off is not None
        if off is not None:  # DISTMON_DISABLE: nothing is built, installed or started
            self.config, self.run_id, self.rank, self.world_size = None, "", off.rank, off.world_size
            self.rank_infos, self.layers, self._model = (), (), model
            return
        run = start(model, optimizer, given)
        self.config, self.run_id, self.rank = run.built.cfg, run.run_id, run.me.rank
        self.world_size, self.rank_infos = len(run.peers), tuple(p.info for p in run.peers)
        self.layers = run.built.grouping.layers
        self._run, self._schedule, self._export, self._closed = run, run.built.schedule, run.export, False
        # closes the monitor at exit if close() is never called; keyed in the store by rank 0's nonce
        self._exit = ExitGuard(
            self._close, rank=self.rank, world=self.world_size, key=f"distmon/exit/{run.peers[0].nonce}"
        )
        announce(run.opened, peers=run.peers, run_id=self.run_id, url=self.metrics_url, errors=run.errors)

    # -- public API -------------------------------------------------------------------------
    def on_anomaly(
        self, fn: Callable[[AnomalyEvent, Snapshot], None]
    ) -> Callable[[AnomalyEvent, Snapshot], None]:
        """Call ``fn(event, snapshot)`` for every detector event (usable as a decorator).

        Runs on a thread of its own when the step is exported (up to ``export_every`` steps
        later), behind a bounded queue: a slow callback never holds training (decisions before
        the step: ``guard``). Exceptions are counted and logged once. A disabled monitor
        (``DISTMON_DISABLE``) never calls ``fn``.

        Example:
            >>> @mon.on_anomaly                                       # doctest: +SKIP
            ... def page(event, snap):
            ...     print(event.kind, event.step, event.rank, event.layer)
        """
        if not self.disabled:
            self._run.callbacks.add(fn)
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
        A disabled monitor (``DISTMON_DISABLE``) calls ``torch.nn.utils.clip_grad_norm_`` over the
        trainable parameters of the model it was given, so the loop clips as it would without
        distmon (on DDP, FSDP2 and one process the same norm; a pipeline stage clips by its own).

        Example:
            >>> scaler.scale(loss).backward()      # doctest: +SKIP
            >>> scaler.unscale_(opt)               # doctest: +SKIP
            >>> norm = mon.clip_grad_norm_(1.0)    # doctest: +SKIP
            >>> scaler.step(opt); scaler.update()  # doctest: +SKIP
        """
        if self.disabled:
            params = [p for p in trained_module(self._model).parameters() if p.requires_grad]
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
            )
        if self._closed:
            raise RuntimeError(
                "distmon: clip_grad_norm_ on a closed GradMonitor (it no longer measures "
                "gradients); use torch.nn.utils.clip_grad_norm_"
            )
        return self._run.clip(max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def port(self) -> int | None:
        """The port this process serves metrics on, or None if it does not serve (or is closed or
        disabled)."""
        if self.disabled:
            return None
        server = self._run.opened.server
        return server.port if server and not self._closed else None

    @property
    def metrics_url(self) -> str | None:
        """Where this process serves its metrics (``http(s)://host:port/metrics``), or None."""
        if self.port is None:
            return None
        return self._run.opened.server.url(target_host(self.config.addr))

    @property
    def step(self) -> int:
        """Training steps finished so far (the first is 1): what a snapshot's ``step`` counts (0 on a
        disabled monitor, which counts nothing)."""
        return 0 if self.disabled else self._schedule.step

    def latest(self) -> Snapshot | None:
        """The newest exported snapshot (None before the first export, and always on a disabled
        monitor). Never blocks.

        Example:
            >>> net = torch.nn.Linear(2, 1)
            >>> mon = GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none")
            >>> mon.latest() is None   # nothing exported yet
            True
            >>> mon.close()
        """
        return None if self.disabled else self._export.latest

    def state_dict(self) -> dict[str, object]:
        """What the run carries across a restart: its step count, what the detectors and the noise
        scale have learned (``distmon/verdicts/resume.py``). Plain lists and numbers, alike on every rank.

        Save it with the model and optimizer (``torch.save``; with ``torch.distributed.checkpoint``
        the monitor is itself a ``Stateful``), on every rank or on one (the usual ``if rank == 0:``
        checkpoint), at any step: no collective, and the run goes on as if it had not been called.
        The rank-outlier scales and the noise scale are as of the latest export (at most
        ``export_every - 1`` steps before: the other ranks' figures of the steps since are theirs
        until the next export); the rest is as of the latest step. A disabled monitor returns
        ``{"version": STATE_VERSION, "disabled": True}``: a monitor that loads it starts afresh.

        Example:
            >>> if rank == 0:                                                  # doctest: +SKIP
            ...     torch.save({"model": model.state_dict(), "distmon": mon.state_dict()}, path)
            >>> mon = GradMonitor(model, opt)                                  # doctest: +SKIP
            >>> mon.load_state_dict(torch.load(path)["distmon"])               # doctest: +SKIP
        """
        if self.disabled:
            return disabled_state()
        detector, noise, precursor = self._schedule.learned()
        return monitor_state(
            step=self.step,
            layers=self.layers,
            world=self.world_size,
            detector=detector,
            noise=noise,
            scaler_run=self._schedule.scaler_run,
            precursor=precursor,
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume from :meth:`state_dict`'s ``state``: the next step is its step + 1, judged against what
        the run had learned. On every rank, right after building the monitor, before the first step.
        Another model or ``groups=`` is refused (``ValueError``); another world size keeps all but the
        rank-outlier scales. A state a disabled monitor saved starts the run afresh (said in a warning);
        a disabled monitor ignores ``state``."""
        if self.disabled:
            return
        judge, decoder = self._schedule.judge, self._export.decoder
        resumed = load_monitor_state(
            state,
            measured_steps=self._schedule.measured_steps,
            layers=self.layers,
            world=self.world_size,
            detector=judge.detector,
            noise=judge.noise,
            precursor=judge.precursor,
        )
        if resumed is None:  # saved by a disabled monitor: nothing to resume
            return
        step, scaler_run = resumed
        self._schedule.resume_at(step)
        self._schedule.scaler_run = scaler_run
        decoder.resumed_from = step
        if decoder.detector is not None:
            decoder.detector.scaler_run = scaler_run

    def flush(self) -> Snapshot | None:
        """Export every finished step now and wait until the exporters have it (at most 10 s for a sink).

        May synchronize with the device: call it in tests, at evaluation points or at the
        end of training, not every step. Call it on every rank at the same point of the loop:
        the other ranks' figures of the steps since the last export come in the export's
        collectives (the node's ranks' rows gathered within the node, the job-wide figures in two
        fixed-size reductions over the job: a snapshot holds its own node's ranks). After
        ``close()``, and on a disabled monitor, it only returns :meth:`latest`.
        """
        if not self._closed:
            self._schedule.export(gather=True)
            self._export.drain(SINK_WAIT_S)
        return self.latest()

    def close(self, finished: bool = True) -> None:
        """Flush, stop measuring, mark the run finished, linger, stop serving. Idempotent.

        Call on every rank at the same point of training (the monitor's per-step collective
        stops with it). ``finished=False`` (used on an exception) skips the clean-finish mark,
        the linger and the export's collectives (the other ranks may not be closing: the steps since the
        last export are exported with this rank's figures only, the others' as not measured),
        so the run reads as having died. Called while an exception propagates (in a ``finally``
        or ``except`` block) it closes so too, as a ``with`` block does: a peer still blocked in
        a reduction with this rank never joins a gather, and the job would hang instead of failing.
        Afterwards ``latest()``, ``step`` and ``flush()`` report the final state,
        ``clip_grad_norm_`` raises, and the model trains exactly as without distmon. Never called:
        it runs at exit, said on stderr (``lifecycle.ExitGuard``). On a disabled monitor it does
        nothing.
        """
        finished = finished and sys.exc_info()[1] is None
        self._close(finished, gather=finished, timeout_s=None if finished else EXIT_GATHER_S)

    def _close(self, finished: bool, gather: bool, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._exit.disarm()
        try:
            self._schedule.export(gather, timeout_s)
            self._export.drain(SINK_WAIT_S)
        finally:
            self._closed = True
            self._schedule.close()
            self._run.hooks.remove()
            shut_down(
                self._run.opened,
                export=self._export,
                aggregate=self._run.aggregate,
                cfg=self.config,
                finished=finished,
                errors=self._run.errors,
            )

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.close(finished=exc_type is None)


# help(GradMonitor) documents every option: its Args entries are rendered from their declarations
GradMonitor.__doc__ = (GradMonitor.__doc__ or "").replace(
    "        {options}\n", options.options_args() + "\n"
)
