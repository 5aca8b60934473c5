"""The framework runs that tests/test_tracker_frameworks.py reads back (issue #43).

    python -m torch.distributed.run --nproc-per-node 2 tests/jobs/tracker_frameworks_job.py OUT

On 2 gloo ranks, each with a NaN in rank 1's batch at step ``NAN_STEP`` (``guard="skip"``: an
event, a refused step) and ``DistmonCallback`` as a user writes it (no code for the loggers):

* Lightning: the example's model (``launch/examples/lightning_example.py``) fitted for ``STEPS``
  steps with ``logger=[TensorBoardLogger(OUT/lt_tb), CSVLogger(OUT/lt_csv)]``;
* the HF Trainer: the example's GPT-2 (``launch/examples/hf_trainer_example.py``) trained for
  ``STEPS`` steps with ``report_to=["tensorboard"]``, its TensorBoard directory ``OUT/hf_tb``.

Rank 0's distmon writes ``OUT/lightning.jsonl`` and ``OUT/hf.jsonl``, what the loggers must hold;
rank 0 writes the Trainer's ``state.log_history`` to ``OUT/hf_state.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "launch" / "examples")]  # this checkout's distmon, the examples

STEPS, EVERY, NAN_STEP = 12, 5, 7
OPTIONS = {"guard": "skip", "serve": "none", "export_every": EVERY, "export_interval_s": 0}


def lightning(out: Path) -> None:
    import lightning as L
    import lightning_example as example
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader

    from distmon.integrations.lightning import DistmonCallback

    class NanOnRank1(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if trainer.global_rank == 1 and trainer.global_step + 1 == NAN_STEP:
                batch[0][0, 0] = float("nan")

    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        logger=[TensorBoardLogger(out, name="lt_tb"), CSVLogger(out, name="lt_csv")],
        log_every_n_steps=1,
        callbacks=[DistmonCallback(log_path=str(out / "lightning.jsonl"), **OPTIONS), NanOnRank1()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(example.Regressor(), DataLoader(example.dataset(), batch_size=8))


def hf(out: Path) -> None:
    import hf_trainer_example as example
    from transformers import TrainerCallback

    from distmon.integrations.transformers import DistmonCallback

    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "hf_tb")  # the TensorBoard integration's directory
    made = example.TrainingArguments
    example.TrainingArguments = lambda **kw: made(**{**kw, "report_to": ["tensorboard"]})
    poisoned = [False]

    class NanOnRank1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            poisoned[0] = int(os.environ.get("RANK", "0")) == 1 and state.global_step + 1 == NAN_STEP

    callbacks = [DistmonCallback(log_path=str(out / "hf.jsonl"), **OPTIONS), NanOnRank1()]
    trainer = example.build_trainer(str(out / "hf_out"), callbacks, max_steps=STEPS)
    # the embeddings' output, NaN on rank 1 at NAN_STEP (token ids cannot hold a NaN)
    trainer.model.transformer.wte.register_forward_hook(
        lambda module, args, output: output * float("nan") if poisoned[0] else output
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:  # what the Trainer itself kept of its logs
        (out / "hf_state.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    torch.set_num_threads(1)
    lightning(target)
    hf(target)
