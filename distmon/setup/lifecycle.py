"""A monitor's start and end: all-or-nothing start-up on every rank, and a shutdown that never raises.

Start-up: every rank prepares what can fail, all ranks agree, then all go on or none.

A monitor that starts on some ranks and not on others hangs the job at its first collective;
one that fails after its hooks are installed leaves them running. So the constructor
prepares on each rank everything that can fail (options, the HTTP endpoint's port and its
TLS and basic-auth files, the JSONL log, the file_sd directory), the ranks exchange their
outcomes in one collective, and then either every rank installs its hooks, or every rank
releases what it prepared and raises the same error, naming the rank, the option and the path.
"""

from __future__ import annotations

import atexit
import errno
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ..compat import default_store
from ..errors import ErrorCounter, logger
from ..export.export_thread import ExportThread
from ..export.jsonl_log import JsonlLog, node_log_path
from ..export.trackers import Tracker, open_trackers
from ..options import option_label
from ..serve.file_sd import TargetFile, target_host
from ..serve.http_server import MetricServer
from ..serve.prometheus_exporter import MetricsAggregate
from . import hostinfo
from .config import MonitorConfig
from .hostinfo import RankInfo

T = TypeVar("T")

__all__ = [
    "Peer",
    "Opened",
    "prepare",
    "agree",
    "differences",
    "serves",
    "served_ranks",
    "announce",
    "shut_down",
    "ExitGuard",
]


@dataclass(frozen=True)
class Peer:
    """What one rank tells the others at start-up."""

    info: RankInfo
    run_id: str | None  # its proposal; rank 0's wins
    endpoint: str | None  # "host:port" it serves metrics on, if it serves
    failure: tuple[str, int, str] | None = None  # (exception type, errno, message) if it cannot start
    agreed: Mapping[str, str] | None = None  # the options every rank must set alike (config.AGREED)
    nonce: str = ""  # rank 0's names this monitor's keys in the job's store (ExitGuard)


def serves(serve: str, rank: int, lead: bool) -> bool:
    """Whether a process runs an HTTP endpoint under ``serve`` (known before the exchange); ``lead``:
    it is the job's lowest rank on its node.

    Example:
        >>> serves("node", rank=5, lead=True), serves("rank0", rank=5, lead=True)
        (True, False)
    """
    return {"rank0": rank == 0, "node": lead, "all": True, "none": False}[serve]


def served_ranks(serve: str, me: RankInfo, everyone: Sequence[RankInfo]) -> tuple[bool, tuple[RankInfo, ...]]:
    """(serves the cluster-wide families, ranks whose per-rank series it serves) for this process.

    Cluster-wide families come only from global rank 0, so no series is counted twice; a rank
    holds the rows of its own node's ranks only, so per-rank series come from their own node
    (``serve="rank0"``: node 0's alone).
    """
    if not serves(serve, me.rank, me.lead):
        return False, ()
    node = tuple(i for i in everyone if i.node == me.node)
    return me.rank == 0, {"rank0": node, "node": node, "all": (me,)}[serve]


@dataclass
class Opened:
    """What a rank opened at start-up, released again if the start-up does not complete."""

    server: MetricServer | None = None
    endpoint: str | None = None
    log: JsonlLog | None = None
    target: TargetFile | None = None
    trackers: tuple[Tracker, ...] = ()  # tracker= (global rank 0's)

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.log is not None:
            self.log.discard()
        if self.target is not None:
            self.target.discard()
        for tracker in self.trackers:
            try:
                if tracker.made:
                    tracker.close()
            except Exception:  # the start-up's own error is the one to raise
                logger.exception("distmon: closing tracker %s after a failed start-up", tracker.name)
        self.server = self.log = self.target = None
        self.trackers = ()


def _usable(option: str, path: str, make: Callable[[str], T]) -> T:
    try:
        return make(path)
    except OSError as e:
        raise OSError(e.errno, f"distmon: {option} {path!r} is not usable: {e.strerror or e}") from e


def prepare(cfg: MonitorConfig, me: RankInfo, run_id: str) -> Opened:
    """Open this rank's endpoint, log and target file; on failure release them and raise.

    Example:
        >>> prepared = prepare(cfg, me, "run-1")   # every rank, before agree()  # doctest: +SKIP
    """
    out = Opened()
    try:
        if serves(cfg.serve, me.rank, me.lead):
            port = cfg.port + me.local_rank if cfg.serve == "all" and cfg.port else cfg.port
            # a restarted worker wants its predecessor's port (scrape configs name it): wait for it
            wait = RESTART_BIND_S if hostinfo.restart_count() else 0.0
            out.server = MetricServer.bind(cfg.addr, port, cfg.port_fallback, cfg.security, wait_s=wait)
            out.endpoint = f"{target_host(cfg.addr)}:{out.server.port}"
            if port and out.server.port != port:  # port_fallback: said before anything else is
                logger.warning(
                    "distmon: port %d is in use (another job on this node?): serving on port %d "
                    "instead (port_fallback; port_fallback=False raises instead)",
                    port,
                    out.server.port,
                )
        if cfg.log_path and me.lead:  # the job's rank 0 leads its node 0: the log itself
            out.log = _usable("log_path", node_log_path(cfg.log_path, me.node_index), JsonlLog)
        if cfg.file_sd_dir and me.rank == 0:
            out.target = _usable("file_sd_dir", cfg.file_sd_dir, lambda d: TargetFile(d, run_id))
        if cfg.tracker is not None and me.rank == 0:  # the job's figures are global rank 0's
            out.trackers = tuple(open_trackers(cfg.tracker, run_id))
    except BaseException:
        out.release()
        raise
    return out


RESTART_BIND_S = 10.0  # how long a restarted worker waits for its predecessor's port to be free

_KINDS: dict[str, type[Exception]] = {"OSError": OSError, "ValueError": ValueError, "TypeError": TypeError}


def _describe(exc: BaseException) -> tuple[str, int, str]:
    kind = next((name for name, cls in _KINDS.items() if isinstance(exc, cls)), "RuntimeError")
    # an OSError's str() repeats "[Errno n]": its strerror is the message
    message = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__
    return kind, getattr(exc, "errno", None) or 0, message.removeprefix("distmon: ")


def _ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def differences(everyone: Sequence[Peer]) -> str | None:
    """Which agreed options differ between ranks, and each value's ranks; None if they all agree.

    Example:
        >>> info = lambda r: RankInfo(r, r, "host", "")
        >>> peers = [Peer(info(r), None, None, agreed={"export_every": v}) for r, v in enumerate("3355")]
        >>> differences(peers)
        'export_every (DISTMON_EXPORT_EVERY) is 3 on ranks 0-1, 5 on ranks 2-3'
    """
    told = [p for p in everyone if p.agreed is not None]
    if not told:
        return None
    out = []
    for name in told[0].agreed:
        by_value: dict[str, list[int]] = {}
        for p in told:
            by_value.setdefault(p.agreed.get(name, "?"), []).append(p.info.rank)
        if len(by_value) > 1:
            values = ", ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in by_value.items())
            out.append(f"{option_label(name)} is {values}")
    return "; ".join(out) or None


def agree(
    me: RankInfo,
    run_id: str | None,
    *,
    endpoint: str | None,
    failure: BaseException | None,
    group: dist.ProcessGroup | None,
    agreed: Mapping[str, str] | None = None,
) -> list[Peer]:
    """Exchange every rank's outcome (one collective); raise the same error everywhere if any failed.

    Call on every rank, whatever happened locally: that is what keeps a failure on one rank
    from leaving the others waiting. ``agreed`` are this rank's options that every rank must
    set alike (:meth:`MonitorConfig.agreed`); a difference is a failure of every rank, named
    with each value's ranks. The caller releases what it prepared before the error propagates.
    """
    nonce = uuid.uuid4().hex  # rank 0's wins: the key of this monitor's exit in the job's store
    told = Peer(me, run_id, endpoint, failure=failure and _describe(failure), agreed=agreed, nonce=nonce)
    everyone: list[Peer] = hostinfo.gather_objects(told, group)
    _raise_failures(everyone, failure)
    differ = differences(everyone)
    if differ is None:
        return everyone
    raise ValueError(
        f"distmon: GradMonitor did not start on any rank: options differ between ranks: {differ}. "
        "Every rank must set them alike (a difference hangs or aborts the job at the monitor's "
        "first collective): check each node's DISTMON_* environment and the arguments"
    )


def _raise_failures(everyone: Sequence[Peer], failure: BaseException | None) -> None:
    """Raise, on every rank alike, the error naming each rank that failed (nothing if none did)."""
    failed = [p for p in everyone if p.failure is not None]
    if not failed:
        return
    kind, code, _ = failed[0].failure
    # one line per distinct reason (a thousand ranks failing alike make one line, not a thousand)
    by_reason: dict[str, list[Peer]] = {}
    for p in failed:
        by_reason.setdefault(p.failure[2], []).append(p)
    detail = "; ".join(_where(peers) + f": {reason}" for reason, peers in by_reason.items())
    message = f"distmon: GradMonitor did not start on any rank: {detail}"
    if kind == "OSError":
        error: Exception = OSError(code or errno.EIO, message)
    else:
        error = _KINDS.get(kind, RuntimeError)(message)
    if failure is not None:
        raise error from failure
    raise error


def _where(peers: Sequence[Peer]) -> str:
    """``rank 3 (node-a)``, or ``ranks 0-7 (node-a, node-b)`` naming at most three hosts."""
    ranks = [p.info.rank for p in peers]
    hosts = list(dict.fromkeys(p.info.hostname for p in peers))
    shown = ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more hosts" if len(hosts) > 3 else "")
    return f"rank {ranks[0]} ({shown})" if len(ranks) == 1 else f"ranks {_ranks(ranks)} ({shown})"


# Prometheus needs a moment to notice a withdrawn file_sd target; closing at once would show it
# as down (up == 0) in between
WITHDRAW_GRACE_S = 5.0
STOP_S = 2.0  # the sinks had SINK_WAIT_S to drain at the last export: a stuck one gets this much more
LINGER_SCRAPES = 2  # scrapes of the final state a clean finish waits for (at most linger_s)


def announce(
    prepared: Opened, *, peers: Sequence[Peer], run_id: str, url: str | None, errors: ErrorCounter
) -> None:
    """Started: write the file_sd target file (rank 0), say where metrics are served (if this rank serves)."""
    if prepared.target is not None:
        try:
            prepared.target.write(
                [
                    (p.endpoint, {"run_id": run_id, "node": str(p.info.node_index)})
                    for p in peers
                    if p.endpoint
                ]
            )
        except OSError:
            errors.record("file_sd target file")
    if prepared.server is not None:  # a warning: frameworks show no INFO lines, and this must be seen
        logger.warning("distmon: serving metrics at %s (run_id=%s)", url, run_id)


def shut_down(
    prepared: Opened,
    *,
    export: ExportThread,
    aggregate: MetricsAggregate | None,
    cfg: MonitorConfig,
    finished: bool,
    errors: ErrorCounter,
) -> None:
    """Stop the export thread and the sinks, linger, withdraw the target, stop serving. Never raises.

    Each part on its own: one failing (a full disk under the log, say) is counted and logged,
    and the rest still shuts down. ``finished`` (a clean close): the clean-finish mark, the
    linger and the withdrawal of the file_sd target; without it the run reads as having died.
    With ``file_sd_dir`` the job's endpoints are in a target file rank 0 withdraws after the
    linger: every one serves the whole ``linger_s`` (an endpoint that stopped early would be a
    listed target down; one that waited for its own scrapes cannot tell when the others did).
    """
    linger_s, listed = cfg.linger_s, bool(cfg.file_sd_dir)

    def quietly(site: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            errors.record(site)

    quietly("export thread shutdown", lambda: export.stop(STOP_S))
    if aggregate is not None and finished:
        aggregate.mark_finished()
    server, target = prepared.server, prepared.target
    if server is not None and finished and linger_s > 0:
        # Prometheus must scrape distmon_run_finished=1 before the target goes away, or the
        # vanished-metrics alert cannot tell a clean finish from a crash: serve until two scrapes
        # took the final state, at most linger_s; nobody scraped during the run, nobody waits.
        if listed:
            logger.warning(
                "distmon: run finished; serving the final metrics %.0f s more (linger_s)", linger_s
            )
            time.sleep(linger_s)
        elif server.scrapes == 0:
            logger.warning("distmon: run finished; /metrics was never scraped, so not serving on")
        else:
            logger.warning(
                "distmon: run finished; serving the final metrics until Prometheus scraped them twice, "
                "at most %.0f s more (linger_s, DISTMON_LINGER_S; 0: stop at once)",
                linger_s,
            )
            server.wait_for_scrapes(server.scrapes + LINGER_SCRAPES, linger_s)
    if target is not None and finished:
        quietly("file_sd target file", target.remove)
        time.sleep(min(WITHDRAW_GRACE_S, linger_s))
    if server is not None:
        quietly("metrics server shutdown", server.close)


EXIT_GATHER_S = 30.0  # at exit, how long a rank waits for the others to exit too, then for their rows


def meet_at_exit(key: str, world: int, timeout_s: float) -> tuple[bool, bool]:
    """Whether every rank of the job reached its exit within ``timeout_s``, and whether they gather.

    Through the default group's store, not a collective: a rank that ended early (``sys.exit(1)``
    after an error) while the others still train must not start a collective they never join (it
    would wait for its timeout, then leave its work in flight and hang the process's exit, and the
    peer blocked on this rank with it). Each rank counts itself in and waits for the others (one
    blocking ``wait`` on a key the last one sets: no polling, whatever the number of ranks); the
    first to decide sets the outcome for all (``compare_set``): "gather" once every rank is in,
    "alone" once one gave up waiting. A store that fails (its host rank already gone) means alone.

    Example:
        >>> meet_at_exit("distmon/exit/doc", world=1, timeout_s=1.0)   # one rank: nothing to wait for
        (True, True)
    """
    if world == 1:
        return True, True
    try:
        store = default_store()
        everyone = _all_arrive(store, key, world, timeout_s)
        decided = store.compare_set(f"{key}/decision", "", "gather" if everyone else "alone")
    except Exception:  # no store, or its host gone: this rank closes alone
        return False, False
    return everyone, decided == b"gather"


def _all_arrive(store: dist.Store, key: str, world: int, timeout_s: float) -> bool:
    """Count this rank in; whether all ``world`` ranks are in within ``timeout_s``."""
    if store.add(f"{key}/arrived", 1) >= world:
        store.set(f"{key}/all", "1")
        return True
    try:
        store.wait([f"{key}/all"], timedelta(seconds=timeout_s))
    except Exception:  # timed out: a rank did not come (a store that failed fails the decision too)
        return False
    return True


class ExitGuard:
    """Closes a monitor that the program never closed, when the interpreter exits; armed at start-up.

    Forgetting ``close()`` (a module-level loop like nanoGPT's, which cannot be re-indented into
    a ``with``) must not lose the steps since the last export, nor leave ``distmon_run_finished``
    at 0 after a clean end. At exit, the monitor is closed as ``close()`` would: finished, every
    rank's rows gathered (each rank exits through the same guard). The gather is a collective, so
    it starts only once every rank is known to be exiting (:func:`meet_at_exit`, up to
    :data:`EXIT_GATHER_S`): a rank that ended early while the others train (a script that caught
    its error and called ``sys.exit(1)``) closes with its own figures, not marked finished, and
    exits; no gather is tried once the process group is destroyed (nanoGPT calls
    ``destroy_process_group()``; the steps since the last export then carry this rank's figures,
    the others' as not measured). An uncaught exception ended the program: closed as on an
    exception (not finished, no gather, no waiting for anyone), and said so. Said once on stderr.

    Example:
        >>> guard = ExitGuard(lambda finished, gather, timeout_s: None, rank=0, world=1, key="doc")
        >>> guard.disarm()   # close() was called
    """

    def __init__(
        self, close: Callable[[bool, bool, float | None], None], *, rank: int, world: int, key: str
    ) -> None:
        self._close, self.rank, self.world, self.key = close, rank, world, key
        atexit.register(self._at_exit)

    def disarm(self) -> None:
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        if getattr(sys, "last_value", None) is not None:  # set by an uncaught exception
            logger.warning(
                "distmon: rank %d: the program died of an uncaught exception; distmon closed its "
                "monitor (the run is not marked finished: it reads as having died)",
                self.rank,
            )
            self._close(False, False, EXIT_GATHER_S)
            return
        if self.world > 1 and not (dist.is_available() and dist.is_initialized()):
            self._say("process group already destroyed: this rank's own figures of the last steps only")
            self._close(True, False, EXIT_GATHER_S)
            return
        everyone, gather = meet_at_exit(self.key, self.world, EXIT_GATHER_S)
        if not everyone:
            logger.warning(
                "distmon: rank %d exits without GradMonitor.close() while other ranks did not reach "
                "their exit within %.0f s (the program ended early on this rank): closed it with this "
                "rank's own figures of the last steps, not marked finished",
                self.rank,
                EXIT_GATHER_S,
            )
        else:
            self._say(
                "every rank's figures gathered, marked finished"
                if gather
                else "the other ranks stopped waiting for this one: its own figures of the last steps, "
                "marked finished"
            )
        self._close(everyone, gather, EXIT_GATHER_S)

    def _say(self, how: str) -> None:
        logger.warning(
            "distmon: rank %d exits without GradMonitor.close(): closing it now (%s). Call "
            "mon.close() on every rank when training ends, or build it in a `with` block",
            self.rank,
            how,
        )
