"""What a source hands over during one training step: each backward's sums, and whether they were measured.

A source (``sources/``) measures gradients where they live and hands the sums of squares
here, per set of runs (a DDP bucket, an FSDP unit, all of a module's gradients): the *local*
ones (this rank's gradient before the data-parallel reduction) and the *reduced* ones (what
the optimizer steps with). The step schedule folds them into per-layer sums when the step
needs them, divided by the loss scale in force for that backward. Failures are recorded per
side: a rank whose local measurement failed still reports exact reduced figures, and back.

:class:`BackwardSums` is the one object the sources call (their ``receiver``).
"""

from __future__ import annotations

import enum

import torch

from ..compat import foreach_mul_
from ..errors import ErrorCounter
from .loss_scale import LossScale
from .sums import LayerFold, Runs

__all__ = ["BackwardSums", "StepState", "LayerOrder", "Pending"]


class StepState(enum.Flag):
    """Where this rank's training step stands (cf. FSDP2's ``TrainingState``): one value, held by
    :class:`BackwardSums`, which the sources read and the step schedule advances.

    No flag: between steps. ``BACKWARD``: a backward is handing over its sums (cleared when it
    ends; more may come: gradient accumulation). ``READ``: the step's figures were first needed (the
    optimizer step began, or a guard or ``clip_grad_norm_`` asked): a source that reads the
    gradients at the step has read them. ``FROZEN``: the optimizer step began: backwards until it
    ends (a closure's later calls, LBFGS's line search) are no new step and are not measured.
    ``BEGUN``: the step's collective started. ``ROW``: its reduced sums are in its row. ``READ``,
    ``BEGUN`` and ``ROW`` come in no fixed order (a guard finishes the row before the step begins);
    the step's end clears every flag but ``CLOSED``, set for good once the monitor closed.

    Example:
        >>> state = StepState.BACKWARD | StepState.READ
        >>> StepState.FROZEN in state, bool(state & (StepState.FROZEN | StepState.CLOSED))
        (False, False)
    """

    BACKWARD = enum.auto()
    READ = enum.auto()
    FROZEN = enum.auto()
    BEGUN = enum.auto()
    ROW = enum.auto()
    CLOSED = enum.auto()


Pending = list[tuple[Runs, list[torch.Tensor]]]


class LayerOrder:
    """Each layer's position in backward order (first gradient ready = 0), as the source learned it.

    On the device for the per-step "first non-finite layer" (``sums.first_nonfinite``), on the
    host for the decoder; layers not yet seen sort last. Changes are rare (a new bucket layout).

    Example:
        >>> order = LayerOrder(3, torch.device("cpu")); order.set([2.0, 0.0, 1.0]); order.host
        [2.0, 0.0, 1.0]
    """

    def __init__(self, n_layers: int, device: torch.device) -> None:
        self.device = torch.full((n_layers,), float(n_layers), device=device)
        self.host: list[float] = [float(n_layers)] * n_layers

    def set(self, positions: list[float]) -> None:
        self.host = positions
        self.device.copy_(torch.tensor(positions))


class BackwardSums:
    """Sums handed over by a source during one step, folded into layers when the step needs them.

    Source side: :meth:`begin_backward`, :meth:`add_local`, :meth:`add_reduced` (in the backward's
    hooks and final callbacks, before it returns), :meth:`end_backward`, :meth:`fail`; a
    failure may be recorded from another thread (:class:`~distmon.errors.ErrorCounter` locks).
    Step side: :meth:`fold_local`,
    :meth:`fold_reduced`, the flags, :meth:`new_step`.

    Example:
        >>> sums = BackwardSums(n_layers=1, device=torch.device("cpu"), loss_scale=LossScale(),
        ...                     errors=ErrorCounter())
        >>> runs = Runs((0,), seq=0, device=torch.device("cpu"))
        >>> sums.begin_backward(); sums.add_local(runs, [torch.tensor(4.0)]); sums.end_backward()
        >>> out = torch.empty(1); sums.fold_local(out); out.tolist(), sums.local_ok
        ([4.0], True)
    """

    def __init__(
        self,
        *,
        n_layers: int,
        device: torch.device,
        loss_scale: LossScale,
        errors: ErrorCounter,
        fixed_order: list[float] | None = None,
    ) -> None:
        self.device = device
        self.errors = errors
        self.loss_scale = loss_scale
        self.fold = LayerFold(n_layers, device)
        self.state = StepState(0)
        self.order = LayerOrder(n_layers, device)
        self._fixed = fixed_order is not None  # the sources' backward orders are not the job's
        if fixed_order is not None:
            self.order.set(fixed_order)
        self._local: Pending = []
        self._reduced: Pending = []
        self.new_step()

    @property
    def active(self) -> bool:
        """Whether the sources measure now: not once the monitor closed, nor between the step's
        start and its end (a closure's later calls, LBFGS's line search, are no new step)."""
        return not self.state & (StepState.FROZEN | StepState.CLOSED)

    @property
    def closed(self) -> bool:
        """Whether the monitor closed: nothing is measured any more."""
        return StepState.CLOSED in self.state

    def close(self) -> None:
        """The monitor closed: nothing is measured from now on."""
        self.state |= StepState.CLOSED

    def freeze(self) -> None:
        """The step began: its figures are taken; backwards until it ends are not measured."""
        if StepState.CLOSED not in self.state:
            self.state = (self.state & ~StepState.BACKWARD) | StepState.FROZEN

    def new_step(self) -> None:
        """Forget the finished step's flags (its sums were folded or dropped)."""
        # the step's flags go; CLOSED stays (and BACKWARD, never set between steps)
        self.state &= StepState.BACKWARD | StepState.CLOSED
        self.measured = False  # a backward handed this step its sums
        self.local_ok = True  # no failure where the local figures are measured
        self.local_exact = True  # one reduction input held the step's whole local gradient
        self.reduced_ok = True  # ... where the reduced ones are
        self._scaled = True
        self._reduced_scaled = True
        self._inv_sq: torch.Tensor | None = None

    # -- source side ------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """The source saw a gradient of a backward; the first of a backward starts it afresh.

        Per backward, not per step: a second backward before the step replaces the first one's
        figures, as DDP's buckets do.
        """
        if StepState.BACKWARD not in self.state:
            if self.active:
                self.state |= StepState.BACKWARD
            self._local.clear()
            self._reduced.clear()

    def add_local(self, runs: Runs, sums: list[torch.Tensor]) -> None:
        self._local.append((runs, sums))

    def add_reduced(self, runs: Runs, sums: list[torch.Tensor]) -> None:
        self._reduced.append((runs, sums))

    def end_backward(self, scaled: bool = True, reduced_scaled: bool | None = None) -> None:
        """The backward's sums are all handed over.

        ``scaled``: they were read before the loss scale was divided out (``reduced_scaled``: the
        same for the reduced ones, when they were read at another time).
        """
        self.state &= ~StepState.BACKWARD
        self.measured = True
        self._scaled = scaled
        self._reduced_scaled = scaled if reduced_scaled is None else reduced_scaled

    def fail(self, site: str, local: bool = True, reduced: bool = True) -> None:
        """Count a failure at ``site`` (logged once); this step's ``local`` and/or ``reduced``
        figures on this rank are not measured (NaN where reported)."""
        self.errors.record(site)
        self.local_ok &= not local
        self.reduced_ok &= not reduced

    def rescale(self, factor: float) -> None:
        """The gradients whose sums were handed over were multiplied by ``factor`` since (a pipeline
        schedule dividing by its micro-batch count): their sums of squares follow."""
        # a single process hands over the same sums as local and reduced: scale each tensor once
        unique = {id(t): t for _, sums in self._local + self._reduced for t in sums}
        if unique:
            foreach_mul_(list(unique.values()), factor * factor)

    def local_unmeasured(self) -> None:
        """This step's local figures cannot be measured, and that is no failure (no local gradient
        was read: NaN where served, no rank named for a non-finite one)."""
        self.local_ok = False

    def local_summed(self) -> None:
        """The local sums handed over are of every one of several reduction inputs (ZeRO-2/3
        reducing every micro-batch): no norm (NaN where served), but non-finite iff one
        micro-batch's gradient was, so the rank whose gradient went non-finite is still named."""
        self.local_exact = False

    def set_layer_order(self, positions: list[float]) -> None:
        """Each layer's position in backward order, as the source learned it (rare: new layouts)."""
        if not self._fixed:
            self.order.set(positions)

    # -- step side --------------------------------------------------------------------------
    def fold_local(self, out: torch.Tensor) -> None:
        """This step's local per-layer sums of squares into ``out``, in gradient units; then dropped."""
        self.fold(self._local, out)
        self._unscale(out, self._scaled)
        self._local.clear()

    def fold_reduced(self, out: torch.Tensor) -> None:
        """This step's reduced per-layer sums of squares into ``out``, in gradient units; then dropped."""
        if self.measured:
            self.fold(self._reduced, out)
            self._unscale(out, self._reduced_scaled)
        self._reduced.clear()

    def _unscale(self, sq: torch.Tensor, scaled: bool) -> None:
        """Divide sums of squares of loss-scaled gradients by the step's scale squared."""
        if not scaled:
            return
        if self._inv_sq is None:
            self._inv_sq = self.loss_scale.inv_sq()
        if self._inv_sq is not None:
            sq.mul_(self._inv_sq)
