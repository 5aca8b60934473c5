#!/usr/bin/env python3
"""Regenerate ``distmon.verdicts.detectors.CONSISTENCY``: the rank-outlier scale's constant per world size.

The rank-outlier scale is the mean squared deviation of the ranks' log-norms from their center
(``distmon.step.crossrank``): from 5 ranks on, of the ranks between the two extremes around their own
mean; up to 4, of the ranks around their lower median, leaving out the largest from 3 on. For
Gaussian ranks its expectation is below sigma^2 by a factor that depends on the
world size only; the table holds sigma^2 / E[that mean] for 2..128 ranks, by Monte Carlo over
4M values each (standard error ~0.07%). Beyond 128 ranks the detector uses the large-world
approximation ``large_world_consistency`` (``--check`` prints its distance from Monte Carlo at
129, 256 and 1,024 ranks).

    python benchmarks/consistency_table.py      # prints the table as Python
"""

import torch

from distmon.verdicts.detectors import large_world_consistency


def consistency(world: int, total: int = 4_000_000, seed: int = 0) -> float:
    """sigma^2 / E[trimmed mean squared deviation from the trimmed center], by seeded Monte Carlo."""
    if world < 2:
        return 1.0
    samples = max(200, total // world)
    x = torch.randn(samples, world, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = x.sort(dim=1).values
    if world >= 5:  # the middle ranks around their own mean (crossrank's center)
        middle = x[:, 1:-1]
        d2 = (middle - middle.mean(1, keepdim=True)) ** 2
    else:  # around the lower median, leaving out the largest from 3 ranks on
        d2 = ((x - x[:, (world - 1) // 2 : (world - 1) // 2 + 1]) ** 2).sort(dim=1).values
        d2 = d2[:, :-1] if world >= 3 else d2
    return float(1.0 / d2.mean())


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    if "--check" in sys.argv:
        for n in (129, 256, 1024):
            mc, approx = consistency(n), large_world_consistency(n)
            print(f"{n} ranks: Monte Carlo {mc:.4f}, approximation {approx:.4f} ({approx / mc - 1:+.2%})")
        sys.exit()
    values = [consistency(n) for n in range(2, 129)]
    print("CONSISTENCY = (  # ranks 2..128, from benchmarks/consistency_table.py")
    for i in range(0, len(values), 8):
        print("    " + " ".join(f"{v:.4f}," for v in values[i : i + 8]))
    print(")")
