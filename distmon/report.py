"""``python -m distmon report RUN.jsonl -o DIR``: pictures and a summary of one run of a JSONL log.

Reads the log ``log_path=`` wrote (:mod:`distmon.log_reader`: one run of it, the latest unless
``--run-id ID`` or ``--run N`` picks another; malformed lines skipped and counted by reason;
memory bounded) and writes, with matplotlib (``pip install distmon[report]``):

- ``global_norm.png``: the global gradient norm over steps, anomaly events marked;
- ``layer_heatmap.png``: layer x step, log10 of each layer's norm (the first 127 layers, the
  rest folded into ``other``; past 2,000 steps, the largest of each bin of steps);
- ``rank_layer_at_worst.png``: rank x layer local norms at the worst step (the first
  non-finite one, else the strongest event, else the largest norm), the first 64 ranks;
- ``rank_norms.png``: the local norm of each of the first 64 ranks over steps;
- ``noise_scale.png``: the gradient noise scale over steps (when the run had ``batch_size``);
- ``summary.md``: steps, events (step, kind, rank, layer), the first non-finite step, skips,
  monitor errors, the runs the log holds, the lines skipped and why.

A log that cannot be reported (missing, empty, no valid snapshot, no such run) or an output
directory that cannot be written is one line on stderr and exit code 2. Neither this module nor
``python -m distmon`` imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .log_reader import (
    MAX_LAYERS,
    MAX_LINE_BYTES,
    MAX_RANKS,
    OTHER,
    LogError,
    LogRead,
    Run,
    as_float,
    describe_runs,
    describe_skips,
    read_log,
)

if TYPE_CHECKING:  # numpy and matplotlib are imported when a report is drawn, not with the module
    import numpy as np
    from matplotlib.figure import Figure

__all__ = ["write_report", "summary", "main"]

HEATMAP_COLUMNS = 2000  # steps per heatmap row before steps are binned
MARKED_CELLS = 200  # non-finite cells of the rank x layer picture labelled "NaN"/"Inf"


def _grid(rows: Sequence[array], width: int) -> np.ndarray:
    """Rows of varying length (array('d')) as one NaN-padded float matrix."""
    import numpy as np

    grid = np.full((len(rows), width), math.nan)
    for i, row in enumerate(rows):
        grid[i, : len(row)] = np.frombuffer(row, dtype=np.float64)[:width]
    return grid


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def summary(log: LogRead, pictures: Sequence[str]) -> str:
    """``summary.md`` of the run read, naming the pictures written.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write('{"step": 1, "grad_norm": 0.5, "run_id": "a"}\\n[1]\\n')
        >>> print(summary(read_log(f.name), []).splitlines()[2])
        - steps 1..1 (1 logged), world size 1
    """
    run = log.run
    lines = [
        f"# distmon run {run.span.run_id or '?'}",
        "",
        f"- steps {run.steps[0]}..{run.steps[-1]} ({len(run.steps)} logged), world size {run.world_size}",
        f"- skipped by the guard: {run.guard_skips}, by the GradScaler: {run.scaler_skips}",
        f"- invalid (unmeasured) steps: {run.invalid}; monitor errors at the end: {run.monitor_errors}",
    ]
    if run.restarts:
        where = ", ".join(f"after step {step} (line {line})" for step, line in run.restarts)
        lines.append(
            f"- resumed from a checkpoint {len(run.restarts)} time{'s' if len(run.restarts) > 1 else ''}: "
            f"{where}; the steps after each checkpoint are the resumed process's"
        )
    if run.first_nonfinite is not None:
        step, rank, layer = run.first_nonfinite
        lines.append(f"- **first non-finite step {step}**: rank {rank}, layer `{layer}`")
    gns = [g for g in run.noise_scale if math.isfinite(g)]
    if gns:
        lines.append(f"- gradient noise scale at the end: {gns[-1]:,.1f} (batch_size units)")
    if run.capped:
        lines.append(
            f"- layers: up to {run.most_layers} a step; the first {MAX_LAYERS - 1} drawn, the rest folded "
            f"into `{OTHER}` (root-sum-of-squares), as `max_layers={MAX_LAYERS}` folds them"
        )
    if run.most_ranks > MAX_RANKS:
        lines.append(f"- ranks: {run.most_ranks}; the first {MAX_RANKS} drawn")
    if log.run_count > 1:
        lines.append(
            f"- the log holds {log.run_count} runs (a job restarted into the same file): "
            f"{describe_runs(log.runs, log.run_count)}; this is #{run.span.index} "
            "(`--run-id ID` or `--run N` picks another)"
        )
    if log.skipped:
        lines.append(f"- lines of the log: {describe_skips(log.skipped, log.first_skipped)}")
    shown = f"the first {len(run.events)} of " if run.event_count > len(run.events) else ""
    lines += ["", f"## Events ({shown}{run.event_count})", ""]
    if run.events:
        lines += ["| step | kind | rank | layer | value | threshold |", "|---:|---|---:|---|---:|---:|"]
        lines += [
            f"| {e['step']} | {_cell(e['kind'])} | {e['rank']} | {_cell(e['layer']) or '-'} "
            f"| {as_float(e['value']):.4g} | {as_float(e['threshold']):.4g} |"
            for e in run.events
        ]
    else:
        lines.append("none")
    lines += ["", "## Pictures", ""] + [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def write_report(log: LogRead, out_dir: str) -> list[str]:
    """Write the pictures and ``summary.md`` of the run in ``log`` into ``out_dir``; returns the
    files written. Raises ``ImportError`` without matplotlib, ``OSError`` when ``out_dir`` is
    not writable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    run: Run = log.run
    steps = np.array(run.steps, dtype=np.int64)
    written: list[str] = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        try:
            fig.savefig(os.path.join(out_dir, name), dpi=110)
        finally:
            plt.close(fig)
        written.append(name)

    # global norm with events
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(steps, np.array(run.grad_norm), lw=1, label="global grad norm")
    colors = {"spike": "tab:orange", "nonfinite": "tab:red", "vanishing": "tab:purple"}
    for kind in sorted(run.event_steps):
        for i, step in enumerate(run.event_steps[kind]):
            label = kind if i == 0 else None
            ax.axvline(step, color=colors.get(kind, "tab:green"), alpha=0.5, lw=1, label=label)
    for i, (step, _) in enumerate(run.restarts):  # a resumed process took over after this step
        ax.axvline(step, color="black", ls="--", lw=1, label="resumed" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm")
    ax.set_title("Global gradient norm, anomaly events and resumes marked")
    ax.legend(loc="upper right")
    save(fig, "global_norm.png")

    # layer x step heatmap
    layers, order = run.layers, run.order
    if layers:
        grid = _grid(run.layer_norms, len(run.columns) + 1)[:, order].T
        title = "log10 layer gradient norm (model order, top to bottom)"
        if len(steps) > HEATMAP_COLUMNS:  # the largest of each bin: a spike stays visible
            starts = np.linspace(0, len(steps), HEATMAP_COLUMNS, endpoint=False).astype(np.int64)
            grid = np.fmax.reduceat(grid, starts, axis=1)
            title += f", largest of every {len(steps) / HEATMAP_COLUMNS:.3g} steps"
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.where(grid > 0, grid, np.nan))
        fig, ax = plt.subplots(figsize=(10, max(3, 0.25 * len(layers) + 1)))
        extent = (steps[0], max(steps[-1], steps[0] + 1), len(layers), 0)
        im = ax.imshow(logs, aspect="auto", interpolation="nearest", extent=extent)
        ax.set_yticks(np.arange(len(layers)) + 0.5, layers, fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
        save(fig, "layer_heatmap.png")

    # rank x layer at the worst step
    worst = run.worst()
    if worst.matrix and layers:
        m = _grid(worst.matrix, len(run.columns) + 1)[:, order]
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.where(m > 0, m, np.nan))
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 2), max(2.5, 0.4 * len(m) + 1.5)))
        im = ax.imshow(logs, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=7)
        ax.set_yticks(range(len(m)), [f"rank {r}" for r in range(len(m))])
        bad = np.argwhere(~np.isfinite(m))
        for r, c in bad[:MARKED_CELLS]:
            label = "NaN" if math.isnan(m[r, c]) else "Inf"
            ax.text(c, r, label, ha="center", va="center", color="red", fontsize=7)
        more = f"; {len(bad)} non-finite cells, {MARKED_CELLS} marked" if len(bad) > MARKED_CELLS else ""
        ax.set_title(f"log10 local norm, rank x layer, at step {worst.step}{more}")
        fig.colorbar(im, ax=ax)
        save(fig, "rank_layer_at_worst.png")

    # per-rank norms
    width = min(run.most_ranks, MAX_RANKS)
    if width:
        ranks = _grid(run.rank_norms, width)
        fig, ax = plt.subplots(figsize=(10, 4))
        for r in range(width):
            ax.plot(steps, ranks[:, r], lw=1, label=f"rank {r}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("Local (pre-all-reduce) gradient norm per rank")
        ax.legend(loc="upper right", fontsize=7, ncol=max(1, width // 8))
        save(fig, "rank_norms.png")

    # noise scale
    gns = np.array(run.noise_scale)
    if np.isfinite(gns).any():
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot(steps, gns, lw=1.5)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("B_simple (batch_size units)")
        ax.set_title("Gradient noise scale")
        save(fig, "noise_scale.png")

    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary(log, written))
    return written + ["summary.md"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m distmon report RUN.jsonl -o DIR [--run-id ID | --run N]``."""
    parser = argparse.ArgumentParser(prog="python -m distmon", description="distmon tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="pictures and a summary of a run's JSONL log (log_path=)")
    rep.add_argument("log", help="the JSONL file distmon wrote (log_path / DISTMON_LOG_PATH)")
    rep.add_argument("-o", "--out", default="distmon-report", help="output directory (default: %(default)s)")
    which = rep.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="report the latest run with this run_id (default: the latest run)")
    which.add_argument("--run", type=_positive, metavar="N", help="report the N-th run of the log (from 1)")
    rep.add_argument(
        "--max-line-mib",
        type=float,
        default=MAX_LINE_BYTES / 2**20,
        help=f"skip lines longer than this, unread (default: {MAX_LINE_BYTES / 2**20:g})",
    )
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"distmon report: {message}", file=sys.stderr)
        return 2

    if importlib.util.find_spec("matplotlib") is None:  # said before a long read, imported after it
        return fail("the report needs matplotlib: pip install 'distmon[report]'")
    try:
        log = read_log(args.log, args.run_id, args.run, max(1, int(args.max_line_mib * 2**20)))
    except LogError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot read {args.log}: {e.strerror or e}")
    if log.run_count > 1:
        print(
            f"distmon report: {args.log} holds {log.run_count} runs: "
            f"{describe_runs(log.runs, log.run_count)}; "
            f"reporting #{log.run.span.index} (--run-id ID or --run N picks another)"
        )
    if log.skipped:
        print(f"distmon report: {describe_skips(log.skipped, log.first_skipped)}")
    try:
        files = write_report(log, args.out)
    except OSError as e:
        return fail(f"cannot write the report to {args.out}: {e.strerror or e}")
    print(f"distmon report: wrote {', '.join(files)} to {args.out}")
    return 0
