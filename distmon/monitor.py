"""GradMonitor: the composition root. Builds the source, the step tracker, the exporters and the
optimizer hooks; starts on every rank or on none; shuts them down in order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import hostinfo
from ._version import __version__
from .activations import ActivationWatch, select_modules
from .collective import RankFields
from .config import MonitorConfig
from .detectors import DetectorConfig, DetectorDecoder, DeviceDetector, block_column
from .errors import ErrorCounter, logger
from .file_sd import target_host
from .grouping import Grouping, GroupSpec, build_grouping
from .guard import GradientAnomalyError, StepHooks, warn_uncovered
from .hostinfo import RankInfo
from .loss_scale import LossScale
from .noise_scale import NoiseScale
from .prometheus_exporter import GradCollector, MetricsAggregate
from .publisher import Publisher, RowDecoder
from .sinks import Sink, SinkWorker
from .snapshot import AnomalyEvent, Snapshot
from .sources import source_for
from .startup import Prepared, agree, prepare, served_ranks
from .tracker import StepTracker
from .update_ratio import UpdateRatio

__all__ = ["GradMonitor", "GradientAnomalyError"]


_WITHDRAW_GRACE_S = 5.0  # serving after the file_sd target file is removed
# The longest flush() and close() wait for the sinks on threads of their own (the JSONL log, the
# on_anomaly callbacks): a log on a hung mount or a blocked callback must not hold the job.
SINK_WAIT_S = 10.0
_STOP_S = 2.0


def _has_events(snap: Snapshot) -> bool:
    return bool(snap.events)


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


class _Extras(NamedTuple):
    """The opt-in measurements, built (and their option combinations checked) for one monitor."""

    noise: Callable[[RankFields], NoiseScale] | None
    batch_of_step: Callable[[], float] | None
    watch: ActivationWatch | None
    ratio: UpdateRatio | None


def _extras(cfg: MonitorConfig, source: Any, grouping: Grouping, errors: ErrorCounter) -> _Extras:
    """Loss-scale, noise-scale, activation and update-ratio parts, or the error naming the option."""
    world = source.world_size
    if cfg.loss_scale is not None and not source.reads_in_backward:
        raise ValueError(
            "distmon: loss_scale= needs a DDP model: a single process's (or an FSDP model's "
            "sharded) gradients are read at the optimizer step, when distmon cannot tell "
            "whether you divided the scale out; use torch.amp.GradScaler and pass scaler="
        )
    noise, batch_of_step = None, None
    if cfg.batch_size is not None:
        if world < 2:
            raise ValueError(
                "distmon: batch_size= turns on the gradient noise scale, which compares one rank's "
                "batch with the global one: it needs 2 or more data-parallel ranks"
            )
        if source.divide_factor_set:
            raise ValueError(
                "distmon: the gradient noise scale needs the reduced gradient to be the mean of "
                "the ranks' gradients; an FSDP gradient divide factor changes that"
            )
        n, size = len(grouping.layers), cfg.batch_size
        noise = lambda fields: NoiseScale(n, world, fields, cfg.gns_alpha, source.device)  # noqa: E731
        batch_of_step = size if callable(size) else lambda: size
    watch = None
    if cfg.activations:
        watched = select_modules(source.module, cfg.activations)
        if not watched:
            raise ValueError(f"distmon: activations={cfg.activations!r} selects no module of the model")
        watch = ActivationWatch(watched, source.device, errors.record)
    ratio = None
    if cfg.update_ratio:
        if source.shard_ranks is not None:
            raise ValueError(
                "distmon: update_ratio=True is not supported for FSDP models yet (a layer's "
                "weights are sharded over ranks)"
            )
        ratio = UpdateRatio(
            list(grouping.params), list(grouping.param_layer), len(grouping.layers), source.device
        )
    return _Extras(noise, batch_of_step, watch, ratio)


class GradMonitor:
    """Always-on gradient monitor for a DDP model (or a single process's module), served to Prometheus.

    Wraps DDP's communication hook (around ``comm_hook``, default DDP's own reduction) to
    measure every bucket's local and reduced gradients on the device (a plain module in a
    single process: its gradients, once per step, when the optimizer steps), hooks the
    optimizers' ``step`` to begin and end each training step, and publishes host snapshots
    every ``export_every`` steps from a background thread. Build it on every rank, after
    ``DDP(...)`` and the optimizers, and close it on every rank (or use it as a context
    manager). Construction is all or nothing on every rank: if anything fails on any rank
    (an option, a port, the log file, the file_sd directory), every rank releases what it
    prepared and raises the same error, naming the rank, the option and the path.

    Args:
        model: the ``DistributedDataParallel`` model. If it has a comm hook already, pass that
            as ``comm_hook`` (and ``comm_state``) instead: DDP accepts one, distmon wraps it.
            In a single process (no ``torch.distributed``, or a world of one): the plain module.
        optimizer: the optimizer that steps the model, or a list of them: a training step is
            one backward and one ``step()`` of each.
        options: keyword-only; every one is validated here, and the serving ones also read a
            ``DISTMON_*`` environment variable. The README's "Options" table is where each
            option, its variable, its default and its meaning are documented (a test keeps it
            in step with this signature).

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
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        export_every: int | None = None,
        export_interval_s: float | None = None,
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
        scaler: torch.amp.GradScaler | None = None,
        loss_scale: float | None = None,
        batch_size: float | Callable[[], float] | None = None,
        gns_alpha: float | None = None,
        activations: bool | Sequence[type | str] | None = None,
        activation_every: int | None = None,
        update_ratio: bool | None = None,
    ) -> None:
        # every keyword option, as given (None: not given); read before any other local exists
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "optimizer")}
        self._closed = True  # until every rank has started
        optimizers = _as_tuple(optimizer)
        source = source_for(model, comm_hook, comm_state)  # the model's type: the same on every rank
        me = hostinfo.local_rank_info(source.group, source.device)
        # Everything that can fail, on this rank; nothing is installed yet.
        proposal: str | None = None  # this rank's run id; rank 0's wins
        agreed: dict[str, str] | None = None  # the options every rank must set alike
        prepared = Prepared()
        failure: Exception | None = None
        try:
            self.config = cfg = MonitorConfig.from_options(**options)
            _check_optimizers(optimizers)
            source.check()
            grouping = build_grouping(source.module, cfg.groups, cfg.max_layers)
            self._errors = ErrorCounter()
            det_cfg = cfg.detect if isinstance(cfg.detect, DetectorConfig) else DetectorConfig()
            world = source.world_size
            self._loss_scale = LossScale(cfg.scaler, cfg.loss_scale, source.device, optimizers)
            extras = _extras(cfg, source, grouping, self._errors)
            factory = (
                (lambda fields: DeviceDetector(det_cfg, len(grouping.layers), world, fields, source.device))
                if cfg.detect is not False
                else None
            )
            self._tracker = tracker = StepTracker(
                len(grouping.layers),
                source.group,
                world,
                source.device,
                cfg.export_every,
                cfg.rank_layers,
                self._errors,
                factory,
                self._loss_scale,
                source.shard_ranks,
                cfg.export_interval_s,
                extras.noise,
                extras.batch_of_step,
                extras.watch,
                cfg.activation_every or cfg.export_every,
                extras.ratio,
            )
            source.bind(tracker, grouping)
            watched = tracker.activations.names if tracker.activations else ()
            agreed = cfg.agreed(grouping.layers, tuple(watched))
            proposal = hostinfo.resolve_run_id(cfg.run_id)
            prepared = prepare(cfg, me, proposal)
        except Exception as e:
            failure = e
        try:
            peers = agree(me, proposal, prepared.endpoint, failure, source.group, agreed)
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
        # clip_grad_norm_ checks its first finite norm against a direct one (see _check_clip)
        self._clip_checked = False
        self._fixed_scale_in_grads: bool | None = None  # loss_scale=: did the user unscale by clip time?
        self._server, self._log, self._target = prepared.server, prepared.log, prepared.target
        self._callbacks: list[Callable[[AnomalyEvent, Snapshot], None]] = []
        inline: list[Sink] = []
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
            inline.append(self._aggregate.add)
        workers = [SinkWorker("on_anomaly callbacks", self._dispatch_events, self._errors, want=_has_events)]
        if self._log is not None:
            workers.append(SinkWorker("JSONL log", self._log, self._errors, close=self._log.close))
        decoder = RowDecoder(
            tracker.layout,
            grouping.layers,
            tracker.exchange.fields,
            self.run_id,
            lambda: tracker.layer_order_host,
            DetectorDecoder(det_cfg, grouping.layers) if factory else None,
            tracker.activations.names if tracker.activations else (),
        )
        self._publisher = Publisher(decoder, inline, workers, self._errors)
        tracker.publish_batch = self._publisher.submit
        self._source = source
        source.install()
        self._hooks = StepHooks(
            tracker,
            optimizers,
            cfg.guard,
            _as_tuple(cfg.lr_scheduler or ()),
            block_column(tracker.layout),
            cfg.scaler,
        )
        self._hooks.install()
        if tracker.activations is not None:
            tracker.activations.install()
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

        Same return value and same resulting gradients as torch's at the same point of the
        loop (its own ``clip_grads_with_norm_`` scales them), without its pass over the
        gradients. Call on every rank, after ``backward()`` and before the optimizer step;
        with a ``GradScaler`` before or after ``scaler.unscale_(opt)``, like torch's: before
        it, the gradients and the norm are still in loss-scaled units. No host sync (but with
        ``error_if_nonfinite=True``, as in torch), except once: the first finite norm is
        checked against a direct one, so that a loss scale distmon was not told about (pass
        ``scaler=`` or ``loss_scale=``) raises instead of clipping wrongly. A step distmon
        could not measure is clipped by ``torch.nn.utils.clip_grad_norm_`` itself. A closed
        monitor raises rather than clip by a stale norm.

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
        tracker = self._tracker
        sq = tracker.total_sq()  # in gradient units: the loss scale divided out
        if not tracker.row_valid():
            return torch.nn.utils.clip_grad_norm_(self._params, max_norm, 2.0, error_if_nonfinite, foreach)
        total = sq.sqrt()
        if self._grads_scaled():
            total = total * self._loss_scale.scale()  # the gradients as they are now: still scaled
        if not self._clip_checked:
            self._check_clip(total)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(self._params, max_norm, total, foreach)
        return total

    def _grads_scaled(self) -> bool:
        """Whether the gradients are still multiplied by the loss scale now."""
        unscaled = self._loss_scale.scaler_unscaled()
        if unscaled is not None:
            return not unscaled
        return bool(self._fixed_scale_in_grads)

    def _check_clip(self, total: torch.Tensor) -> None:
        """Compare the norm distmon would clip by with a direct one, once (one pass, one host sync).

        The loss scale is the one thing distmon cannot see in the gradients: a scale applied by
        hand and not passed in would make every clip wrong by that factor. With ``loss_scale=``
        this also learns whether the user divides it out before clipping. Sparse gradients have
        no direct norm to compare with: they skip the check.
        """
        grads = [p.grad for p in self._params if p.grad is not None]
        if any(g.is_sparse for g in grads):
            self._clip_checked = True
            return
        direct = float(torch.nn.utils.get_total_norm(grads, 2.0))
        measured = float(total)
        if not (math.isfinite(direct) and math.isfinite(measured)):
            return  # an overflowed step says nothing: check the next one
        close = lambda a, b: abs(a - b) <= 1e-3 * max(abs(a), abs(b), 1e-30)  # noqa: E731
        if self._loss_scale.fixed is not None and self._fixed_scale_in_grads is None:
            scale = self._loss_scale.fixed
            if close(direct, measured):
                self._fixed_scale_in_grads = False
            elif close(direct, measured * scale):
                self._fixed_scale_in_grads = True
                measured *= scale
        if not close(direct, measured):
            told = (
                f"scaler= (scale {float(self._loss_scale.scale()):g})"
                if self._loss_scale.scaler is not None
                else f"loss_scale={self._loss_scale.fixed:g}"
                if self._loss_scale.fixed is not None
                else "no loss scale"
            )
            raise RuntimeError(
                f"distmon: clip_grad_norm_ refuses to clip: the gradients' norm is {direct:.6g} but "
                f"distmon's figure, with {told}, is {measured:.6g} (ratio {direct / measured:.6g}). "
                "The loss was scaled by a factor distmon was not told: pass GradMonitor(..., "
                "scaler=your_GradScaler) or loss_scale=S, or clip with torch.nn.utils.clip_grad_norm_."
            )
        self._clip_checked = True

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
            >>> net = torch.nn.Linear(2, 1)
            >>> mon = GradMonitor(net, torch.optim.SGD(net.parameters(), lr=0.1), serve="none")
            >>> mon.latest() is None   # nothing exported yet
            True
            >>> mon.close()
        """
        return self._publisher.latest

    def flush(self) -> Snapshot | None:
        """Publish every finished step now and wait until the exporters have it.

        May synchronize with the device: call it in tests, at evaluation points or at the
        end of training, not every step. Call it on every rank at the same point of the loop:
        the other ranks' figures of the steps since the last export come in one all-gather.
        After ``close()`` it only returns :meth:`latest`.
        """
        if not self._closed:
            self._publish(gather=True)
        return self.latest()

    def _publish(self, gather: bool) -> None:
        self._tracker.publish(gather)
        if not self._publisher.drain(SINK_WAIT_S):
            logger.warning(
                "distmon: a sink (the JSONL log or an on_anomaly callback) has not written every "
                "snapshot within %.0f s; going on without waiting for it",
                SINK_WAIT_S,
            )

    def close(self, finished: bool = True) -> None:
        """Flush, stop measuring, mark the run finished, linger, stop serving. Idempotent.

        Call on every rank at the same point of training (the monitor's per-step collective
        stops with it). ``finished=False`` (used on an exception) skips the clean-finish mark,
        the linger and the all-gather (the other ranks may not be closing: the steps since the
        last export are published with this rank's figures only, the others' as not measured),
        so the run reads as having died. Afterwards ``latest()``, ``step`` and
        ``flush()`` report the final state, ``clip_grad_norm_`` raises, and the model keeps
        training exactly as without distmon (a new monitor can be built on it).
        """
        if self._closed:
            return
        try:
            self._publish(gather=finished)
        finally:
            self._closed = True
            self._tracker.active = False
            self._source.remove()
            self._hooks.remove()
            if self._tracker.activations is not None:
                self._tracker.activations.remove()
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

        # the sinks had SINK_WAIT_S to drain in _publish: a sink still stuck now gets a moment more
        quietly("publisher shutdown", lambda: self._publisher.stop(_STOP_S))
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

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)
