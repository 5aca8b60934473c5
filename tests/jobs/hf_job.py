"""The rank side of tests/test_framework_hf.py: the example scripts, and float64 references beside them.

``python tests/jobs/hf_job.py OUT`` (one process) or under ``torchrun --nproc-per-node 2``
runs, in one process per rank, each configuration of each framework, as the examples in
``launch/examples/`` build them (a Hugging Face ``Trainer``; an accelerate loop):

- ``plain``: the example's ``main(["--no-distmon"])``: the script without distmon;
- ``monitored``: the example's ``main()``: the script as written, with distmon;
- ``measured``: the example's objects with distmon serving on a free port and logging every
  step (``log_path``), and the references below; after the last step every rank flushes and
  rank 0 scrapes its ``/metrics`` (a real HTTP scrape);
- ``nan`` (2+ ranks): ``guard="skip"``, and a NaN put into one element of :data:`NAN_LAYER`'s
  local gradient on rank 1 in step :data:`NAN_STEP` (a tensor hook, as ``launch/train.py
  --nan-step`` does).

References, taken from the framework and autograd, never from distmon (:class:`GradsAtClip`):

- the reduced gradient before clipping: ``accelerator.clip_grad_norm_`` (what the Trainer's
  ``max_grad_norm`` and the accelerate example call) is wrapped on the instance; the wrapper
  copies every ``p.grad`` to float64, calls the original, and keeps the norm of the gradient
  it left (clipped). The framework's own pre-clip norm is what it reports: the Trainer's
  logged ``grad_norm``, the accelerate example's list of ``clip_grad_norm_`` values. In
  transformers 5.23 ``on_pre_optimizer_step`` runs after the clipping, so a callback cannot
  see the pre-clip gradient;
- each rank's local gradient (what it computed, before DDP averages it): a tensor hook on every
  parameter adds each micro-batch's gradient into a float64 sum, read and reset by the clip
  wrapper. ``local`` vectors are saved so the test can check that their mean over the ranks is
  the reduced gradient, which validates the method.

Each rank saves ``OUT/{framework}-rank{r}.pt`` (a dict per configuration); rank 0 also writes
each logged configuration's JSONL to ``OUT/{framework}-{config}.jsonl``.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "launch", "examples"), TESTS_DIR]

import accelerate_example  # noqa: E402
import hf_trainer_example  # noqa: E402
from ddp_harness import leave  # noqa: E402
from helpers import LocalGrads, as_float64, flat, layer_of, scrape_metrics  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import distmon  # noqa: E402
from distmon.integrations.transformers import DistmonCallback  # noqa: E402

STEPS = 10
ACCUMULATION = 2  # micro-batches per optimizer step, in both examples
BATCH = 8  # sequences (samples) per rank per optimizer step, in both examples
NAN_STEP = 4
NAN_RANK = 1
NAN_LAYER = {"hf": "transformer.h.1.mlp.c_fc", "accelerate": "encoder.0"}
MAX_GRAD_NORM = {"hf": hf_trainer_example.MAX_GRAD_NORM, "accelerate": accelerate_example.MAX_GRAD_NORM}


class GradsAtClip:
    """Float64 gradients of every optimizer step, read where the framework clips (its
    ``clip_grad_norm_`` wrapped on the instance) and from autograd (``helpers.LocalGrads``).

    ``steps[i]``: ``reduced`` and ``local`` (float64 vectors in model order), ``post_clip``
    (float64 norm of the clipped gradient), ``params_before`` (the parameters before that step's
    update) and ``micro_batches`` (backwards in the step).
    """

    def __init__(self, module: torch.nn.Module, accelerator: object, inject: tuple[str, int] | None = None):
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        self.steps: list[dict[str, object]] = []
        for name, p in module.named_parameters():
            if inject is not None and layer_of(name) == inject[0]:
                p.register_hook(functools.partial(self._nan, name, inject[1]))
        self.local = LocalGrads(module.named_parameters())  # its hooks run after _nan
        self._backwards = 0  # of the first parameter, before this step
        self._clip = accelerator.clip_grad_norm_
        accelerator.clip_grad_norm_ = self.clip_grad_norm_

    def _nan(self, name: str, step: int, grad: torch.Tensor) -> torch.Tensor | None:
        # this parameter's backward count so far (before LocalGrads counts this one) -> optimizer step
        if self.local.backwards.get(name, 0) // ACCUMULATION + 1 != step:
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def _vector(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([grads[name].reshape(-1) for name in self.names])

    def clip_grad_norm_(self, parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        grads = {n: as_float64(p.grad).clone() for n, p in self.module.named_parameters()}
        params_before = flat(self.module.parameters())
        norm = self._clip(parameters, max_norm, *args, **kwargs)
        post = flat(p.grad for p in self.module.parameters())
        backwards = self.local.backwards.get(self.names[0], 0)
        self.steps.append(
            {
                "reduced": self._vector(grads),
                "local": self._vector(self.local.take()),
                "post_clip": float(post.norm()),
                "params_before": params_before,
                "micro_batches": backwards - self._backwards,
            }
        )
        self._backwards = backwards
        return norm

    def layers(self) -> list[tuple[str, int, int]]:
        """(layer, start, stop) slices of the vectors, in model order."""
        out: list[tuple[str, int, int]] = []
        start = 0
        for name, p in self.module.named_parameters():
            stop = start + p.numel()
            if out and out[-1][0] == layer_of(name):
                out[-1] = (out[-1][0], out[-1][1], stop)
            else:
                out.append((layer_of(name), start, stop))
            start = stop
        return out

    def result(self) -> dict[str, object]:
        return {"steps": self.steps, "layers": self.layers()}


def scrape_after_flush(monitor: distmon.GradMonitor) -> list | None:
    """Every rank exports its finished steps now; rank 0 then scrapes its endpoint."""
    monitor.flush()
    return scrape_metrics(monitor.port) if monitor.port else None


class ScrapeAtEnd(TrainerCallback):
    """After the last optimizer step (before ``on_train_end`` closes the monitor): flush, scrape."""

    def __init__(self, distmon_callback: DistmonCallback) -> None:
        self.distmon_callback = distmon_callback
        self.samples: list | None = None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == state.max_steps:
            self.samples = scrape_after_flush(self.distmon_callback.monitor)


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def adam_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """AdamW's own count of the steps it took, per parameter."""
    return [int(s["step"]) for s in inner_optimizer(optimizer).state.values()]


def measure_options(out: str, framework: str, config: str) -> dict[str, object]:
    options: dict[str, object] = {"log_path": os.path.join(out, f"{framework}-{config}.jsonl")}
    if config == "measured":
        options.update(serve="rank0", port=0, linger_s=0)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # this rank's samples per step: turns the gradient noise series on (2+ ranks only)
            options.update(batch_size=BATCH, gns_alpha=0.5)
    else:
        options.update(serve="none", guard="skip")
    return options


def run_hf(config: str, out: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as workdir:
        if config in ("plain", "monitored"):
            flags = ["--steps", str(STEPS), "--port", "0", "--output-dir", workdir]
            trainer = hf_trainer_example.main(flags + (["--no-distmon"] if config == "plain" else []))
            return {"params": flat(trainer.model.parameters()), "history": trainer.state.log_history}
        callback = DistmonCallback(**measure_options(out, "hf", config))
        scrape = ScrapeAtEnd(callback)
        trainer = hf_trainer_example.build_trainer(workdir, [callback, scrape], max_steps=STEPS)
        inject = (
            (NAN_LAYER["hf"], NAN_STEP)
            if config == "nan" and trainer.accelerator.process_index == NAN_RANK
            else None
        )
        reference = GradsAtClip(trainer.model, trainer.accelerator, inject)
        trainer.train()
        return {
            **reference.result(),
            "params": flat(trainer.model.parameters()),
            "history": trainer.state.log_history,
            "samples": scrape.samples if config == "measured" else None,
            "adam_steps": adam_steps(trainer.optimizer),
            "world_size": trainer.accelerator.num_processes,
        }


def run_accelerate(config: str, out: str) -> dict[str, object]:
    if config in ("plain", "monitored"):
        flags = ["--steps", str(STEPS), "--port", "0"]
        model, norms = accelerate_example.main(flags + (["--no-distmon"] if config == "plain" else []))
        return {"params": flat(model.parameters()), "history": norms}
    accelerator, model, optimizer, loader = accelerate_example.prepare(STEPS)
    module = accelerator.unwrap_model(model)
    inject = (
        (NAN_LAYER["accelerate"], NAN_STEP)
        if config == "nan" and accelerator.process_index == NAN_RANK
        else None
    )
    reference = GradsAtClip(module, accelerator, inject)
    monitor = distmon.GradMonitor(model, optimizer, **measure_options(out, "accelerate", config))
    norms = accelerate_example.train(accelerator, model, optimizer, loader)
    samples = scrape_after_flush(monitor) if config == "measured" else None
    monitor.close()
    return {
        **reference.result(),
        "params": flat(module.parameters()),
        "history": norms,
        "samples": samples,
        "adam_steps": adam_steps(optimizer),
        "world_size": accelerator.num_processes,
    }


RUNS: dict[str, Callable[[str, str], dict[str, object]]] = {"hf": run_hf, "accelerate": run_accelerate}


def main(out: str) -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    configs = ["plain", "monitored", "measured"] + (["nan"] if distributed else [])
    for framework, run in RUNS.items():
        results: dict[str, object] = {config: run(config, out) for config in configs}
        results["meta"] = {
            "steps": STEPS,
            "max_grad_norm": MAX_GRAD_NORM[framework],
            "nan_step": NAN_STEP,
            "nan_rank": NAN_RANK,
            "nan_layer": NAN_LAYER[framework],
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(results, os.path.join(out, f"{framework}-rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        dist.barrier()
        leave(0)  # results are written: no interpreter finalization (see ddp_harness.leave)


if __name__ == "__main__":
    main(sys.argv[1])
