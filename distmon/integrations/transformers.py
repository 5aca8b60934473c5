"""Hugging Face ``Trainer``: ``DistmonCallback(**options)``, a ``TrainerCallback``.

``Trainer(..., callbacks=[DistmonCallback()])``. When training begins, on every rank, it finds
what distmon needs that a callback is not handed: the wrapped model (``trainer.model_wrapped``,
the DDP or FSDP2 model accelerate prepared; a callback gets the unwrapped one), the optimizer
that steps (under accelerate's ``AcceleratedOptimizer``) and the LR scheduler, builds the
:class:`distmon.GradMonitor`, and closes it when training ends. The norm distmon serves is the
one the Trainer logs as ``grad_norm``: the gradient before ``max_grad_norm`` clips it.

Every step's figures (``docs/trackers.md``) go to the integrations ``report_to`` names
(TensorBoard, W&B, MLflow, ...), each at the step it belongs to. The Trainer reports through
``Trainer.log``: it appends ``logs`` to ``state.log_history`` (kept in every checkpoint) and calls
every callback's ``on_log``; the ``report_to`` integrations are callbacks
(``get_reporting_integration_callbacks``, placed before the user's) that write ``logs`` at
``state.global_step``. So after each step, on the training thread, distmon calls those
integrations' ``on_log`` itself, with its figures and a copy of the state whose ``global_step``
is the figures' step (they arrive up to ``export_every`` steps late): each integration writes
them as it writes the Trainer's own (TensorBoard as ``train/distmon/...``), and the log history
and the console stay as they were. At the last step it flushes the monitor first, so every step
is reported before the integrations close. ``report=False`` turns it off.

Example:
    >>> from distmon.integrations.transformers import DistmonCallback            # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[DistmonCallback()])  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import sys
from typing import ClassVar

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from ..errors import logger
from ..export.trackers import Mailbox
from ..monitor import GradMonitor
from . import checked_options, with_mailbox

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
    ``report``: hand every step's figures to the ``report_to`` integrations.
    """

    _user_options: ClassVar[dict[str, object]] = {}  # the options of the callback a user built last

    def __init__(self, *, report: bool = True, from_checkpoint: bool = False, **options: object) -> None:
        # the Trainer restores a stateful callback as type(cb)(**state["args"]): a new instance that
        # replaces the user's; its options (processes groups, callables: not JSON) are the user's
        if from_checkpoint:
            options = dict(DistmonCallback._user_options)
        else:
            DistmonCallback._user_options = options
        self.options = checked_options(options)
        self.report = report
        self.monitor: GradMonitor | None = None
        self._mailbox: Mailbox | None = None  # figures waiting for the report_to integrations
        self._integrations: list[TrainerCallback] = []
        self.resume_state: dict[str, object] | None = None  # set by the Trainer from a checkpoint
        self._saved: dict[str, object] | None = None  # the monitor's state at the step being saved

    def state(self) -> dict[str, object]:
        """What the Trainer keeps in a checkpoint (called on the saving process only: no collective)."""
        return {
            "args": {"from_checkpoint": True, "report": self.report},
            "attributes": {"resume_state": self._saved},
        }

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if control.should_save and self.monitor is not None:  # every rank, before the Trainer saves
            self._saved = self.monitor.state_dict()
        if self._mailbox is not None and self.monitor is not None:
            if control.should_training_stop or state.global_step >= state.max_steps:
                self.monitor.flush()  # every rank, at the same step: the last steps' figures now
            self._hand_over(args, state, control, kwargs.get("model"))

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
        reporting = tuple(get_reporting_integration_callbacks(args.report_to)) if self.report else ()
        self._integrations = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, reporting)]
        self._mailbox = Mailbox() if self._integrations else None
        if self._mailbox is not None:
            options = with_mailbox(options, self._mailbox)
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
            if self._mailbox is not None:
                self._hand_over(args, state, control, kwargs.get("model"))

    def _hand_over(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: object
    ) -> None:
        """The figures exported since the last call, to every ``report_to`` integration at their own
        step (an integration that raises is counted, never raised into training)."""
        for figures in self._mailbox.take():  # empty but on global rank 0
            at = copy.copy(state)
            at.global_step = figures.step
            logs = figures.logs()
            for integration in self._integrations:
                try:
                    integration.on_log(args, at, control, logs=dict(logs), model=model)
                except Exception:
                    self._mailbox.failed(f"report_to {type(integration).__name__}.on_log")
