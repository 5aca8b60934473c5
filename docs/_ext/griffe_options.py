"""A griffe extension for the API reference (mkdocs.yml): ``GradMonitor``'s options in its docstring.

``GradMonitor.__doc__`` holds an ``{options}`` line that ``distmon/monitor.py`` replaces at import
with every option's entry (``distmon.options.options_args``: the options are declared once). The
reference reads the source without importing it (no torch), so this puts the same entries there.
"""

from __future__ import annotations

from typing import Any

import griffe

from distmon.options import options_args


class OptionsInDocstring(griffe.Extension):
    """Render ``{options}`` in ``distmon.monitor.GradMonitor``'s docstring as the import does."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path == "distmon.monitor.GradMonitor" and cls.docstring is not None:
            cls.docstring.value = cls.docstring.value.replace("    {options}\n", options_args("    ") + "\n")
