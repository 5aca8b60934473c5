"""Time and peak memory of ``python -m distmon report`` on large synthetic logs.

Writes a JSONL log shaped like the exporter's (every field, a rank x layer matrix on every
line) with ``--layers`` layers, ``--ranks`` ranks and ``--steps`` steps, optionally ending in
one line with ``--huge-layers`` layers (a run configured with no practical ``max_layers``),
then runs the report ``--repeat`` times in a fresh process and prints the median wall time and
the median peak resident memory (``ru_maxrss`` of the child).

    python benchmarks/report_scale.py                          # 3,000 layers x 8 ranks x 200 steps
    python benchmarks/report_scale.py --steps 20 --huge-layers 4000000
    python benchmarks/report_scale.py --nodes 4       # the same job as 4 node logs (run.node<n>.jsonl)
    python benchmarks/report_scale.py --root /tmp/old   # another checkout's distmon, e.g.
        # git archive 9667105 | tar -x -C /tmp/old   (the report before the bounded reader)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot_line(step: int, layers: int, ranks: int, rng: random.Random, run_id: str = "scale") -> str:
    """One exporter-shaped JSONL line with ``layers`` layers and ``ranks`` ranks."""
    names = [f"blocks.{i // 4}.mlp.fc{i % 4}" for i in range(layers)]
    norms = {name: rng.lognormvariate(0.0, 0.5) for name in names}
    matrix = [[v * rng.uniform(0.9, 1.1) for v in norms.values()] for _ in range(ranks)]
    snap: dict[str, Any] = {
        "step": step,
        "timestamp": 1.0e9 + step,
        "grad_norm": sum(v * v for v in norms.values()) ** 0.5,
        "layer_grad_norms": norms,
        "rank_grad_norms": [sum(v * v for v in row) ** 0.5 for row in matrix],
        "rank_layer_grad_norms": matrix,
        "nonfinite": False,
        "nonfinite_ranks": [],
        "first_nonfinite": None,
        "events": [],
        "monitor_errors": 0,
        "valid": True,
        "run_id": run_id,
        "world_size": ranks,
        "layer_noise_signal": dict(norms),
        "layer_gradient_noise_scale": dict(norms),
    }
    return json.dumps(snap) + "\n"


def huge_line(step: int, layers: int, run_id: str = "scale") -> bytes:
    """A line with ``layers`` layers and nothing else (a run with no practical ``max_layers``)."""
    head = f'{{"step": {step}, "run_id": "{run_id}", "grad_norm": 1.0, "layer_grad_norms": {{'
    body = (f'"l{i}": 1.0' for i in range(layers))
    return (head + ", ".join(body) + "}}\n").encode()


def node_lines(line: str, nodes: int) -> list[str]:
    """``line`` (of the whole job) as each of ``nodes`` nodes' logs hold it: the job-wide fields
    and its ranks' entries of the per-rank lists, with ``"ranks"`` and ``"node"``."""
    snap = json.loads(line)
    world = len(snap["rank_grad_norms"])
    parts = []
    for n in range(nodes):
        ranks = list(range(n * world // nodes, (n + 1) * world // nodes))
        part = dict(snap, ranks=ranks, node=n)
        for name in ("rank_grad_norms", "rank_layer_grad_norms"):
            part[name] = [snap[name][r] for r in ranks]
        parts.append(json.dumps(part) + "\n")
    return parts


def write_log(path: str, layers: int, ranks: int, steps: int, huge_layers: int, nodes: int = 1) -> list[str]:
    """Write the log (``nodes`` > 1: one per node, ``<stem>.node<n>.jsonl``); returns the files."""
    rng = random.Random(0)
    stem = path[: -len(".jsonl")]
    paths = [path] + [f"{stem}.node{n}.jsonl" for n in range(1, nodes)]
    files = [open(p, "wb") for p in paths]
    try:
        for step in range(1, steps + 1):
            line = snapshot_line(step, layers, ranks, rng)
            for f, part in zip(files, node_lines(line, nodes) if nodes > 1 else [line]):
                f.write(part.encode())
        if huge_layers:
            files[0].write(huge_line(steps + 1, huge_layers))
    finally:
        for f in files:
            f.close()
    return paths


# Runs in a fresh process: its only child is the report, so RUSAGE_CHILDREN is that run's peak.
_MEASURE = """
import json, resource, subprocess, sys, time
timeout, cmd = float(sys.argv[1]), sys.argv[2:]
t0 = time.perf_counter()
try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    rc, text = proc.returncode, proc.stdout + proc.stderr
except subprocess.TimeoutExpired:
    rc, text = -9, f"killed at {timeout:.0f} s"
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"wall": wall, "rss": rss, "rc": rc, "tail": text.strip().splitlines()[-1:]}))
"""


def run_report(log: str | list[str], out: str, timeout: float, root: str = ROOT) -> dict[str, Any]:
    """Wall seconds, peak RSS (MiB), exit code and last output line of one report run."""
    cmd = [sys.executable, "-m", "distmon", "report", *([log] if isinstance(log, str) else log), "-o", out]
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(timeout), *cmd],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--huge-layers", type=int, default=0, help="a last line with this many layers")
    parser.add_argument("--nodes", type=int, default=1, help="write the job as this many node logs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--root", default=ROOT, help="the checkout whose distmon runs (default: this one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "run.jsonl")
        logs = write_log(log, args.layers, args.ranks, args.steps, args.huge_layers, args.nodes)
        size = sum(map(os.path.getsize, logs)) / 2**20
        outs = [os.path.join(tmp, f"r{i}") for i in range(args.repeat)]
        runs = [run_report(logs, out, args.timeout, args.root) for out in outs]
    walls = [r["wall"] for r in runs]
    rss = [r["rss"] for r in runs]
    print(
        f"log: {args.steps} steps x {args.layers} layers x {args.ranks} ranks"
        + (f" in {args.nodes} node logs" if args.nodes > 1 else "")
        + (f" + a last line of {args.huge_layers:,} layers" if args.huge_layers else "")
        + f", {size:.1f} MiB"
    )
    print(f"report: median {statistics.median(walls):.2f} s (runs {', '.join(f'{w:.2f}' for w in walls)})")
    print(f"peak RSS: median {statistics.median(rss):.0f} MiB (runs {', '.join(f'{m:.0f}' for m in rss)})")
    print(f"exit codes {[r['rc'] for r in runs]}; last output line: {runs[-1]['tail']}")


if __name__ == "__main__":
    main()
