"""Lightning: ``DistmonCallback(**options)``, a ``Callback`` that monitors the fit it is given to.

The monitor is built on every rank when the fit starts (``on_fit_start``: the strategy's model,
DDP or FSDP2 or the plain module, and the optimizers exist by then), with the trainer's LR
schedulers (held back by a guard on skipped steps); it is closed when the fit ends, and on an
exception without the clean-finish mark (the run then reads as having died). Lightning's
default automatic optimization runs forward and backward inside the closure it passes to
``optimizer.step``: distmon measures that step after the closure's backward. ``.monitor`` is the
:class:`distmon.GradMonitor` (``None`` outside a fit), e.g. for ``configure_gradient_clipping``.
The monitor's state is saved in Lightning's checkpoints and restored with ``ckpt_path=``: a
resumed fit's steps, detectors and noise scale go on where the checkpoint left them.

Example:
    >>> from distmon.integrations.lightning import DistmonCallback      # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[DistmonCallback(guard="skip")])  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ..monitor import GradMonitor
from . import checked_options

__all__ = ["DistmonCallback"]


class DistmonCallback(pl.Callback):
    """Builds a :class:`distmon.GradMonitor` with ``options`` for each fit, closes it after.

    Options are checked here (a typo fails when the trainer is set up, not mid-fit).
    """

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.options = checked_options(options)
        self.monitor: GradMonitor | None = None
        self._resume: dict[str, object] | None = None  # a checkpoint's state, for the next fit

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        options = {"lr_scheduler": schedulers, **self.options} if schedulers else self.options
        self.monitor = GradMonitor(trainer.strategy.model, trainer.optimizers, **options)
        if self._resume:
            state, self._resume = self._resume, None
            self.monitor.load_state_dict(state)

    def state_dict(self) -> dict[str, object]:
        """The monitor's state (:meth:`GradMonitor.state_dict`), kept in Lightning's checkpoints.

        Lightning asks every rank for it when it saves (no collective)."""
        return self.monitor.state_dict() if self.monitor is not None else {}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """A checkpoint's state (``trainer.fit(..., ckpt_path=...)``): loaded when the fit starts."""
        self._resume = dict(state_dict) or None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(finished=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if self.monitor is not None:
            self.monitor.close(finished=finished)
