"""Prometheus ``file_sd`` target file: the job announces its endpoints, and withdraws them.

Rank 0 writes ``{dir}/{run_id}.json`` listing every serving process of the run (one target
per node with ``serve="node"``), atomically (write to a temporary file, then rename), and
removes it after a clean finish. A killed job leaves it behind, which is what lets
Prometheus see the target go down and the alerts fire.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Sequence

__all__ = ["TargetFile", "target_host"]


def target_host(addr: str) -> str:
    """The address Prometheus should scrape for a server bound to ``addr``.

    Example:
        >>> target_host("127.0.0.1")
        '127.0.0.1'
    """
    return socket.getfqdn() if addr in ("0.0.0.0", "::", "") else addr


class TargetFile:
    """One run's target file: reserved when the monitor starts, written, removed at a clean finish.

    The constructor creates the directory and a temporary file in it, so an unusable
    directory fails the monitor's start-up (on every rank) rather than after hooks are
    installed; :meth:`write` fills that file and renames it into place (Prometheus never reads
    a half-written file); :meth:`discard` drops the reservation. ``targets`` holds
    ``(host:port, labels)`` per serving process.

    Example:
        >>> import json, tempfile
        >>> f = TargetFile(tempfile.mkdtemp(), "run-1")
        >>> f.write([("127.0.0.1:9290", {"run_id": "run-1", "node": "n0"})])
        >>> json.load(open(f.path))[0]["targets"]
        ['127.0.0.1:9290']
        >>> f.remove()
    """

    def __init__(self, directory: str, run_id: str) -> None:
        os.makedirs(directory, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        self.path = os.path.join(directory, f"{safe}.json")
        self._fd: int | None = None
        self._reserve()

    def _reserve(self) -> None:
        self._fd, self._tmp = tempfile.mkstemp(
            dir=os.path.dirname(self.path), prefix=".distmon-", suffix=".tmp"
        )

    def write(self, targets: Sequence[tuple[str, dict[str, str]]]) -> None:
        groups = [{"targets": [t], "labels": labels} for t, labels in targets]
        if self._fd is None:  # written before
            self._reserve()
        fd, tmp, self._fd = self._fd, self._tmp, None
        with os.fdopen(fd, "w") as f:
            json.dump(groups, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    def discard(self) -> None:
        """Drop the reserved temporary file (a start-up that did not complete)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            os.unlink(self._tmp)

    def remove(self) -> None:
        self.discard()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
