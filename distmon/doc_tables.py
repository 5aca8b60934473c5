"""The tables of the docs site, rendered from the code: never copied by hand.

Each table lives in one place in the code and is rendered into a page of ``docs/`` between two
marker lines (``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->``):

- ``options`` (``docs/options.md``): :data:`distmon.options.OPTIONS`, as
  :func:`distmon.options.options_table` renders it;
- ``metrics`` (``docs/metrics.md``): :data:`distmon.serve.prometheus_exporter.METRICS`, the
  declarations the collector builds its families from;
- ``hops`` (``docs/how-it-works.md``): the data path of the global norm, hop by hop,
  :mod:`distmon.step.data_path` (``tests/test_data_path.py`` traces it);
- ``errors`` (``docs/errors.md``): every refusal and warning distmon raises, read from its source
  (:mod:`distmon.doc_errors`);
- ``log`` (``docs/log-schema.md``): the JSONL log's fields, from :class:`distmon.Snapshot` and
  :mod:`distmon.export.log_schema`;
- ``state`` (``docs/api.md``): the fields of ``GradMonitor.state_dict()``
  (:data:`distmon.verdicts.resume.STATE_FIELDS`);
- ``extras`` (``docs/install.md``): ``pyproject.toml``'s extras, their packages and what each is for
  (the comment beside or above each).

``python -m distmon.doc_tables --write`` renders them into the pages; ``tests/test_docs.py``
fails when a page's table differs from what the code renders now.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = [
    "TABLES",
    "metrics_table",
    "hop_table",
    "extras_table",
    "render_into",
    "stale_tables",
    "write_tables",
]


def metrics_table() -> str:
    """The metric table (Markdown), from the collector's declarations.

    Example:
        >>> metrics_table().splitlines()[2].split(" | ")[:3]
        ['| `distmon_grad_norm`', 'gauge', 'run_id']
    """
    from .serve.prometheus_exporter import METRICS

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, spec in METRICS.items():
        shown = f"{name}_bucket{{le}} / _sum / _count" if spec.kind == "histogram" else name
        labels = ", ".join(("run_id", *spec.labels))
        rows.append(f"| `{shown}` | {spec.kind} | {labels} | {spec.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def hop_table() -> str:
    """The data path of the global norm, hop by hop (:mod:`distmon.step.data_path`): one table per
    layout, DDP's and FSDP2's.

    Example:
        >>> hop_table().splitlines()[0]
        '**DDP**'
    """
    from .step.data_path import PATHS, hop_rows

    return "\n".join(f"**{name}**\n\n{hop_rows(path)}" for name, path in PATHS.items())


def _options_table() -> str:
    from .options import options_table

    return options_table()


def extras_table(pyproject: str | None = None) -> str:
    """The extras of ``pyproject.toml`` (Markdown): each one's packages and what it is for, from the
    comment on its line or the comment lines right above it.

    Example:
        >>> extras_table().splitlines()[2].split(" | ")[:2]
        ['| `auth`', '`bcrypt>=4`']
    """
    import re

    import tomllib

    path = pyproject or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"
    )
    with open(path, "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = ["| extra | installs | for |", "|---|---|---|"]
    for name, packages in extras.items():
        at = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(name)}\s*=", line))
        said = lines[at].split("#", 1)[1].strip() if "#" in lines[at] else ""
        above = at
        while not said and above > 0 and lines[above - 1].lstrip().startswith("#"):
            above -= 1
        if not said:
            said = " ".join(line.lstrip("# ").strip() for line in lines[above:at])
        shown = ", ".join(f"`{p}`" for p in packages)
        rows.append(f"| `{name}` | {shown} | {said} |")
    return "\n".join(rows) + "\n"


def _errors() -> str:
    from .doc_errors import catalogue

    return catalogue()


def _log_table() -> str:
    from .export.log_schema import log_table

    return log_table()


def _state_table() -> str:
    from .verdicts.resume import state_table

    return state_table()


# table name -> (the docs page it is rendered into, its renderer)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "options": ("options.md", _options_table),
    "metrics": ("metrics.md", metrics_table),
    "hops": ("how-it-works.md", hop_table),
    "errors": ("errors.md", _errors),
    "log": ("log-schema.md", _log_table),
    "state": ("api.md", _state_table),
    "extras": ("install.md", extras_table),
}


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- generated: {name} (python -m distmon.doc_tables --write; do not edit) -->\n",
        f"<!-- end: {name} -->\n",
    )


def render_into(text: str, name: str, table: str) -> str:
    """``text`` with the block between ``name``'s markers replaced by ``table`` (ValueError: no markers).

    Example:
        >>> page = "# Page\\n" + "".join(_markers("t")).replace("-->\\n<", "-->\\nold\\n<")
        >>> render_into(page, "t", "| new |\\n").splitlines()[2]
        '| new |'
    """
    start, end = _markers(name)
    if start not in text or end not in text:
        raise ValueError(f"no markers for the {name!r} table")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + table + end + tail


def stale_tables(docs_dir: str) -> list[str]:
    """The tables whose page in ``docs_dir`` differs from what the code renders now (or lacks them)."""
    stale = []
    for name, (page, render) in TABLES.items():
        with open(os.path.join(docs_dir, page), encoding="utf-8") as f:
            text = f.read()
        try:
            fresh = render_into(text, name, render())
        except ValueError:
            fresh = None
        if fresh != text:
            stale.append(f"{page}: {name}")
    return stale


def write_tables(docs_dir: str) -> None:
    """Render every table into its page in ``docs_dir``."""
    for name, (page, render) in TABLES.items():
        path = os.path.join(docs_dir, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        rendered = render_into(text, name, render())  # before the page is opened for writing
        with open(path, "w", encoding="utf-8") as f:
            f.write(rendered)


if __name__ == "__main__":  # python -m distmon.doc_tables [--write] [docs_dir]
    args = sys.argv[1:]
    where = next((a for a in args if not a.startswith("-")), "docs")
    if "--write" in args:
        write_tables(where)
    else:
        print("\n".join(stale_tables(where)) or "every table is current")
