"""``python -m distmon report RUN.jsonl -o DIR``: pictures and a summary of a run's JSONL log.

Reads the log ``log_path=`` wrote (one snapshot per line; a crashed run's truncated last line
is skipped and said) and writes, with matplotlib (``pip install distmon[report]``):

- ``global_norm.png``: the global gradient norm over steps, anomaly events and non-finite
  steps marked;
- ``layer_heatmap.png``: layer x step, log10 of each layer's norm;
- ``rank_layer_at_worst.png``: rank x layer local norms at the worst step (the first
  non-finite one, else the strongest event, else the largest norm);
- ``rank_norms.png``: every rank's local norm over steps;
- ``noise_scale.png``: the gradient noise scale over steps (when the run had ``batch_size``);
- ``summary.md``: steps, events (step, kind, rank, layer), the first non-finite step, skips,
  monitor errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["read_log", "write_report", "main"]


def _num(value: Any) -> float:
    """A JSONL figure as a float ("nan"/"inf" strings included)."""
    return float(value) if value is not None else math.nan


def read_log(path: str) -> tuple[list[dict[str, Any]], int]:
    """The snapshots of a JSONL log, and how many unreadable lines were skipped (a crash's cut line).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write('{"step": 1, "grad_norm": 0.5}\\n{"step": 2, "grad_')
        >>> snaps, skipped = read_log(f.name)
        >>> [s["step"] for s in snaps], skipped
        ([1], 1)
    """
    snaps, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                snaps.append(json.loads(line))
            except json.JSONDecodeError:
                skipped += 1
    return snaps, skipped


def _worst(snaps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first non-finite step, else the step of the strongest event, else the largest norm."""
    for s in snaps:
        if s.get("nonfinite"):
            return s
    with_events = [s for s in snaps if s.get("events")]
    if with_events:
        return max(with_events, key=lambda s: max(_num(e["value"]) for e in s["events"]))
    finite = [s for s in snaps if math.isfinite(_num(s.get("grad_norm")))]
    return max(finite or snaps, key=lambda s: _num(s.get("grad_norm")) if finite else 0.0)


def _summary(snaps: Sequence[dict[str, Any]], skipped_lines: int, pictures: list[str]) -> str:
    steps = [s["step"] for s in snaps]
    events = [e for s in snaps for e in s.get("events", [])]
    first_bad = next((s for s in snaps if s.get("nonfinite")), None)
    lines = [
        f"# distmon run {snaps[-1].get('run_id', '?')}",
        "",
        f"- steps {steps[0]}..{steps[-1]} ({len(snaps)} logged), "
        f"world size {snaps[-1].get('world_size', '?')}",
        f"- skipped by the guard: {sum(s.get('skip_reason') == 'guard' for s in snaps)}, "
        f"by the GradScaler: {sum(s.get('skip_reason') == 'scaler' for s in snaps)}",
        f"- invalid (unmeasured) steps: {sum(not s.get('valid', True) for s in snaps)}; "
        f"monitor errors at the end: {snaps[-1].get('monitor_errors', 0)}",
    ]
    if first_bad is not None:
        where = first_bad.get("first_nonfinite") or ["?", "?"]
        lines.append(f"- **first non-finite step {first_bad['step']}**: rank {where[0]}, layer `{where[1]}`")
    gns = [_num(s.get("gradient_noise_scale")) for s in snaps]
    gns = [g for g in gns if math.isfinite(g)]
    if gns:
        lines.append(f"- gradient noise scale at the end: {gns[-1]:,.1f} (batch_size units)")
    if skipped_lines:
        lines.append(f"- {skipped_lines} unreadable line(s) skipped (a run cut mid-write)")
    lines += ["", f"## Events ({len(events)})", ""]
    if events:
        lines += ["| step | kind | rank | layer | value | threshold |", "|---:|---|---:|---|---:|---:|"]
        lines += [
            f"| {e['step']} | {e['kind']} | {e['rank']} | {e['layer'] or '-'} | {_num(e['value']):.4g} "
            f"| {_num(e['threshold']):.4g} |"
            for e in events[:200]
        ]
    else:
        lines.append("none")
    lines += ["", "## Pictures", ""] + [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def write_report(log_path: str, out_dir: str) -> list[str]:
    """Write the pictures and ``summary.md`` of ``log_path`` into ``out_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    snaps, skipped = read_log(log_path)
    if not snaps:
        raise ValueError(f"distmon report: no snapshot in {log_path}")
    os.makedirs(out_dir, exist_ok=True)
    steps = np.array([s["step"] for s in snaps])
    layers = list(snaps[-1].get("layer_grad_norms", {}))
    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(name)

    # global norm with events
    fig, ax = plt.subplots(figsize=(10, 4))
    norms = np.array([_num(s.get("grad_norm")) for s in snaps])
    ax.plot(steps, norms, lw=1, label="global grad norm")
    colors = {"spike": "tab:orange", "nonfinite": "tab:red", "vanishing": "tab:purple"}
    for kind in sorted({e["kind"] for s in snaps for e in s.get("events", [])}):
        at = [s["step"] for s in snaps if any(e["kind"] == kind for e in s.get("events", []))]
        for i, step in enumerate(at):
            ax.axvline(
                step, color=colors.get(kind, "tab:green"), alpha=0.5, lw=1, label=kind if i == 0 else None
            )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm")
    ax.set_title("Global gradient norm, anomaly events marked")
    ax.legend(loc="upper right")
    save(fig, "global_norm.png")

    # layer x step heatmap
    if layers:
        grid = np.array([[_num(s["layer_grad_norms"].get(name)) for s in snaps] for name in layers])
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.where(grid > 0, grid, np.nan))
        fig, ax = plt.subplots(figsize=(10, max(3, 0.25 * len(layers) + 1)))
        im = ax.imshow(
            logs, aspect="auto", interpolation="nearest", extent=(steps[0], steps[-1], len(layers), 0)
        )
        ax.set_yticks(np.arange(len(layers)) + 0.5, layers, fontsize=7)
        ax.set_xlabel("step")
        ax.set_title("log10 layer gradient norm (model order, top to bottom)")
        fig.colorbar(im, ax=ax)
        save(fig, "layer_heatmap.png")

    # rank x layer at the worst step
    worst = _worst(snaps)
    matrix = worst.get("rank_layer_grad_norms")
    if matrix and layers:
        m = np.array([[_num(v) for v in row] for row in matrix])
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.where(m > 0, m, np.nan))
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 2), max(2.5, 0.4 * len(m) + 1.5)))
        im = ax.imshow(logs, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=7)
        ax.set_yticks(range(len(m)), [f"rank {r}" for r in range(len(m))])
        for r, row in enumerate(m):
            for c, v in enumerate(row):
                if not math.isfinite(v):
                    ax.text(
                        c,
                        r,
                        "NaN" if math.isnan(v) else "Inf",
                        ha="center",
                        va="center",
                        color="red",
                        fontsize=7,
                    )
        ax.set_title(f"log10 local norm, rank x layer, at step {worst['step']}")
        fig.colorbar(im, ax=ax)
        save(fig, "rank_layer_at_worst.png")

    # per-rank norms
    ranks = [s.get("rank_grad_norms") or [] for s in snaps]
    if ranks and ranks[-1]:
        fig, ax = plt.subplots(figsize=(10, 4))
        for r in range(len(ranks[-1])):
            ax.plot(steps, [_num(x[r]) if r < len(x) else math.nan for x in ranks], lw=1, label=f"rank {r}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("Local (pre-all-reduce) gradient norm per rank")
        ax.legend(loc="upper right", fontsize=7, ncol=max(1, len(ranks[-1]) // 8))
        save(fig, "rank_norms.png")

    # noise scale
    gns = np.array([_num(s.get("gradient_noise_scale")) for s in snaps])
    if np.isfinite(gns).any():
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot(steps, gns, lw=1.5)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("B_simple (batch_size units)")
        ax.set_title("Gradient noise scale")
        save(fig, "noise_scale.png")

    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(_summary(snaps, skipped, written))
    return written + ["summary.md"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m distmon report RUN.jsonl -o DIR``."""
    parser = argparse.ArgumentParser(prog="python -m distmon", description="distmon tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="pictures and a summary of a run's JSONL log (log_path=)")
    rep.add_argument("log", help="the JSONL file distmon wrote (log_path / DISTMON_LOG_PATH)")
    rep.add_argument(
        "-o", "--out", default="distmon-report", help="output directory (default: distmon-report)"
    )
    args = parser.parse_args(argv)
    try:
        files = write_report(args.log, args.out)
    except ImportError:
        parser.error("the report needs matplotlib: pip install 'distmon[report]'")
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(f"distmon report: wrote {', '.join(files)} to {args.out}")
    return 0
