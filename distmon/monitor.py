"""GradMonitor: the composition root. Builds the source, the step tracker, the exporters and the
optimizer hooks; starts on every rank or on none; shuts them down in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import hostinfo
from ._version import __version__
from .config import MonitorConfig
from .detectors import DetectorConfig, DetectorDecoder, DeviceDetector, block_column
from .errors import ErrorCounter, logger
from .file_sd import target_host
from .grouping import GroupSpec, build_grouping
from .guard import GradientAnomalyError, StepHooks, warn_uncovered
from .hostinfo import RankInfo
from .prometheus_exporter import GradCollector, MetricsAggregate
from .publisher import Publisher, RowDecoder
from .snapshot import AnomalyEvent, Snapshot
from .sources import source_for
from .startup import Prepared, agree, prepare, served_ranks
from .tracker import StepTracker

__all__ = ["GradMonitor", "GradientAnomalyError"]


_WITHDRAW_GRACE_S = 5.0  # serving after the file_sd target file is removed


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _check_optimizers(optimizers: Sequence[Any]) -> None:
    if not optimizers:
        raise ValueError("distmon: pass the optimizer (or a list of optimizers) that steps the model")
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"distmon: optimizer must be a torch.optim.Optimizer (or a list of them), "
                f"got {type(opt).__name__}"
            )


class GradMonitor:
    """Always-on gradient monitor for a DDP model, served to Prometheus.

    Wraps DDP's communication hook (around ``comm_hook``, default DDP's own reduction) to
    measure every bucket's local and reduced gradients on the device, hooks the optimizers'
    ``step`` to begin and end each training step, and publishes host snapshots every
    ``export_every`` steps from a background thread. Build it on every rank, after
    ``DDP(...)`` and the optimizers, and close it on every rank (or use it as a context
    manager). Construction is all or nothing on every rank: if anything fails on any rank
    (an option, a port, the log file, the file_sd directory), every rank releases what it
    prepared and raises the same error, naming the rank, the option and the path.

    Args:
        model: the ``DistributedDataParallel`` model. If it has a comm hook already, pass that
            as ``comm_hook`` (and ``comm_state``) instead: DDP accepts one, distmon wraps it.
        optimizer: the optimizer that steps the model, or a list of them: a training step is
            one backward and one ``step()`` of each.
        options: keyword-only; every one is validated here, and the serving ones also read a
            ``DISTMON_*`` environment variable. The README's "Options" table is where each
            option, its variable, its default and its meaning are documented (a test keeps it
            in step with this signature).

    Example:
        >>> model = DDP(net)                                           # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters())                 # doctest: +SKIP
        >>> with distmon.GradMonitor(model, opt) as mon:                # doctest: +SKIP
        ...     for x, y in loader:
        ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ...     print(mon.latest().grad_norm)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        export_every: int | None = None,
        groups: GroupSpec = None,
        max_layers: int | None = None,
        rank_layers: bool | None = None,
        serve: str | None = None,
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
        guard: str | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        self._closed = True  # until every rank has started
        optimizers = _as_tuple(optimizer)
        source = source_for(model, comm_hook, comm_state)  # the model's type: the same on every rank
        me = hostinfo.local_rank_info(source.group, source.device)
        # Everything that can fail, on this rank; nothing is installed yet.
        proposal: str | None = None  # this rank's run id; rank 0's wins
        prepared = Prepared()
        failure: Exception | None = None
        try:
            self.config = cfg = MonitorConfig.from_options(
                comm_hook=comm_hook,
                comm_state=comm_state,
                export_every=export_every,
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
            )
            _check_optimizers(optimizers)
            source.check()
            grouping = build_grouping(source.module, cfg.groups, cfg.max_layers)
            self._errors = ErrorCounter()
            det_cfg = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
            world = source.group.size()
            factory = (
                (lambda fields: DeviceDetector(det_cfg, len(grouping.layers), world, fields, source.device))
                if cfg.detect is not False
                else None
            )
            self._tracker = tracker = StepTracker(
                len(grouping.layers),
                source.group,
                source.device,
                cfg.export_every,
                cfg.rank_layers,
                self._errors,
                factory,
            )
            source.bind(tracker, grouping)
            proposal = hostinfo.resolve_run_id(cfg.run_id)
            prepared = prepare(cfg, me, proposal)
        except Exception as e:
            failure = e
        try:
            peers = agree(me, proposal, prepared.endpoint, failure, source.group)
        except BaseException:
            prepared.release()
            raise

        # Every rank is ready: install. Nothing below raises into the training job.
        self.run_id: str = peers[0].run_id
        self.rank: int = me.rank
        self.world_size: int = len(peers)
        self.rank_infos: tuple[RankInfo, ...] = tuple(p.info for p in peers)
        self.layers: tuple[str, ...] = grouping.layers
        self._params = grouping.params
        self._server, self._log, self._target = prepared.server, prepared.log, prepared.target
        self._callbacks: list[Callable[[AnomalyEvent, Snapshot], None]] = []
        sinks: list[Callable[[Sequence[Snapshot]], None]] = []
        self._aggregate: MetricsAggregate | None = None
        if self._server is not None:
            cluster, served = served_ranks(cfg.serve, me, self.rank_infos)
            self._aggregate = MetricsAggregate(
                self.run_id,
                self.world_size,
                __version__,
                cfg.serve,
                cluster,
                served,
                cfg.window_s,
                me.rank,
                lambda: self._errors.count,
            )
            self._server.attach(GradCollector(self._aggregate))
            sinks.append(self._aggregate.add)
        if self._log is not None:
            sinks.append(self._log)
        sinks.append(self._dispatch_events)
        decoder = RowDecoder(
            tracker.layout,
            grouping.layers,
            tracker.gather.fields,
            self.run_id,
            lambda: tracker.layer_order_host,
            DetectorDecoder(det_cfg, grouping.layers) if factory else None,
        )
        self._publisher = Publisher(decoder, sinks, self._errors)
        tracker.publish_batch = self._publisher.submit
        self._source = source
        source.install()
        self._hooks = StepHooks(
            tracker, optimizers, cfg.guard, _as_tuple(cfg.lr_scheduler or ()), block_column(tracker.layout)
        )
        self._hooks.install()
        self._closed = False
        warn_uncovered(list(zip(grouping.param_names, grouping.params)), optimizers)
        if self._target is not None:
            try:
                self._target.write(
                    [
                        (p.endpoint, {"run_id": self.run_id, "node": p.info.node})
                        for p in peers
                        if p.endpoint is not None
                    ]
                )
            except OSError:
                self._errors.record("file_sd target file")
        if self._server is not None:
            logger.info(
                "distmon: serving %s metrics at %s://%s:%d/metrics (run_id=%s)",
                cfg.serve,
                self._server.scheme,
                cfg.addr,
                self._server.port,
                self.run_id,
            )

    def _dispatch_events(self, snaps: Sequence[Snapshot]) -> None:
        for snap in snaps:
            for event in snap.events:
                for fn in self._callbacks:
                    try:
                        fn(event, snap)
                    except Exception:
                        self._errors.record(f"on_anomaly callback {getattr(fn, '__qualname__', fn)}")

    # -- public API -------------------------------------------------------------------------
    def on_anomaly(
        self, fn: Callable[[AnomalyEvent, Snapshot], None]
    ) -> Callable[[AnomalyEvent, Snapshot], None]:
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

    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the monitored parameters, with the norm already measured.

        Same return value and same resulting gradients as torch's (its own
        ``clip_grads_with_norm_`` scales them), without its pass over the gradients. Call
        after ``backward()`` and before the optimizer step. No host sync (but with
        ``error_if_nonfinite=True``, as in torch). A closed monitor measures nothing: it
        raises rather than clip by a stale norm.

        Example:
            >>> loss.backward()                  # doctest: +SKIP
            >>> norm = mon.clip_grad_norm_(1.0)  # doctest: +SKIP
            >>> opt.step()                       # doctest: +SKIP
        """
        if self._closed:
            raise RuntimeError(
                "distmon: clip_grad_norm_ on a closed GradMonitor (it no longer measures "
                "gradients); use torch.nn.utils.clip_grad_norm_"
            )
        if not (
            isinstance(max_norm, torch.Tensor)
            and max_norm.numel() == 1
            or isinstance(max_norm, (int, float))
            and not isinstance(max_norm, bool)
            and max_norm > 0
        ):
            raise ValueError(
                f"distmon: max_norm must be a positive number (or a 1-element tensor), got {max_norm!r}"
            )
        if float(norm_type) != 2.0:
            raise ValueError(
                f"distmon: clip_grad_norm_ clips by the L2 norm distmon measures; norm_type "
                f"{norm_type!r} needs torch.nn.utils.clip_grad_norm_"
            )
        total = self._tracker.total_sq().sqrt()
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(self._params, max_norm, total, foreach)
        return total

    @property
    def port(self) -> int | None:
        """The port this process serves metrics on, or None if it does not serve (or is closed)."""
        return self._server.port if self._server and not self._closed else None

    @property
    def metrics_url(self) -> str | None:
        """Where this process serves its metrics (``http(s)://host:port/metrics``), or None."""
        if self.port is None:
            return None
        host = target_host(self.config.addr)
        return f"{self._server.scheme}://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    @property
    def step(self) -> int:
        """Training steps finished so far (the first is 1): what a snapshot's ``step`` counts."""
        return self._tracker.step

    def latest(self) -> Snapshot | None:
        """The newest published snapshot (None before the first export). Never blocks.

        Example:
            >>> snap = mon.latest()                       # doctest: +SKIP
            >>> snap and print(snap.step, snap.grad_norm)  # doctest: +SKIP
        """
        return self._publisher.latest

    def flush(self) -> Snapshot | None:
        """Publish every finished step now and wait until the exporters have it.

        May synchronize with the device: call it in tests, at evaluation points or at the
        end of training, not every step. Call it on every rank (it issues no collective).
        After ``close()`` it only returns :meth:`latest`.
        """
        if not self._closed:
            self._tracker.publish()
            self._publisher.drain()
        return self.latest()

    def close(self, finished: bool = True) -> None:
        """Flush, stop measuring, mark the run finished, linger, stop serving. Idempotent.

        Call on every rank at the same point of training (the monitor's per-step collective
        stops with it). ``finished=False`` (used on an exception) skips the clean-finish mark
        and the linger, so the run reads as having died. Afterwards ``latest()``, ``step`` and
        ``flush()`` report the final state, ``clip_grad_norm_`` raises, and the model keeps
        training exactly as without distmon (a new monitor can be built on it).
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._tracker.active = False
            self._source.remove()
            self._hooks.remove()
            self._shutdown_io(finished)

    def _shutdown_io(self, finished: bool) -> None:
        """Stop the publisher, linger, withdraw the target, stop serving, close the log.

        Each part on its own: one failing (a full disk under the log, say) is counted and
        logged, and the rest still shuts down; nothing raises into the training job.
        """

        def quietly(site: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception:
                self._errors.record(site)

        quietly("publisher shutdown", self._publisher.stop)
        if self._aggregate is not None and finished:
            self._aggregate.mark_finished()
        if self._server is not None and finished and self.config.linger_s > 0:
            # Prometheus must scrape distmon_run_finished=1 before the target goes away, or the
            # vanished-metrics alert cannot tell a clean finish from a crash.
            logger.info(
                "distmon: run finished; serving final metrics for %.0f s (DISTMON_LINGER_S)",
                self.config.linger_s,
            )
            time.sleep(self.config.linger_s)
        if self._target is not None and finished:
            quietly("file_sd target file", self._target.remove)
            # Prometheus needs a moment to notice the withdrawn target; closing at once would
            # show it as down (up == 0) in between
            time.sleep(min(_WITHDRAW_GRACE_S, self.config.linger_s))
        if self._server is not None:
            quietly("metrics server shutdown", self._server.close)
        if self._log is not None:
            quietly("JSONL log", self._log.close)

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)
