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
- ``cut line``: the last line, without its newline, is not JSON (a run stopped mid-write); or
  a line whose tail is a whole snapshot (a restarted run appended its first line to the cut
  one): the tail is kept, the cut head counted;
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

import bisect
import json
import math
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import BinaryIO

__all__ = [
    "read_log",
    "LogRead",
    "Run",
    "RunSpan",
    "LogError",
    "check_snapshot",
    "as_float",
    "describe_skips",
    "describe_runs",
    "describe_ranks",
    "describe_spans",
    "NodeLog",
    "PER_RANK",
    "MAX_LAYERS",
    "MAX_RANKS",
    "OTHER",
]

MAX_LAYERS = 128  # the exporter's default max_layers (MonitorConfig): the last slot is "other"
MAX_RANKS = 64  # ranks drawn (per-rank norms, the rank x layer matrix)
MAX_EVENTS = 200  # events kept in full (the summary's table)
MAX_LINE_BYTES = 8 << 20  # a 128-layer snapshot of 1,024 ranks is about 3 MiB
LISTED_RUNS = 20  # runs listed from each end of a log with more
MAX_NAME = 256  # characters kept of a name: a line of the cap could hold one of 8 MiB
MAX_TRACKED_RANKS = 1 << 17  # ranks whose run-long figures are kept (the per-rank tables)
MAX_PATTERNS = 32  # distinct sets of missing ranks kept with their steps
MAX_RANK_ID = 1 << 24  # the largest global rank a line may name (16M ranks)
PER_RANK = (  # fields holding one entry per rank of "ranks" (one row per rank for the matrix)
    "rank_grad_norms",
    "rank_layer_grad_norms",
    "rank_valid",
    "rank_monitor_errors",
    "rank_outlier_scores",
)
# fields that differ between node logs by design: not compared as job-wide
_NODE_LOCAL = frozenset(
    {*PER_RANK, "ranks", "node", "timestamp", "nonfinite_ranks", "activation_rms", "activation_absmax"}
)
_OPEN_STATES = 256  # run ids of a file whose segment counts are remembered
OTHER = "other"
_GUARD, _SCALER, _INVALID = 1, 2, 4  # a step's flags: skipped by the guard, by the GradScaler; unmeasured
_NONFINITE = {"nan", "inf", "-inf", "+inf", "infinity", "-infinity", "+infinity"}


class LogError(ValueError):
    """The log cannot be reported: unreadable, empty, no valid snapshot, or no such run."""


def _is_num(v: object) -> bool:
    return v is None or type(v) in (int, float) or (isinstance(v, str) and v.lower() in _NONFINITE)


def as_float(v: object) -> float:
    """A checked JSONL figure as a float (null and the strings "nan"/"inf" included).

    Example:
        >>> as_float("inf"), as_float(None), as_float(2)
        (inf, nan, 2.0)
    """
    return math.nan if v is None else float(v)


def _short(v: object) -> object:
    return v[:MAX_NAME] if isinstance(v, str) else v


def _is_int(v: object, low: int = 0) -> bool:
    return type(v) is int and low <= v < 2**53


def _is_nums(v: object) -> bool:
    return isinstance(v, list) and all(map(_is_num, v))


# field -> (check, what it must be); a field may be absent, but if present must pass
_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "run_id": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "grad_norm": (_is_num, "a number"),
    "gradient_noise_scale": (_is_num, "a number"),
    "layer_grad_norms": (
        lambda v: isinstance(v, dict) and all(map(_is_num, v.values())),
        "an object of numbers",
    ),
    "timestamp": (_is_num, "a number"),
    "rank_grad_norms": (_is_nums, "a list of numbers"),
    "rank_valid": (
        lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v),
        "a list of true/false",
    ),
    "rank_monitor_errors": (
        lambda v: isinstance(v, list) and all(map(_is_int, v)),
        "a list of integers >= 0",
    ),
    "rank_outlier_scores": (_is_nums, "a list of numbers"),
    "nonfinite_ranks": (
        lambda v: isinstance(v, list) and all(_is_int(x) and x < MAX_RANK_ID for x in v),
        "a list of ranks",
    ),
    "ranks": (
        lambda v: (
            isinstance(v, list) and all(_is_int(x) and x < MAX_RANK_ID for x in v) and len(set(v)) == len(v)
        ),
        f"a list of distinct ranks (integers 0..{MAX_RANK_ID - 1})",
    ),
    "node": (_is_int, "an integer >= 0"),
    "rank_layer_grad_norms": (
        lambda v: v is None or (isinstance(v, list) and all(map(_is_nums, v))),
        "null or a list of lists of numbers",
    ),
    "nonfinite": (lambda v: isinstance(v, bool), "true or false"),
    "valid": (lambda v: isinstance(v, bool), "true or false"),
    "skip_reason": (lambda v: isinstance(v, str), "a string"),
    "monitor_errors": (_is_int, "an integer >= 0"),
    "resumed_from": (lambda v: v is None or _is_int(v), "null or an integer >= 0"),
    "first_nonfinite": (
        lambda v: (
            v is None or (isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and isinstance(v[1], str))
        ),
        "null or a [rank, layer] pair",
    ),
    "events": (lambda v: isinstance(v, list), "a list"),
}
_EVENT_FIELDS: dict[str, Callable[[object], bool]] = {
    "kind": lambda v: isinstance(v, str),
    "step": _is_int,
    "rank": lambda v: _is_int(v, -1),
    "layer": lambda v: isinstance(v, str),
    "value": _is_num,
    "threshold": _is_num,
}


def check_snapshot(obj: object) -> str | None:
    """Why ``obj`` (a parsed line) is not a snapshot the report can read, or None when it is.

    Example:
        >>> check_snapshot({"step": 3, "layer_grad_norms": [1.0]})
        '`layer_grad_norms` is not an object of numbers'
        >>> check_snapshot({"step": 3, "events": [{"kind": "spike"}]}) is None
        False
    """
    if not isinstance(obj, dict):
        return "not a JSON object"
    if not _is_int(obj.get("step")):
        return "`step` missing or not an integer >= 0"
    for name, (ok, what) in _FIELDS.items():
        if name in obj and not ok(obj[name]):
            return f"`{name}` is not {what}"
    for event in obj.get("events", ()):
        if not isinstance(event, dict):
            return "an event is not an object"
        for name, ok in _EVENT_FIELDS.items():
            if name not in event or not ok(event[name]):
                return f"an event's `{name}` is missing or of the wrong type"
    matrix = obj.get("rank_layer_grad_norms")
    if matrix and any(len(row) != len(obj.get("layer_grad_norms", ())) for row in matrix):
        return "`rank_layer_grad_norms` rows do not match `layer_grad_norms`"
    ranks = obj.get("ranks")
    if ranks:  # [] (a snapshot made by hand): ranks 0..n-1, as without the field
        for name in PER_RANK:  # empty where no local figure can be read (FSDP2 before torch 2.9)
            if obj.get(name) and len(obj[name]) != len(ranks):
                return f"`{name}` does not hold one entry per rank of `ranks`"
        if ranks and "world_size" in obj and max(ranks) >= obj["world_size"]:
            return "`ranks` holds a rank >= `world_size`"
    return None


def ranks_of(obj: dict[str, object]) -> Sequence[int]:
    """The global ranks a checked line's per-rank lists describe: its ``"ranks"``, else (a line
    of an older log, or ``"ranks": []``) ``0..len(rank_grad_norms)-1``, else (no per-rank figures) every
    rank of the job.

    Example:
        >>> ranks_of({"step": 1, "ranks": [4, 5]}), ranks_of({"step": 1, "rank_grad_norms": [1.0, 2.0]})
        ([4, 5], range(0, 2))
    """
    ranks = obj.get("ranks")
    if ranks:
        return ranks
    n = len(obj.get("rank_grad_norms") or ())
    return range(n) if n else range(obj.get("world_size", 1))


def describe_ranks(ranks: Sequence[int], limit: int = 16) -> str:
    """Sorted ranks as ranges, the first ``limit`` ranges shown.

    Example:
        >>> describe_ranks([0, 1, 2, 5, 7, 8])
        '0-2, 5, 7-8'
        >>> describe_ranks(range(0, 40, 2), limit=3)
        '0, 2, 4 (17 more ranges)'
    """
    return describe_spans(_spans(ranks), limit)


def _spans(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as (first, last) runs of consecutive ranks."""
    spans: list[tuple[int, int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    return spans


def describe_spans(spans: Sequence[tuple[int, int]], limit: int = 16) -> str:
    """(first, last) runs of ranks as text, the first ``limit`` shown.

    Example:
        >>> describe_spans([(0, 3), (9, 9)])
        '0-3, 9'
    """
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    return text + (f" ({len(spans) - limit} more ranges)" if len(spans) > limit else "")


def _gaps(covered: set[int], world: int) -> tuple[tuple[int, int], ...]:
    """The (first, last) runs of ranks 0..world-1 not in ``covered``."""
    if len(covered) >= world and all(r < world for r in covered):
        return ()
    gaps, start = [], 0
    for r in sorted(covered):
        if r >= world:
            break
        if r > start:
            gaps.append((start, r - 1))
        start = r + 1
    if start < world:
        gaps.append((start, world - 1))
    return tuple(gaps)


@dataclass
class RunSpan:
    """One run of the log: its id, first and last step, and lines (``index`` counts from 1)."""

    index: int
    run_id: str
    first_step: int
    last_step: int
    lines: int = 1
    first_line: int | str = 0  # its line ("N of FILE" when several files are read)
    restarts: int = 0  # processes that resumed it from a checkpoint (``resumed_from``)


@dataclass
class _Worst:
    """A candidate for the worst step: its step, key and capped rank x layer matrix."""

    step: int
    key: float = -math.inf
    matrix: list[array] | None = None
    missing: list[int] = field(default_factory=list)  # rows (ranks) no node log reported


@dataclass
class Run:
    """What the report keeps of one run: per-step arrays, capped (see the module docstring).

    ``layers`` are the kept layer names in model order (``"other"`` last when anything
    folded); ``layer_norms[i]`` holds step ``i``'s norms by slot (:attr:`order` gives the slots
    of ``layers``), shorter when later steps brought new layers (read those as NaN).
    """

    span: RunSpan
    steps: array = field(default_factory=lambda: array("q"))
    grad_norm: array = field(default_factory=lambda: array("d"))
    noise_scale: array = field(default_factory=lambda: array("d"))
    layer_norms: list[array] = field(default_factory=list)
    rank_norms: list[array] = field(default_factory=list)
    columns: dict[str, int] = field(default_factory=dict)  # named layer -> slot; slot 0 is "other"
    folded: bool = False  # some step has an "other" value
    capped: bool = False  # some named layer was folded here (not by the exporter)
    most_layers: int = 0  # the most layers one line had
    world_size: int = 1
    most_ranks: int = 0
    events: list[dict[str, object]] = field(default_factory=list)  # the first MAX_EVENTS
    event_steps: dict[str, list[int]] = field(default_factory=dict)  # kind -> steps with it
    first_nonfinite: tuple[int, object, object] | None = None  # step, rank, layer
    flags: array = field(default_factory=lambda: array("b"))  # per step: GUARD | SCALER | INVALID
    event_counts: array = field(default_factory=lambda: array("q"))  # per step: its events
    errors: array = field(default_factory=lambda: array("q"))  # per step: monitor errors so far
    errors_before: int = 0  # monitor errors of the processes before the latest resume
    restarts: list[tuple[int, int | str]] = field(default_factory=list)  # (resumed after step, line)
    worst_nonfinite: _Worst | None = None
    worst_event: _Worst | None = None
    worst_norm: _Worst | None = None
    # per node log (its index in LogRead.logs): lines of this run, its "node", the ranks it described
    log_lines: Counter[int] = field(default_factory=Counter)
    log_nodes: dict[int, object] = field(default_factory=dict)
    log_ranks: dict[int, str] = field(default_factory=dict)
    # per global rank (the first MAX_TRACKED_RANKS), over every line of the run read
    rank_score: array = field(default_factory=lambda: array("d"))  # largest outlier score (NaN: none)
    rank_score_step: array = field(default_factory=lambda: array("q"))
    rank_nonfinite: array = field(default_factory=lambda: array("q"))  # steps in nonfinite_ranks
    rank_invalid: array = field(default_factory=lambda: array("q"))  # steps with rank_valid false
    rank_errors: array = field(default_factory=lambda: array("q"))  # the last rank_monitor_errors
    untracked_ranks: bool = False  # some rank past MAX_TRACKED_RANKS was reported
    missing: Counter[tuple[tuple[int, int], ...]] = field(default_factory=Counter)  # gaps -> steps
    missing_first: dict[tuple[tuple[int, int], ...], int] = field(default_factory=dict)  # gaps -> step
    missing_other: int = 0  # steps with a set of missing ranks past the MAX_PATTERNS kept
    disagreements: int = 0  # steps whose node logs' job-wide fields differ
    disagree_first: int | None = None
    disagree_fields: list[str] = field(default_factory=list)  # the first 8 fields seen to differ

    @property
    def guard_skips(self) -> int:
        return sum(f & _GUARD != 0 for f in self.flags)

    @property
    def scaler_skips(self) -> int:
        return sum(f & _SCALER != 0 for f in self.flags)

    @property
    def invalid(self) -> int:
        return sum(f & _INVALID != 0 for f in self.flags)

    @property
    def event_count(self) -> int:
        return sum(self.event_counts)

    @property
    def monitor_errors(self) -> int:
        """Errors counted in distmon's code by the end, every process of the run together."""
        return self.errors_before + (self.errors[-1] if self.errors else 0)

    @property
    def layers(self) -> list[str]:
        return [*self.columns, OTHER] if self.folded else list(self.columns)

    @property
    def order(self) -> list[int]:
        """The slots of :attr:`layers`, in its order (a stored row is indexed by slot)."""
        return [*self.columns.values(), 0] if self.folded else list(self.columns.values())

    def worst(self) -> _Worst:
        """The first non-finite step, else the strongest event's, else the largest finite norm."""
        return self.worst_nonfinite or self.worst_event or self.worst_norm or _Worst(self.steps[0])

    def _slots(self, names: list[str]) -> list[int]:
        """Each layer name's slot, new names taking free ones; past the cap, slot 0 (folded)."""
        slots = []
        for name in map(_short, names):
            slot = self.columns.get(name)
            if slot is None:
                if name == OTHER or len(self.columns) >= MAX_LAYERS - 1:
                    slot = 0
                    self.capped |= name != OTHER
                else:
                    slot = self.columns[name] = len(self.columns) + 1
            slots.append(slot)
        return slots

    def _fold(self, values: list[object], slots: list[int]) -> array:
        row = array("d", [math.nan]) * (len(self.columns) + 1)
        rest = [as_float(v) for v, slot in zip(values, slots) if slot == 0]
        for v, slot in zip(values, slots):
            if slot:
                row[slot] = as_float(v)
        if rest:
            row[0] = math.hypot(*rest)
            self.folded = True
        return row

    def add(self, snap: dict[str, object], parts: Sequence[tuple[int, dict[str, object]]] = ()) -> None:
        """Take one checked snapshot of this run: ``snap``, or the lines ``parts`` (node log
        index, line) of one step from several node logs, the one with the lowest ranks first."""
        parts = parts or [(0, snap)]
        snap = parts[0][1]
        step = snap["step"]
        layers = snap.get("layer_grad_norms", {})
        slots = self._slots(list(layers))
        self.steps.append(step)
        self.grad_norm.append(as_float(snap.get("grad_norm")))
        self.noise_scale.append(as_float(snap.get("gradient_noise_scale")))
        self.layer_norms.append(self._fold(list(layers.values()), slots))
        covered = [ranks_of(line) for _, line in parts]
        norms, top = self._rank_row(parts, covered)
        self.rank_norms.append(norms)
        self.most_layers = max(self.most_layers, len(layers))
        self.most_ranks = max(self.most_ranks, top)
        self.world_size = snap.get("world_size", max(self.world_size, top))
        self._per_rank(step, parts, covered)
        if len(parts) > 1:
            self._compare(step, parts)
        self.errors.append(snap.get("monitor_errors", self.errors[-1] if self.errors else 0))
        reason = snap.get("skip_reason")
        self.flags.append(
            (_GUARD if reason == "guard" else 0)
            | (_SCALER if reason == "scaler" else 0)
            | (0 if snap.get("valid", True) else _INVALID)
        )

        def matrix() -> tuple[list[array], list[int]] | tuple[None, list[int]]:
            """The first MAX_RANKS ranks' rows by global rank, and the ranks no line had a row for."""
            rows: list[array | None] = [None] * min(len(norms), MAX_RANKS)
            for (_, line), ranks in zip(parts, covered):
                own = slots if line is snap else self._slots(list(line.get("layer_grad_norms", {})))
                for r, values in zip(ranks, line.get("rank_layer_grad_norms") or ()):
                    if r < len(rows):
                        rows[r] = self._fold(values, own)
            if all(row is None for row in rows):
                return None, []
            blank = array("d", [math.nan]) * (len(self.columns) + 1)
            return [blank if row is None else row for row in rows], [
                r for r, row in enumerate(rows) if row is None
            ]

        events = snap.get("events", [])
        self.event_counts.append(len(events))
        for e in events:
            if len(self.events) < MAX_EVENTS:
                self.events.append({k: _short(e[k]) for k in _EVENT_FIELDS})
            steps = self.event_steps.setdefault(_short(e["kind"]), [])
            if not steps or steps[-1] != step:
                steps.append(step)
        if snap.get("nonfinite") and self.worst_nonfinite is None:
            where = snap.get("first_nonfinite") or ["?", "?"]
            self.first_nonfinite = (step, where[0], _short(where[1]))
            self.worst_nonfinite = _Worst(step, -math.inf, *matrix())
        # NaN-valued events (non-finite activations) rank below every measured one
        values = [as_float(e["value"]) for e in events]
        strongest = max((-math.inf if math.isnan(v) else v for v in values), default=None)
        if strongest is not None and (self.worst_event is None or strongest > self.worst_event.key):
            self.worst_event = _Worst(step, strongest, *matrix())
        norm = self.grad_norm[-1]
        if math.isfinite(norm) and (self.worst_norm is None or norm > self.worst_norm.key):
            self.worst_norm = _Worst(step, norm, *matrix())

    @staticmethod
    def _rank_row(
        parts: Sequence[tuple[int, dict[str, object]]], covered: list[Sequence[int]]
    ) -> tuple[array, int]:
        """This step's local norms of the first MAX_RANKS global ranks (NaN where no line had
        one), and how many ranks they are of: the world size, or the highest rank with a norm
        plus one; none when no line has a norm (no local figure can be read)."""
        row = array("d")
        top = 0
        for (_, line), ranks in zip(parts, covered):
            for r, v in zip(ranks, line.get("rank_grad_norms") or ()):
                top = max(top, r + 1)
                if r < MAX_RANKS:
                    if r >= len(row):
                        row.extend(array("d", [math.nan]) * (r + 1 - len(row)))
                    if math.isnan(row[r]):  # two lines with one rank: the lowest-ranked line's
                        row[r] = as_float(v)
        if top:  # the ranks after the last one reported (a node log missing) are NaN too
            top = max(top, parts[0][1].get("world_size", 0))
        row.extend(array("d", [math.nan]) * (min(top, MAX_RANKS) - len(row)))
        return row, top

    def _grow(self, r: int) -> bool:
        """Make room for rank ``r``'s run-long figures; False past MAX_TRACKED_RANKS."""
        if r >= MAX_TRACKED_RANKS:
            self.untracked_ranks = True
            return False
        if r >= len(self.rank_score):
            more = r + 1 - len(self.rank_score)
            self.rank_score.extend(array("d", [math.nan]) * more)
            for values in (self.rank_score_step, self.rank_nonfinite, self.rank_invalid, self.rank_errors):
                values.extend(array("q", [0]) * more)
        return True

    def _per_rank(
        self, step: int, parts: Sequence[tuple[int, dict[str, object]]], covered: list[Sequence[int]]
    ) -> None:
        """Each node log's lines and ranks; each rank's run-long figures; the ranks missing."""
        seen: set[int] = set()
        for (index, line), ranks in zip(parts, covered):
            if not self.log_lines[index]:
                self.log_nodes[index] = line.get("node", "-")
                self.log_ranks[index] = describe_ranks(sorted(ranks)) if ranks else "none"
            self.log_lines[index] += 1
            scores = line.get("rank_outlier_scores") or ()
            valid = line.get("rank_valid") or ()
            errors = line.get("rank_monitor_errors") or ()
            for i, r in enumerate(ranks):
                if r in seen or not self._grow(r):
                    continue
                seen.add(r)
                score = as_float(scores[i]) if i < len(scores) else math.nan
                if not math.isnan(score) and not (score <= self.rank_score[r]):  # NaN-safe max
                    self.rank_score[r], self.rank_score_step[r] = score, step
                if i < len(valid) and not valid[i]:
                    self.rank_invalid[r] += 1
                if i < len(errors):
                    self.rank_errors[r] = errors[i]
        bad = {r for _, line in parts for r in line.get("nonfinite_ranks") or ()}
        for r in bad:
            if self._grow(r):
                self.rank_nonfinite[r] += 1
        gaps = _gaps(seen, parts[0][1].get("world_size", 0)) if parts[0][1].get("world_size") else ()
        if gaps:
            if gaps in self.missing or len(self.missing) < MAX_PATTERNS:
                self.missing[gaps] += 1
                self.missing_first.setdefault(gaps, step)
            else:
                self.missing_other += 1

    def _compare(self, step: int, parts: Sequence[tuple[int, dict[str, object]]]) -> None:
        """Count a step whose node logs' job-wide fields differ (the first line's are kept)."""
        first = parts[0][1]
        differ = False
        for _, line in parts[1:]:
            for name in first.keys() | line.keys():
                if name not in _NODE_LOCAL and first.get(name) != line.get(name):
                    differ = True
                    if name not in self.disagree_fields and len(self.disagree_fields) < 8:
                        self.disagree_fields.append(name)
        if differ:
            self.disagreements += 1
            if self.disagree_first is None:
                self.disagree_first = step

    def resume(self, after: int, line: int | str) -> None:
        """A resumed process goes on after step ``after``: the steps past it were rolled back with
        the checkpoint (their figures are the killed process's), so they are dropped.

        The worst event past it is forgotten (the kept events cannot name the strongest before it
        once more than ``MAX_EVENTS`` were seen); the largest norm is found again, without its
        rank x layer matrix.
        """
        keep = bisect.bisect_right(self.steps, after)
        for values in (self.steps, self.grad_norm, self.noise_scale, self.flags, self.event_counts):
            del values[keep:]
        del self.layer_norms[keep:], self.rank_norms[keep:]
        self.errors_before += self.errors[keep - 1] if keep else 0
        del self.errors[:]
        self.events = [e for e in self.events if e["step"] <= after]
        self.event_steps = {k: [s for s in v if s <= after] for k, v in self.event_steps.items()}
        self.event_steps = {k: v for k, v in self.event_steps.items() if v}
        if self.first_nonfinite is not None and self.first_nonfinite[0] > after:
            self.first_nonfinite = self.worst_nonfinite = None
        if self.worst_event is not None and self.worst_event.step > after:
            self.worst_event = None
        if self.worst_norm is not None and self.worst_norm.step > after:
            finite = [(v, s) for v, s in zip(self.grad_norm, self.steps) if math.isfinite(v)]
            self.worst_norm = _Worst(max(finite)[1], max(finite)[0]) if finite else None
        self.restarts.append((after, line))


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
    tail = text.rfind('{"step":', 1)  # a restarted run's first line appended to a cut one
    if tail > 0:
        try:
            return json.loads(text[tail:]), None, True
        except (ValueError, RecursionError):
            pass
    return None, "cut line" if last and not raw.endswith(b"\n") else "not JSON", False


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
        rid, step = _short(obj.get("run_id", "")), obj["step"]
        seg = state.get(rid)
        if seg is None:
            seg = state[rid] = [0, 0, -1]
            if len(state) > _OPEN_STATES:
                state.popitem(last=False)
        state.move_to_end(rid)
        if _is_int(obj.get("resumed_from")):
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
        raise LogError("no log to read")
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
            if span is not None and _is_int(resumed) and resumed < step and span.first_step <= resumed:
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
        raise LogError(f"{shown} {'is' if len(paths) == 1 else 'are'} empty")
    if span is None:
        raise LogError(f"no valid snapshot in {shown}: {describe_skips(skipped, first_skipped)}")
    runs: list[RunSpan | None] = [*head, *([None] if span.index > len(head) + len(tail) else []), *tail]
    if kept is None:
        wanted = f"no run {run_id!r}" if run_index is None else f"no run #{run_index}"
        holds = "it holds" if len(paths) == 1 else "they hold"
        raise LogError(f"{wanted} in {shown}; {holds} {describe_runs(runs, span.index)}")
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
