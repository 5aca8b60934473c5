"""The Lightning runs that tests/test_framework_lightning.py checks, on the example's own code.

    python -m torch.distributed.run --nproc-per-node 2 tests/jobs/lightning_job.py OUT   # 2 ranks
    python tests/jobs/lightning_job.py OUT                                                # 1 process

Every case fits launch/examples/lightning_example.py's model with its ``train()``, once with
``DistmonCallback`` and once as the plain script (no callback at all), and compares the final
parameters (``torch.equal``). References come from Lightning's hooks, never from distmon:

* ``on_train_batch_start``: an unwrapped twin of the module (this rank's parameters) runs
  backward on this rank's batch: this rank's local gradient, before any reduction;
* ``on_after_backward``: the gradients the strategy left in ``p.grad`` (DDP: reduced, FSDP2:
  the reduced shards, gathered), before Lightning's or the user's clipping;
* ``on_train_batch_end``: the norm the model logged (Lightning's ``grad_norm``).

All in float64 (``helpers.reference_norms``). Each rank writes ``OUT/rank{r}.json``; rank 0's
distmon writes ``OUT/{case}.jsonl`` and its metrics, scraped over HTTP before the monitor
closes, go to ``OUT/{case}.metrics.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "launch" / "examples"), str(ROOT / "tests")]  # this checkout's distmon
import lightning_example as example  # noqa: E402
from helpers import reference_norms, scrape_metrics, whole  # noqa: E402

from distmon.integrations.lightning import DistmonCallback  # noqa: E402

NAN_STEP = 4  # the step at which rank 1's batch holds a NaN (case "nan")
# case: (distmon's guard, train()'s arguments); on 2 ranks, and "single" in one process
CASES = {
    "auto": (None, {}),
    "auto_guard": ("skip", {}),
    "manual": ("skip", {"manual": True}),
    "fsdp2": ("skip", {"fsdp2": True}),
}
SINGLE = {"single": (None, {})}
Batch = tuple[torch.Tensor, torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _norms(named_grads: list[tuple[str, torch.Tensor | None]]) -> dict[str, object]:
    total, layers = reference_norms(named_grads)
    return {"total": total, "layers": layers}


class GradsFromHooks(L.Callback):
    """Each step's float64 figures (``helpers.reference_norms``), read in Lightning's hooks (see the
    module docstring)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, object]] = []
        self.unchanged: list[bool] = []  # per step: the parameters equal those of the step before
        self._twin: L.LightningModule | None = None
        self._before: list[torch.Tensor] | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Batch, batch_idx: int
    ) -> None:
        if self._twin is None:
            self._twin = type(pl_module)()
        params = [_local(p).detach().clone() for p in pl_module.parameters()]
        if self._before is not None:
            self.unchanged.append(all(map(torch.equal, params, self._before)))
        self._before = params
        full = {k: whole(v) for k, v in pl_module.state_dict().items()}
        self._twin.load_state_dict(full)
        self._twin.zero_grad(set_to_none=True)
        self._twin.loss(batch).backward()
        self.steps.append({"local": _norms([(n, p.grad) for n, p in self._twin.named_parameters()])})

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        grads = [(n, whole(p.grad)) for n, p in pl_module.named_parameters()]
        self.steps[-1]["reduced"] = _norms(grads)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.steps[-1]["logged"] = float(trainer.callback_metrics["grad_norm"])


class NanOnRank(L.Callback):
    """Puts a NaN into one input of ``rank``'s batch at ``step`` (before GradsFromHooks sees it)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Batch, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and batch_idx + 1 == self.step:
            batch[0][0, 0] = float("nan")


class ScrapeAtEnd(L.Callback):
    """When training ends, before the monitor closes (``on_fit_end``): flush, then scrape rank 0."""

    def __init__(self, monitor: DistmonCallback, path: Path) -> None:
        self.monitor, self.path = monitor, path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mon = self.monitor.monitor
        mon.flush()  # every rank: its node's figures of the last steps arrive in the export's gather
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(scrape_metrics(mon.port)))


def monitored(name: str, out: Path, guard: str | None, nan: bool = False, **train: bool) -> dict[str, object]:
    """Fit with DistmonCallback and the references; the figures and the final parameters."""
    cb = DistmonCallback(guard=guard, port=0, linger_s=0, log_path=str(out / f"{name}.jsonl"))
    ref = GradsFromHooks()
    callbacks = [NanOnRank(NAN_STEP, rank=1)] if nan else []
    callbacks += [cb, ref, ScrapeAtEnd(cb, out / f"{name}.metrics.json")]
    model = example.train(callbacks=callbacks, **train)
    params = [_local(p).detach().clone() for p in model.parameters()]
    return {
        "steps": ref.steps,
        "unchanged": ref.unchanged,
        "finite": all(bool(p.isfinite().all()) for p in params),
        "params": params,
    }


def main() -> None:
    out = Path(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for name, (guard, train) in (CASES if world > 1 else SINGLE).items():
        run = monitored(name, out, guard, **train)
        plain = [_local(p).detach() for p in example.train(**train).parameters()]
        run["identical"] = len(plain) == len(run["params"]) and all(map(torch.equal, plain, run["params"]))
        results[name] = run
    if world > 1:
        results["nan"] = monitored("nan", out, "skip", nan=True)
    for run in results.values():
        del run["params"]
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
