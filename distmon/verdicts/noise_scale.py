"""The gradient noise scale, B_simple (McCandlish et al. 2018), from figures distmon already has.

Every step distmon holds each rank's local sum of squares (a small batch, ``b`` examples)
and the reduced one (the big batch, ``B = ranks x b``). With ``|G_s|^2`` the mean over ranks of
the local sums and ``|G_b|^2`` the reduced sum, the unbiased estimates are

    |G|^2  = (B |G_b|^2 - b |G_s|^2) / (B - b)
    tr(S)  = (|G_s|^2 - |G_b|^2) / (1/b - 1/B)

and ``B_simple = EMA(tr S) / EMA(|G|^2)``: single-step estimates are noisy and often negative,
so their ratio is useless; each term is averaged (bias-corrected EMAs, kept apart and exported
too) and only the averages are divided. Global and per layer (per layer needs the rank x
layer sums, ``rank_layers=True``). Device ops over a batch of rows at export time: no host
sync, no extra collective. The reduced gradient must be the *mean* of the ranks' local ones
(DDP's and FSDP2's default); steps whose ranks report different batch sizes, or that are not
measured on every rank, are left out; the figures are NaN until ``1/alpha`` steps went in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..step.rows import Head, Job, Noise, RowPlan
from ..step.sums import ema_after
from .resume import load_tensors, save_tensors

__all__ = ["NoiseScale"]


class NoiseScale:
    """Running EMAs of ``tr(S)`` and ``|G|^2`` (global, then per layer) and their ratio per step.

    Writes, per row, ``[B_simple, EMA tr(S), EMA |G|^2, B_simple per layer..., EMA |G|^2 per
    layer...]`` into the row's noise columns (NaN where not yet meaningful). Both estimates are
    linear in the sums of squares, and so are the EMAs: the layers' terms add up to the global
    ones (sum of EMA |G_l|^2 = EMA |G|^2, sum of B_l * EMA |G_l|^2 = EMA tr(S)).

    Example:
        >>> plan = RowPlan.build(n_layers=2, world=2, batch=True)
        >>> ns = NoiseScale(plan, alpha=0.5, device=torch.device("cpu"))
        >>> plan.step.noise.stop - plan.step.noise.start   # 3 global figures, 2 per layer
        7
    """

    def __init__(self, plan: RowPlan, *, alpha: float, device: torch.device):
        self.step_row = plan.step
        self.n = plan.step.n_layers + 1  # global, then layers
        self.world = plan.step.world
        self.alpha = alpha
        self.tr = torch.zeros(self.n, dtype=torch.float32, device=device)
        self.g2 = torch.zeros(self.n, dtype=torch.float32, device=device)
        self.count = torch.zeros(self.n, dtype=torch.float32, device=device)
        self.min_count = math.ceil(1 / alpha)

    def state_dict(self) -> dict[str, list]:
        """The EMAs and their counts, as plain lists (``distmon.verdicts.resume``)."""
        return save_tensors(self, ("tr", "g2", "count"))

    def load_state_dict(self, state: Mapping[str, list]) -> None:
        load_tensors(self, state, ("tr", "g2", "count"), "noise")

    def update(self, rows: torch.Tensor) -> None:
        """Fold a run of finished rows (in step order) in; write their noise columns."""
        w, step_row = self.world, self.step_row
        big = rows[:, step_row.total_and_layers].double()  # reduced: total, then layers
        job = rows[:, step_row.job].double()  # the ranks' mean local sums: total, then layers
        small = torch.cat([job[:, Job.MEAN_SQ : Job.MEAN_SQ + 1], job[:, len(Job) :]], 1)
        bs = job[:, Job.BATCH : Job.BATCH + 1]  # NaN unless every rank had the same batch
        ok = (
            (rows[:, Head.VALID] == 1.0)
            & (job[:, Job.MEASURED] == w)  # every rank's local figures are in the mean
            & (bs[:, 0] > 0)
        )
        bb = bs * w
        g2 = (bb * big - bs * small) / (bb - bs)
        tr = (small - big) / (1 / bs - 1 / bb)
        mask = ok[:, None] & torch.isfinite(g2) & torch.isfinite(tr)
        a = self.alpha
        tr_ema = ema_after(self.tr.double(), tr, mask, a)
        g2_ema = ema_after(self.g2.double(), g2, mask, a)
        count = self.count + mask.float().cumsum(0)
        self.tr.copy_(tr_ema[-1])
        self.g2.copy_(g2_ema[-1])
        self.count.copy_(count[-1])
        correction = 1 - (1 - a) ** count.double()  # the EMAs start at 0: bias-corrected
        meaningful = (count >= self.min_count) & (g2_ema > 0)
        tr_c = torch.where(meaningful, tr_ema / correction, math.nan)
        g2_c = torch.where(meaningful, g2_ema / correction, math.nan)
        gns = tr_c / g2_c
        out = rows[:, step_row.noise]
        out[:, Noise.SCALE] = gns[:, 0].float()
        out[:, Noise.TRACE] = tr_c[:, 0].float()
        out[:, Noise.SIGNAL] = g2_c[:, 0].float()
        n, k = self.n - 1, len(Noise)
        out[:, k : k + n] = gns[:, 1:].float()
        out[:, k + n :] = g2_c[:, 1:].float()
