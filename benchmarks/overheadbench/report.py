"""The Markdown: ``overhead.md`` (every table, the verdicts, the method) and the README's
Performance section."""

import json
import os
from collections.abc import Callable

from .approaches import LABELS, REPORTS, label
from .fmt import fmt_bytes, fmt_num, fmt_paired, fmt_range
from .plot import plot
from .results import RunResult, SizeResult
from .verdicts import TARGET_SIZE


def write_reports(
    res: RunResult,
    out_dir: str,
    readme_path: str | None,
    render: Callable[[RunResult, str | None], str] | None = None,
) -> None:
    """``overhead.json``, ``overhead.png`` and ``overhead.md`` (by ``render``, default
    :func:`render_md`) in ``out_dir``; the README section at ``readme_path`` when given."""
    os.makedirs(out_dir, exist_ok=True)
    res.save(os.path.join(out_dir, "overhead.json"))
    png = plot(res, os.path.join(out_dir, "overhead.png"))
    md = (render or render_md)(res, png)
    with open(os.path.join(out_dir, "overhead.md"), "w") as f:
        f.write(md)
    if readme_path:
        with open(readme_path, "w") as f:
            f.write(render_readme(res))


def size_table(s: SizeResult, hist_freq: int) -> list[str]:
    """One size: bare DDP and the floor, then a row per approach, then the order check."""
    info = s.info
    lines = [
        f"### {info.size}: {info.n_params / 1e6:.2f}M parameters in {info.n_tensors} tensors, "
        f"{info.tokens_per_rank} tokens/rank/step",
        "",
        f"Bare DDP step {fmt_num(s.baseline_ms)} ms wall, {fmt_num(s.baseline_cpu_ms)} ms CPU. Floor (one "
        "fused read "
        f"of the {fmt_bytes(info.grad_bytes)} of gradients): {fmt_num(s.floor_ms, 2)} ms wall, "
        f"{fmt_num(s.floor_cpu_ms, 2)} ms CPU. {s.n_rounds} interleaved rounds; min-max over "
        f"{s.repeats} blocks of rounds."
        + (
            f" DDP with gradient_as_bucket_view=True ({info.bucket_view_reason})."
            if info.gradient_as_bucket_view
            else ""
        )
        + (
            f" NOTE: distmon sites not timed (its private names changed; update the benchmark's "
            f"instrumentation): {', '.join(info.uninstrumented)}."
            if info.uninstrumented
            else ""
        ),
        "",
        "| approach | step ms (wall) | ratio (min-max) | extra ms | extra, passes | step CPU ms | "
        "CPU ratio (min-max) | own code CPU ms | own code, passes | peak mem over baseline | kept state |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, r in s.rows.items():
        name = label(a, hist_freq)
        if a == "baseline":
            lines.append(
                f"| {name} | {fmt_num(r.median_ms)} | 1 | - | - | {fmt_num(r.cpu_ms)} | 1 | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {name} | {fmt_num(r.median_ms)} | {fmt_range(r.ratio, r.ratio_min, r.ratio_max)} | "
            f"{fmt_num(r.extra_ms)} | {fmt_num(r.extra_passes)} | "
            f"{fmt_num(r.cpu_ms)} | {fmt_range(r.cpu_ratio, r.cpu_ratio_min, r.cpu_ratio_max)} | "
            f"{fmt_num(r.own_ms, 2)} | {fmt_num(r.own_passes, 2)} | "
            f"{fmt_bytes(r.peak_over_baseline)} | {fmt_bytes(r.kept_bytes)} |"
        )
    lines.append("")
    checks = [
        f"{label(a, hist_freq)} {r.order.paired_after:.4f} after it, {r.order.paired_before:.4f} before it "
        f"({r.order.n_after} and {r.order.n_before} rounds)"
        for a, r in s.rows.items()
        if a != "baseline" and r.order and r.order.n_after and r.order.n_before
    ]
    if checks:
        lines += [
            "Order check, paired median ratio to bare DDP by the copy's place in the round "
            "(a cost of the place, not the copy, shows as a gap between the two; it cancels in the "
            "paired ratio over all rounds): " + "; ".join(checks) + ".",
            "",
        ]
    return lines


def summary_table(res: RunResult) -> list[str]:
    """distmon with its defaults, one row per size."""
    L = [
        "| model | params | tensors | tokens/rank | bare DDP step ms | floor ms (wall / CPU) | "
        "distmon ratio, wall (min-max) | paired ratio [95% CI] | ratio, CPU (min-max) | extra ms, wall "
        "(passes) | own code CPU ms (passes) | "
        "kept state | hand-written own code CPU ms (passes) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res.sizes:
        i, r, h = s.info, s.rows["distmon"], s.rows.get("hand-written")
        L.append(
            f"| {i.size} | {i.n_params / 1e6:.2f}M | {i.n_tensors} | {i.tokens_per_rank} | "
            f"{fmt_num(s.baseline_ms)} | {fmt_num(s.floor_ms, 2)} / {fmt_num(s.floor_cpu_ms, 2)} | "
            f"{fmt_range(r.ratio, r.ratio_min, r.ratio_max)} | {fmt_paired(r)} | "
            f"{fmt_range(r.cpu_ratio, r.cpu_ratio_min, r.cpu_ratio_max)} | "
            f"{fmt_num(r.extra_ms)} ({fmt_num(r.extra_passes)}) | "
            f"{fmt_num(r.own_ms, 2)} ({fmt_num(r.own_passes, 2)}) | {fmt_bytes(r.kept_bytes)} | "
            + (f"{fmt_num(h.own_ms, 2)} ({fmt_num(h.own_passes, 2)}) |" if h else "- |")
        )
    return L


def machine_lines(res: RunResult) -> list[str]:
    """Machine, software, load and command, as list items."""
    m = res.machine
    dev = m.gpu or "no GPU available (the CUDA/NCCL path and its no-host-sync check did not run)"
    la = m.load_avg_start
    return [
        f"- Machine: {m.cpu}, {m.cores} cores; {dev}",
        f"- torch {m.torch}, Python {m.python}, backend {m.backend}, {m.world_size} ranks, "
        f"{m.threads_per_rank} thread(s) per rank; distmon {'?' if m.distmon is None else m.distmon} (git "
        f"{'?' if m.git is None else m.git})",
        f"- Load average at start {tuple(round(x, 1) for x in la) if la else '?'}, at end "
        f"{tuple(round(x, 1) for x in res.load_avg_end) if res.load_avg_end else '?'} "
        "(the machine is shared: other jobs ran during the measurement)",
        f"- Command: `{res.command}` ({res.mode} mode, {res.wall_s / 60:.1f} min, {res.date})",
    ]


def render_md(res: RunResult, png: str | None) -> str:
    """``overhead.md``."""
    sizes = res.sizes
    L = ["# distmon overhead benchmark", ""]
    L += machine_lines(res)
    L += ["", "## Results", ""]
    for msg in res.skipped:
        L += [f"**Not measured** -- {msg}", ""]
    if png:
        L += [f"![overhead]({os.path.basename(png)})", ""]
    L += ["distmon with its defaults, across model sizes:", ""] + summary_table(res) + [""]
    L += ["Every approach, per model (all measured in the same run, interleaved step by step):", ""]
    for s in sizes:
        L += size_table(s, res.hist_freq)
        hist, hist_1 = s.rows.get("wandb-hist"), s.rows.get("wandb-hist-1")
        if hist and hist_1:
            a = hist.own_ms + hist_1.own_ms / res.hist_freq
            L += [
                f"wandb-style every {res.hist_freq} steps, amortized: {a:.2f} ms CPU of own code per step "
                f"({a / s.floor_cpu_ms:.2f} passes).",
                "",
            ]
    L += ["## Acceptance", ""]
    for what, verdict, detail in res.acceptance:
        L.append(f"- {verdict}: {what} -- {detail}")
    L += ["", "Check that the monitors measured what they claim (same steps, same data on every copy): "]
    for s in sizes:
        ref = s.health.get("hand-written")
        parts = []
        for a in ("distmon", "distmon-detailed"):
            d = s.health.get(a)
            if d:
                parts.append(f"{a} step {d.step} global norm {d.grad_norm:.6g}, {d.errors} monitor errors")
        L.append(
            f"- {s.info.size}: "
            + "; ".join(parts)
            + (f"; hand-written (independent) {ref.grad_norm:.6g}" if ref else "")
        )
    L += ["", "## Where distmon's time goes (torch.profiler)", ""]
    L += profile_lines(sizes)
    L += [
        "Own-code time per step by site, CPU ms (wall ms, which adds blocking waits and preemption by other "
        "jobs), median over timed steps, mean over ranks; `local_sums` = the comm hook's own work on every "
        "bucket, or without one its forward and backward hooks, and the one fused read of the local "
        "gradients where the backward ends, `reduced_sums` = one fused read of the reduced gradients after "
        "DDP's, `before_step` = fold the local sums, pack and start the step's collective (optimizer step "
        "pre-hook), `after_step` = optimizer step post-hook without its export (fold the reduced sums into "
        "the step's row), `export` = totals and detectors over the rows since the last export and the host "
        "copy, once per `export_every` steps, mean CPU time of one export divided by `export_every` (no wall "
        "figure), `publisher` = host thread decoding exported rows (off the training thread):",
        "",
    ]
    for s in sizes:
        for a in ("distmon", "distmon-detailed"):
            r = s.rows.get(a)
            if r:
                wall = r.sites_wall_ms
                L.append(
                    f"- {s.info.size}, {LABELS[a]}: "
                    + ", ".join(
                        f"{k.split('::')[-1]} {v:.3f}" + (f" ({wall[k]:.3f})" if k in wall else "")
                        for k, v in r.sites_ms.items()
                    )
                )
    if any(s.sync_debug for s in sizes):
        L += ["", "## GPU: host syncs on non-export steps (torch.cuda.set_sync_debug_mode('error'))", ""]
        for s in sizes:
            L.append(f"- {s.info.size}: {json.dumps(s.sync_debug)}")
    else:
        L += [
            "",
            "## GPU",
            "",
            "No GPU was available for this run: the NCCL path, `torch.cuda.max_memory_allocated` and the "
            '`torch.cuda.set_sync_debug_mode("error")` check (no host sync on distmon\'s non-export steps, '
            "with "
            "a positive control) are implemented in this script but did not run. On a GPU machine the same "
            "command runs them and reports them here.",
        ]
    L += ["", "## What each approach reports", ""]
    for a in res.approaches:
        L.append(f"- **{label(a, res.hist_freq)}**: {REPORTS[a]}")
    L += ["", "## How it is measured", ""] + method_notes(res)
    return "\n".join(L) + "\n"


def profile_lines(sizes: list[SizeResult]) -> list[str]:
    """The torch.profiler breakdown of every profiled distmon copy."""
    L = [
        "torch.profiler over a few steps of each distmon copy (after the timed rounds; the profiler's own "
        "overhead inflates small ops). The reduced-gradient sums run in a callback on gloo's threads, "
        "which the "
        "profiler does not record on CPU: see the own-code table below for them.",
        "",
    ]
    for s in sizes:
        for name, p in (s.profile or {}).items():
            if name == "baseline":
                continue
            sites = p.sites_ms
            step = sites.get("bench::step", float("nan"))
            mine = {k: v for k, v in sites.items() if k.startswith("distmon::")}
            tot = sum(mine.values())
            L.append(
                f"**{s.info.size}, {LABELS[name]}** ({p.steps if p.steps is not None else '?'} profiled "
                f"steps): step {step:.1f} ms; distmon's sites "
                f"{tot:.2f} ms = {100 * tot / step:.2f}% of it (floor {s.floor_ms:.2f} ms wall):"
            )
            L.append("")
            dev = p.device_ms or {}
            L.append("| site | ms/step (host) | GPU ms/step | calls/step | torch ops/step |")
            L.append("|---|---:|---:|---:|---:|")
            for k, v in sites.items():
                if k != "bench::step":
                    g = f"{dev[k]:.3f}" if k in dev else "-"
                    L.append(
                        f"| {k} | {v:.3f} | {g} | {p.calls_per_step.get(k, 0):.0f} | "
                        f"{p.ops_per_step.get(k, 0):.0f} |"
                    )
            L.append("")
            L.append(
                "Top ops inside distmon's sites (self CPU ms/step): "
                + ", ".join(f"`{k}` {v:.3f}" for k, v in list(p.distmon_ops_ms.items())[:10])
            )
            L.append("")
    if len(L) == 2:
        L = ["(not profiled: run with --profile)", ""]
    return L


def method_notes(res: RunResult) -> list[str]:
    """How it is measured, as list items."""
    sizes = res.sizes
    mem_method = sizes[0].mem_method if sizes else ""
    hf = res.hist_freq
    return [
        "- One torchrun job, one DDP copy per approach (deep copies of one seeded GPT from "
        "`launch/model.py`, "
        "AdamW), the same batch for every approach in a round. Each round runs one step of every approach "
        "in a "
        "balanced order (pairs of rounds in an order and its reverse, rotated one further per pair, so every "
        "approach runs in every place equally often); each step is timed around forward + backward + the "
        "approach's extra work + `optimizer.step()`, after a `dist.barrier()`; `zero_grad` is outside. "
        "Machine drift hits all approaches alike and cancels in the ratios.",
        "- step ms (wall) = `time.perf_counter`, the slowest rank's; step CPU ms = `time.process_time` (CPU "
        "seconds of all of the rank's threads: training thread, gloo's threads, distmon's publisher thread), "
        "mean over ranks. On a shared machine other jobs inflate wall time, not CPU time; both are given.",
        f"- Warm-up: {res.warmup} round(s) and one memory-measuring round, not timed. ratio = median / "
        "bare "
        "DDP's median; (min-max) = the same ratio within each block of consecutive rounds.",
        "- extra = median - bare DDP median; passes = extra / floor, the floor being `torch._foreach_norm` "
        "over "
        "the bare DDP copy's gradients timed alone after its step (median over rounds; wall or CPU time as "
        "the "
        "column).",
        "- own code CPU ms = CPU time (`time.thread_time`) inside the approach's own code per step, summed "
        "over "
        "its call sites: for distmon its comm-hook work (local sums before the inner all-reduce hook, "
        "reduced "
        "sums in the future callback) and its optimizer step hooks (fold, pack and issue the step's "
        "collective; wait); "
        "its "
        "export (totals, detectors and the host copy, once per `export_every` steps) is timed on every "
        "export "
        "(mean over the exports outside the profiler) and amortized, divided by `export_every`, as a "
        "median step "
        "would miss it; for the peers their hook bodies or calls. It resolves the differences "
        "of a few ms that multi-second steps on a shared machine bury in noise, but not indirect costs "
        "(Python comm-hook dispatch, GIL hand-offs, cache effects): the step columns carry those.",
        f"- wandb-style every {hf} steps: the median step carries only the per-parameter hook; the "
        "amortized cost "
        "is given below each table. It follows wandb's GPU path (min/max `.item()`, `torch.histc` with 64 "
        "bins, "
        "`.cpu()`) without wandb's NaN/Inf filtering (two more copies per parameter): a lower bound of "
        "wandb.",
        "- Lightning: `grad_norm(module, 2)` as called from `on_before_optimizer_step`, every step "
        "(logging its "
        "dict not included). Tutorial and wandb-style hooks see *local* gradients; Lightning and the "
        "hand-written best effort see the reduced ones; distmon sees both. Under DDP the reduced gradients "
        "are "
        "identical on every rank, so the hand-written all_reduce adds a collective and no information; it is "
        "kept as specified.",
        f"- Memory: peak over baseline = {mem_method} for one step, minus the same for bare DDP (allocations "
        "that do not raise the step's peak cost nothing here; small differences are allocation-timing "
        "noise). "
        "kept state = bytes of the tensors an approach keeps between steps; for distmon, every tensor "
        "reachable "
        "from its step tracker (per-parameter sums, parameter->layer map, bucket layouts, gather buffers, "
        "the "
        "device ring and its host copies, detector state), found by walking its objects. Python objects on "
        "the "
        "host (snapshots) are not counted.",
        '- distmon runs with `serve="none"` (no HTTP server in a benchmark) and otherwise its defaults '
        "(export "
        "every 10 steps, rank x layer gather, detectors on); DISTMON_* environment variables are ignored. "
        "The "
        "instrumentation wraps distmon's entry points from outside (no distmon file is changed) and costs "
        "about "
        "a microsecond per call.",
    ]


def render_readme(res: RunResult) -> str:
    """The README's Performance section: the headline, the table across sizes, the verdicts.

    Everything else (the alternatives, where distmon's time goes, the method, the findings'
    details) stays in ``overhead.md``, which the section links to.
    """
    by = {s.info.size: s for s in res.sizes}
    L = ["## Performance", ""]
    t = by.get(TARGET_SIZE)
    if t:
        r = t.rows["distmon"]
        L.append(
            f"On a {t.info.n_params / 1e6:.0f}M-parameter GPT ({t.info.tokens_per_rank:,} "
            "tokens per "
            f"rank per step, {res.machine.world_size} CPU ranks on gloo) distmon with its defaults "
            f"spends {r.own_ms:.1f} ms of CPU per {t.baseline_ms / 1e3:.1f} s step in its own code "
            f"({r.own_passes:.2f} reads of the gradient bytes, {100 * (r.own_ratio - 1):.2f}% of the "
            "step); "
            f"the paired median step-time ratio to bare DDP, end to end, is "
            f"{fmt_paired(r)} "
            f"(95% CI over {t.n_rounds} rounds; ratio of medians {r.ratio:.3f}, min-max over blocks "
            f"of rounds {r.ratio_min:.3f}-{r.ratio_max:.3f})."
        )
        L.append("")
    L += [
        'distmon with its defaults, across model sizes ("passes": extra time in units of one fused read of '
        "every gradient byte, `torch._foreach_norm` over the gradients, timed alone):",
        "",
    ]
    L += summary_table(res) + ["", "Verdicts:", ""]
    L += [f"- {verdict}: {what}" for what, verdict, _ in res.acceptance]
    m = machine_lines(res)
    L += [
        "",
        "Measured on " + m[0][len("- Machine: ") :] + "; " + m[1][2:] + ". " + m[2][2:] + ". "
        f"Reproduce with `{res.command}`. The comparison with the alternatives people use today (tutorial "
        "hooks, wandb-style histograms, Lightning's grad_norm, a hand-written best effort), where "
        "distmon's time "
        "goes, the findings in detail and the method: "
        "[benchmarks/results/overhead.md](benchmarks/results/overhead.md).",
        "",
    ]
    if not res.machine.gpu:
        L += [
            "No GPU was available for these numbers; on a GPU the same command uses NCCL, measures peak "
            "memory "
            "with `torch.cuda.max_memory_allocated` and checks under "
            '`torch.cuda.set_sync_debug_mode("error")` '
            "that distmon's non-export steps never sync the host.",
            "",
        ]
    return "\n".join(L)
