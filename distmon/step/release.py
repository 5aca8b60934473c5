"""What the process group's own thread may still hold of distmon's, and the wait until it let go.

gloo's worker thread ends each collective by dropping its share of the work, and with it what
the work holds: the tensors it was handed and, for one started inside a backward, the Python
state torch stashed for that backward; a continuation chained on its future (``Future.then``) it
ran is dropped there too. In torch 2.11 to 2.14 a tensor that C++ code holds keeps a reference
to its Python object, so dropping a handed tensor is a Python decref, under the GIL. A thread
that takes the GIL after the interpreter began to finalize is ended by Python (``pthread_exit``)
through a C++ destructor: ``terminate called without an active exception``, SIGABRT, and a job
that finished cleanly reads as failed. A bare two-rank gloo script that exits right after one
all-reduce aborts so on its own (``benchmarks/exit_aborts.py``).

So whatever distmon hands such a thread is referenced, on distmon's side, by one list and
nothing else, as a reference object is: while the other thread holds it, its reference count is
above that object's (the count changes only under the GIL, which that thread gives up at once);
distmon waits until it is not, before the interpreter may finalize.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["RELEASE_S", "HandedViews", "still_held", "wait_released"]

# How long close() and the interpreter's exit wait for the backend's thread to let go:
# milliseconds on a busy machine; bounded, for a thread that is stuck.
RELEASE_S = 10.0


def still_held(objects: Iterable[object], alone: object) -> list[object]:
    """Those of ``objects``, each referenced by one list and nothing else as ``alone`` is, that
    have a holder besides that list.

    Example:
        >>> kept, alone, other = [object(), object()], [object()], []
        >>> still_held(kept, alone[0]), other.append(kept[1]), still_held(kept, alone[0]) == [kept[1]]
        ([], None, True)
    """
    # both counts include the same references: the list, this frame's name, the call's argument
    limit = sys.getrefcount(alone)
    return [obj for obj in objects if sys.getrefcount(obj) > limit]


def wait_released(busy: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``busy()`` turned false within ``timeout_s``, polled every millisecond.

    Example:
        >>> wait_released(lambda: False, 1.0), wait_released(lambda: True, 0.01)
        (True, False)
    """
    deadline = time.monotonic() + timeout_s
    while busy():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # gives the GIL up: the other thread takes it to drop its reference
    return True


class HandedViews:
    """The tensors distmon hands its collectives, each a fresh view of its buffer held in one list,
    and the wait until the backend's thread let go of the views of the completed ones.

    A view writes into its buffer's storage as the buffer would, and only this list references it
    on distmon's side. Where torch adds no such reference, the count never shows another holder:
    the list keeps the views alive from close() on, so that thread's drop is not the last and
    takes no GIL.

    Example:
        >>> views, buf = HandedViews(), torch.zeros(4)
        >>> sent = buf.view_as(buf); work = [sent]      # a collective's work holds the view
        >>> views.landed([sent]); del sent
        >>> views.let_go(0.01), work.clear(), views.let_go(0.01)
        (False, None, True)
    """

    def __init__(self) -> None:
        self._landed: list[torch.Tensor] = []  # views of completed collectives, perhaps still held
        self._alone = [torch.empty(0)]  # referenced as each view is: the count to compare with

    def landed(self, views: Sequence[torch.Tensor]) -> None:
        """``views``' collective completed: they are kept until let go; those already let go are dropped."""
        self._landed = still_held(self._landed, self._alone[0])  # type: ignore[assignment]
        self._landed.extend(views)

    def busy(self) -> bool:
        """Whether something besides this still holds a view of a completed collective."""
        return bool(still_held(self._landed, self._alone[0]))

    def let_go(self, timeout_s: float) -> bool:
        """Whether every view of a completed collective was let go within ``timeout_s``."""
        return wait_released(self.busy, timeout_s)
