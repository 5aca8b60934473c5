"""distmon in the frameworks people train with: a few lines each, documented in docs/frameworks.md.

- ``lightning.py``: ``DistmonCallback(**options)``, a Lightning ``Callback``;
- ``transformers.py``: ``DistmonCallback(**options)``, a Hugging Face ``TrainerCallback``;
- both hand distmon's figures (``tracker_figures.py``) to the framework's own loggers, at each
  figure's step (``report=True``, the default; ``docs/trackers.md``);
- accelerate needs none: ``GradMonitor(model, optimizer)`` on the objects ``accelerator.prepare``
  returned (its optimizer wrapper is unwrapped to the optimizer that steps).

The frameworks stay optional (``pip install 'distmon[lightning]'``, ``'distmon[transformers]'``):
``import distmon`` never imports them, and each module here imports only its own.
"""

from __future__ import annotations

import os

from .. import compat  # noqa: F401  (first: an unsupported torch is refused before anything runs)
from ..export.trackers import Mailbox
from ..options import BY_NAME
from ..setup.config import MonitorConfig

__all__ = ["checked_options", "with_mailbox"]


def checked_options(options: dict[str, object]) -> dict[str, object]:
    """The options of a monitor a callback will build later, checked now (a typo fails at once).

    Values read from the environment are checked too; what needs the model is checked when the
    monitor is built.

    Example:
        >>> checked_options({"export_every": 5})
        {'export_every': 5}
    """
    MonitorConfig.from_options(**options)
    return dict(options)


def with_mailbox(options: dict[str, object], mailbox: Mailbox) -> dict[str, object]:
    """``options`` with ``mailbox`` added to the trackers the user gave (``tracker=`` or
    ``DISTMON_TRACKER``): the callback hands what it receives to the framework's loggers.

    Example:
        >>> box = Mailbox()
        >>> with_mailbox({"tracker": print}, box)["tracker"] == [print, box]
        True
    """
    given = options.get("tracker")
    if given is None:
        given = os.environ.get(BY_NAME["tracker"].env or "") or None
    mine = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    return {**options, "tracker": [*mine, mailbox]}
