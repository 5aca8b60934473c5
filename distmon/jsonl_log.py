"""JSONL exporter: one strict-JSON line per optimizer step, written by rank 0."""

from __future__ import annotations

import json
import os
from typing import Sequence

from .snapshot import Snapshot, to_jsonable

__all__ = ["JsonlLog"]


class JsonlLog:
    """Appends each snapshot as a JSON object line (non-finite floats as "nan"/"inf").

    Example:
        >>> log = JsonlLog("/tmp/run.jsonl")   # doctest: +SKIP
        >>> log([snap]); log.close()           # doctest: +SKIP
    """

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        for snap in snaps:
            self._file.write(json.dumps(to_jsonable(snap), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
