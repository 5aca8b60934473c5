"""The monitor's one collective per step: every rank's packed local figures, all-gathered.

Reduced gradients are identical on every rank, so global norms need no collective; only the
per-rank (pre-reduction) figures do. They travel in ONE small tensor per step, issued on DDP's
own process group right after DDP's last bucket, on every rank, whatever happened locally
(a collective issued on some ranks only would hang the job).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import norms

__all__ = ["RankGather", "RANK_FIELDS"]

# per-rank fields after the optional per-layer sums
RANK_FIELDS = ("total_sq", "first_nonfinite", "errors", "valid")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup]) -> dist.Work:
    # looked up at call time: all_gather_single is the newer name of all_gather_into_tensor
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


class RankGather:
    """Packs this rank's local figures and all-gathers them into a caller-given flat view.

    Per rank, ``width`` floats: the per-layer local sums of squares (when ``rank_layers``), then
    :data:`RANK_FIELDS`.
    """

    def __init__(self, n_layers: int, rank_layers: bool, group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        self.n_layer_cols = n_layers if rank_layers else 0
        self.width = self.n_layer_cols + len(RANK_FIELDS)
        self.group = group
        self.layer_sq = torch.zeros(n_layers, dtype=torch.float32, device=device)
        self.send = torch.zeros(self.width, dtype=torch.float32, device=device)
        base = self.n_layer_cols
        self._total = self.send[base:base + 1]
        self._first_bad = self.send[base + 1]
        self._errors = self.send[base + 2]
        self._valid = self.send[base + 3]
        self._work: Optional[dist.Work] = None

    def pack(self, local_sq: torch.Tensor, param_layer: torch.Tensor, layer_order: torch.Tensor,
             errors: int, valid: bool) -> None:
        """Fold per-parameter local sums into layers and fill the send buffer (device ops only)."""
        norms.fold_layers(local_sq, param_layer, self.layer_sq)
        if self.n_layer_cols:
            self.send[: self.n_layer_cols].copy_(self.layer_sq)
        torch.sum(self.layer_sq, 0, keepdim=True, out=self._total)
        norms.first_nonfinite(self.layer_sq, layer_order, self._first_bad)
        self._errors.fill_(errors)
        self._valid.fill_(1.0 if valid else 0.0)

    def invalidate(self, errors: int) -> None:
        """Send a row that says "no figures from this rank this step" (after a local failure)."""
        self.send.zero_()
        self._first_bad.fill_(-1.0)
        self._errors.fill_(errors)

    def issue(self, out: torch.Tensor) -> None:
        """Start the all-gather into ``out`` (world x width floats, flat); waits any earlier one."""
        self.wait()
        self._work = _all_gather(out, self.send, self.group)

    def wait(self) -> bool:
        """Complete the pending gather (a stream wait on NCCL); True if there was one."""
        work, self._work = self._work, None
        if work is None:
            return False
        work.wait()
        return True
