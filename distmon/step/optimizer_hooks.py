"""The optimizer side: where a training step begins and ends, and the guard that may skip it.

A training step is one backward followed by one ``step()`` of every monitored optimizer, in
any order. The first monitored ``step()`` begins it (the step's collective starts there, on
every rank, after the gradient reduction has completed); it ends when every monitored
optimizer has stepped, or when one steps a second time before the others did. With a guard
(``"skip"`` or ``"raise"``) every monitored optimizer's ``step()`` is wrapped: the step's
verdict, from reduced figures identical on every rank, is read once per step (the one opt-in
host sync) and every optimizer of that step obeys it, so no part of the model takes a step
the guard refused. With a ``GradScaler``, a ``scaler.step(opt)`` that does not call
``opt.step()`` (an Inf/NaN in the scaled gradient) still ends the training step, marked as
skipped by the scaler: the loop made that step, and distmon's step numbers stay the loop's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch

from ..setup.config import GuardMode, Scheduler
from .schedule import StepSchedule

Step = Callable[..., object]  # an optimizer's (or a scaler's, a scheduler's) step()

__all__ = ["GradientAnomalyError", "StepHooks", "uncovered_parameters"]


class GradientAnomalyError(RuntimeError):
    """Raised from ``optimizer.step()`` with ``guard="raise"`` (on every rank alike)."""


def uncovered_parameters(
    named: Sequence[tuple[str, torch.nn.Parameter]], optimizers: Sequence[torch.optim.Optimizer]
) -> list[str]:
    """Names of the trainable parameters that none of ``optimizers`` steps.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> uncovered_parameters(list(net.named_parameters()), [torch.optim.SGD(net[0].parameters(), 0.1)])
        ['1.weight', '1.bias']
    """
    covered = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    return [name for name, p in named if id(p) not in covered]


def warn_uncovered(
    named: Sequence[tuple[str, torch.nn.Parameter]], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Warn (once, at construction) when the monitored optimizers do not step the whole model."""
    missing = uncovered_parameters(named, optimizers)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        warnings.warn(
            f"distmon: {len(missing)} trainable parameter(s) are stepped by none of the monitored "
            f"optimizers ({shown}): steps are counted, and a guard applied, only where those "
            f"optimizers step. Pass every optimizer that steps the model: "
            f"GradMonitor(model, [opt1, opt2, ...]).",
            stacklevel=3,
        )


def _closure(args: tuple[object, ...], kwargs: dict[str, object]) -> Callable[[], object] | None:
    """The closure an ``optimizer.step(...)`` call was given (positionally first, or by name), or None."""
    closure = kwargs.get("closure", args[0] if args else None)
    return closure if callable(closure) else None


def _with_closure(
    args: tuple[object, ...], kwargs: dict[str, object], closure: Callable[[], object], *, at: int
) -> tuple[tuple[object, ...], dict[str, object]]:
    """``(args, kwargs)`` with the closure (by name, or positional at ``at``) replaced."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (*args[:at], closure, *args[at + 1 :]), kwargs


class _Replay:
    """A closure already called once: its first call returns that result, later ones call it again."""

    def __init__(self, result: object, closure: Callable[[], object]) -> None:
        self._result, self._closure, self._fresh = result, closure, True

    def __call__(self) -> object:
        if self._fresh:
            self._fresh = False
            return self._result
        return self._closure()


class StepHooks:
    """Begins and ends the schedule's steps from the monitored optimizers' ``step()`` calls.

    Without a guard, step pre- and post-hooks (``Optimizer.register_step_pre_hook``); with
    one, each optimizer's ``step`` is shadowed by an instance attribute, the only way not to
    take a step (hooks cannot cancel one); whatever ``step`` was (a scheduler's wrapper, say)
    stays inside. ``schedulers`` are held back once after every skipped step. A ``scaler``'s
    ``step`` is shadowed the same way, to see the steps it skips.

    A step taken as ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS)
    runs its backward inside the closure: the step begins when the closure's first call
    returns (the pre-hook hands the optimizer a closure that calls the user's, then begins
    it). With a guard, the closure is called first (under ``torch.enable_grad()``, as the
    optimizer would), the step judged, and the optimizer handed a closure whose first call
    returns that result: the closure still runs once, as without distmon. Later calls of the
    closure in the same step (LBFGS's line search) run it as usual and are not measured.

    Nothing raised in distmon's code here reaches the training loop: it is counted, logged
    once, and the step goes on (a guard that cannot judge a step lets it be taken); the
    schedule still begins and ends the step (its collective issued, the step counted) as on
    every other rank.

    Example:
        >>> hooks = StepHooks(schedule, optimizers=[opt], verdict_column=col)   # doctest: +SKIP
        >>> hooks.install(); ...; hooks.remove()                               # doctest: +SKIP
    """

    def __init__(
        self,
        schedule: StepSchedule,
        *,
        optimizers: Sequence[torch.optim.Optimizer],
        verdict_column: int,
        guard: GuardMode | None = None,
        schedulers: Sequence[Scheduler] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.schedule = schedule
        self.optimizers = tuple(optimizers)
        self.guard = guard
        self.schedulers = tuple(schedulers)
        self.scaler = scaler
        self._column = verdict_column
        self._finished = 0  # optimizer steps finished, ever: did scaler.step(opt) call opt.step()?
        self._scaler_skip = False  # the scaler skipped an optimizer of this training step
        self._stepped: set[int] = set()  # ids of the optimizers that stepped in this training step
        self._verdict: bool | None = None  # True: the guard refuses this training step
        self._hold: set[int] = set()  # ids of the schedulers to hold back once
        self._undo: list[Callable[[], object]] = []

    def install(self) -> None:
        """Install every hook; all or nothing (a failure removes what was installed, then raises)."""
        try:
            self._install()
        except BaseException:
            self.remove()
            raise

    def _install(self) -> None:
        for opt in self.optimizers:
            if self.guard is None:
                # each undo noted as soon as its hook is in: a later failure removes it
                self._undo.append(opt.register_step_pre_hook(self._pre_hook).remove)
                self._undo.append(opt.register_step_post_hook(self._finish).remove)
            else:
                opt.step = self._guarded(opt, opt.step)
                self._undo.append(functools.partial(opt.__dict__.pop, "step", None))
        if self.scaler is not None:
            self.scaler.step = self._scaled(self.scaler.step)
            self._undo.append(functools.partial(self.scaler.__dict__.pop, "step", None))
        if self.guard is not None:
            for sched in self.schedulers:
                sched.step = self._held(sched, sched.step)
                self._undo.append(functools.partial(sched.__dict__.pop, "step", None))

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()

    def _pre_hook(
        self, opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        closure = _closure(args[1:], kwargs)  # args[0] is the optimizer
        if closure is None:
            self._begin(opt)
            return None

        def then_begin() -> object:  # the closure runs the step's backward: the step begins after it
            result = closure()
            self._begin(opt)
            return result

        return _with_closure(args, kwargs, then_begin, at=1)

    def _begin(self, opt: torch.optim.Optimizer) -> None:
        try:
            if id(opt) in self._stepped:  # stepped again before the others: that training step is over
                self._end()
            self.schedule.before_step()
        except Exception:
            self.schedule.errors.record("optimizer step pre-hook")
            self.schedule.begin_anyway()  # its collective, now, as on the other ranks

    def _finish(self, opt: torch.optim.Optimizer, *hook_args: object) -> None:
        """``opt`` stepped (its post-hook; ``hook_args``: the step's, unused): the training step ends
        once every monitored optimizer stepped."""
        try:
            self._finished += 1
            # an optimizer that skipped its own update (DeepSpeed's engine step on an overflow)
            self._scaler_skip |= bool(getattr(opt, "step_was_skipped", False))
            self._stepped.add(id(opt))
            if len(self._stepped) == len(self.optimizers):
                self._end()
        except Exception:
            self.schedule.errors.record("optimizer step post-hook")

    def _end(self) -> None:
        skip = "guard" if self._verdict else "scaler" if self._scaler_skip else ""
        self._stepped.clear()
        self._verdict = None
        self._scaler_skip = False
        step = self.schedule.step + 1
        try:
            self.schedule.after_step(skip)
        except Exception:
            self.schedule.errors.record("optimizer step post-hook")
            self.schedule.end_anyway(step, skip)

    def _refused(self) -> bool:
        if self._verdict is None:
            try:
                row = self.schedule.judge_now()
                self._verdict = row[self._column].item() != 0.0  # the one opt-in host sync per step
            except Exception:
                self.schedule.errors.record("guard verdict")
                self._verdict = False  # no verdict: the step is taken, as without distmon
        return self._verdict

    def _guarded(self, opt: torch.optim.Optimizer, inner_step: Step) -> Step:
        @functools.wraps(inner_step)  # keeps e.g. the LR scheduler's marker attribute
        def guarded_step(*args: object, **kwargs: object) -> object:
            closure = _closure(args, kwargs)
            loss = None
            if closure is not None:  # its backward must run before the step can be judged
                with torch.enable_grad():
                    loss = closure()
                args, kwargs = _with_closure(args, kwargs, _Replay(loss, closure), at=0)
            self._begin(opt)
            if not self._refused():
                self._hold.clear()  # a step taken: a scheduler not stepped since the skip keeps its pace
                result = inner_step(*args, **kwargs)
                self._finish(opt)
                return result
            step = self.schedule.step + 1
            self._hold = {id(s) for s in self.schedulers}
            self._finish(opt)
            if self.guard == "raise":
                raise GradientAnomalyError(
                    f"distmon: non-finite or spiking gradient at step {step}; optimizer step not taken "
                    "(guard='raise'): catch distmon.GradientAnomalyError to go on, or use guard='skip'"
                )
            return loss

        return guarded_step

    def _scaled(self, inner_step: Step) -> Step:
        monitored = {id(opt) for opt in self.optimizers}

        @functools.wraps(inner_step)
        def scaler_step(optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
            finished = self._finished
            result = inner_step(optimizer, *args, **kwargs)
            if id(optimizer) in monitored and self._finished == finished:
                # the scaler found an Inf/NaN and did not call optimizer.step(): same on every
                # rank (the gradients it checked are the reduced ones), so the step ends alike
                self._begin(optimizer)
                self._scaler_skip = True
                self._finish(optimizer)
            return result

        return scaler_step

    def _held(self, sched: Scheduler, inner_step: Step) -> Step:
        @functools.wraps(inner_step)
        def held_step(*args: object, **kwargs: object) -> object:
            if id(sched) in self._hold:
                self._hold.discard(id(sched))
                return None
            return inner_step(*args, **kwargs)

        return held_step
