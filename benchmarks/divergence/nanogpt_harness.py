"""What ``nanogpt_trial.py`` adds to nanoGPT's ``train.py`` besides the user's distmon lines.

Imported by the patched ``train.py`` (``from benchmarks.divergence import nanogpt_harness as
_trial``), in both twins of a run, the bare one and the monitored one:

- :func:`seed`: the run's seed offset (``NANOGPT_TRIAL_SEED``; nanoGPT seeds ``1337`` and has no
  option for it), added to ``torch.manual_seed(1337 + seed_offset)``;
- :func:`record`: each iteration's training loss (``lossf``, the float train.py prints), at full
  precision; it says when to stop: ``TAIL`` iterations after the divergence step of
  :func:`benchmarks.divergence.divergence.divergence_step` (the early-warning benchmark's
  definition, from the loss alone), so a diverged run does not go on to ``max_iters``;
- :func:`probe` (the bare twin only): read-only forward hooks, independent of distmon, on the
  forward of every iteration distmon samples (``iter % 10 == 9``: distmon's step ``iter + 1``):
  per attention block the bound ``max|q| max|k| / sqrt(d_head)`` and the largest ``|q . k| /
  sqrt(d_head)`` over causal pairs, from ``c_attn``'s output; from ``lm_head``'s output the largest
  logit magnitude and the mean and largest ``log Z`` (log-sum-exp over the vocabulary);
- at exit, all of it as JSON to ``NANOGPT_TRIAL_OUT``.

Nothing here changes what the training computes: the hooks read detached outputs under
``no_grad`` and return nothing; the stop rule ends the loop with ``break`` (train.py then runs
what follows its loop: the user's ``mon.close()``).
"""

from __future__ import annotations

import atexit
import json
import math
import os

import torch

from benchmarks.divergence.divergence import divergence_step

EVERY = 10  # distmon's PrecursorConfig().every: the probe reads the same forwards
TAIL = 40  # iterations run past the divergence step (its window looks 20 ahead)

_loss: list[float] = []
_rows: list[dict[str, object]] = []
_state: dict[str, object] = {"stopped_at_divergence": None}


class _Probe:
    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self.row: dict[str, object] = {}
        self.blocks = []
        for name, m in model.named_modules():
            if hasattr(m, "c_attn") and hasattr(m, "n_head"):
                self.blocks.append(name)
                m.c_attn.register_forward_hook(self._attention(len(self.blocks) - 1, m.n_head))
        model.lm_head.register_forward_hook(self._head)

    def _attention(self, index: int, n_head: int):  # noqa: ANN202
        @torch.no_grad()
        def hook(module, inputs, output):  # noqa: ANN001, ANN202
            if not self.active:
                return
            x = output.detach().float()
            B, T, C3 = x.shape
            C = C3 // 3
            hs = C // n_head
            q = x[..., :C].view(B, T, n_head, hs).transpose(1, 2)
            k = x[..., C : 2 * C].view(B, T, n_head, hs).transpose(1, 2)
            bound = q.norm(dim=-1).amax() * k.norm(dim=-1).amax() / math.sqrt(hs)
            att = (q @ k.transpose(-2, -1)).abs() / math.sqrt(hs)
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            logit = att.masked_fill(~causal, 0.0).amax()
            self.row.setdefault("attn_bound", [math.nan] * len(self.blocks))[index] = bound.item()
            self.row.setdefault("attn_logit_max", [math.nan] * len(self.blocks))[index] = logit.item()

        return hook

    @torch.no_grad()
    def _head(self, module, inputs, output):  # noqa: ANN001, ANN202
        if not self.active:
            return
        z = output.detach().float()
        logz = torch.logsumexp(z, dim=-1)
        self.row["out_logit_absmax"] = z.abs().amax().item()
        self.row["log_z_mean"] = logz.mean().item()
        self.row["log_z_max"] = logz.amax().item()

    def next_iter(self, it: int) -> None:
        self.active = it % EVERY == EVERY - 1


_probe: _Probe | None = None


def seed() -> int:
    return int(os.environ.get("NANOGPT_TRIAL_SEED", "0"))


def probe(model: torch.nn.Module) -> None:
    global _probe
    _probe = _Probe(model)


def record(it: int, loss: float) -> bool:
    """Note iteration ``it``'s loss; True when the run should stop (``TAIL`` past its divergence)."""
    if len(_loss) != it:
        raise RuntimeError(f"nanogpt trial: iteration {it} after {len(_loss)} recorded (log_interval=1?)")
    _loss.append(float(loss))
    if _probe is not None:
        if _probe.active:
            _rows.append({"iter": it, **_probe.row})
            _probe.row = {}
        _probe.next_iter(it + 1)
    d = divergence_step(_loss)
    if d is not None and len(_loss) >= d + TAIL:
        _state["stopped_at_divergence"] = d
        return True
    return False


@atexit.register
def _save() -> None:
    out = os.environ.get("NANOGPT_TRIAL_OUT")
    if not out:
        return
    import sys

    distmon = sys.modules.get("distmon")
    doc = {
        "loss": _loss,
        "probe_blocks": _probe.blocks if _probe is not None else [],
        "probe": _rows,
        "distmon_file": getattr(distmon, "__file__", None),
        **_state,
    }
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out + ".tmp", out)
