"""Reading a JSONL log (``log_path=``) for the report: one run of it, in bounded memory.

Several files are read together as the node logs of one job (``log_path`` and its
``<stem>.node<n><suffix>`` siblings, one per node): each line of a node log carries the job-wide
fields (identical in every node's log) and its node's slices of the per-rank lists, with
``"ranks"`` (the global ranks they describe, in order) and ``"node"``. Lines of the same run id,
segment and step (see "Runs" below; a segment is counted per run id in each file, at a step that
does not rise and at a ``resumed_from`` line) are one step: the per-rank lists are placed by
global rank (a rank no node log reported is NaN / not valid and is named as missing), the
job-wide fields are the line's with the lowest ranks (node 0's); a line whose job-wide fields
differ from it is counted, not raised. A line without ``"ranks"`` (older logs, one node)
describes ranks ``0..len(rank_grad_norms)-1``. Steps of different segments (different runs,
where only some files hold them) are taken in the order of their ``timestamp``, ties in file
order. Memory grows with the files by one line each (the line being merged).

Imports neither torch nor matplotlib (``python -m distmon report`` loads no torch).

Each line is read in binary with a size cap, decoded as UTF-8, parsed as JSON and checked
against the snapshot schema; a line that fails any of these is skipped and counted under its
reason (with the number of its first line), never raised:

- ``longer than N MiB``: never loaded; read past in 1 MiB pieces;
- ``not UTF-8``, ``not JSON``;
- ``cut line``: the last line, without its newline, is not JSON (a run stopped mid-write); a
  line that starts as a snapshot's (``{"step":``) and is not JSON (a run stopped mid-write and
  the restarted run's log closed the line before its own: ``JsonlLog``); or a line whose tail is
  a whole snapshot (a restarted run of an older distmon appended its first line to the cut one):
  the tail is kept, the cut head counted;
- ``not a JSON object``, ```step` missing or not an integer >= 0``, and one reason per field of
  the wrong type (```layer_grad_norms` is not an object of numbers``, ``an event's `value` is
  missing or of the wrong type``, ...). Every field but ``step`` may be absent.

Runs: the log of a job restarted in append mode holds several runs one after another. A run
is a stretch of lines with the same ``run_id`` and rising steps; a step that does not rise
starts a new run even with the same id (a restart that reused it: ``TORCHELASTIC_RUN_ID``,
a requeued Slurm job), unless its line says the process resumed the run from a checkpoint
(``resumed_from``, written by a monitor that ``load_state_dict``-ed; a new job may have a new
run id): the run goes on, the steps after the checkpoint rolled back (dropped) and the restart
kept (:attr:`Run.restarts`).
One run is kept: the latest by default, else the latest with a given id, else the N-th; the
others are only listed (id, steps, lines).

Bounds: a line costs at most ``max_line_bytes`` while it is parsed; what is kept per step is
``MAX_LAYERS`` layer norms and ``MAX_RANKS`` rank norms (8 bytes each): layers past the first
``MAX_LAYERS - 1`` of the run fold into ``"other"`` as their root-sum-of-squares, as the
exporter's ``max_layers`` folds them. Events keep their steps per kind and the first
``MAX_EVENTS`` in full; the rank x layer matrix is kept (capped) only for the steps that may
be the worst one; names (run ids, layers, event kinds) are kept to ``MAX_NAME`` characters.

Example:
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
    ...     _ = f.write(b'{"step": 1, "grad_norm": 0.5}\\n[1, 2]\\n{"step": 2, "grad_')
    >>> log = read_log(f.name)
    >>> list(log.run.steps), dict(log.skipped)
    ([1], {'not a JSON object': 1, 'cut line': 1})
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import BinaryIO

from .log_lines import (
    LISTED_RUNS,
    MAX_LINE_BYTES,
    MAX_RANK_ID,
    OPEN_STATES,
    LogError,
    as_float,
    check_snapshot,
    is_int,
    ranks_of,
    shortened,
)
from .run import Run, RunSpan

__all__ = ["read_log", "LogRead", "NodeLog", "describe_skips", "describe_runs"]


@dataclass
class NodeLog:
    """One file read: its path, lines (blank ones included) and the snapshots taken from it."""

    path: str
    lines: int = 0
    snapshots: int = 0


@dataclass
class LogRead:
    """A log read for the report: the chosen run, the runs listed, the lines skipped."""

    run: Run
    runs: list[RunSpan | None]  # the first and last LISTED_RUNS, None where some were left out
    run_count: int
    skipped: Counter[str]  # reason -> lines
    first_skipped: dict[str, int | str]  # reason -> its first line ("4", or "4 of run.node1.jsonl")
    max_line_bytes: int
    logs: list[NodeLog] = field(default_factory=list)  # the files read, in the order given


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, bool]]:
    """(line number, its bytes or None when longer than ``limit``, whether it is the last line).

    An over-long line is read past in 1 MiB pieces, never held whole.
    """

    def raw() -> Iterator[bytes | None]:
        while chunk := f.readline(limit + 1):
            if len(chunk) > limit and not chunk.endswith(b"\n"):
                while chunk and not chunk.endswith(b"\n"):
                    chunk = f.readline(1 << 20)
                yield None
            else:
                yield chunk

    lines = raw()
    line, number = next(lines, b""), 0
    while line != b"":
        after = next(lines, b"")
        number += 1
        yield number, line, after == b""
        line = after


_LINE_START = b'{"step":'  # how every snapshot's line starts (JsonlLog)


def _parse(raw: bytes, last: bool) -> tuple[object, str | None, bool]:
    """(the parsed line, the reason it is skipped or None, whether a cut head was dropped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8", False
    try:
        return json.loads(text), None, False
    except (ValueError, RecursionError):
        pass
    tail = text.rfind(_LINE_START.decode(), 1)  # a restarted run's first line appended to a cut one
    if tail > 0:
        try:
            return json.loads(text[tail:]), None, True
        except (ValueError, RecursionError):
            pass
    # cut: the file's unfinished last line, or one a restarted writer closed with a newline (it
    # starts as a snapshot's line does, as far as it goes)
    head = raw.rstrip(b"\n")[: len(_LINE_START)]
    cut = (last and not raw.endswith(b"\n")) or _LINE_START.startswith(head)
    return None, "cut line" if cut else "not JSON", False


@dataclass
class _Line:
    """A checked line of one file, with the segment of its run id it belongs to in that file."""

    segment: tuple[str, int, int]  # run id, its restarts in this file, its resumes in this file
    step: int
    timestamp: float
    where: int | str  # its line number, or "N of FILE" when several files are read
    obj: dict[str, object]


def _checked(
    f: BinaryIO,
    log: NodeLog,
    *,
    name: str | None,
    max_line_bytes: int,
    skip: Callable[[str, int | str], None],
) -> Iterator[_Line]:
    """The checked lines of one file, each with its segment; the others skipped by reason.

    A segment of a run id starts where its step does not rise (a restart that reused the id) and
    at a ``resumed_from`` line, so that node logs agree on it whichever runs each of them holds.
    """
    state: OrderedDict[str, list[int]] = OrderedDict()  # run id -> [restarts, resumes, last step]
    for line_no, raw, last in _lines(f, max_line_bytes):
        log.lines = line_no
        where = line_no if name is None else f"{line_no} of {name}"
        if raw is None:
            skip(f"longer than {max_line_bytes / 2**20:g} MiB", where)
            continue
        if not raw.strip():
            continue
        obj, reason, cut_head = _parse(raw, last)
        if cut_head:
            skip("cut line", where)
        reason = reason or check_snapshot(obj)
        if reason:
            skip(reason, where)
            continue
        log.snapshots += 1
        rid, step = shortened(obj.get("run_id", "")), obj["step"]
        seg = state.get(rid)
        if seg is None:
            seg = state[rid] = [0, 0, -1]
            if len(state) > OPEN_STATES:
                state.popitem(last=False)
        state.move_to_end(rid)
        if is_int(obj.get("resumed_from")):
            seg[1] += 1
        elif step <= seg[2]:
            seg[0], seg[1] = seg[0] + 1, 0
        seg[2] = step
        stamp = as_float(obj.get("timestamp"))
        yield _Line(
            segment=(rid, seg[0], seg[1]),
            step=step,
            timestamp=stamp if math.isfinite(stamp) else math.inf,
            where=where,
            obj=obj,
        )


def _steps(files: list[Iterator[_Line]]) -> Iterator[list[tuple[int, _Line]]]:
    """The lines of every file, one step at a time: (file index, line) of each file holding it,
    the one with the lowest ranks first.

    Every file's lines are in its own order, a segment's lines together: a segment goes on while
    some file's next line is in it; then the earliest of the files' next lines (timestamp, then
    file order) gives the next segment. Of the segment's next lines, the lowest step goes.
    """
    heads = [next(f, None) for f in files]
    segment: tuple[str, int, int] | None = None
    while True:
        live = [(i, h) for i, h in enumerate(heads) if h is not None]
        if not live:
            return
        if all(h.segment != segment for _, h in live):
            segment = min(live, key=lambda ih: (ih[1].timestamp, ih[0]))[1].segment
        step = min(h.step for _, h in live if h.segment == segment)
        parts = [(i, h) for i, h in live if h.segment == segment and h.step == step]
        for i, _ in parts:
            heads[i] = next(files[i], None)
        if len(parts) > 1:
            parts.sort(key=lambda ih: (min(ranks_of(ih[1].obj), default=MAX_RANK_ID), ih[0]))
        yield parts


def _allow_open_files(count: int) -> None:
    """Raise the soft limit on open files to read ``count`` node logs at once, where it is lower."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < count + 64:
            want = count + 64 if hard == resource.RLIM_INFINITY else min(hard, count + 64)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: opening says so
        pass


def read_log(
    path: str | Sequence[str],
    run_id: str | None = None,
    run_index: int | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> LogRead:
    """Read one run of the JSONL log at ``path``, or of the node logs of one job at the paths
    ``path`` (read together, see the module docstring): the latest run, the latest with
    ``run_id``, or the ``run_index``-th (from 1). Raises :class:`LogError` (or ``OSError``,
    its ``filename`` the file) when there is none."""
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise LogError("no log to read: pass the JSONL log the monitor wrote (log_path=)")
    shown = ", ".join(paths) if len(paths) <= 3 else f"{paths[0]} and {len(paths) - 1} more logs"
    skipped: Counter[str] = Counter()
    first_skipped: dict[str, int | str] = {}
    head: list[RunSpan] = []
    tail: deque[RunSpan] = deque(maxlen=LISTED_RUNS)
    span: RunSpan | None = None
    kept: Run | None = None  # the run chosen so far
    current: Run | None = None  # the run being read, when it is a choice
    logs = [NodeLog(p) for p in paths]

    def skip(reason: str, where: int | str) -> None:
        skipped[reason] += 1
        first_skipped.setdefault(reason, where)

    if len(paths) > 1:
        _allow_open_files(len(paths))
    with ExitStack() as files:
        streams = [
            _checked(
                files.enter_context(open(p, "rb")),
                log,
                name=p if len(paths) > 1 else None,
                max_line_bytes=max_line_bytes,
                skip=skip,
            )
            for p, log in zip(paths, logs)
        ]
        for parts in _steps(streams):
            first = parts[0][1]
            obj, line_no = first.obj, first.where
            rid, step = first.segment[0], first.step
            resumed = obj.get("resumed_from")
            if span is not None and is_int(resumed) and resumed < step and span.first_step <= resumed:
                # a process resumed this run from a checkpoint (a new job may bring a new run id):
                # the same run, the steps past the checkpoint rolled back
                span.last_step, span.lines, span.run_id = step, span.lines + 1, rid
                span.restarts += 1
                if current is not None:
                    current.resume(resumed, line_no)
            elif span is None or rid != span.run_id or step <= span.last_step:
                span = RunSpan((span.index if span else 0) + 1, rid, step, step, first_line=line_no)
                (head if len(head) < LISTED_RUNS else tail).append(span)
                wanted = span.index == run_index if run_index else run_id in (None, rid)
                current = Run(span) if wanted else None
                kept = current or kept
            else:
                span.last_step, span.lines = step, span.lines + 1
            if current is not None:
                current.add(obj, [(i, line.obj) for i, line in parts])
    if not any(log.lines for log in logs):
        raise LogError(
            f"{shown} {'is' if len(paths) == 1 else 'are'} empty: pass the log of a run that exported a "
            "step (the first export comes after export_every steps)"
        )
    if span is None:
        raise LogError(
            f"no valid snapshot in {shown}: {describe_skips(skipped, first_skipped)}; pass the JSONL log "
            "the monitor wrote (log_path=)"
        )
    runs: list[RunSpan | None] = [*head, *([None] if span.index > len(head) + len(tail) else []), *tail]
    if kept is None:
        wanted = f"no run {run_id!r}" if run_index is None else f"no run #{run_index}"
        holds = "it holds" if len(paths) == 1 else "they hold"
        raise LogError(
            f"{wanted} in {shown}; {holds} {describe_runs(runs, span.index)}: pick one with --run-id or --run"
        )
    return LogRead(
        run=kept,
        runs=runs,
        run_count=span.index,
        skipped=skipped,
        first_skipped=first_skipped,
        max_line_bytes=max_line_bytes,
        logs=logs,
    )


def describe_skips(skipped: Counter[str], first: dict[str, int | str]) -> str:
    """How many lines were skipped and why, with the first line of each reason.

    Example:
        >>> describe_skips(Counter({"not JSON": 2, "cut line": 1}), {"not JSON": 4, "cut line": 9})
        '3 lines skipped: 2 not JSON (first: line 4), 1 cut line (line 9)'
    """
    total = sum(skipped.values())
    if not total:
        return "no line skipped"
    parts = [f"{n} {why} ({'first: ' if n > 1 else ''}line {first[why]})" for why, n in skipped.most_common()]
    return f"{total} line{'s' if total > 1 else ''} skipped: " + ", ".join(parts)


def describe_runs(runs: list[RunSpan | None], count: int) -> str:
    """The runs as ``#1 'a' steps 1..150 (150 lines), ...``; None stands for those left out.

    Example:
        >>> describe_runs([RunSpan(1, "a", 1, 150, 150), None, RunSpan(45, "b", 1, 9, 9)], 45)
        "#1 'a' steps 1..150 (150 lines), (43 more), #45 'b' steps 1..9 (9 lines)"
    """
    shown = sum(s is not None for s in runs)
    return ", ".join(
        f"({count - shown} more)"
        if s is None
        else f"#{s.index} {s.run_id!r} steps {s.first_step}..{s.last_step} "
        f"({s.lines} line{'s' if s.lines > 1 else ''})"
        for s in runs
    )
