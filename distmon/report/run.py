"""What the report keeps of one run of a log: per-step arrays, capped (:class:`Run`).

Imports neither torch nor matplotlib.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .log_lines import (
    EVENT_FIELDS,
    MAX_EVENTS,
    MAX_LAYERS,
    MAX_PATTERNS,
    MAX_RANKS,
    MAX_TRACKED_RANKS,
    NODE_LOCAL,
    OTHER,
    as_float,
    describe_ranks,
    rank_gaps,
    ranks_of,
    shortened,
)

__all__ = ["Run", "RunSpan"]

_GUARD, _SCALER, _INVALID = 1, 2, 4  # a step's flags: skipped by the guard, by the GradScaler; unmeasured


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
        for name in map(shortened, names):
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
                # figures as floats here ("inf"/"nan" in the log), once for every reader
                self.events.append(
                    {
                        k: as_float(e[k]) if k in ("value", "threshold") else shortened(e[k])
                        for k in EVENT_FIELDS
                    }
                )
            steps = self.event_steps.setdefault(shortened(e["kind"]), [])
            if not steps or steps[-1] != step:
                steps.append(step)
        if snap.get("nonfinite") and self.worst_nonfinite is None:
            where = snap.get("first_nonfinite") or ["?", "?"]
            self.first_nonfinite = (step, where[0], shortened(where[1]))
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
        gaps = rank_gaps(seen, parts[0][1].get("world_size", 0)) if parts[0][1].get("world_size") else ()
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
                if name not in NODE_LOCAL and first.get(name) != line.get(name):
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
