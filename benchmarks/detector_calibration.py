"""Evidence for the detector defaults: score distributions on the demo model's real training.

Runs ``launch/train.py`` under torchrun (3 gloo ranks, so the rank-outlier detector is armed)
on several seeds, reads the JSONL snapshots, and reports, over the clean steps after the
warm-up, the largest global z-score, layer z-score, norm/median ratio and rank-outlier
score, next to the same scores at injected faults. The defaults in
``distmon.DetectorConfig`` must sit well above the first group and well below the second.

    python benchmarks/detector_calibration.py                # 3 seeds x 500 steps, tiny preset
    python benchmarks/detector_calibration.py --seeds 0 1 2 3 4 --steps 800 --preset small
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.join(ROOT, "launch"))

from train import torchrun_command  # noqa: E402  (launch/train.py)

from distmon.verdicts.detectors import DetectorConfig  # noqa: E402


def run_demo(extra: list[str], nproc: int, log: str, timeout: float = 600) -> list[dict[str, Any]]:
    """One torchrun run of the demo with ``extra`` flags; returns its JSONL snapshots."""
    cmd = torchrun_command(
        nproc, ["--serve", "none", "--linger", "0", "--print-every", "100000", "--log-path", log, *extra]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"demo failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f]


def _num(x: Any) -> float:
    return float(x) if not isinstance(x, str) else float(x.replace("inf", "Infinity"))


def score_summary(snaps: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Largest score of each kind over the snapshots after the first ``skip`` steps."""
    rows = [s for s in snaps if s["step"] > skip]
    return {
        "zscore": max(_num(s["scores"]["zscore"]) for s in rows),
        "layer_zmax": max(_num(s["scores"]["layer_zmax"]) for s in rows),
        "median_ratio": max(_num(s["scores"]["median_ratio"]) for s in rows),
        "outlier": max(max(map(_num, s["rank_outlier_scores"])) for s in rows),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    args = p.parse_args(argv)
    cfg = DetectorConfig()
    base = ["--preset", args.preset, "--steps", str(args.steps)]
    fault_step = args.steps - args.steps // 5
    clean, faults = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            snaps = run_demo(base + ["--seed", str(seed)], args.nproc, os.path.join(tmp, f"c{seed}.jsonl"))
            s = score_summary(snaps, cfg.warmup_steps)
            s["events"] = sum(len(x["events"]) for x in snaps)
            clean.append((seed, s))
        for name, flags in [
            ("spike x100 on one layer", ["--spike-step", str(fault_step), "--spike-factor", "100"]),
            ("spike x10 on one layer", ["--spike-step", str(fault_step), "--spike-factor", "10"]),
            (
                "rank 1 batch x4",
                ["--corrupt-rank", "1", "--corrupt-scale", "4", "--corrupt-from", str(fault_step)],
            ),
        ]:
            snaps = run_demo(
                base + ["--seed", "0"] + flags, args.nproc, os.path.join(tmp, f"f{len(faults)}.jsonl")
            )
            at = [x for x in snaps if x["step"] == fault_step][0]
            faults.append(
                (
                    name,
                    {
                        "zscore": _num(at["scores"]["zscore"]),
                        "layer_zmax": _num(at["scores"]["layer_zmax"]),
                        "median_ratio": _num(at["scores"]["median_ratio"]),
                        "outlier": max(map(_num, at["rank_outlier_scores"])),
                        "events": [(e["kind"], e["rank"], e["layer"]) for e in at["events"]],
                    },
                )
            )
    cols = ("zscore", "layer_zmax", "median_ratio", "outlier")
    print(
        f"# Detector calibration: demo `{args.preset}` preset, {args.nproc} ranks, {args.steps} steps, "
        f"warm-up {cfg.warmup_steps}\n"
    )
    print("| run | max global z | max layer z | max norm/median | max rank-outlier score | events |")
    print("|---|---|---|---|---|---|")
    for seed, s in clean:
        print(f"| clean, seed {seed} | " + " | ".join(f"{s[c]:.2f}" for c in cols) + f" | {s['events']} |")
    for name, s in faults:
        print(
            f"| {name} @ step {fault_step} | "
            + " | ".join(f"{s[c]:.2f}" for c in cols)
            + f" | {s['events']} |"
        )
    print(
        f"| **defaults** | z > {cfg.spike_zscore} | z > {cfg.spike_zscore} | > {cfg.spike_ratio} "
        f"(global) | > {cfg.outlier_score} | |"
    )
    print(
        f"\ncommand: python benchmarks/detector_calibration.py --seeds {' '.join(map(str, args.seeds))} "
        f"--steps {args.steps} --nproc {args.nproc} --preset {args.preset}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
