"""Byte-level text that needs no download: the Python standard library's own source files.

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` left out), in
sorted order, concatenated and cut to a fixed number of bytes: the same corpus on every
machine with the same Python. Batches are random windows drawn from a seeded generator.
"""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache

import torch


@lru_cache(maxsize=2)
def corpus(n_bytes: int = 4_000_000) -> torch.Tensor:
    """The first ``n_bytes`` of the sorted stdlib sources, as a uint8 tensor.

    Example:
        >>> c = corpus(10_000); c.dtype, len(c)
        (torch.uint8, 10000)
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        paths += [os.path.join(top, f) for f in files if f.endswith(".py")]
    out = bytearray()
    for path in sorted(paths):
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= n_bytes:
            break
    if len(out) < n_bytes:
        raise RuntimeError(f"the stdlib holds {len(out)} bytes of sources, fewer than {n_bytes}")
    return torch.frombuffer(bytearray(out[:n_bytes]), dtype=torch.uint8)


class Batches:
    """Random ``(batch, seq_len)`` windows of the corpus and their next-byte targets, from ``seed``.

    Example:
        >>> x, y = Batches(seq_len=8, batch=2, seed=0).next()
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([2, 8]), True)
    """

    def __init__(self, *, seq_len: int, batch: int, seed: int, n_bytes: int = 4_000_000) -> None:
        self.data = corpus(n_bytes).long()
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch,), generator=self.gen)
        idx = start[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[idx]
        return window[:, :-1], window[:, 1:]
