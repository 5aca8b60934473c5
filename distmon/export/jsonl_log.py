"""JSONL exporter: one strict-JSON line per optimizer step, written by rank 0 (and by the first rank
of every other node, for its node's ranks: :func:`node_log_path`). The fields and their version:
``log_schema.py`` (``docs/log-schema.md``)."""

from __future__ import annotations

import json
import os
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
        self._file = open(path, "a", encoding="utf-8")

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        for snap in snaps:
            line = {**to_jsonable(snap), "schema": LOG_SCHEMA_VERSION}
            self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def discard(self) -> None:
        """Close, and remove the file if this log created it and it is still empty."""
        self.close()
        if self._created and os.path.getsize(self.path) == 0:
            os.unlink(self.path)
