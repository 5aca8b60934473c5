"""Failures of the monitor's own code: caught, counted, logged once, never raised into training."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("distmon")

__all__ = ["ErrorCounter", "logger"]


class ErrorCounter:
    """Counts caught exceptions and logs the first one of each site with its traceback.

    Example:
        >>> errors = ErrorCounter()
        >>> try:
        ...     raise RuntimeError("boom")
        ... except RuntimeError:
        ...     errors.record("comm_hook")
        >>> errors.count
        1
    """

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # comm-hook callbacks may run on a backend thread

    def record(self, site: str) -> None:
        """Call from an ``except`` block: counts it, logs the first per ``site``."""
        with self._lock:
            self.count += 1
            first = site not in self._seen
            self._seen.add(site)
        if first:
            logger.exception(
                "distmon: error in %s; training continues unaffected (further errors "
                "here are counted in distmon_monitor_errors_total, not logged)",
                site,
            )

    def value(self) -> int:
        """The count now (for a collector that reads it live)."""
        return self.count

    def note(self, site: str, n: int, message: str) -> None:
        """Count ``n`` losses at ``site`` that are no exception (a sink fell behind); warn once per site."""
        with self._lock:
            self.count += n
            first = site not in self._seen
            self._seen.add(site)
        if first:
            logger.warning(message)
