"""The report's pictures and summary of one run of a JSONL log (``python -m distmon report``).

Reads the log ``log_path=`` wrote, or the node logs of one job together (several files and/or
directories, every ``*.jsonl`` directly in a directory: ``run.jsonl`` and the ``run.node<n>.jsonl``
each node's serving rank writes beside it), as :mod:`distmon.report.log_reader` reads them: one run,
the latest unless ``--run-id ID`` or ``--run N`` picks another; each step's per-rank figures
from every node log, placed by global rank; malformed lines skipped and counted by reason;
memory bounded. Writes, with matplotlib (``pip install distmon[report]``):

- ``global_norm.png``: the global gradient norm over steps, anomaly events marked (the
  precursor's divergence warnings among them);
- ``layer_heatmap.png``: layer x step, log10 of each layer's norm (the first 127 layers, the
  rest folded into ``other``; past 2,000 steps, the largest of each bin of steps);
- ``rank_layer_at_worst.png``: rank x layer local norms at the worst step (the first
  non-finite one, else the strongest event, else the largest norm), the first 64 ranks;
- ``rank_norms.png``: the local norm of each of the first 64 ranks over steps;
- ``noise_scale.png``: the gradient noise scale over steps (when the run had ``batch_size``);
- ``summary.md``: steps, events (step, kind, rank, layer), the first non-finite step, the first
  divergence warning, skips,
  monitor errors, the runs the log holds, the lines skipped and why; the ranks: world size, the
  node logs read (node, ranks, lines), the ranks no node log reported, steps where node logs
  disagree on job-wide figures, and per rank over the run (every rank, not only the drawn
  ones): non-finite and unmeasured steps, monitor errors, the most outlying ranks.

A log that cannot be reported (missing, empty, no valid snapshot, no such run) or an output
directory that cannot be written is one line on stderr and exit code 2. Neither this module nor
``python -m distmon`` imports torch.
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .log_lines import MAX_LAYERS, MAX_RANKS, OTHER, describe_spans
from .log_reader import LogRead, describe_runs, describe_skips
from .run import Run

if TYPE_CHECKING:  # numpy and matplotlib are imported when a report is drawn, not with the module
    import numpy as np
    from matplotlib.figure import Figure


__all__ = ["write_report", "summary", "missing_ranks"]

HEATMAP_COLUMNS = 2000  # steps per heatmap row before steps are binned
MARKED_CELLS = 200  # non-finite cells of the rank x layer picture labelled "NaN"/"Inf"
LISTED = 10  # ranks named per per-rank list of the summary
LISTED_LOGS = 64  # node logs in the summary's table


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
        >>> from distmon.report.log_reader import read_log
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
    warned = run.event_steps.get("divergence_warning")
    if warned:  # the precursor (precursor=): a warning before the loss diverges
        first = next((e for e in run.events if e["kind"] == "divergence_warning"), None)
        if first is None:
            block = ""
        elif first["layer"]:
            block = f", attention block `{first['layer']}` (logit bound {first['value']:.4g})"
        else:  # the oscillation rule (PrecursorConfig(peak_lr=...))
            block = f", consecutive gradients' cosine {first['value']:.2f} while the rate still rises"
        more = f"; {len(warned)} warnings in all" if len(warned) > 1 else ""
        lines.append(f"- **divergence warning (precursor) at step {warned[0]}**{block}{more}")
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
    lines += ["", "## Ranks", "", *_ranks_section(log)]
    shown = f"the first {len(run.events)} of " if run.event_count > len(run.events) else ""
    lines += ["", f"## Events ({shown}{run.event_count})", ""]
    if run.events:
        lines += ["| step | kind | rank | layer | value | threshold |", "|---:|---|---:|---|---:|---:|"]
        lines += [
            f"| {e['step']} | {_cell(e['kind'])} | {e['rank']} | {_cell(e['layer']) or '-'} "
            f"| {e['value']:.4g} | {e['threshold']:.4g} |"
            for e in run.events
        ]
    else:
        lines.append("none")
    lines += ["", "## Pictures", ""] + [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def _top(values: array, n: int = LISTED) -> list[int]:
    """The ranks with the ``n`` largest positive values, largest first (lowest rank on a tie)."""
    return [r for r in sorted(range(len(values)), key=lambda r: -values[r]) if values[r] > 0][:n]


def missing_ranks(run: Run) -> list[str]:
    """The ranks no node log reported, each set with its steps, as sentences.

    Example:
        >>> from distmon.report.run import RunSpan
        >>> run = Run(RunSpan(1, "r", 1, 9))
        >>> run.steps.extend([1, 2]); run.missing[((2, 3),)] = 2; run.missing_first[((2, 3),)] = 1
        >>> missing_ranks(run)
        ['ranks 2-3 at 2 of 2 steps (from step 1)']
    """
    said = []
    for gaps, steps in run.missing.most_common():
        many = len(gaps) > 1 or gaps[0][0] != gaps[0][1]
        said.append(
            f"rank{'s' if many else ''} {describe_spans(gaps)} at {steps} of {len(run.steps)} steps "
            f"(from step {run.missing_first[gaps]})"
        )
    if run.missing_other:
        said.append(f"other ranks at {run.missing_other} more steps")
    return said


def _ranks_section(log: LogRead) -> list[str]:
    """The summary's ranks: world size, node logs, missing ranks, disagreements, per-rank figures."""
    run = log.run
    lines = [f"- world size {run.world_size}; {len(log.logs)} log{'s' if len(log.logs) > 1 else ''} read"]
    lines += ["", "| log | node | ranks | lines of this run |", "|---|---:|---|---:|"]
    for i, node_log in enumerate(log.logs[:LISTED_LOGS]):
        node, ranks = run.log_nodes.get(i, "-"), run.log_ranks.get(i, "-")
        lines.append(f"| {_cell(node_log.path)} | {node} | {ranks} | {run.log_lines[i]} |")
    if len(log.logs) > LISTED_LOGS:
        lines.append(f"| ({len(log.logs) - LISTED_LOGS} more) | | | |")
    lines.append("")
    missing = missing_ranks(run)
    if missing:
        lines.append(
            "- **ranks missing** (no log read reported them; their figures are NaN and not valid): "
            + "; ".join(missing)
        )
    if run.disagreements:
        fields = ", ".join(f"`{f}`" for f in run.disagree_fields)
        lines.append(
            f"- **node logs disagree** on job-wide fields at {run.disagreements} steps (first: step "
            f"{run.disagree_first}; {fields}): the line with the lowest ranks (node 0's) is reported"
        )
    for values, what in (
        (run.rank_nonfinite, "non-finite local gradient"),
        (run.rank_invalid, "local figures not measured (`rank_valid` false)"),
    ):
        top = _top(values)
        if top:
            more = f" (the {len(top)} with the most)" if sum(v > 0 for v in values) > len(top) else ""
            lines.append(f"- {what}{more}: " + ", ".join(f"rank {r} at {values[r]} steps" for r in top))
    top = _top(run.rank_errors)
    if top:
        lines.append(
            "- monitor errors at the end: " + ", ".join(f"rank {r}: {run.rank_errors[r]}" for r in top)
        )
    if run.untracked_ranks:
        lines.append(f"- ranks past {len(run.rank_score):,} are not in these per-rank figures")
    scored = [r for r in range(len(run.rank_score)) if not math.isnan(run.rank_score[r])]
    if scored:
        top = sorted(scored, key=lambda r: -run.rank_score[r])[:LISTED]
        lines += [
            "",
            f"Most outlying ranks (largest of `rank_outlier_scores` over the run, {len(top)} of "
            f"{len(scored)}):",
            "",
        ]
        lines += ["| rank | largest outlier score | at step |", "|---:|---:|---:|"]
        lines += [f"| {r} | {run.rank_score[r]:.4g} | {run.rank_score_step[r]} |" for r in top]
    return lines


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
    colors = {
        "spike": "tab:orange",
        "nonfinite": "tab:red",
        "vanishing": "tab:purple",
        "divergence_warning": "tab:brown",
    }
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
        absent = set(worst.missing)  # no log reported these ranks: not a non-finite gradient
        ax.set_yticks(
            range(len(m)), [f"rank {r}" + (" (no log)" if r in absent else "") for r in range(len(m))]
        )
        bad = np.argwhere(~np.isfinite(m) & ~np.isin(np.arange(len(m)), list(absent))[:, None])
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
