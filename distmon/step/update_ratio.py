"""Per-layer update-to-weight ratio ||delta theta|| / ||theta||, on scheduled export steps only.

Updates that grow relative to the weights precede loss spikes. On a scheduled export step (every
``export_every``-th step, :meth:`distmon.step.exchange.Exchange.scheduled`: known before it begins,
unlike an export that ``export_interval_s`` adds, which therefore reports NaN ratios) the
parameters are copied (one fused copy into a buffer kept for the purpose) when the optimizer
step begins, and when it ends the copy becomes ``before - after`` in place: one fused pass
gives each layer's ``||delta||^2`` and, taken before the subtraction, ``||theta||^2``. Device
ops only. The buffer costs one copy of the parameters' memory, hence opt-in
(``update_ratio=True``); a step the optimizer did not take reads 0.
"""

from __future__ import annotations

import math

import torch

from ..compat import foreach_copy_, foreach_sub_
from .sums import LayerFold, Runs, sq_sums

__all__ = ["UpdateRatio"]


class UpdateRatio:
    """Takes the parameters' copy at a step's start and writes ``n_layers`` ratios at its end.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> ur = UpdateRatio([w], layer_of=[0], n_layers=1, device=torch.device("cpu"))
        >>> ur.begin()
        >>> with torch.no_grad():
        ...     _ = w.sub_(0.5)   # the optimizer's update
        >>> out = torch.empty(1); ur.end(out); round(float(out[0]), 3)   # |0.5 * 1| / |1|
        0.5
    """

    def __init__(
        self, params: list[torch.nn.Parameter], *, layer_of: list[int], n_layers: int, device: torch.device
    ):
        self.params = params
        self._copy = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        self._runs = Runs(tuple(layer_of), seq=0, device=device)
        self._fold = LayerFold(n_layers, device)
        self._weight_sq = torch.zeros(n_layers, dtype=torch.float32, device=device)
        self.taken = False  # the copy of the step in progress was taken

    def begin(self) -> None:
        """The step begins: copy the parameters, and their per-layer sums of squares."""
        with torch.no_grad():
            foreach_copy_(self._copy, [p.detach() for p in self.params])
        self._fold([(self._runs, sq_sums(self._copy))], self._weight_sq)
        self.taken = True

    def end(self, out: torch.Tensor) -> None:
        """The step ended: ``out[l] = ||before_l - after_l|| / ||before_l||`` (NaN if not begun)."""
        if not self.taken:
            out.fill_(math.nan)
            return
        self.taken = False
        with torch.no_grad():
            foreach_sub_(self._copy, [p.detach() for p in self.params])
        self._fold([(self._runs, sq_sums(self._copy))], out)
        out.div_(self._weight_sq).sqrt_()
