"""Exporters that may be slow or stuck (the JSONL log, ``on_anomaly`` callbacks), each on a thread of its own.

The export thread decodes exported rows and must never wait on a file system or on user
code: a JSONL log on a hung network mount or a callback that blocks would otherwise hold the
export thread, then the host buffers it releases, then the training step that needs one. So each
such sink gets a :class:`SinkWorker`: a thread behind a queue bounded in snapshots. Offering
never blocks; when the queue is full the batch is dropped, counted in
``distmon_monitor_errors_total`` and logged once. :meth:`SinkWorker.drain` and
:meth:`SinkWorker.stop` wait at most the time they are given.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import ErrorCounter, logger
from ..snapshot import AnomalyEvent, Snapshot

__all__ = ["SinkWorker", "Sink", "SINK_CAPACITY", "AnomalyCallbacks", "NonfiniteNotice"]

Sink = Callable[[Sequence[Snapshot]], None]

# Snapshots a sink may hold unwritten: about 17 minutes of 1 s steps. A snapshot with a
# 128-layer rank x layer matrix of 8 ranks is ~40 KB in memory, so this bounds a stuck sink's
# backlog to tens of MB.
SINK_CAPACITY = 1024


class SinkWorker:
    """Runs ``sink(snaps)`` on its own thread, in order; ``close`` (if given) runs on that thread at stop.

    ``want`` picks the snapshots the sink takes (the callbacks take only those with events).

    Example:
        >>> seen = []
        >>> worker = SinkWorker("list", seen.extend, ErrorCounter())
        >>> worker.offer([1, 2]); worker.drain(5.0)
        True
        >>> worker.stop(5.0); seen
        [1, 2]
    """

    def __init__(
        self,
        name: str,
        sink: Sink,
        errors: ErrorCounter,
        close: Callable[[], None] | None = None,
        want: Callable[[Snapshot], bool] | None = None,
        capacity: int = SINK_CAPACITY,
    ) -> None:
        self.name = name
        self._want = want  # the snapshots this sink takes (all, if None)
        self.dropped = 0  # snapshots dropped because the sink fell behind
        self._sink, self._close, self._errors, self._capacity = sink, close, errors, capacity
        self._queue: deque[Sequence[Snapshot] | None] = deque()
        self._held = 0  # snapshots queued or being written
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"distmon-sink-{name}", daemon=True)
        self._thread.start()

    def offer(self, snaps: Sequence[Snapshot]) -> None:
        """Queue ``snaps`` (those it wants) for the sink; never blocks (a full queue drops them, counted)."""
        if self._want is not None:
            snaps = [s for s in snaps if self._want(s)]
            if not snaps:
                return
        with self._cond:
            if self._held + len(snaps) > self._capacity:
                self.dropped += len(snaps)
                dropped = True
            else:
                self._queue.append(snaps)
                self._held += len(snaps)
                self._cond.notify_all()
                dropped = False
        if dropped:
            self._errors.note(
                f"sink {self.name}",
                len(snaps),
                f"distmon: the {self.name} fell behind ({self._capacity} snapshots unwritten); "
                "snapshots are dropped and counted in distmon_monitor_errors_total until it catches up",
            )

    def drain(self, timeout: float) -> bool:
        """Wait until everything offered so far is written, at most ``timeout`` seconds; True if it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            return self._cond.wait_for(lambda: self._held == 0, max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float) -> None:
        """Write what is queued, run ``close``, end the thread; waits at most ``timeout`` seconds.

        A sink still stuck after that keeps its (daemon) thread: the process does not wait for it.
        """
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                snaps = self._queue.popleft()
            if snaps is None:
                if self._close is not None:
                    try:
                        self._close()
                    except Exception:
                        self._errors.record(f"{self.name} close")
                return
            try:
                self._sink(snaps)
            except Exception:
                self._errors.record(f"sink {self.name}")
            finally:
                with self._cond:
                    self._held -= len(snaps)
                    self._cond.notify_all()


class AnomalyCallbacks:
    """The ``on_anomaly`` callbacks, called for every event of the snapshots handed over (a sink).

    Example:
        >>> calls = AnomalyCallbacks(ErrorCounter()); calls.add(print)
        >>> calls([Snapshot(step=1, timestamp=0.0, grad_norm=1.0)])   # no event: no call
    """

    def __init__(self, errors: ErrorCounter) -> None:
        self._fns: list[Callable[[AnomalyEvent, Snapshot], None]] = []
        self._errors = errors

    def add(self, fn: Callable[[AnomalyEvent, Snapshot], None]) -> None:
        self._fns.append(fn)

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        for snap in snaps:
            for event in snap.events:
                for fn in self._fns:
                    try:
                        fn(event, snap)
                    except Exception:
                        self._errors.record(f"on_anomaly callback {getattr(fn, '__qualname__', fn)}")


class NonfiniteNotice:
    """Says on stderr, once per run, the first step whose gradient held a NaN/Inf: its rank and layer.

    The metrics and the log have every such step, but a run that is non-finite from step 1 (an
    uninitialized buffer after ``to_empty``, say) should not need a dashboard to be noticed.
    Later non-finite steps are only counted (``distmon_nonfinite_steps_total``): one line, not
    one per step. A step the ``GradScaler`` skipped is routine fp16 overflow, not this.

    Example:
        >>> notice = NonfiniteNotice()
        >>> notice([Snapshot(step=3, timestamp=0.0, grad_norm=float("nan"), nonfinite=True,
        ...                  first_nonfinite=(1, "blocks.0.fc"))])   # doctest: +SKIP
        distmon: step 3 is the first whose gradient holds a NaN/Inf: rank 1, layer 'blocks.0.fc' ...
    """

    def __init__(self) -> None:
        self.said = False

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        if self.said:
            return
        first = next((s for s in snaps if s.nonfinite and s.skip_reason != "scaler"), None)
        if first is None:
            return
        self.said = True
        if first.first_nonfinite is not None:
            rank, layer = first.first_nonfinite
            coords = ", ".join(f"{k}={v}" for k, v in (first.first_nonfinite_coords or {}).items() if v)
            where = (
                f"rank {rank}{f' ({coords})' if coords else ''}, layer {layer!r} (first in backward order)"
            )
        else:
            where = f"ranks {first.nonfinite_ranks or 'unknown'}"
        logger.warning(
            "distmon: step %d is the first whose gradient holds a NaN/Inf: %s; later ones are "
            "counted in distmon_nonfinite_steps_total and the log, not printed",
            first.step,
            where,
        )
