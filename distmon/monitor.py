"""GradMonitor: wires the comm hook, the optimizer hooks, the host thread and the exporters."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import hostinfo
from ._version import __version__
from .comm_hook import HookState, monitor_hook
from .config import MonitorConfig
from .detectors import DetectorConfig, DetectorDecoder, DeviceDetector, block_column
from .errors import ErrorCounter, logger
from .file_sd import TargetFile, target_host
from .grouping import GroupSpec, build_grouping
from .hostinfo import RankInfo
from .jsonl_log import JsonlLog
from .http_server import MetricServer
from .prometheus_exporter import GradCollector, MetricsAggregate
from .publisher import Publisher, RowDecoder
from .snapshot import AnomalyEvent, Snapshot
from .step_tracker import StepTracker

__all__ = ["GradMonitor", "GradientAnomalyError"]


_WITHDRAW_GRACE_S = 5.0  # serving after the file_sd target file is removed


class GradientAnomalyError(RuntimeError):
    """Raised from ``optimizer.step()`` with ``guard="raise"`` (on every rank alike)."""


def _serves(serve: str, rank: int, local_rank: int) -> bool:
    """Whether this process runs an HTTP endpoint under ``serve`` (known before the exchange)."""
    return {"rank0": rank == 0, "node": local_rank == 0, "all": True, "none": False}[serve]


def _served_ranks(serve: str, me: RankInfo, everyone: Sequence[RankInfo]) -> tuple[bool, tuple[RankInfo, ...]]:
    """(serves cluster-wide families, per-rank series it serves) for this process.

    Cluster-wide families come only from global rank 0, so no series is counted twice.
    """
    if not _serves(serve, me.rank, me.local_rank):
        return False, ()
    ranks = {"rank0": tuple(everyone),
             "node": tuple(i for i in everyone if i.node == me.node),
             "all": (me,)}[serve]
    return me.rank == 0, ranks


class GradMonitor:
    """Always-on gradient monitor for a DDP model, served to Prometheus.

    Wraps DDP's communication hook (around ``comm_hook``, default all-reduce) to measure
    every bucket's local and reduced gradients on the device, hooks ``optimizer.step`` to
    close each step, and publishes host snapshots every ``export_every`` steps from a
    background thread. Build it on every rank, after ``DDP(...)`` and the optimizer, and
    close it on every rank (or use it as a context manager).

    Args:
        model: the ``DistributedDataParallel`` model. It must not have a comm hook yet: pass
            yours as ``comm_hook`` and the monitor wraps it.
        optimizer: the optimizer whose ``step()`` ends a training step.
        comm_hook, comm_state: the DDP comm hook to wrap and its state (default
            ``default_hooks.allreduce_hook``).
        export_every: steps between host copies (``DISTMON_EXPORT_EVERY``; default 10).
        groups: how parameters fold into layers: None (owning module's qualified name),
            a callable ``(name, param) -> group``, or ``[(regex, group), ...]`` rules
            (first match wins, ``\\1`` backreferences allowed, unmatched -> owning module).
        max_layers: cap on layer groups; groups beyond it (model order) fold into ``"other"``.
        rank_layers: also gather the ranks x layers matrix of local norms (else per-rank
            totals only; turn off for very large world size x layer counts).
        serve: ``"rank0"`` (default), ``"node"``, ``"all"`` or ``"none"`` (``DISTMON_SERVE``).
        port: HTTP port (``DISTMON_PORT``, default 9290; 0 = ephemeral; with
            ``serve="all"`` local rank i uses ``port + i``). The bound port is ``mon.port``.
        addr: bind address (``DISTMON_ADDR``, default ``127.0.0.1``; ``0.0.0.0`` for remote
            scrapes).
        port_fallback: take the next free port instead of failing (``DISTMON_PORT_FALLBACK``).
        tls_cert, tls_key: PEM certificate (chain) and unencrypted private key: serve HTTPS,
            TLS 1.2+ (``DISTMON_TLS_CERT``, ``DISTMON_TLS_KEY``; both or neither).
        tls_client_ca: PEM CA certificate(s): clients must present a certificate signed by
            one of them (mutual TLS; ``DISTMON_TLS_CLIENT_CA``; needs ``tls_cert``).
        basic_auth_file: htpasswd file of ``user:bcrypt-hash`` lines (``htpasswd -nbB user
            password``): requests need one of those users' passwords (HTTP basic auth;
            ``DISTMON_BASIC_AUTH_FILE``; needs ``pip install bcrypt``; use with TLS). Files
            are read when the endpoint starts: one that cannot be read fails every rank at
            construction, naming the option and the path.
        run_id: run label (``DISTMON_RUN_ID``; default ``TORCHELASTIC_RUN_ID``, then
            ``SLURM_JOB_ID``, then generated); identical on all ranks (rank 0's wins).
        log_path: JSONL file of every step's snapshot, written by rank 0 (``DISTMON_LOG_PATH``).
        file_sd_dir: directory of Prometheus ``file_sd`` target files; rank 0 writes
            ``{run_id}.json`` there and removes it after a clean finish (``DISTMON_FILE_SD_DIR``).
        linger_s: seconds to keep serving after a clean ``close()`` so Prometheus scrapes the
            final state (``DISTMON_LINGER_S``, default 30).
        window_s: window of ``distmon_grad_norm_window_max`` in seconds (default 60).
        detect: run the device detectors (spike, vanishing, rank outlier, non-finite events):
            True (default thresholds), False, or a :class:`DetectorConfig`.
        guard: ``None`` (default: observe only), ``"skip"`` (do not take an optimizer step
            whose reduced gradient is non-finite or spiked: parameters, optimizer state and
            ``lr_scheduler`` stay untouched, on every rank) or ``"raise"`` (raise
            :class:`GradientAnomalyError` from ``optimizer.step()``, on every rank). The
            verdict comes from reduced statistics, identical on all ranks, so no collective
            is added; it costs ONE small host sync per step (a few microseconds on CPU, one
            device round trip on GPU).
        lr_scheduler: the scheduler to hold back on skipped steps (with ``guard="skip"``).

    Example:
        >>> model = DDP(net)                                           # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters())                 # doctest: +SKIP
        >>> with distmon.GradMonitor(model, opt) as mon:                # doctest: +SKIP
        ...     for x, y in loader:
        ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ...     print(mon.latest().grad_norm)
    """

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, *,
                 comm_hook: Optional[Callable] = None, comm_state: Any = None,
                 export_every: Optional[int] = None, groups: GroupSpec = None,
                 max_layers: Optional[int] = None, rank_layers: Optional[bool] = None,
                 serve: Optional[str] = None, port: Optional[int] = None, addr: Optional[str] = None,
                 port_fallback: Optional[bool] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_client_ca: Optional[str] = None,
                 basic_auth_file: Optional[str] = None, run_id: Optional[str] = None,
                 log_path: Optional[str] = None, file_sd_dir: Optional[str] = None,
                 linger_s: Optional[float] = None, window_s: Optional[float] = None,
                 detect: Union[bool, DetectorConfig, None] = None, guard: Optional[str] = None,
                 lr_scheduler: Any = None) -> None:
        self.config = cfg = MonitorConfig.from_options(
            comm_hook=comm_hook, comm_state=comm_state, export_every=export_every, groups=groups,
            max_layers=max_layers, rank_layers=rank_layers, serve=serve, port=port, addr=addr,
            port_fallback=port_fallback, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
            basic_auth_file=basic_auth_file, run_id=run_id, log_path=log_path, file_sd_dir=file_sd_dir,
            linger_s=linger_s, window_s=window_s, detect=detect, guard=guard, lr_scheduler=lr_scheduler)
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"distmon: GradMonitor needs a DistributedDataParallel model, got "
                            f"{type(model).__name__} (FSDP and single-process training are not supported yet)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"distmon: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("distmon: torch.distributed is not initialized (call init_process_group first)")

        group = model.process_group
        device = next(p.device for p in model.module.parameters())
        grouping = build_grouping(model.module, cfg.groups, cfg.max_layers)
        me = hostinfo.local_rank_info(group, device)
        self._closed = False
        self._server: Optional[MetricServer] = None
        self._target_file: Optional[TargetFile] = None
        self._log: Optional[JsonlLog] = None

        everyone = self._bind_and_agree(cfg, me, group)
        self.run_id: str = everyone[0][1]
        self.rank: int = me.rank
        self.world_size: int = len(everyone)
        self.rank_infos: tuple[RankInfo, ...] = tuple(info for info, *_ in everyone)
        self.layers: tuple[str, ...] = grouping.layers
        self._errors = ErrorCounter()
        det_cfg = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
        factory = (lambda fields: DeviceDetector(det_cfg, len(grouping.layers), self.world_size, fields, device)) \
            if cfg.detect is not False else None
        self._tracker = StepTracker(grouping, group, device, cfg.export_every, cfg.rank_layers,
                                    self._errors, factory)
        self._params = grouping.params
        self._callbacks: list[Callable[[AnomalyEvent, Snapshot], None]] = []
        sinks: list[Callable[[Sequence[Snapshot]], None]] = []
        cluster, served = _served_ranks(cfg.serve, me, self.rank_infos)
        self._aggregate: Optional[MetricsAggregate] = None
        if self._server is not None:
            self._aggregate = MetricsAggregate(self.run_id, self.world_size, __version__, cfg.serve,
                                               cluster, served, cfg.window_s)
            self._server.attach(GradCollector(self._aggregate))
            sinks.append(self._aggregate.add)
        if cfg.log_path and me.rank == 0:
            self._log = JsonlLog(cfg.log_path)
            sinks.append(self._log)
        sinks.append(self._dispatch_events)
        decoder = RowDecoder(self._tracker.layout, grouping.layers, self._tracker.gather.fields, self.run_id,
                             lambda: self._tracker.stats.layer_order_host,
                             DetectorDecoder(det_cfg, grouping.layers) if factory else None)
        self._publisher = Publisher(decoder, sinks, self._errors)
        self._tracker.publish = self._publisher.submit

        try:
            model.register_comm_hook(HookState(self._tracker, cfg.comm_hook, cfg.comm_state), monitor_hook)
        except RuntimeError as e:
            self._shutdown_io(finished=False)
            raise RuntimeError(
                "distmon: the DDP model already has a comm hook (registered by you, or by "
                "DDP(mixed_precision=...)); DDP accepts one. Pass your hook as "
                f"GradMonitor(..., comm_hook=hook, comm_state=state) and distmon wraps it. ({e})") from e
        self._hooks = [optimizer.register_step_post_hook(self._on_step)]
        self._last_skipped = False
        self._restore: list[Callable[[], Any]] = []
        if cfg.guard is not None:
            self._install_guard(optimizer, cfg.lr_scheduler)

        if cfg.file_sd_dir and me.rank == 0:
            self._target_file = TargetFile(cfg.file_sd_dir, self.run_id)
            self._target_file.write([(ep, {"run_id": self.run_id, "node": info.node})
                                     for info, _, _, ep in everyone if ep is not None])
        if self._server is not None:
            logger.info("distmon: serving %s metrics at http://%s:%d/metrics (run_id=%s)",
                        cfg.serve, cfg.addr, self._server.port, self.run_id)

    def _bind_and_agree(self, cfg: MonitorConfig, me: RankInfo,
                        group: Optional[dist.ProcessGroup]) -> list[tuple]:
        """Start this rank's server (if it serves), then exchange identities with every rank.

        Bind first, then agree: a taken port on any rank fails every rank at construction
        with the same clear error, instead of one rank dying and the others hanging. Returns
        per rank ``(RankInfo, run_id proposal, bind error as (errno, text) or None, "host:port" or None)``.
        """
        bind_error = None
        if _serves(cfg.serve, me.rank, me.local_rank):
            port = cfg.port + me.local_rank if cfg.serve == "all" and cfg.port else cfg.port
            try:
                self._server = MetricServer.bind(cfg.addr, port, cfg.port_fallback, cfg.security)
            except (OSError, ValueError) as e:  # ValueError: a TLS or auth file that cannot be loaded
                bind_error = (getattr(e, "errno", None),
                              f"rank {me.rank} on {me.hostname}: {getattr(e, 'strerror', None) or e}")
        endpoint = f"{target_host(cfg.addr)}:{self._server.port}" if self._server else None
        everyone = hostinfo.exchange((me, hostinfo.resolve_run_id(cfg.run_id), bind_error, endpoint), group)
        errors_seen = [e for _, _, e, _ in everyone if e]
        if errors_seen:
            if self._server:
                self._server.close()
            code = errors_seen[0][0]  # EADDRINUSE only for a taken port; None for a TLS/auth file
            message = "; ".join(text for _, text in errors_seen)
            raise OSError(code, message) if code is not None else ValueError(message)
        return everyone

    # -- hooks ------------------------------------------------------------------------------
    def _on_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        try:
            self._tracker.end_step()
        except Exception:
            self._errors.record("optimizer step hook")

    def _install_guard(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        # An instance attribute shadows the class's step(): the only way to not take a step;
        # hooks cannot cancel one. Whatever step() was (e.g. a scheduler's wrapper) stays inside.
        inner_step = optimizer.step
        block = block_column(self._tracker.layout)

        @functools.wraps(inner_step)  # keeps e.g. the LR scheduler's marker attribute
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            verdict = self._tracker.finalize(complete=True)[block]
            if verdict.item() == 0.0:  # the one opt-in host sync per step
                self._last_skipped = False
                return inner_step(*args, **kwargs)
            step = self._tracker.step + 1
            self._tracker.end_step(skipped=True)
            if self.config.guard == "raise":
                raise GradientAnomalyError(f"distmon: non-finite or spiking gradient at step {step}; "
                                           f"optimizer step not taken")
            self._last_skipped = True
            return None

        optimizer.step = guarded_step
        self._restore.append(lambda: optimizer.__dict__.pop("step", None))
        if scheduler is not None:
            inner_sched = scheduler.step

            @functools.wraps(inner_sched)
            def guarded_scheduler_step(*args: Any, **kwargs: Any) -> Any:
                if self._last_skipped:
                    self._last_skipped = False
                    return None
                return inner_sched(*args, **kwargs)

            scheduler.step = guarded_scheduler_step
            self._restore.append(lambda: scheduler.__dict__.pop("step", None))

    def _dispatch_events(self, snaps: Sequence[Snapshot]) -> None:
        for snap in snaps:
            for event in snap.events:
                for fn in self._callbacks:
                    try:
                        fn(event, snap)
                    except Exception:
                        self._errors.record(f"on_anomaly callback {getattr(fn, '__qualname__', fn)}")

    # -- public API -------------------------------------------------------------------------
    def on_anomaly(self, fn: Callable[[AnomalyEvent, Snapshot], None]) -> Callable[[AnomalyEvent, Snapshot], None]:
        """Call ``fn(event, snapshot)`` for every detector event (usable as a decorator).

        Runs on the publisher thread when the step is exported (up to ``export_every`` steps
        later): for decisions before the optimizer step use ``guard``. Exceptions are
        counted in ``distmon_monitor_errors_total`` and logged once.

        Example:
            >>> @mon.on_anomaly                                       # doctest: +SKIP
            ... def page(event, snap):
            ...     print(event.kind, event.step, event.rank, event.layer)
        """
        self._callbacks.append(fn)
        return fn

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by the global norm the monitor already computed; returns that norm.

        Same result as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
        (scale ``max_norm / (norm + 1e-6)`` clamped to 1) without its pass over the gradients.
        Call after ``backward()`` and before ``optimizer.step()``. No host sync.

        Example:
            >>> loss.backward()                  # doctest: +SKIP
            >>> norm = mon.clip_grad_norm_(1.0)  # doctest: +SKIP
            >>> opt.step()                       # doctest: +SKIP
        """
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"distmon: max_norm must be a positive number, got {max_norm!r}")
        total = self._tracker.finalize(complete=True)[1].sqrt()
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return total

    @property
    def port(self) -> Optional[int]:
        """The port this process serves metrics on, or None if it does not serve."""
        return self._server.port if self._server else None

    @property
    def step(self) -> int:
        """Optimizer steps finished so far."""
        return self._tracker.step

    def latest(self) -> Optional[Snapshot]:
        """The newest published snapshot (None before the first export). Never blocks.

        Example:
            >>> snap = mon.latest()                       # doctest: +SKIP
            >>> snap and print(snap.step, snap.grad_norm)  # doctest: +SKIP
        """
        return self._publisher.latest

    def flush(self) -> Optional[Snapshot]:
        """Publish every finished step now and wait until the exporters have it.

        May synchronize with the device: call it in tests, at evaluation points or at the
        end of training, not every step. Call it on every rank (it issues no collective).
        Returns :meth:`latest`.
        """
        self._tracker.export()
        self._publisher.drain()
        return self.latest()

    def close(self, finished: bool = True) -> None:
        """Flush, stop measuring, mark the run finished, linger, stop serving. Idempotent.

        Call on every rank at the same point of training (the monitor's per-step collective
        stops with it). ``finished=False`` (used on an exception) skips the clean-finish mark
        and the linger, so the run reads as having died.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._tracker.active = False
            for h in self._hooks:
                h.remove()
            for undo in self._restore:
                undo()
            self._shutdown_io(finished)

    def _shutdown_io(self, finished: bool) -> None:
        self._publisher.stop()
        if self._aggregate is not None and finished:
            self._aggregate.mark_finished()
        if self._server is not None and finished and self.config.linger_s > 0:
            # Prometheus must scrape distmon_run_finished=1 before the target goes away, or the
            # vanished-metrics alert cannot tell a clean finish from a crash.
            logger.info("distmon: run finished; serving final metrics for %.0f s (DISTMON_LINGER_S)",
                        self.config.linger_s)
            time.sleep(self.config.linger_s)
        if self._target_file is not None and finished:
            self._target_file.remove()
            # Prometheus needs a moment to notice the withdrawn target; closing at once would
            # show it as down (up == 0) in between
            time.sleep(min(_WITHDRAW_GRACE_S, self.config.linger_s))
        if self._server is not None:
            self._server.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "GradMonitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)
