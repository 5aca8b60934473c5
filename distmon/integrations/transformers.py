"""Hugging Face ``Trainer``: ``DistmonCallback(**options)``, a ``TrainerCallback``.

``Trainer(..., callbacks=[DistmonCallback()])``. When training begins, on every rank, it finds
what distmon needs that a callback is not handed: the wrapped model (``trainer.model_wrapped``,
the DDP or FSDP2 model accelerate prepared; a callback gets the unwrapped one), the optimizer
that steps (under accelerate's ``AcceleratedOptimizer``) and the LR scheduler, builds the
:class:`distmon.GradMonitor`, and closes it when training ends. The norm distmon serves is the
one the Trainer logs as ``grad_norm``: the gradient before ``max_grad_norm`` clips it.

Example:
    >>> from distmon.integrations.transformers import DistmonCallback            # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[DistmonCallback()])  # doctest: +SKIP
"""

from __future__ import annotations

import sys

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..monitor import GradMonitor
from . import checked_options

__all__ = ["DistmonCallback"]


def _trainer() -> Trainer:
    """The Trainer whose training loop calls this callback (a callback is not handed it)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    raise RuntimeError(
        "distmon: DistmonCallback.on_train_begin was not called by a transformers.Trainer; build "
        "distmon.GradMonitor(model, optimizer) yourself on the wrapped model and the optimizer"
    )


class DistmonCallback(TrainerCallback):
    """Builds a :class:`distmon.GradMonitor` with ``options`` when training begins, closes it at its end.

    ``.monitor`` is the monitor (``None`` outside training). Options are checked here.
    """

    def __init__(self, **options: object) -> None:
        self.options = checked_options(options)
        self.monitor: GradMonitor | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: object = None,
        **kwargs: object,
    ) -> None:
        trainer = _trainer()
        options = {"lr_scheduler": lr_scheduler, **self.options} if lr_scheduler is not None else self.options
        self.monitor = GradMonitor(trainer.model_wrapped, optimizer or trainer.optimizer, **options)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.monitor is not None:
            self.monitor.close()
