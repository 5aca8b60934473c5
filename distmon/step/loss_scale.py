"""The loss scale in force for a step's backward: figures in gradient units, clipping at the right scale.

Mixed-precision loops multiply the loss by a scale ``S`` before ``backward()``, so every
gradient distmon reads is ``S`` times the true one until ``scaler.unscale_`` (or the user's
own division) undoes it. distmon divides its sums of squares by ``S**2`` on the device:
``torch.amp.GradScaler`` keeps ``S`` in a device tensor, which ``scaler.scale(one)`` returns
without a host sync, and it only changes in ``scaler.update()``, after the step's figures
were taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.amp.grad_scaler import OptState

from ..compat import scaler_optimizer_states

__all__ = ["LossScale"]


class LossScale:
    """The scale of a step's gradients: a ``GradScaler``, a fixed number, or none.

    Example:
        >>> LossScale(fixed=1024.0).inv_sq()
        tensor(9.5367e-07)
        >>> LossScale().inv_sq() is None
        True
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler | None = None,
        fixed: float | None = None,
        device: torch.device | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        self.scaler = scaler
        self.fixed = fixed
        self.optimizers = tuple(optimizers)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        # a fixed scale's 1/S^2 never changes: one tensor, made once
        self._fixed_inv_sq = None if fixed is None else torch.tensor(fixed**-2.0, device=device)

    @property
    def active(self) -> bool:
        """Whether gradients are (or may be) loss-scaled at all."""
        return self.fixed is not None or (self.scaler is not None and self.scaler.is_enabled())

    def scale(self) -> torch.Tensor:
        """The scale now, as a 0-d float32 device tensor (1 without scaling); no host sync."""
        if self.fixed is not None:
            return self._one * self.fixed
        if self.scaler is not None and self.scaler.is_enabled():
            return self.scaler.scale(self._one)
        return self._one

    def inv_sq(self) -> torch.Tensor | None:
        """``1 / S**2`` as a 0-d device tensor, or None when gradients are not scaled."""
        if self._fixed_inv_sq is not None:
            return self._fixed_inv_sq
        return self.scale().square().reciprocal() if self.active else None

    def scaler_unscaled(self) -> bool | None:
        """With a scaler: whether ``scaler.unscale_`` already ran on every optimizer this step.

        None without an enabled scaler (a fixed scale's division is the user's own, so whether
        it happened is not known here).
        """
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        # GradScaler keeps no public record of this; its per-optimizer stage is the record
        states = scaler_optimizer_states(self.scaler)
        return all(states.get(id(opt), {}).get("stage") is OptState.UNSCALED for opt in self.optimizers)
