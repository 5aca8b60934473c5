"""JSONL exporter: one strict-JSON line per optimizer step, written by rank 0 (and by the first rank
of every other node, for its node's ranks: :func:`node_log_path`). The fields and their version:
``log_schema.py`` (``docs/log-schema.md``)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence

from ..snapshot import Snapshot, to_jsonable
from .log_schema import LOG_SCHEMA_VERSION

__all__ = ["JsonlLog", "node_log_path"]


def node_log_path(path: str, node: int) -> str:
    """Where node ``node`` writes its log: ``path`` itself for the first node (global rank 0's),
    ``<stem>.node<n><suffix>`` beside it for the others (their lines hold their own ranks' rows).

    Example:
        >>> node_log_path("logs/run.jsonl", 0), node_log_path("logs/run.jsonl", 3)
        ('logs/run.jsonl', 'logs/run.node3.jsonl')
    """
    if node == 0:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.node{node}{suffix}"


class JsonlLog:
    """Appends each snapshot as a JSON object line (non-finite floats as "nan"/"inf"), its schema
    version last (``"schema"``: a line starts with ``{"step":``, which the report's reader relies on).

    The file is opened (and its directory created) by the constructor, so an unusable path
    fails the monitor's start-up; :meth:`discard` undoes that when the start-up does not
    complete (the file goes if this log created it and wrote nothing).

    Every line this log writes is whole, whatever the file held: a process killed mid-write (a
    SIGKILL, an OOM kill) can leave the file's last line cut, and the restarted job appends to the
    same file; so a file that does not end in a newline gets one first, and the cut line stays a
    line of its own (the report skips it as a ``cut line``) instead of swallowing the restarted
    run's first line, the one that says it resumed. Each export's lines go to the file in one
    ``write`` on an ``O_APPEND`` descriptor, which leaves a kill far fewer places to cut them
    than a buffered file's 8 KiB pieces.

    Example:
        >>> import os, tempfile
        >>> log = JsonlLog(os.path.join(tempfile.mkdtemp(), "run.jsonl"))
        >>> log([Snapshot(step=1, timestamp=0.0, grad_norm=0.5)]); log.close()
        >>> open(log.path).read().count("\\n")
        1
    """

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self._created = not os.path.exists(path)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        if not _ends_a_line(self._fd, path):
            self._write(b"\n")

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        lines = (json.dumps({**to_jsonable(s), "schema": LOG_SCHEMA_VERSION}, allow_nan=False) for s in snaps)
        self._write("".join(f"{line}\n" for line in lines).encode("utf-8"))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it all at once but for a full disk or a fatal signal
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close, and remove the file if this log created it and it is still empty."""
        self.close()
        if self._created and os.path.getsize(self.path) == 0:
            os.unlink(self.path)


def _ends_a_line(fd: int, path: str) -> bool:
    """Whether the file is empty or its last byte is a newline (else a writer died mid-line); a
    path that is not a regular file (``/dev/stdout``, a pipe) has no last line to mend."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        return True
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
