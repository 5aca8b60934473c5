"""What a line of a JSONL log must be for the report: its fields' types, the caps, the ranks it names.

A line that fails a check is skipped and counted under its reason (:mod:`distmon.report.log_reader`).
Imports neither torch nor matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = [
    "LogError",
    "check_snapshot",
    "as_float",
    "ranks_of",
    "describe_ranks",
    "describe_spans",
    "rank_gaps",
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
NODE_LOCAL = frozenset(
    {*PER_RANK, "ranks", "node", "timestamp", "nonfinite_ranks", "activation_rms", "activation_absmax"}
)
OPEN_STATES = 256  # run ids of a file whose segment counts are remembered
OTHER = "other"
_NONFINITE = {"nan", "inf", "-inf", "+inf", "infinity", "-infinity", "+infinity"}


class LogError(ValueError):
    """The log cannot be reported: unreadable, empty, no valid snapshot, or no such run."""


def is_num(v: object) -> bool:
    return v is None or type(v) in (int, float) or (isinstance(v, str) and v.lower() in _NONFINITE)


def as_float(v: object) -> float:
    """A checked JSONL figure as a float (null and the strings "nan"/"inf" included).

    Example:
        >>> as_float("inf"), as_float(None), as_float(2)
        (inf, nan, 2.0)
    """
    return math.nan if v is None else float(v)


def shortened(v: object) -> object:
    return v[:MAX_NAME] if isinstance(v, str) else v


def is_int(v: object, low: int = 0) -> bool:
    return type(v) is int and low <= v < 2**53


def _is_nums(v: object) -> bool:
    return isinstance(v, list) and all(map(is_num, v))


# field -> (check, what it must be); a field may be absent, but if present must pass
_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "run_id": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: is_int(v, 1), "an integer >= 1"),
    "grad_norm": (is_num, "a number"),
    "gradient_noise_scale": (is_num, "a number"),
    "layer_grad_norms": (
        lambda v: isinstance(v, dict) and all(map(is_num, v.values())),
        "an object of numbers",
    ),
    "timestamp": (is_num, "a number"),
    "rank_grad_norms": (_is_nums, "a list of numbers"),
    "rank_valid": (
        lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v),
        "a list of true/false",
    ),
    "rank_monitor_errors": (
        lambda v: isinstance(v, list) and all(map(is_int, v)),
        "a list of integers >= 0",
    ),
    "rank_outlier_scores": (_is_nums, "a list of numbers"),
    "nonfinite_ranks": (
        lambda v: isinstance(v, list) and all(is_int(x) and x < MAX_RANK_ID for x in v),
        "a list of ranks",
    ),
    "ranks": (
        lambda v: (
            isinstance(v, list) and all(is_int(x) and x < MAX_RANK_ID for x in v) and len(set(v)) == len(v)
        ),
        f"a list of distinct ranks (integers 0..{MAX_RANK_ID - 1})",
    ),
    "node": (is_int, "an integer >= 0"),
    "rank_layer_grad_norms": (
        lambda v: v is None or (isinstance(v, list) and all(map(_is_nums, v))),
        "null or a list of lists of numbers",
    ),
    "nonfinite": (lambda v: isinstance(v, bool), "true or false"),
    "valid": (lambda v: isinstance(v, bool), "true or false"),
    "skip_reason": (lambda v: isinstance(v, str), "a string"),
    "monitor_errors": (is_int, "an integer >= 0"),
    "resumed_from": (lambda v: v is None or is_int(v), "null or an integer >= 0"),
    "first_nonfinite": (
        lambda v: (
            v is None or (isinstance(v, list) and len(v) == 2 and is_int(v[0]) and isinstance(v[1], str))
        ),
        "null or a [rank, layer] pair",
    ),
    "events": (lambda v: isinstance(v, list), "a list"),
}
EVENT_FIELDS: dict[str, Callable[[object], bool]] = {
    "kind": lambda v: isinstance(v, str),
    "step": is_int,
    "rank": lambda v: is_int(v, -1),
    "layer": lambda v: isinstance(v, str),
    "value": is_num,
    "threshold": is_num,
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
    if not is_int(obj.get("step")):
        return "`step` missing or not an integer >= 0"
    for name, (ok, what) in _FIELDS.items():
        if name in obj and not ok(obj[name]):
            return f"`{name}` is not {what}"
    for event in obj.get("events", ()):
        if not isinstance(event, dict):
            return "an event is not an object"
        for name, ok in EVENT_FIELDS.items():
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


def rank_gaps(covered: set[int], world: int) -> tuple[tuple[int, int], ...]:
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
