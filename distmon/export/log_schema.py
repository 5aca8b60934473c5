"""The JSONL log's schema: one line per step, a :class:`~distmon.snapshot.Snapshot` as strict JSON, versioned.

A line is ``to_jsonable(snapshot)`` (non-finite floats as the strings ``"nan"``, ``"inf"``,
``"-inf"``: strict JSON has no NaN) with ``"schema"``, :data:`LOG_SCHEMA_VERSION`, as its last
field. The fields, their JSON types and meanings come from ``Snapshot`` (its annotations and its
docstring's ``Attributes:``); what is declared here is each field's unit, and which fields hold
the writing node's ranks only (``report/log_lines.py``'s ``NODE_LOCAL``, which the report reads by).
``docs/log-schema.md``'s table is rendered from them (``python -m distmon.doc_tables --write``);
a field of ``Snapshot`` without a unit here fails the docs' test.

:data:`LOG_SCHEMA_VERSION` is raised when a field is renamed or removed or changes its meaning,
type or unit; a field added leaves it (readers ignore fields they do not know, as the report
does). docs/stability.md says how a change is announced.

Example:
    >>> log_fields()[0].name, log_fields()[0].json_type
    ('step', 'integer')
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass

from ..report.log_lines import NODE_LOCAL
from ..snapshot import AnomalyEvent, Snapshot

__all__ = ["LOG_SCHEMA_VERSION", "UNITS", "LogField", "log_fields", "log_table", "meanings"]

LOG_SCHEMA_VERSION = 1

_NORM = "gradient units: the L2 norm with any loss scale divided out"
UNITS: dict[str, str] = {
    "step": "optimizer steps, from 1",
    "timestamp": "seconds since the Unix epoch (this rank's clock)",
    "grad_norm": _NORM,
    "layer_grad_norms": _NORM,
    "rank_grad_norms": _NORM,
    "rank_layer_grad_norms": _NORM,
    "nonfinite": "",
    "nonfinite_ranks": "global ranks",
    "first_nonfinite": "[global rank, layer name]",
    "events": "per event: kind, step, rank (global; -1: the job), layer, value and threshold in the "
    "detector's units",
    "monitor_errors": "errors caught (a count since the start)",
    "valid": "",
    "run_id": "",
    "world_size": "ranks",
    "scores": "zscore and layer_zmax: standard deviations; median_ratio: a ratio; rank_outlier_worst: "
    "robust standard deviations; rank_outlier_worst_rank: a global rank",
    "rank_outlier_scores": "robust standard deviations",
    "skipped": "",
    "rank_monitor_errors": "errors caught per rank (counts since the start)",
    "skip_reason": '"", "guard" or "scaler"',
    "gradient_noise_scale": "batch_size units (sequences or tokens, as you gave batch_size)",
    "layer_gradient_noise_scale": "batch_size units",
    "layer_noise_signal": "squared gradient units",
    "noise_trace": "squared gradient units x batch_size units",
    "noise_signal": "squared gradient units",
    "activation_rms": "the module output's own units",
    "activation_absmax": "the module output's own units",
    "first_nonfinite_activation": "[global rank, module name]",
    "layer_update_ratio": "a ratio: ||update|| / ||weights||",
    "attention_logit_bound": "attention-logit units (q . k / sqrt(d_head)), per attention block",
    "gradient_cosine": "a cosine (-1 to 1)",
    "divergence_warning": "",
    "rank_valid": "",
    "first_nonfinite_coords": 'dimension ("dp_rank", "tp_rank", "pp_stage", "ep_rank") -> its index, '
    "as a string",
    "restart": "restarts (a count)",
    "resumed_from": "optimizer steps",
    "ranks": "global ranks",
    "node": "a node index (nodes ordered by their lowest rank)",
    "nonfinite_rank_count": "ranks (a count)",
}


@dataclass(frozen=True)
class LogField:
    """One field of a JSONL line."""

    name: str
    json_type: str
    unit: str
    node_local: bool  # holds the writing node's ranks only (else the same in every node's log)
    meaning: str


def _json_type(hint: object) -> str:
    """A Python annotation as the JSON it is written as.

    Example:
        >>> _json_type(dict[str, float]), _json_type(typing.Optional[tuple[int, str]])
        ('object: name -> number', '[integer, string], or null')
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        others = [a for a in args if a is not type(None)]
        return ", or ".join(_json_type(a) for a in others) + (", or null" if len(others) < len(args) else "")
    if origin is typing.Literal:
        return "string"
    if origin is dict:
        return f"object: name -> {_json_type(args[1])}"
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return "array of " + _plural(_json_type(args[0]))
    if origin is tuple:
        return "[" + ", ".join(_json_type(a) for a in args) + "]"
    if hint is AnomalyEvent:
        return "object"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}[hint]  # type: ignore[index]


def _plural(kind: str) -> str:
    return "arrays of " + kind[len("array of ") :] if kind.startswith("array of ") else kind + "s"


def meanings() -> dict[str, str]:
    """Each field's meaning, from ``Snapshot``'s docstring (``Attributes:``; "a, b: ..." covers both).

    Example:
        >>> meanings()["step"]
        'optimizer steps taken so far (the first step is 1).'
    """
    doc = (Snapshot.__doc__ or "").split("Attributes:\n", 1)[1]
    entries = re.split(r"^        (?=[a-z_]+(?:, [a-z_]+)*: )", doc, flags=re.M)[1:]
    out: dict[str, str] = {}
    for entry in entries:
        names, text = entry.split(": ", 1)
        for name in names.split(", "):
            text = re.sub(r"\bNone\b", "null", " ".join(text.split()).replace("``", "`"))
            out[name.strip()] = text
    return out


def log_fields() -> list[LogField]:
    """Every field of a line, in the order it is written (``Snapshot``'s, then ``schema``)."""
    hints, said = typing.get_type_hints(Snapshot), meanings()
    out = []
    for f in dataclasses.fields(Snapshot):
        if f.name not in UNITS or f.name not in said:
            raise KeyError(
                f"Snapshot.{f.name} has no unit in distmon/export/log_schema.py's UNITS or no entry in "
                "Snapshot's Attributes: declare both (a new field is a schema change: docs/stability.md)"
            )
        kind = _json_type(hints[f.name])
        if "number" in kind:
            kind += ' (non-finite: "nan", "inf", "-inf")'
        out.append(
            LogField(f.name, kind, UNITS[f.name], node_local=f.name in NODE_LOCAL, meaning=said[f.name])
        )
    schema = f"the schema version of this line ({LOG_SCHEMA_VERSION}); absent in the logs of distmon 0.1.0"
    out.append(LogField("schema", "integer", "", node_local=False, meaning=schema))
    return out


def log_table() -> str:
    """The table of ``docs/log-schema.md`` (Markdown), a row per field.

    Example:
        >>> log_table().splitlines()[2].split(" | ")[:3]
        ['| `step`', 'integer', 'job']
    """
    rows = ["| field | JSON type | scope | unit | meaning |", "|---|---|---|---|---|"]
    for f in log_fields():
        cells = [f"`{f.name}`", f.json_type, "node" if f.node_local else "job", f.unit, f.meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
