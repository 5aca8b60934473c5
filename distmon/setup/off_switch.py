"""``DISTMON_DISABLE``: distmon off without a code change, on every rank of the job or on none.

With ``DISTMON_DISABLE=1`` (or ``true``, ``yes``, ``on``) ``GradMonitor(...)`` builds nothing: no
hook, no comm hook, no endpoint, no thread, no log, no collective during training, so the job
trains exactly as without distmon. Its methods stay callable (``GradMonitor``'s docstrings say
what each returns then), and the job's rank 0 says once on stderr that distmon is off.

Ranks that disagree are refused like any option every rank must set alike: a monitor on some
ranks and none on others would hang the job at its first collective. So the switch is agreed in
**one collective at construction**, on every rank whatever its value, before anything else: a
MAX all-reduce of three integers over the job's group (which of "on", "off", "not a boolean" the
ranks hold). Every rank reads the same three, so every rank takes the same branch: all on (the
monitor starts), all off (nothing more, ever), or the same ``ValueError`` everywhere. Only on
that error path are the ranks' values gathered, to name them with their ranks. An enabled
monitor pays the same one small all-reduce at construction, nothing per step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import logger
from . import hostinfo
from .lifecycle import _ranks

__all__ = ["ENV", "Off", "agreed_off", "read"]

ENV = "DISTMON_DISABLE"
_ON, _OFF, _BAD = 0, 1, 2
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read(text: str | None) -> int:
    """This rank's switch: 0 on (unset, empty or false), 1 off (true), 2 not a boolean.

    Example:
        >>> read(None), read(""), read("0"), read("1"), read("True"), read("maybe")
        (0, 0, 0, 1, 1, 2)
    """
    low = (text or "").strip().lower()
    if low in _TRUE:
        return _OFF
    return _ON if low in ("", *_FALSE) else _BAD


class Off:
    """What a disabled monitor knows of its job: its rank and size in the job's group (no more)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def agreed_off(group: dist.ProcessGroup | None) -> Off | None:
    """``Off`` when ``DISTMON_DISABLE`` turns distmon off on every rank of ``group`` (the job's), None
    when it is on everywhere; raises the same ``ValueError`` on every rank when the ranks disagree or a
    value is not a boolean. One collective over ``group`` (none without one), on every rank.

    Example:
        >>> os.environ["DISTMON_DISABLE"] = "1"
        >>> agreed_off(None).world_size   # one process: nothing to agree with
        1
        >>> del os.environ["DISTMON_DISABLE"]; agreed_off(None) is None
        True
    """
    text = os.environ.get(ENV)
    mine = read(text)
    if group is None:
        seen = [mine == k for k in (_ON, _OFF, _BAD)]
        rank, world = 0, 1
    else:
        held = torch.zeros(3, dtype=torch.int64, device=hostinfo._collective_device(group))
        held[mine] = 1
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)  # every rank, whatever it holds
        seen = [bool(v) for v in held.tolist()]  # a host read at construction, never after
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    if seen == [True, False, False]:
        return None
    if seen == [False, True, False]:
        if rank == 0:  # one line per job, on stderr (a warning: frameworks show no INFO lines)
            logger.warning(
                f"distmon: off ({ENV}={text} on every rank of the job's {world}): GradMonitor installs "
                f"nothing, serves nothing and writes nothing; unset {ENV} to monitor again"
            )
        return Off(rank, world)
    texts = hostinfo.gather_objects(text, group) if group is not None else [text]
    by_value: dict[str, list[int]] = {}
    for r, value in enumerate(texts):
        by_value.setdefault("unset" if value is None else repr(value), []).append(r)
    values = ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}" for v, rs in by_value.items())
    raise ValueError(
        f"distmon: GradMonitor did not start on any rank: {ENV} is {values}. Set it alike on every "
        f"rank of the job, to 1/true (distmon off) or 0/false or unset (on): a monitor on some ranks "
        "and not on others hangs the job at its first collective"
    )
