"""The export thread: turns exported device rows into snapshots and hands them to the sinks.

The training loop only enqueues an :class:`~distmon.step.ring.ExportBatch` (a host copy in flight
and the steps it holds); waiting for the copy to land, decoding rows and running the sinks
all happen here, or on the sinks' own threads (``sinks.py``).
"""

from __future__ import annotations

import threading
import time

from ..errors import ErrorCounter, logger
from ..serve.prometheus_exporter import MetricsAggregate
from ..snapshot import Snapshot
from ..step.ring import ExportBatch, ExportQueue
from .decode import RowDecoder
from .sinks import NonfiniteNotice, SinkWorker

__all__ = ["ExportThread", "SINK_WAIT_S"]

# The longest flush() and close() wait for the sinks on threads of their own (the JSONL log, the
# on_anomaly callbacks): a log on a hung mount or a blocked callback must not hold the job.
SINK_WAIT_S = 10.0


class ExportThread:
    """The background thread that decodes exports into snapshots and feeds every sink, in order.

    It reads the export ``queue`` the step schedule puts into. The ``aggregate`` this rank's
    endpoint serves (in-memory, bounded work) and the job's one-line ``notice`` of a non-finite
    step (rank 0's) are fed on this thread; ``workers`` (the JSONL log, callbacks: file systems
    and user code) get the snapshots through their own bounded queues, so nothing they do can
    hold this thread, the host buffers it releases, or the training step that waits for one.

    Example:
        >>> thread = ExportThread(decoder, queue=exports, aggregate=agg, notice=None,  # doctest: +SKIP
        ...                       workers=[log], errors=errors)
        >>> exports.put(batch); thread.drain(10.0); thread.stop(5.0)                   # doctest: +SKIP
    """

    def __init__(
        self,
        decoder: RowDecoder,
        *,
        queue: ExportQueue,
        aggregate: MetricsAggregate | None,
        notice: NonfiniteNotice | None,
        workers: list[SinkWorker],
        errors: ErrorCounter,
    ) -> None:
        self.decoder = decoder
        self.aggregate, self.notice = aggregate, notice
        self.workers = workers
        self.errors = errors
        self.latest: Snapshot | None = None
        self._queue = queue  # the schedule puts its exports there
        self._thread = threading.Thread(target=self._run, name="distmon-export", daemon=True)
        self._thread.start()

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
        if not done:
            logger.warning(
                "distmon: a sink (the JSONL log or an on_anomaly callback) has not written every "
                "snapshot within %.0f s; going on without waiting for it",
                timeout,
            )
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
                self._export(batch)
            except Exception:
                self.errors.record("export thread")
            finally:
                self._queue.task_done()

    def _export(self, batch: ExportBatch) -> None:
        try:
            batch.copy.wait_ready()
            rows = batch.copy.rows.tolist()  # host memory: no device sync
        finally:
            batch.copy.release()
        snaps = [self.decoder.decode(info, rows[info.slot]) for info in batch.steps]
        if not snaps:
            return
        self.latest = snaps[-1]
        if self.aggregate is not None:
            try:
                self.aggregate.add(snaps)
            except Exception:
                self.errors.record("sink MetricsAggregate.add")
        if self.notice is not None:
            try:
                self.notice(snaps)
            except Exception:
                self.errors.record("sink NonfiniteNotice")
        for worker in self.workers:
            worker.offer(snaps)
