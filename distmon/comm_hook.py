"""The DDP communication hook that measures each bucket around the user's own hook.

No ``from __future__ import annotations`` here: DDP inspects the ``bucket`` annotation of a
Python comm hook when it is registered, and a string annotation fails that check.
"""

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["HookState", "monitor_hook"]


class HookState:
    """State of :func:`monitor_hook`: the step tracker and the user's hook it wraps.

    Example:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        >>> state = HookState(tracker, default_hooks.allreduce_hook, None)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, monitor_hook)               # doctest: +SKIP
    """

    __slots__ = ("tracker", "inner_hook", "inner_state")

    def __init__(self, tracker: Any, inner_hook: Callable | None, inner_state: Any) -> None:
        self.tracker = tracker
        self.inner_hook = inner_hook or default_hooks.allreduce_hook
        self.inner_state = inner_state


def monitor_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Measure the local bucket, run the user's hook, measure its reduced result.

    The local sums are read before the inner hook because ``allreduce_hook`` divides the
    buffer in place (and with ``gradient_as_bucket_view=True`` that buffer is ``p.grad``).
    Every monitor failure is caught inside the tracker; the user's hook and its result are
    never altered.
    """
    tracker = state.tracker
    measure_reduced = tracker.before_reduce(bucket)
    fut = state.inner_hook(state.inner_state, bucket)
    if bucket.is_last():
        tracker.issue_gather()  # on every rank, even after a local failure: never hang peers
    if measure_reduced is None:
        return fut
    return fut.then(measure_reduced)
