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
from typing import ClassVar

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from ..errors import logger
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


def _check_distributed(args: TrainingArguments) -> None:
    """Several processes under torchrun, but the Trainer set up no distributed training: say why.

    On a machine without a GPU transformers sets up DDP only with ``use_cpu=True``; without it
    every process trains its own copy of the model alone (it logs "distributed training: False").
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and args.parallel_mode != ParallelMode.DISTRIBUTED:
        raise RuntimeError(
            f"distmon: torchrun started {world} processes, but the Trainer is not training distributed "
            f"(TrainingArguments.parallel_mode is {args.parallel_mode.value}): each process trains its own "
            "copy of the model alone, and there is no job-wide gradient to monitor. On a machine without "
            "a GPU, transformers trains distributed only with --use_cpu (TrainingArguments(use_cpu=True)): "
            "add it and run again"
        )


class DistmonCallback(TrainerCallback, ExportableState):
    """Builds a :class:`distmon.GradMonitor` with ``options`` when training begins, closes it at its end.

    ``.monitor`` is the monitor (``None`` outside training). Options are checked here. The
    monitor's state goes into every checkpoint's ``trainer_state.json`` (a stateful callback)
    and, with ``TrainingArguments(restore_callback_states_from_checkpoint=True)``, comes back on
    ``trainer.train(resume_from_checkpoint=...)``: steps, detectors and noise scale go on.
    """

    _user_options: ClassVar[dict[str, object]] = {}  # the options of the callback a user built last

    def __init__(self, *, from_checkpoint: bool = False, **options: object) -> None:
        # the Trainer restores a stateful callback as type(cb)(**state["args"]): a new instance that
        # replaces the user's; its options (processes groups, callables: not JSON) are the user's
        if from_checkpoint:
            options = dict(DistmonCallback._user_options)
        else:
            DistmonCallback._user_options = options
        self.options = checked_options(options)
        self.monitor: GradMonitor | None = None
        self.resume_state: dict[str, object] | None = None  # set by the Trainer from a checkpoint
        self._saved: dict[str, object] | None = None  # the monitor's state at the step being saved

    def state(self) -> dict[str, object]:
        """What the Trainer keeps in a checkpoint (called on the saving process only: no collective)."""
        return {"args": {"from_checkpoint": True}, "attributes": {"resume_state": self._saved}}

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if control.should_save and self.monitor is not None:  # every rank, before the Trainer saves
            self._saved = self.monitor.state_dict()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: object = None,
        **kwargs: object,
    ) -> None:
        _check_distributed(args)
        trainer = _trainer()
        options = {"lr_scheduler": lr_scheduler, **self.options} if lr_scheduler is not None else self.options
        self.monitor = GradMonitor(trainer.model_wrapped, optimizer or trainer.optimizer, **options)
        if self.resume_state:
            resume, self.resume_state = self.resume_state, None
            self.monitor.load_state_dict(resume)
        elif state.global_step:
            logger.warning(
                "distmon: the Trainer resumed at step %d without distmon's state: steps are counted "
                "from 1 and the detectors start cold; pass TrainingArguments("
                "restore_callback_states_from_checkpoint=True) to resume them",
                state.global_step,
            )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.monitor is not None:
            self.monitor.close()
