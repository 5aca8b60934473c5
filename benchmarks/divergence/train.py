"""One reproduction run: train a :class:`TinyGPT` on stdlib bytes and record every candidate signal.

AdamW (beta1 0.9, beta2 0.95, eps 1e-8), linear warm-up then constant or cosine, gradient
clipping at 1.0, fixed seeds for the weights and the batches; one CPU thread. Optionally
distmon's ``GradMonitor`` (one process, ``detect=True``) watches the same run, so its explosion
detector is judged on exactly the steps the recorder saw. A run stops ``tail`` steps after
it diverged (:mod:`.divergence`) or at a non-finite loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .data import Batches
from .divergence import divergence_step
from .model import ModelConfig, TinyGPT
from .recorder import ConsecutiveCosine, Recorder, UpdateRatios, layer_grad_norms


@dataclass(frozen=True)
class RunSpec:
    """Everything that decides a run; ``name`` keys its cached recording."""

    lr: float
    seed: int = 0
    steps: int = 1500
    warmup: int = 1000
    schedule: str = "constant"  # or "cosine" (to 10% of lr)
    batch: int = 16
    weight_decay: float = 0.0
    clip: float = 1.0
    model: ModelConfig = field(default_factory=ModelConfig)
    tail: int = 40

    @property
    def name(self) -> str:
        m = self.model
        tags = ("qkln-" if m.qk_layernorm else "") + (f"z{m.z_loss:g}-" if m.z_loss else "")
        return (
            f"{tags}d{m.d_model}L{m.n_layers}-lr{self.lr:g}-wu{self.warmup}-{self.schedule}"
            f"-wd{self.weight_decay:g}-b{self.batch}-s{self.seed}"
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "cosine":
            frac = (step - self.warmup) / max(1, self.steps - self.warmup)
            return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        return self.lr


def train(
    spec: RunSpec,
    *,
    record_every: int = 5,
    distmon_watch: bool = True,
    probe: Callable[[torch.optim.Optimizer, torch.nn.Module], None] | None = None,
) -> dict[str, object]:
    """Run ``spec``; return the recording: arrays per signal, names, divergence step, distmon events.
    ``probe(optimizer, model)`` runs after each backward, before clipping (the gradients as
    computed); ``model(x, y)[1]`` is the training loss of a batch."""
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    model = TinyGPT(spec.model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data = Batches(seq_len=spec.model.seq_len, batch=spec.batch, seed=1000 + spec.seed)
    rec = Recorder(model, every=record_every)
    ratios = UpdateRatios(model, rec.layers)
    cosine = ConsecutiveCosine(model, window=10)  # the pairs of a 10-step sampling interval
    events: list[dict[str, object]] = []
    mon = None
    if distmon_watch:
        import distmon

        mon = distmon.GradMonitor(model, opt, serve="none", detect=True, export_every=10)

        @mon.on_anomaly
        def _note(event, snap) -> None:  # noqa: ANN001
            events.append(
                {
                    "kind": event.kind,
                    "step": int(event.step),
                    "layer": event.layer,
                    "value": float(event.value),
                    "threshold": float(event.threshold),
                }
            )

    losses: list[float] = []
    gnorms: list[float] = []
    diverged = None
    t0 = time.perf_counter()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = spec.lr_at(step)
        x, y = data.next()
        recorded = rec.begin(step)
        _, loss, ce = model(x, y)
        loss.backward()
        if probe is not None:
            probe(opt, model)
        extra: dict[str, np.ndarray] = {}
        if recorded:
            extra["layer_grad_norm"] = layer_grad_norms(model, rec.layers)
            ratios.begin()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        cosine.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(ce))
        gnorms.append(float(gnorm))
        if recorded:
            extra["update_ratio"] = ratios.end()
            extra["grad_norm"] = np.asarray([gnorms[-1]], np.float32)
            extra["grad_cos"] = np.asarray([cosine.mean()], np.float32)
            extra["loss"] = np.asarray([losses[-1]], np.float32)
            rec.end(extra)
        if diverged is None and (step % 10 == 0 or not math.isfinite(losses[-1])):
            diverged = divergence_step(losses)
        if not math.isfinite(losses[-1]) or (diverged is not None and step >= diverged + spec.tail):
            break
    seconds = time.perf_counter() - t0
    if mon is not None:
        mon.close()
    rec.remove()
    return {
        "spec": spec.as_dict(),
        "name": spec.name,
        "arrays": rec.arrays(),
        "loss": np.asarray(losses, np.float32),
        "grad_norm": np.asarray(gnorms, np.float32),
        "linears": rec.linears,
        "layers": rec.layers,
        "blocks": rec.blocks,
        "diverged": diverged,
        "steps_run": len(losses),
        "seconds": seconds,
        "distmon_events": events,
    }
