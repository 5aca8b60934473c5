"""``clip_grad_norm_`` with the global norm the monitor already measured: no pass over the gradients.

The loss scale is the one thing distmon cannot see in the gradients, so the first finite norm
is checked once against a direct one (one pass, one host sync): a scale applied by hand and not
passed in would make every clip wrong by that factor, and raises instead. The direct norm is the
placement-aware one of :mod:`distmon.layout.verify` (DTensor meshes one at a time, pipeline stages
summed, as torchtitan's ``clip_grad_norm_``): ``torch.nn.utils.get_total_norm`` fails on gradients
of several meshes and sees one stage only. A step distmon did not measure is clipped by that
direct norm too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..layout.verify import DirectNorm, agrees
from .loss_scale import LossScale
from .schedule import StepSchedule

__all__ = ["Clipper"]


class Clipper:
    """Clips the monitored parameters' gradients by the step's measured global norm.

    Example:
        >>> clip = Clipper(schedule, params=params, loss_scale=loss_scale, direct=direct)  # doctest: +SKIP
        >>> norm = clip(1.0)                                                 # doctest: +SKIP
    """

    def __init__(
        self,
        schedule: StepSchedule,
        *,
        params: Sequence[torch.nn.Parameter],
        loss_scale: LossScale,
        direct: DirectNorm,
    ) -> None:
        self.schedule, self.params, self.loss_scale, self.direct = schedule, list(params), loss_scale, direct
        self.checked = False  # the first finite norm was compared with a direct one
        self.fixed_scale_in_grads: bool | None = None  # loss_scale=: did the user unscale by clip time?

    def __call__(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s result and effect, by the norm already measured."""
        refusal = getattr(self.schedule.source, "CLIP_REFUSAL", None)  # a source that clips itself
        if refusal is not None:
            raise RuntimeError(f"distmon: {refusal}")
        if not (
            isinstance(max_norm, torch.Tensor)
            and max_norm.numel() == 1
            or isinstance(max_norm, (int, float))
            and not isinstance(max_norm, bool)
            and max_norm > 0
        ):
            raise ValueError(
                f"distmon: max_norm must be a positive number (or a 1-element tensor), got {max_norm!r}"
            )
        if float(norm_type) != 2.0:
            raise ValueError(
                f"distmon: clip_grad_norm_ clips by the L2 norm distmon measures; norm_type "
                f"{norm_type!r} needs torch.nn.utils.clip_grad_norm_"
            )
        schedule = self.schedule
        sq = schedule.finish_total_sq()  # in gradient units: the loss scale divided out
        if not schedule.finish_row_valid():  # not measured (the same on every rank): measured directly
            device = sq.device
            total = torch.tensor(math.sqrt(self.direct()), dtype=torch.float32, device=device)
        else:
            total = sq.sqrt()
            if self._grads_scaled():
                total = total * self.loss_scale.scale()  # the gradients as they are now: still scaled
            if not self.checked and not self._check(total):
                total = total * self.loss_scale.scale()  # learned now: the scale is still in the gradients
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        for params in self._by_mesh():  # DTensor ops take one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    def _by_mesh(self) -> list[list[torch.nn.Parameter]]:
        """The parameters with a gradient, grouped by the device mesh of their gradient (plain
        gradients together): a tensor-parallel layer's and an FSDP unit's meshes differ."""
        groups: dict[int, list[torch.nn.Parameter]] = {}
        for p in self.params:
            if p.grad is not None:
                mesh = getattr(p.grad, "device_mesh", None)
                groups.setdefault(id(mesh), []).append(p)
        return list(groups.values())

    def _grads_scaled(self) -> bool:
        """Whether the gradients are still multiplied by the loss scale now."""
        unscaled = self.loss_scale.scaler_unscaled()
        if unscaled is not None:
            return not unscaled
        return bool(self.fixed_scale_in_grads)

    def _check(self, total: torch.Tensor) -> bool:
        """Compare the norm distmon would clip by with a direct one, once (one pass, one host sync).

        With ``loss_scale=`` this also learns whether the user divides it out before clipping;
        returns False when it learned just now that ``total`` lacks the scale still in the
        gradients.
        """
        direct = math.sqrt(self.direct())
        measured = float(total)
        if not (math.isfinite(direct) and math.isfinite(measured)):
            return True  # an overflowed step says nothing: check the next one
        consistent = True
        fixed = self.loss_scale.fixed
        if fixed is not None and self.fixed_scale_in_grads is None:
            if agrees(measured, direct):
                self.fixed_scale_in_grads = False
            elif agrees(measured * fixed, direct):
                self.fixed_scale_in_grads = True
                measured *= fixed
                consistent = False
        if not agrees(measured, direct):
            told = (
                f"scaler= (scale {float(self.loss_scale.scale()):g})"
                if self.loss_scale.scaler is not None
                else f"loss_scale={fixed:g}"
                if fixed is not None
                else "no loss scale"
            )
            raise RuntimeError(
                f"distmon: clip_grad_norm_ refuses to clip: the gradients' norm is {direct:.6g} but "
                f"distmon's figure, with {told}, is {measured:.6g} (ratio {direct / measured:.6g}). "
                "The loss was scaled by a factor distmon was not told: pass GradMonitor(..., "
                "scaler=your_GradScaler) or loss_scale=S, or clip with torch.nn.utils.clip_grad_norm_."
            )
        self.checked = True
        return consistent
