"""The tables of the docs site, rendered from the code: never copied by hand.

Each table lives in one place in the code and is rendered into a page of ``docs/`` between two
marker lines (``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->``):

- ``options`` (``docs/options.md``): :data:`distmon.options.OPTIONS`, as
  :func:`distmon.options.options_table` renders it;
- ``metrics`` (``docs/metrics.md``): :data:`distmon.serve.prometheus_exporter.METRICS`, the
  declarations the collector builds its families from;
- ``hops`` (``docs/how-it-works.md``): the bucket-to-gauge table of ``distmon/step/tracker.py``'s
  docstring, its one copy.

``python -m distmon.doc_tables --write`` renders them into the pages; ``tests/test_docs.py``
fails when a page's table differs from what the code renders now.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

__all__ = ["TABLES", "metrics_table", "hop_table", "render_into", "stale_tables", "write_tables"]


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
    """The bucket-to-gauge trace of ``distmon/step/tracker.py``'s docstring, as a Markdown table.

    Example:
        >>> hop_table().splitlines()[0]
        '| hop | function | thread |'
    """
    from .step import tracker

    lines = (tracker.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    top, head_rule, bottom = rules[0], rules[1], rules[2]
    spans = [m.span() for m in re.finditer(r"=+", lines[top])]

    def cells(line: str) -> list[str]:
        # the last column runs to the end of the line; ``code`` becomes `code`
        bounds = [(a, b) for a, b in spans[:-1]] + [(spans[-1][0], len(line))]
        return [line[a:b].strip().replace("``", "`") for a, b in bounds]

    head = cells(lines[top + 1])
    rows = [f"| {' | '.join(head)} |", "|---:|" + "---|" * (len(head) - 1)]
    rows += [f"| {' | '.join(cells(line))} |" for line in lines[head_rule + 1 : bottom]]
    return "\n".join(rows) + "\n"


def _options_table() -> str:
    from .options import options_table

    return options_table()


# table name -> (the docs page it is rendered into, its renderer)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "options": ("options.md", _options_table),
    "metrics": ("metrics.md", metrics_table),
    "hops": ("how-it-works.md", hop_table),
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
        with open(path, "w", encoding="utf-8") as f:
            f.write(render_into(text, name, render()))


if __name__ == "__main__":  # python -m distmon.doc_tables [--write] [docs_dir]
    args = sys.argv[1:]
    where = next((a for a in args if not a.startswith("-")), "docs")
    if "--write" in args:
        write_tables(where)
    else:
        print("\n".join(stale_tables(where)) or "every table is current")
