"""The rank side of tests/test_framework_deepspeed.py's framework runs: DeepSpeed under the Hugging
Face ``Trainer`` (a ZeRO-2 config) and under accelerate (a ZeRO-3 ``DeepSpeedPlugin``).

``torchrun --nproc-per-node 2 tests/jobs/deepspeed_hf_job.py OUT`` runs each framework twice,
``plain`` (without distmon) and ``measured`` (distmon serving on a free port on rank 0 and
logging every step; the Trainer with the shipped ``DistmonCallback``, unchanged; accelerate with
``GradMonitor`` on the prepared objects); after the last step every rank flushes and rank 0
scrapes its ``/metrics``. References, never from distmon: the framework's own norm (the
Trainer's logged ``grad_norm``, the value ``accelerator.clip_grad_norm_`` returns: DeepSpeed's
``get_global_grad_norm()``) and float64 norms of ``deepspeed.utils.safe_get_full_grad`` taken
as DeepSpeed's optimizer step begins (its ZeRO optimizer's ``step`` wrapped on the instance),
before it clips.

Each rank saves ``OUT/{framework}-rank{r}.pt``; rank 0 writes ``OUT/{framework}.jsonl``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "launch", "examples"), TESTS_DIR]

import hf_trainer_example  # noqa: E402
from ddp_harness import leave  # noqa: E402
from deepspeed_job import flat_params  # noqa: E402
from helpers import reference_norms, scrape_metrics  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import distmon  # noqa: E402
from distmon.integrations.transformers import DistmonCallback  # noqa: E402

STEPS = 8
MAX_GRAD_NORM = 0.3
ACCUMULATION = {"hf": 2, "accelerate": 1}
STAGE = {"hf": 2, "accelerate": 3}


class FullGradNorms:
    """Float64 norm of DeepSpeed's gathered reduced gradient, as its ZeRO optimizer's step begins."""

    def __init__(self, engine: object) -> None:
        from deepspeed.utils import safe_get_full_grad

        self.named, self.full_grad, self.norms = (
            list(engine.module.named_parameters()),
            safe_get_full_grad,
            [],
        )
        self._inner = engine.optimizer.step
        engine.optimizer.step = self.step

    def step(self, *args: object, **kwargs: object) -> object:
        self.norms.append(reference_norms((n, self.full_grad(p)) for n, p in self.named)[0])
        return self._inner(*args, **kwargs)


def options(out: str, framework: str) -> dict[str, object]:
    return {
        "serve": "rank0",
        "port": 0,
        "linger_s": 0,
        "log_path": os.path.join(out, f"{framework}.jsonl") if dist.get_rank() == 0 else None,
    }


class Watch(TrainerCallback):
    """Installs the reference once DeepSpeed's engine exists; flushes and scrapes after the last step."""

    def __init__(self, distmon_callback: DistmonCallback | None) -> None:
        self.distmon_callback, self.refs, self.samples = distmon_callback, None, None
        self.trainer: Trainer | None = None  # set once the Trainer is built

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.refs = FullGradNorms(self.trainer.model_wrapped)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == state.max_steps and self.distmon_callback is not None:
            monitor = self.distmon_callback.monitor
            monitor.flush()
            self.samples = scrape_metrics(monitor.port) if monitor.port else None


def run_hf(config: str, out: str) -> dict[str, object]:
    """The Trainer with a ZeRO-2 DeepSpeed config: the example's GPT-2, clipping, accumulation."""
    set_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": STAGE["hf"]},
    }
    distmon_callback = DistmonCallback(**options(out, "hf")) if config == "measured" else None
    watch = Watch(distmon_callback)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        deepspeed=ds_config,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION["hf"],
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=1e-3,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    callbacks = [c for c in (distmon_callback, watch) if c is not None]
    trainer = watch.trainer = Trainer(
        model=model, args=args, train_dataset=hf_trainer_example.RandomTokens(), callbacks=callbacks
    )
    trainer.train()
    history = [
        (h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "grad_norm" in h
    ]
    return {
        "params": flat_params(trainer.model_wrapped),
        "history": history,
        "reference": watch.refs.norms,
        "samples": watch.samples,
        "engine": type(trainer.model_wrapped).__name__,
    }


def run_accelerate(config: str, out: str) -> dict[str, object]:
    """accelerate with a ZeRO-3 ``DeepSpeedPlugin``: ``GradMonitor`` on what ``prepare`` returned."""
    import accelerate_example
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils import set_seed as accelerate_seed

    AcceleratorState._reset_state(reset_partial_state=False)  # the Trainer's runs left theirs
    PartialState(cpu=True)  # gloo over torchrun's ranks; DeepSpeed then takes them over
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch --use_deepspeed` sets
    plugin = DeepSpeedPlugin(
        zero_stage=STAGE["accelerate"],
        gradient_accumulation_steps=ACCUMULATION["accelerate"],
        gradient_clipping=MAX_GRAD_NORM,
    )
    accelerator = Accelerator(deepspeed_plugin=plugin)
    accelerate_seed(0)
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUMULATION["accelerate"] * 4 * accelerator.num_processes
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randint(4, (n,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = accelerate_example.Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    refs = FullGradNorms(model)
    monitor = (
        distmon.GradMonitor(model, optimizer, **options(out, "accelerate")) if config == "measured" else None
    )
    norms = []
    for x, y in loader:  # accelerate_example.train's loop; DeepSpeed's norm may be a float
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    samples = None
    if monitor is not None:
        monitor.flush()
        samples = scrape_metrics(monitor.port) if monitor.port else None
        monitor.close()
    return {
        "params": flat_params(model),
        "history": norms,
        "reference": refs.norms,
        "samples": samples,
        "engine": type(model).__name__,
    }


def main(out: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    for framework, run in (("hf", run_hf), ("accelerate", run_accelerate)):
        results = {config: run(config, out) for config in ("plain", "measured")}
        results["meta"] = {
            "steps": STEPS,
            "stage": STAGE[framework],
            "accumulation": ACCUMULATION[framework],
            "max_grad_norm": MAX_GRAD_NORM,
        }
        torch.save(results, os.path.join(out, f"{framework}-rank{rank}.pt"))
    dist.barrier()
    leave(0)  # results are written: no interpreter finalization (see ddp_harness.leave)


if __name__ == "__main__":
    main(sys.argv[1])
