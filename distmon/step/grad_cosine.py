"""The cosine between consecutive optimizer steps' gradients: what the precursor's oscillation rule reads.

A learning rate at the edge of what the loss's curvature allows makes the iterate overshoot the
valley's floor along the sharpest direction, so that the next gradient points back: consecutive
gradients turn anti-aligned (their cosine negative). Adam trains stably there at a constant rate
(the "edge of stability", Cohen et al. 2022, arXiv 2207.14484); a warm-up that still raises the
rate takes it past the edge, and the run diverges (``benchmarks/early_warning.py``).

When each optimizer step begins, the gradients as the optimizer sees them are copied into one
flat buffer per dtype (allocated once: no step allocates gradient-sized memory), and one pass gives
their dot product with the previous step's copy and their squared norm; the two buffers then
swap roles. The pair's cosine is added to an interval sum on the device; a pair with a
non-finite or zero gradient (a step the loss scaler skips) is left out. :meth:`take` gives the
interval's ``1 - mean cosine`` (NaN: no pair measured) and starts the next interval;
:meth:`sample` writes it into a sampled step's row with the rate headroom (``peak_lr`` over the
learning rate now while the rate still rises, 0 once it fell from its highest:
:class:`~distmon.step.rows.Oscillation`). Device ops only, no host sync.
The buffers cost two copies of the gradient's memory, hence opt-in
(``PrecursorConfig(peak_lr=...)``), and they need every rank to hold the whole gradient (one
process, DDP): sharded layouts are refused at construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .rows import Oscillation

__all__ = ["GradientCosine"]


class GradientCosine:
    """Consecutive steps' gradient cosines of ``params``, summed over a sampling interval.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> cos = GradientCosine([w], torch.device("cpu"))
        >>> for g in ([1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]):
        ...     w.grad = torch.tensor(g); cos.step()
        >>> float(cos.take())   # the pairs' cosines -1 and 0: 1 - mean = 1.5
        1.5
        >>> float(cos.take())   # no pair since: not measured
        nan
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        device: torch.device,
        *,
        peak_lr: float = 1.0,
        rate: Callable[[], float | torch.Tensor] = lambda: 1.0,
    ) -> None:
        self.peak_lr, self.rate = peak_lr, rate  # the schedule's highest rate, and the rate now
        self._top: float | torch.Tensor | None = None  # the highest rate a sample read
        groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            # fp16's range cannot hold a gradient's squared norm: its copies are kept in fp32
            groups.setdefault(torch.float32 if p.dtype == torch.float16 else p.dtype, []).append(p)
        self._groups = list(groups.values())
        # two flat buffers per dtype: this step's gradients and the previous step's
        self._now = [
            torch.zeros(sum(p.numel() for p in g), dtype=dtype, device=device) for dtype, g in groups.items()
        ]
        self._prev = [torch.zeros_like(b) for b in self._now]
        f32 = dict(dtype=torch.float32, device=device)
        self._prev_norm = torch.zeros((), **f32)  # |previous gradient| (0: none yet)
        self._sum = torch.zeros((), **f32)  # the interval's cosines
        self._pairs = torch.zeros((), **f32)  # and how many pairs were measured

    def step(self) -> None:
        """Read this step's gradients (when the optimizer step begins: after any clipping; the
        cosine does not change with a gradient's scale)."""
        dot = torch.zeros((), dtype=torch.float32, device=self._sum.device)
        sq = torch.zeros_like(dot)
        with torch.no_grad():
            for group, now, prev in zip(self._groups, self._now, self._prev):
                # a parameter without a gradient this step reads as zeros
                torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group],
                    out=now,
                )
                dot += torch.dot(now, prev).float()
                # its own norm, not the step row's: .grad may be clipped, the row's is the gradient's
                sq += torch.dot(now, now).float()
            norm = torch.sqrt(sq)
            cos = dot / (norm * self._prev_norm)  # the norms apart: their squares' product underflows sooner
            ok = torch.isfinite(cos)  # 0/0 (no previous, a zero gradient), a non-finite gradient
            self._sum += torch.where(ok, cos, 0.0)
            self._pairs += ok.float()
            self._prev_norm.copy_(torch.where(torch.isfinite(norm), norm, 0.0))
        self._now, self._prev = self._prev, self._now

    def take(self) -> torch.Tensor:
        """``1 - `` the mean cosine of the pairs since the last call (NaN: none measured), on the
        device; starts the next interval."""
        out = 1.0 - self._sum / self._pairs  # 0/0 when no pair was measured
        self._sum.zero_()
        self._pairs.zero_()
        return out

    def sample(self, out: torch.Tensor) -> None:
        """A sampled step: ``out`` (the :class:`~distmon.step.rows.Oscillation` columns) takes the
        interval's ``1 - mean cosine`` and the rate headroom; the next interval starts."""
        out[Oscillation.ONE_MINUS_COS] = self.take()
        out[Oscillation.HEADROOM] = self._headroom(self.rate())

    def _headroom(self, lr: float | torch.Tensor) -> float | torch.Tensor:
        """``peak_lr / lr`` while the rate is still rising (not below the highest it reached at a
        sample; a rate of 0 rises to anything); 0 once it fell: past its peak the schedule will not
        raise it again, however far below ``peak_lr`` a decay takes it."""
        if isinstance(lr, torch.Tensor):  # a capturable optimizer's rate, on the device: no sync
            if self._top is None:
                self._top = lr.detach().clone()
            else:
                torch.maximum(self._top, lr, out=self._top)  # in place: no new tensor per sample
            return torch.where(lr >= self._top, self.peak_lr / lr, 0.0)
        self._top = lr if self._top is None else max(self._top, lr)
        if lr < self._top:
            return 0.0
        return self.peak_lr / lr if lr > 0 else math.inf

    def reset(self) -> None:
        """Forget the previous gradient (a step whose figures were dropped): the next pair starts afresh."""
        self._prev_norm.zero_()
