"""Host thread: turns exported device rows into Snapshots and hands them to the sinks.

The training loop only enqueues a :class:`~distmon.ring.HostCopy`; waiting for the copy to
land, decoding rows and running exporters all happen here.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .collective import RankFields, earliest_nonfinite
from .errors import ErrorCounter
from .ring import HostCopy, RowLayout
from .snapshot import Snapshot

__all__ = ["RowDecoder", "Publisher", "ExportBatch"]

Sink = Callable[[Sequence[Snapshot]], None]


@dataclass(frozen=True)
class ExportBatch:
    """Rows to publish: the host copy and, per step, ``(step, ring row, timestamp, skipped)``."""

    copy: HostCopy
    steps: tuple[tuple[int, int, float, bool], ...]


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
    ) -> None:
        self.layout = layout
        self.layers = tuple(layers)
        self.fields = fields
        self.run_id = run_id
        self.layer_order = layer_order
        self.decode_detector = decode_detector

    def decode(self, step: int, timestamp: float, skipped: bool, row: list[float]) -> Snapshot:
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
        all_valid = measured
        for r, (vals, total) in enumerate(zip(ranks, f.totals(ranks))):
            rank_errors.append(int(vals[f.errors]))
            ok = vals[f.valid] == 1.0
            all_valid &= ok
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
            step=step,
            timestamp=timestamp,
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
            valid=all_valid,
            run_id=self.run_id,
            world_size=lay.world,
            skipped=skipped,
        )
        if self.decode_detector is not None:
            snap = self.decode_detector(step, row[lay.detector], snap)
        return snap


class Publisher:
    """Background thread that decodes export batches and feeds every sink, in order.

    Example:
        >>> pub = Publisher(decoder, [print], errors)   # doctest: +SKIP
        >>> pub.submit(batch); pub.drain(); pub.stop()   # doctest: +SKIP
    """

    def __init__(self, decoder: RowDecoder, sinks: list[Sink], errors: ErrorCounter) -> None:
        self.decoder = decoder
        self.sinks = sinks
        self.errors = errors
        self.latest: Snapshot | None = None
        self._queue: queue.Queue[ExportBatch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distmon-publisher", daemon=True)
        self._thread.start()

    def submit(self, batch: ExportBatch) -> None:
        self._queue.put(batch)

    def drain(self) -> None:
        """Block until every submitted batch has been published."""
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

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
        snaps = [
            self.decoder.decode(step, ts, skipped, rows[slot]) for step, slot, ts, skipped in batch.steps
        ]
        if not snaps:
            return
        self.latest = snaps[-1]
        for sink in self.sinks:
            try:
                sink(snaps)
            except Exception:
                self.errors.record(f"sink {getattr(sink, '__qualname__', type(sink).__name__)}")
