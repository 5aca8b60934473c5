"""Host thread: turns exported device rows into Snapshots and hands them to the sinks.

The training loop only enqueues a :class:`~distmon.ring.HostCopy`; waiting for the copy to
land, decoding rows and running exporters all happen here.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from .collective import RankFields, earliest_nonfinite
from .errors import ErrorCounter
from .ring import HostCopy, RowLayout
from .sinks import Sink, SinkWorker
from .snapshot import AnomalyEvent, Snapshot

__all__ = ["RowDecoder", "Publisher", "ExportBatch", "StepInfo"]


class StepInfo(NamedTuple):
    """What the host knows of a finished step besides its ring row."""

    step: int
    slot: int  # its row in the ring (and in the host copy)
    timestamp: float
    skip: str  # "" (taken), "guard" or "scaler": who kept the optimizer from taking it


@dataclass(frozen=True)
class ExportBatch:
    """Rows to publish: the host copy and the steps whose rows it holds."""

    copy: HostCopy
    steps: tuple[StepInfo, ...]


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else math.nan  # NaN stays NaN, inf stays inf


class RowDecoder:
    """Decodes one ring row (a list of floats) into a :class:`Snapshot`.

    ``layer_order`` returns each layer's position in backward order (known once DDP's buckets
    were seen); ``decode_detector`` turns the detector columns into events and scores.
    """

    def __init__(
        self,
        layout: RowLayout,
        layers: Sequence[str],
        fields: RankFields,
        run_id: str,
        layer_order: Callable[[], Sequence[float]],
        decode_detector: Callable[[int, list[float], Snapshot], Snapshot] | None,
        watched: Sequence[str] = (),
    ) -> None:
        self.layout = layout
        self.layers = tuple(layers)
        self.fields = fields
        self.run_id = run_id
        self.layer_order = layer_order
        self.decode_detector = decode_detector
        self.watched = tuple(watched)  # modules whose forward outputs are watched

    def decode(self, info: StepInfo, row: list[float]) -> Snapshot:
        lay = self.layout
        layer_sq = row[lay.layers]
        gathered = row[lay.gathered]
        f = self.fields
        order = self.layer_order()
        ranks = [gathered[r * lay.rank_width : (r + 1) * lay.rank_width] for r in range(lay.world)]
        rank_norms: list[float] = []
        rank_layers: list[list[float]] = []
        bad: list[tuple[int, int]] = []  # (rank, layer)
        rank_errors: list[int] = []
        measured = row[0] == 1.0  # this rank measured the reduced gradient (what it reports globally)
        if f.reduced_ok is not None:  # a sharded model's reduced figures need every rank's shard
            measured &= all(vals[f.reduced_ok] == 1.0 for vals in ranks)
        rank_valid: list[bool] = []
        for r, (vals, total) in enumerate(zip(ranks, f.totals(ranks))):
            rank_errors.append(int(vals[f.errors]))
            ok = vals[f.valid] == 1.0
            rank_valid.append(ok)
            rank_norms.append(_sqrt(total) if ok else math.nan)
            if f.n_layer_cols:
                rank_layers.append([_sqrt(v) if ok else math.nan for v in vals[: f.n_layer_cols]])
            first_bad = f.first_nonfinite_layer(vals, order) if ok else -1
            if first_bad >= 0:
                bad.append((r, first_bad))
        # a figure that was not measured is NaN, never a real-looking number (and not "non-finite")
        grad_norm = _sqrt(row[1]) if measured else math.nan
        first: tuple[int, str] | None = None
        if bad:
            r, layer = min(bad, key=lambda rl: (order[rl[1]], rl[0]))
            first = (r, self.layers[layer])
        elif measured and not math.isfinite(grad_norm):
            # finite on every rank, non-finite after reduction (e.g. fp16 overflow): rank -1
            layer = earliest_nonfinite(layer_sq, order)
            if layer >= 0:
                first = (-1, self.layers[layer])
        snap = Snapshot(
            step=info.step,
            timestamp=info.timestamp,
            grad_norm=grad_norm,
            layer_grad_norms={
                name: _sqrt(v) if measured else math.nan for name, v in zip(self.layers, layer_sq)
            },
            rank_grad_norms=rank_norms,
            rank_layer_grad_norms=rank_layers if f.n_layer_cols else None,
            nonfinite=first is not None or (measured and not math.isfinite(grad_norm)),
            nonfinite_ranks=[r for r, _ in bad],
            first_nonfinite=first,
            monitor_errors=sum(rank_errors),
            rank_monitor_errors=rank_errors,
            valid=measured,
            rank_valid=rank_valid,
            run_id=self.run_id,
            world_size=lay.world,
            skipped=bool(info.skip),
            skip_reason=info.skip,
        )
        if lay.n_noise:
            noise = row[lay.noise]
            snap = replace(
                snap,
                gradient_noise_scale=noise[0],
                noise_trace=noise[1],
                noise_signal=noise[2],
                layer_gradient_noise_scale=dict(zip(self.layers, noise[3 : 3 + len(self.layers)])),
                layer_noise_signal=dict(zip(self.layers, noise[3 + len(self.layers) :])),
            )
        if self.decode_detector is not None:
            snap = self.decode_detector(info.step, row[lay.detector], snap)
        if lay.n_act:
            snap = self._activations(info.step, row[lay.act], ranks, snap)
        if lay.n_upd:
            ratios = row[lay.upd]
            if not all(math.isnan(v) for v in ratios):  # an export step
                snap = replace(snap, layer_update_ratio=dict(zip(self.layers, ratios)))
        return snap

    def _activations(self, step: int, act: list[float], ranks: list[list[float]], snap: Snapshot) -> Snapshot:
        n = len(self.watched)
        bad = [(int(vals[self.fields.act_first]), r) for r, vals in enumerate(ranks)]
        bad = [(module, r) for module, r in bad if module >= 0]
        first = None
        events = snap.events
        if bad:
            module, r = min(bad)  # earliest in forward order, lowest rank on a tie
            first = (r, self.watched[module])
            events += (AnomalyEvent("activation_nonfinite", step, r, first[1], math.nan, math.inf),)
        if all(math.isnan(v) for v in act[:n]):  # not an activation step
            return replace(snap, first_nonfinite_activation=first, events=events)
        return replace(
            snap,
            activation_rms=dict(zip(self.watched, act[:n])),
            activation_absmax=dict(zip(self.watched, act[n : 2 * n])),
            first_nonfinite_activation=first,
            events=events,
        )


class Publisher:
    """Background thread that decodes export batches and feeds every sink, in order.

    ``inline`` sinks (the Prometheus aggregate: in-memory, bounded work) run on this thread;
    ``workers`` (the JSONL log, callbacks: file systems and user code) get the snapshots through
    their own bounded queues, so nothing they do can hold this thread, the host buffers it
    releases, or the training step that waits for one.

    Example:
        >>> pub = Publisher(decoder, [aggregate.add], [log_worker], errors)   # doctest: +SKIP
        >>> pub.submit(batch); pub.drain(10.0); pub.stop(5.0)                  # doctest: +SKIP
    """

    def __init__(
        self, decoder: RowDecoder, inline: list[Sink], workers: list[SinkWorker], errors: ErrorCounter
    ) -> None:
        self.decoder = decoder
        self.inline = inline
        self.workers = workers
        self.errors = errors
        self.latest: Snapshot | None = None
        self._queue: queue.Queue[ExportBatch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distmon-publisher", daemon=True)
        self._thread.start()

    def submit(self, batch: ExportBatch) -> None:
        self._queue.put(batch)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted batch is decoded and written by every sink, at most ``timeout`` s.

        Returns whether everything was written in time (a stuck sink keeps its backlog).
        """
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            done = self._queue.all_tasks_done.wait_for(
                lambda: self._queue.unfinished_tasks == 0, max(0.0, deadline - time.monotonic())
            )
        for worker in self.workers:
            done = worker.drain(max(0.0, deadline - time.monotonic())) and done
        return done

    def stop(self, timeout: float) -> None:
        """Publish what is queued, stop every worker (closing its sink): at most ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        self._queue.put(None)
        self._thread.join(timeout)
        for worker in self.workers:
            worker.stop(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._publish(batch)
            except Exception:
                self.errors.record("publisher")
            finally:
                self._queue.task_done()

    def _publish(self, batch: ExportBatch) -> None:
        try:
            batch.copy.wait_ready()
            rows = batch.copy.rows.tolist()  # host memory: no device sync
        finally:
            batch.copy.release()
        snaps = [self.decoder.decode(info, rows[info.slot]) for info in batch.steps]
        if not snaps:
            return
        self.latest = snaps[-1]
        for sink in self.inline:
            try:
                sink(snaps)
            except Exception:
                self.errors.record(f"sink {getattr(sink, '__qualname__', type(sink).__name__)}")
        for worker in self.workers:
            worker.offer(snaps)
