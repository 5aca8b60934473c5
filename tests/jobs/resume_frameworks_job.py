"""The rank side of tests/test_resume.py's framework cases: resume through the shipped callbacks.

``python -m torch.distributed.run --nproc-per-node 2 tests/jobs/resume_frameworks_job.py FW OUT``

``FW`` is ``lightning`` or ``hf``. In one job, as a user would across two: a fit of ``STEPS``
optimizer steps that checkpoints at ``CKPT_AT`` (Lightning's ``ModelCheckpoint``; the Trainer's
``save_steps``), logging every step to ``OUT/FW-full.jsonl``; then a new trainer, model and
callback resumed from that checkpoint (``ckpt_path=``; ``resume_from_checkpoint=``) to
``STEPS``, logging to ``OUT/FW-resumed.jsonl``. The examples' models and data
(``launch/examples``); checkpoints at an epoch boundary (Lightning restarts an epoch it
resumes in).
"""

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "launch", "examples"), os.path.join(ROOT, "tests")]

from ddp_harness import leave  # noqa: E402

STEPS, CKPT_AT = 40, 20
fw, out = sys.argv[1], sys.argv[2]
options = {"serve": "none", "export_every": 10, "batch_size": 8, "linger_s": 0}


def lightning() -> None:
    import lightning as L
    import lightning_example as example
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from distmon.integrations.lightning import DistmonCallback

    def fit(log: str, ckpt_path: str | None) -> None:
        L.seed_everything(0, verbose=False)
        saves = ModelCheckpoint(
            dirpath=os.path.join(out, "lightning-ckpt"), every_n_train_steps=CKPT_AT, save_top_k=-1
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=STEPS,
            gradient_clip_val=example.CLIP,
            callbacks=[DistmonCallback(log_path=log, **options), saves],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(example.Regressor(), DataLoader(example.dataset(), batch_size=8), ckpt_path=ckpt_path)

    fit(os.path.join(out, "lightning-full.jsonl"), None)  # 320 samples, 2 x 8 a step: 20 steps an epoch
    (ckpt,) = [c for c in glob.glob(os.path.join(out, "lightning-ckpt", "*.ckpt")) if f"step={CKPT_AT}" in c]
    fit(os.path.join(out, "lightning-resumed.jsonl"), ckpt)


def hf() -> None:
    import hf_trainer_example as example
    from transformers import Trainer, TrainingArguments

    from distmon.integrations.transformers import DistmonCallback

    def train(log: str, resume: str | None) -> None:
        trainer = example.build_trainer(
            os.path.join(out, "hf"), [DistmonCallback(log_path=log, **options)], STEPS
        )
        args = trainer.args.to_dict() | {"save_strategy": "steps", "save_steps": CKPT_AT}
        args["restore_callback_states_from_checkpoint"] = True
        trainer = Trainer(
            model=trainer.model,
            args=TrainingArguments(
                **{k: v for k, v in args.items() if k in TrainingArguments.__dataclass_fields__}
            ),
            train_dataset=trainer.train_dataset,
            callbacks=[DistmonCallback(log_path=log, **options)],
        )
        trainer.train(resume_from_checkpoint=resume)

    train(os.path.join(out, "hf-full.jsonl"), None)
    train(os.path.join(out, "hf-resumed.jsonl"), os.path.join(out, "hf", f"checkpoint-{CKPT_AT}"))


{"lightning": lightning, "hf": hf}[fw]()
leave(0)
