"""Device ring buffer of per-step rows, and its occasional non-blocking copy to the host.

Each optimizer step writes one row on the device. Every ``export_every`` steps the whole ring
goes to (pinned) host memory in one ``non_blocking`` copy with an event recorded behind it; a
host thread waits for the event, never the training loop. Two host buffers alternate so one
can be read while the next copy lands.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..snapshot import SkipReason
from .rows import Head, StepRow

__all__ = ["DeviceRing", "HostCopy", "StepInfo", "ExportBatch", "ExportQueue", "HOST_WAIT_S"]

# The longest an export step waits for a host buffer. The export thread frees one as soon
# as it has read it (sinks that write files or run callbacks have threads of their own), so
# this is reached only if decoding falls two exports behind.
HOST_WAIT_S = 1.0


@dataclass
class HostCopy:
    """One export in flight: host rows, the event that says they landed, and a release hook."""

    rows: torch.Tensor
    event: torch.cuda.Event | None
    _free: threading.Event

    def wait_ready(self, poll_s: float = 0.0005) -> None:
        """Block the calling (host) thread until the copy has landed; polls, never synchronizes."""
        if self.event is not None:
            while not self.event.query():
                time.sleep(poll_s)

    def release(self) -> None:
        self._free.set()


class StepInfo(NamedTuple):
    """What the host knows of a finished step besides its ring row."""

    step: int
    slot: int  # its row in the ring (and in the host copy)
    timestamp: float
    skip: SkipReason  # who kept the optimizer from taking it ("": taken)


@dataclass(frozen=True)
class ExportBatch:
    """Rows to export: the host copy and the steps whose rows it holds."""

    copy: HostCopy
    steps: tuple[StepInfo, ...]


class ExportQueue(queue.Queue["ExportBatch | None"]):
    """Where the step schedule hands its exports to the export thread, which reads them in order
    (``None``: stop). Unbounded: the ring's two host copies bound what is ever in it."""


class DeviceRing:
    """``n_rows`` step rows (:class:`~distmon.step.rows.StepRow`) of fp32 on ``device``.

    Step s has row ``(s - 1) % n_rows``.

    Example:
        >>> from distmon.step.rows import RowPlan
        >>> ring = DeviceRing(4, RowPlan.build(n_layers=1, world=1).step, torch.device("cpu"))
        >>> ring.slot(1), ring.slot(5), tuple(ring.data.shape)
        (0, 0, (4, 16))
    """

    def __init__(self, n_rows: int, layout: StepRow, device: torch.device) -> None:
        self.n_rows = n_rows
        self.data = torch.zeros(n_rows, layout.width, dtype=torch.float32, device=device)
        # views made once: the hooks index rows every step
        self._rows = list(self.data.unbind(0))
        self._layers = [row[layout.layers] for row in self._rows]
        self._totals = [row[Head.TOTAL_SQ : Head.TOTAL_SQ + 1] for row in self._rows]
        pin = device.type == "cuda"
        self._host = [torch.empty_like(self.data, device="cpu", pin_memory=pin) for _ in range(2)]
        self._free = [threading.Event() for _ in self._host]
        for ev in self._free:
            ev.set()
        self._next = 0
        self._cuda = device.type == "cuda"

    def slot(self, step: int) -> int:
        """Ring row of optimizer step ``step`` (the first step is 1)."""
        return (step - 1) % self.n_rows

    def row(self, step: int) -> torch.Tensor:
        return self._rows[self.slot(step)]

    def layers(self, step: int) -> torch.Tensor:
        """The reduced per-layer sums of squares of step ``step``'s row."""
        return self._layers[self.slot(step)]

    def land_reduced(self, step: int, layer_sq: torch.Tensor) -> None:
        """The one place a step's reduced figures land in its row: the per-layer sums of squares
        ``layer_sq`` (a layout in parts: the job's, after the step's collective; else this rank's,
        folded in place: ``layer_sq`` is :meth:`layers` itself) and their total, the global norm
        squared. Device ops only.

        Example:
            >>> from distmon.step.rows import RowPlan
            >>> ring = DeviceRing(2, RowPlan.build(n_layers=2, world=1).step, torch.device("cpu"))
            >>> ring.land_reduced(1, torch.tensor([9.0, 16.0])); ring.row(1)[Head.TOTAL_SQ].item() ** 0.5
            5.0
        """
        layers = self.layers(step)
        if layer_sq is not layers:
            layers.copy_(layer_sq)
        torch.sum(layers, 0, keepdim=True, out=self._totals[self.slot(step)])

    def span(self, first: int, last: int) -> torch.Tensor:
        """The rows of steps ``first..last``, consecutive in the ring (a stretch between exports)."""
        start = self.slot(first)
        return self.data[start : start + last - first + 1]

    def reset(self, first: int, last: int, blank: torch.Tensor) -> None:
        """Write the row ``blank`` into the rows of steps ``first..last`` (at most ``n_rows`` steps).

        One copy per contiguous stretch of the ring (two when it wraps), so rows are reset
        once per export rather than once per step.
        """
        start, n = self.slot(first), last - first + 1
        head = min(n, self.n_rows - start)
        self.data[start : start + head].copy_(blank.expand(head, -1))
        if n > head:
            self.data[: n - head].copy_(blank.expand(n - head, -1))

    def copy_to_host(self, timeout: float = HOST_WAIT_S) -> HostCopy | None:
        """Start the copy of the whole ring; the caller hands the result to the host thread.

        None when no host buffer came free within ``timeout`` seconds (the host thread is two
        exports behind): the caller drops this export rather than hold the training step.
        """
        i = self._next
        if not self._free[i].wait(timeout):
            return None
        self._next = 1 - i
        self._free[i].clear()
        self._host[i].copy_(self.data, non_blocking=True)
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        return HostCopy(self._host[i], event, self._free[i])
