"""distmon in a Hugging Face ``Trainer``: one callback.

A tiny GPT-2 built from its config (nothing is downloaded) learns random token sequences on
CPU, with gradient clipping (``max_grad_norm``) and gradient accumulation; distmon serves its
gradient figures on http://127.0.0.1:9290/metrics and skips any optimizer step whose gradient
is non-finite (``guard="skip"``)::

    torchrun --nproc-per-node 2 launch/examples/hf_trainer_example.py    # 2 CPU ranks (gloo DDP)
    python launch/examples/hf_trainer_example.py                          # one process
    curl -s 127.0.0.1:9290/metrics | grep ^distmon_                       # while it runs

The norm distmon serves is the one the Trainer logs as ``grad_norm``: before clipping.
``tests/test_framework_hf.py`` runs this file under torchrun and checks every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

# The checkout's distmon wins when this file is run from a checkout (the script's own folder,
# not the repository root, is on sys.path).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.isfile(os.path.join(_REPO_ROOT, "distmon", "__init__.py")) and _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

from distmon.integrations.transformers import DistmonCallback  # noqa: E402

VOCAB, SEQ = 64, 16
MAX_GRAD_NORM = 0.3


class RandomTokens(torch.utils.data.Dataset):
    """``size`` fixed random sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, size: int = 256, seed: int = 1) -> None:
        self.ids = torch.randint(VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_trainer(output_dir: str, callbacks: list | None = None, max_steps: int = 10) -> Trainer:
    """The Trainer of this example: a 2-layer GPT-2, batches of 4, 2 micro-batches per step.

    Example:
        >>> trainer = build_trainer(tempfile.mkdtemp(), max_steps=1)  # doctest: +SKIP
        >>> trainer.train().global_step                                # doctest: +SKIP
        1
    """
    set_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,  # under torchrun: DDP over gloo
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=1e-3,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)


def main(argv: list[str] | None = None) -> Trainer:
    """Train (with distmon unless ``--no-distmon``); returns the trained Trainer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--port", type=int, default=9290, help="metrics port (0: any free one)")
    parser.add_argument("--no-distmon", action="store_true", help="the same training, unmonitored")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf_trainer_example"))
    args = parser.parse_args(argv)
    callbacks = [] if args.no_distmon else [DistmonCallback(guard="skip", port=args.port)]
    trainer = build_trainer(args.output_dir, callbacks, max_steps=args.steps)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
