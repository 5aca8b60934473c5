#!/usr/bin/env python3
"""CPU accuracy of a sum of squares, torch's fused fp32 call against distmon's rows (issue #39).

For gradient-like tensors of 0.4M to 50M elements (fp32, and bf16 at 0.4M): the relative error
against float64 of torch's one fused call (``_foreach_powsum``: what distmon used before, and
what ``clip_grad_norm_``'s ``vector_norm`` shares) and of ``distmon.step.sums.sq_sums`` (rows on the
CPU), and the time of each on one thread (median of interleaved repeats), as a ratio.

    python benchmarks/cpu_accuracy.py              # prints a markdown table
    python benchmarks/cpu_accuracy.py --write      # and writes benchmarks/results/cpu_accuracy.md
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from distmon.compat import sq_sums_fp32
from distmon.step.sums import sq_sums

CASES = [
    (400_000, torch.float32),
    (4_000_000, torch.float32),
    (38_597_376, torch.float32),
    (50_000_000, torch.float32),
    (400_000, torch.bfloat16),
]
REPEATS = 15


def _rel(x: torch.Tensor, ref: float) -> float:
    return abs(float(x) - ref) / ref


def measure(n: int, dtype: torch.dtype) -> dict[str, float]:
    """Errors and one-thread times (ms) of both ways for one tensor of ``n`` elements."""
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.01 + 0.003).to(dtype)
    ref = float(g.double().pow(2).sum())
    fused, rows = [], []
    for _ in range(REPEATS):  # interleaved: both see the same machine
        for fn, times in ((sq_sums_fp32, fused), (sq_sums, rows)):
            t0 = time.perf_counter()
            fn([g])
            times.append(time.perf_counter() - t0)
    return {
        "fused_err": _rel(sq_sums_fp32([g])[0], ref),
        "rows_err": _rel(sq_sums([g])[0], ref),
        "fused_ms": 1e3 * statistics.median(fused),
        "rows_ms": 1e3 * statistics.median(rows),
    }


def table() -> str:
    lines = [
        "| elements | dtype | torch fused fp32: error | distmon rows: error "
        "| time, rows / fused (1 thread) |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, dtype in CASES:
        m = measure(n, dtype)
        lines.append(
            f"| {n:,} | {str(dtype).removeprefix('torch.')} | {m['fused_err']:.1e} | {m['rows_err']:.1e} "
            f"| {m['rows_ms'] / m['fused_ms']:.2f} ({m['rows_ms']:.2f} / {m['fused_ms']:.2f} ms) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = (
        "# CPU accuracy of a sum of squares\n\n"
        "`python benchmarks/cpu_accuracy.py --write`: relative error against float64 of torch's fused "
        "fp32 call and of distmon's rows (`distmon.step.sums.sq_sums` on the CPU), on one thread.\n\n"
        + table()
        + "\n"
    )
    print(out)
    if "--write" in sys.argv:
        Path(__file__).with_name("results").joinpath("cpu_accuracy.md").write_text(out)
