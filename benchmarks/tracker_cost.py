#!/usr/bin/env python3
"""What a tracker costs, from an overhead run's rounds (issue #43): docs/trackers.md's table.

    python benchmarks/overhead.py --sizes 1M --approaches distmon distmon-tensorboard wandb-watch \\
        --hist-freq 10 --no-profile --rounds 300 --out benchmarks/results/overhead-trackers-1M
    python benchmarks/tracker_cost.py benchmarks/results/overhead-trackers-1M/overhead.json

For each approach, against bare DDP and against distmon's defaults, from the same interleaved
rounds: the paired median ratio (what a typical step pays) and the ratio of total times (what the
run pays: it includes the work done every N steps, which a median step misses: distmon's export,
the TensorBoard tracker's writes, ``wandb.watch``'s histograms), each with a 95% bootstrap interval
over rounds, in wall time (the slowest rank's) and in CPU time (all of a rank's threads, mean over
ranks: what other jobs on a shared machine do not inflate).
"""

import json
import random
import sys

from overheadbench.stats import paired_ratio

N_BOOT = 2000


def total_ratio(t: list[float], base: list[float]) -> tuple[float, float, float]:
    """``sum(t) / sum(base)`` over the rounds and its 95% bootstrap interval (rounds resampled).

    Example:
        >>> r, lo, hi = total_ratio([1.1, 1.0, 1.2], [1.0, 1.0, 1.0])
        >>> round(r, 3), lo <= r <= hi
        (1.1, True)
    """
    rng = random.Random(0)
    idx = range(len(t))
    boots = []
    for _ in range(N_BOOT):
        pick = rng.choices(idx, k=len(t))
        boots.append(sum(t[i] for i in pick) / sum(base[i] for i in pick))
    boots.sort()
    return sum(t) / sum(base), boots[int(0.025 * N_BOOT)], boots[int(0.975 * N_BOOT) - 1]


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.4f} [{r[1]:.4f}, {r[2]:.4f}]"


def main(path: str) -> None:
    with open(path) as f:
        run = json.load(f)
    labels = run.get("labels", {})
    load = f"load average at start {run['machine'].get('load_avg_start')}, at end {run['load_avg_end']}"
    print(f"`{run['command']}` ({load})")
    for size in run["sizes"]:
        raw = size["raw"]
        print(f"\n{size['info']['size']}, {size['n_rounds']} rounds\n")
        print("| approach | against | paired median, wall | total, wall | paired median, CPU | total, CPU |")
        print("|---|---|---:|---:|---:|---:|")
        for name in raw["wall_s"]:
            for ref in ("baseline", "distmon"):
                if name in ("baseline", ref) or ref not in raw["wall_s"]:
                    continue
                cells = [
                    fmt(fn(raw[clock][name], raw[clock][ref]))
                    for clock in ("wall_s", "cpu_s")
                    for fn in (paired_ratio, total_ratio)
                ]
                print(f"| {labels.get(name, name)} | {labels.get(ref, ref)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main(sys.argv[1])
