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

Every step's figures (``docs/trackers.md``) go to the trainer's loggers (``trainer.loggers``:
``TensorBoardLogger``, ``CSVLogger``, ``WandbLogger``, ``MLFlowLogger``, ...) through
``logger.log_metrics(figures, step)`` at the step they belong to, on the training thread after
each batch (Lightning's loggers are called from it: ``CSVLogger`` buffers rows without a lock),
from global rank 0; ``report=False`` turns that off.

Example:
    >>> from distmon.integrations.lightning import DistmonCallback      # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[DistmonCallback(guard="skip")])  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ..export.trackers import Mailbox
from ..monitor import GradMonitor
from . import checked_options, with_mailbox

__all__ = ["DistmonCallback"]


class DistmonCallback(pl.Callback):
    """Builds a :class:`distmon.GradMonitor` with ``options`` for each fit, closes it after.

    Options are checked here (a typo fails when the trainer is set up, not mid-fit). ``report``:
    hand every step's figures to the trainer's loggers (if it has any).
    """

    def __init__(self, *, report: bool = True, **options: object) -> None:
        super().__init__()
        self.options = checked_options(options)
        self.report = report
        self.monitor: GradMonitor | None = None
        self._mailbox: Mailbox | None = None  # figures waiting for the loggers
        self._resume: dict[str, object] | None = None  # a checkpoint's state, for the next fit

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        options = {"lr_scheduler": schedulers, **self.options} if schedulers else self.options
        self._mailbox = Mailbox() if self.report and trainer.loggers else None
        if self._mailbox is not None:
            options = with_mailbox(options, self._mailbox)
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

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        self._hand_over(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(finished=True)
        self._hand_over(trainer)  # the steps close() exported, before Lightning finalizes its loggers

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(finished=False)
        self._hand_over(trainer)

    def _close(self, finished: bool) -> None:
        if self.monitor is not None:
            self.monitor.close(finished=finished)

    def _hand_over(self, trainer: pl.Trainer) -> None:
        """The figures exported since the last call, to every logger at their own step (never raises)."""
        if self._mailbox is None:
            return
        for figures in self._mailbox.take():  # empty but on global rank 0
            for logger in trainer.loggers:
                try:
                    logger.log_metrics(dict(figures.scalars), step=figures.step)
                except Exception:
                    self._mailbox.failed(f"Lightning logger {type(logger).__name__}.log_metrics")
