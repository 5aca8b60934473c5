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
from typing import Sequence

__all__ = ["TargetFile", "target_host"]


def target_host(addr: str) -> str:
    """The address Prometheus should scrape for a server bound to ``addr``.

    Example:
        >>> target_host("127.0.0.1")
        '127.0.0.1'
    """
    return socket.getfqdn() if addr in ("0.0.0.0", "::", "") else addr


class TargetFile:
    """Writes and removes one run's target file.

    ``targets`` holds ``(host:port, labels)`` per serving process.

    Example:
        >>> f = TargetFile("/tmp/sd", "run-1")                          # doctest: +SKIP
        >>> f.write([("127.0.0.1:9290", {"run_id": "run-1", "node": "n0"})])  # doctest: +SKIP
    """

    def __init__(self, directory: str, run_id: str) -> None:
        os.makedirs(directory, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        self.path = os.path.join(directory, f"{safe}.json")

    def write(self, targets: Sequence[tuple[str, dict[str, str]]]) -> None:
        groups = [{"targets": [t], "labels": labels} for t, labels in targets]
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".distmon-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(groups, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
