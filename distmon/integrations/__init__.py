"""distmon in the frameworks people train with: a few lines each, documented in docs/frameworks.md.

- ``lightning.py``: ``DistmonCallback(**options)``, a Lightning ``Callback``;
- ``transformers.py``: ``DistmonCallback(**options)``, a Hugging Face ``TrainerCallback``;
- accelerate needs none: ``GradMonitor(model, optimizer)`` on the objects ``accelerator.prepare``
  returned (its optimizer wrapper is unwrapped to the optimizer that steps).

The frameworks stay optional (``pip install 'distmon[lightning]'``, ``'distmon[transformers]'``):
``import distmon`` never imports them, and each module here imports only its own.
"""

from __future__ import annotations

from .. import compat  # noqa: F401  (first: an unsupported torch is refused before anything runs)
from ..setup.config import MonitorConfig

__all__ = ["checked_options"]


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
