#!/usr/bin/env python3
"""Does distmon's precursor warn of divergence earlier than the alternatives? Side by side, same runs.

    python benchmarks/early_warning.py            # the sweep (49 runs), the hold-out (26), stress (20),
                                                  # validation (24) and fast warm-up runs (13):
                                                  # ~45-55 min on 2 cores
                                                  # the first time (recordings are cached), then
                                                  # ~1 min; + cost
    python benchmarks/early_warning.py --quick    # smoke: 2 short runs, under a minute

Runs (or reads from the cache) the reproductions of ``benchmarks/divergence`` (a tiny pre-LN
GPT on stdlib bytes, AdamW, the learning rate ramped to where each mechanism sets in), judges
divergence from each run's loss alone, and applies to every run: distmon's precursor
(``distmon/verdicts/precursor.py``, the code that ships, on the sampled signal), distmon's existing
explosion detector (``GradMonitor(detect=True)``'s spike events, recorded live), Lightning's
SpikeDetection rule on the loss, and a global gradient-norm threshold (set at the largest
norm any healthy run reached after step 50: the best a fixed threshold can do without a false
warning, tuned on these very runs). Writes ``early_warning.json`` (per detector:
diverging_runs, detected, median_lead_steps, healthy_runs, false_warnings, per-run details),
``early_warning.md`` and ``early_warning.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's distmon and benchmarks/

import numpy as np  # noqa: E402

from benchmarks.divergence import candidates, cost, detectors, runs  # noqa: E402
from benchmarks.divergence.divergence import FACTOR, WINDOW, divergence_step  # noqa: E402
from benchmarks.divergence.model import ModelConfig  # noqa: E402
from benchmarks.divergence.plot import plot  # noqa: E402
from benchmarks.divergence.train import RunSpec  # noqa: E402
from distmon.verdicts.precursor import PrecursorConfig  # noqa: E402

# the shipped rule: each attention block's logit bound, sampled every 10 steps, above 1000
CHOSEN: list[tuple[str, float | None]] = [("attn_bound", PrecursorConfig().bound)]
CONFIG = PrecursorConfig()
CHOSEN_LABEL = (
    "each attention block's logit bound max|q| max|k| / sqrt(d_head) (queries and keys as the dot "
    "product sees them), sampled every 10 steps; a warning once it is above 1000 for 2 samples in a row "
    "(the defaults of `PrecursorConfig`)"
)
# with PrecursorConfig(peak_lr=the run's peak rate): the oscillation rule as well
OSCILLATION = PrecursorConfig(peak_lr=1.0)  # the peak itself is each run's own (schedule=True)
WITH_OSCILLATION: list[tuple[str, float | None]] = [*CHOSEN, ("1-grad_cos", OSCILLATION.oscillation_bound)]
OSCILLATION_LABEL = (
    "and, with `PrecursorConfig(peak_lr=` the run's peak rate `)`, the cosine between consecutive "
    f"steps' gradients (the mean of the 10 pairs up to each sample) below {OSCILLATION.cosine_below} for "
    f"2 samples in a row while the peak rate is {OSCILLATION.rate_headroom} times the rate at the sample "
    "or more"
)
SETS = tuple(runs.sets())
AFTER = 50  # the alternatives' warm-up in steps (distmon's DetectorConfig.warmup_steps)


def detector_table(triples, healthy_gn: float) -> dict[str, dict[str, object]]:  # noqa: ANN001
    """Every detector's summary over the same runs."""

    def spike(rec):  # noqa: ANN001, ANN202
        return detectors.distmon_spike_steps(rec)

    def lightning(rec):  # noqa: ANN001, ANN202
        return detectors.lightning_spike_step([float(v) for v in rec["loss"]])

    return {
        "distmon_precursor": detectors.summarize(
            triples, lambda r: detectors.precursor_steps(r, CHOSEN, CONFIG)
        ),
        "distmon_precursor_peak_lr": detectors.summarize(
            triples, lambda r: detectors.precursor_steps(r, WITH_OSCILLATION, OSCILLATION, schedule=True)
        ),
        "distmon_spike": detectors.summarize(triples, spike),
        "lightning_spike": detectors.summarize(triples, lightning),
        "gradnorm_threshold": detectors.summarize(
            triples, lambda r: detectors.gradnorm_steps(r, healthy_gn, after=AFTER)
        ),
    }


LABELS = {
    "distmon_precursor": "distmon precursor",
    "distmon_precursor_peak_lr": "distmon precursor, peak_lr=",
    "distmon_spike": "distmon spike",
    "lightning_spike": "Lightning SpikeDetection",
    "gradnorm_threshold": "gradient-norm threshold",
}


def head_to_head(table: dict[str, dict[str, object]]) -> dict[str, dict[str, int]]:
    """Per alternative: diverging runs where the precursor (with ``peak_lr``) warned earlier, at the
    same step, later."""
    mine = {r["run"]: r for r in table["distmon_precursor_peak_lr"]["runs"] if r["diverged_at"] is not None}
    out = {}
    for name, summary in table.items():
        if name.startswith("distmon_precursor"):
            continue
        earlier = same = later = 0
        for r in summary["runs"]:
            if r["diverged_at"] is None:
                continue
            a = mine[r["run"]].get("lead_steps")
            b = r.get("lead_steps")
            a, b = (-1 if a is None else a), (-1 if b is None else b)
            earlier += a > b
            same += a == b
            later += a < b
        out[name] = {"earlier": earlier, "same": same, "later": later}
    return out


def markdown(result: dict[str, object]) -> str:
    lines = [
        "# Early warning of divergence: distmon's precursor against the alternatives",
        "",
        f"`{result['command']}` ({result['elapsed_s']:.0f} s). Model: {result['model']}. "
        f"Divergence: the loss's {WINDOW}-step mean above {FACTOR} x its best (or non-finite), "
        "from the loss alone. Lead = divergence step - first warning step (a warning after the "
        "divergence is no detection). False warnings: warning episodes (warnings at most 10 steps "
        "apart count once) over the healthy runs. Classes (`benchmarks/divergence/runs.py`): "
        "**attention** no qk-layernorm, no z-loss, peak rate 0.7/1.0; **qkln** qk-layernorm, no z-loss, "
        "peak 0.5/1.0; **mitigated** qk-layernorm + z-loss 1e-4, peak 0.5; **gray** no mitigation, "
        "peak 0.3 (attention logits blow up, the loss may or may not pass the divergence bar); "
        "**healthy** no mitigation at peak 0.003/0.01, qk-layernorm + z-loss 1e-4 at peak 0.2/0.3 "
        "(and in the later sets up to 0.4, some after warm-ups of 50-500 steps); "
        "**constant** (stress, validation and fast warm-up runs) qk-layernorm (some with z-loss) "
        "warmed up to 0.45-0.6 in 50-200 steps: a divergence at (or near) a constant rate.",
        "",
        "distmon precursor: `distmon.verdicts.precursor.PrecursorDetector` on "
        f"{result['precursor']['label']}; `peak_lr=`: {result['precursor']['oscillation']}.",
        "",
        "On the sweep:",
        "",
        "| detector | detected / diverging | median lead (steps) | min lead "
        "| median lead / steps to divergence | false warnings (healthy runs warned) / healthy runs "
        "| the precursor with peak_lr= earlier on |",
        "|---|---|---|---|---|---|---|",
    ]
    h2h = result["head_to_head"]
    for name, s in result["detectors"].items():
        med = "-" if s["median_lead_steps"] is None else f"{s['median_lead_steps']:.0f}"
        mn = "-" if s["min_lead_steps"] is None else f"{s['min_lead_steps']}"
        frac = "-" if s["median_lead_fraction"] is None else f"{100 * s['median_lead_fraction']:.0f}%"
        vs = "" if name not in h2h else f"{h2h[name]['earlier']}/{s['diverging_runs']} runs"
        lines.append(
            f"| {LABELS[name]} | {s['detected']}/{s['diverging_runs']} | {med} | {mn} | {frac} | "
            f"{s['false_warnings']} ({s['healthy_runs_warned']}) / {s['healthy_runs']} | {vs} |"
        )
    if result.get("sets"):
        lines += ["", "## Every set of runs", ""]
        lines += [
            "Detected / diverging runs, median lead (as % of the steps to divergence); healthy runs warned. "
            "The sweep and the hold-out runs are those every candidate was scored on; the stress runs "
            "were recorded while the oscillation rule was chosen (near its edges: healthy runs warmed up "
            "close to the critical rate, runs diverging at a constant rate after a 100-step warm-up); "
            "the validation runs were recorded after it was fixed and scored once; the fast warm-ups "
            "(50-200 steps) in a later session, to test a gradient-norm jump rule (below), and scored "
            "once (`runs.py`). "
            "The gradient-norm threshold is the sweep's.",
            "",
            "| detector | " + " | ".join(SETS) + " | all |",
            "|---" * (len(SETS) + 2) + "|",
        ]
        for name, cells in result["sets"].items():
            lines.append(f"| {LABELS[name]} | " + " | ".join(cells[s] for s in (*SETS, "all")) + " |")
        lines.append("")
        for name in ("distmon_precursor", "distmon_precursor_peak_lr"):
            warned = result["sets"][name]["warned"]
            lines.append(f"Healthy runs warned by {LABELS[name]} (its first warning): {warned or 'none'}.  ")
    if result.get("jumps"):
        lines += ["", "## A gradient-norm jump rule for the constant-rate class (tried, not kept)", ""]
        lines += [
            "The largest rise of the global gradient norm within 100 steps (10-step means, from step 50 "
            "on, up to the divergence): over the healthy runs, the largest; over the diverging runs and "
            "those of the constant class, the range. Runs diverging at a constant rate after a short "
            "warm-up jump further than any healthy run of the sets recorded before them, but healthy "
            "fast warm-ups (recorded to test that) jump nearly as far: the norm jumps with the warm-up's "
            "speed, not only before a divergence, and no threshold keeps a margin on both.",
            "",
            "| set | healthy (largest) | diverged (range) | constant class (range) |",
            "|---|---|---|---|",
        ]
        for name, row in result["jumps"].items():
            lines.append(f"| {name} | {row['healthy']} | {row['diverged']} | {row['constant']} |")
    lines += ["", "## Per class: detected / diverged, median lead (lead as % of the steps to divergence)", ""]
    classes = list(next(iter(result["by_class"].values())))
    lines += ["| detector | " + " | ".join(classes) + " |", "|---" * (len(classes) + 1) + "|"]
    for name, row in result["by_class"].items():
        lines.append(f"| {LABELS[name]} | " + " | ".join(row[c] for c in classes) + " |")
    if result.get("candidates"):
        lines += [
            "",
            "## Every candidate signal and rule (sampled every 10 steps, 2 samples in a row unless said)",
            "",
            "Hold-out runs (`runs.holdout()`): seeds the sweep does not use, which played no part in "
            f"choosing any row: {result['holdout']}.",
            "",
        ]
        lines.append(candidates.table(result["candidates"]))
    lines += ["", "## Which signal leaves the healthy range first (verifying the mechanisms)", ""]
    lines += [
        "Per signal family: the largest value any healthy run reached from step 50 on; per class, "
        "the diverging runs whose signal exceeded it before the divergence, the median step it first did, "
        "and how long before the divergence. Descriptive (the range is read off these very runs).",
        "",
        "| signal | healthy max | attention | qkln | mitigated |",
        "|---|---|---|---|---|",
    ]
    for label, row in result["mechanism"].items():
        cells = " | ".join(row.get(c, "-") for c in ("healthy max", "attention", "qkln", "mitigated"))
        lines.append(f"| {label} | {cells} |")
    lines += ["", "## The chosen signal at other sampling intervals and bounds", ""]
    lines += ["| every (steps) | bound | detected / diverging | median lead | false warnings / healthy |"]
    lines += ["|---|---|---|---|---|"]
    for r in result["intervals"]:
        med = "-" if r["median_lead_steps"] is None else f"{r['median_lead_steps']:.0f}"
        lines.append(
            f"| {r['every']} | {r['bound']:g} | {r['detected']}/{r['diverging_runs']} | {med} | "
            f"{r['false_warnings']} / {r['healthy_runs']} |"
        )
    if result.get("cost"):
        lines += ["", "## Cost of sampling the signals (one CPU thread, paired within rounds, median)", ""]
        lines += [
            "| model | params | step (ms) | sampled | extra per sampled step (ms) [quartiles] | "
            "per sampled step | at every 10 steps |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in result["cost"]["hooks"]:
            for mode, what in (("bound", "attention bound"), ("full", "bound + RMS of every Linear")):
                m = c[mode]
                lines.append(
                    f"| {c['label']} | {c['params']:,} | {c['step_ms']:.1f} | {what} | {m['extra_ms']:.2f} "
                    f"[{m['quartiles_ms'][0]:.2f}, {m['quartiles_ms'][1]:.2f}] | "
                    f"{100 * m['fraction']:.2f}% | {10 * m['fraction']:.3f}% |"
                )
        lines += [
            "",
            "The oscillation rule (`peak_lr=`): the gradients' copy and fused dot product, every step.",
            "",
            "| model | step (ms) | extra per step (ms) [quartiles] | per step |",
            "|---|---|---|---|",
        ]
        for c in result["cost"]["hooks"]:
            m = c["cosine"]
            lines.append(
                f"| {c['label']} | {c['step_ms']:.1f} | {m['extra_ms']:.3f} "
                f"[{m['quartiles_ms'][0]:.3f}, {m['quartiles_ms'][1]:.3f}] | {100 * m['fraction']:.2f}% |"
            )
        lines.append(
            f"\nDetector update over 10 samples x {result['cost']['detector_signals']} signals: "
            f"{1e6 * result['cost']['detector_update_s']:.0f} us (once per export)."
        )
    lines += ["", "## Runs", "", "| run | class | diverged at | steps run | s |", "|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['name']} | {r['class']} | {r['diverged_at']} | {r['steps_run']} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def by_class(triples, table) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """Per detector and class: ``detected/diverged, median lead (%)``; warned runs that did not diverge."""
    out: dict[str, dict[str, str]] = {}
    for name, summary in table.items():
        rows = {r["run"]: r for r in summary["runs"]}
        out[name] = {}
        for cls in ("attention", "qkln", "mitigated", "constant", "gray", "healthy"):
            mine = [rows[rec["name"]] for c, rec, _ in triples if c == cls]
            if not mine:
                continue
            div = [r for r in mine if r["diverged_at"] is not None]
            leads = [r["lead_steps"] for r in div if r["lead_steps"] is not None]
            pct = [r["lead_steps"] / r["diverged_at"] for r in div if r["lead_steps"] is not None]
            cell = f"{len(leads)}/{len(div)}"
            if leads:
                cell += f", {np.median(leads):.0f} ({100 * np.median(pct):.0f}%)"
            quiet = [r for r in mine if r["diverged_at"] is None]
            if quiet:
                cell += (
                    f"; warned {sum(r['first_warning'] is not None for r in quiet)}/{len(quiet)} not diverged"
                )
            out[name][cls] = cell
    return out


def set_cells(by_set, healthy_gn: float) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """Per detector and set of runs (and all of them): ``detected/diverging, median lead (%);
    healthy warned``; under ``warned``, the healthy runs it warned and the step of the first warning."""
    every = [t for ts in by_set.values() for t in ts]
    tables = {name: detector_table(ts, healthy_gn) for name, ts in (*by_set.items(), ("all", every))}
    out: dict[str, dict[str, str]] = {}
    for det in tables["all"]:
        out[det] = {}
        for name, table in tables.items():
            s = table[det]
            lead = "" if s["median_lead_steps"] is None else f", {s['median_lead_steps']:.0f}"
            pct = "" if s["median_lead_fraction"] is None else f" ({100 * s['median_lead_fraction']:.0f}%)"
            out[det][name] = (
                f"{s['detected']}/{s['diverging_runs']}{lead}{pct}; "
                f"healthy {s['healthy_runs_warned']}/{s['healthy_runs']}"
            )
        warned = [
            r
            for r in tables["all"][det]["runs"]
            if r["class"] == "healthy" and r["first_warning"] is not None
        ]
        out[det]["warned"] = ", ".join(f"{r['run']} (step {r['first_warning']})" for r in warned)
    return out


MECHANISM_SIGNALS = {
    "attention logit max": "attn_logit_max",
    "output logit max-abs": "logit_max",
    "mean log Z": "Z",
    "linear-output RMS": "lin_rms",
    "gradient norm": "grad_norm",
    "1 - consecutive gradients' cosine": "1-grad_cos",
}


def jumps(by_set) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """Per set of runs: the largest rise of the gradient norm within 100 steps
    (:func:`detectors.gradnorm_jump`) over its healthy runs, and its range over the runs that
    diverged (up to their divergence): where a jump rule would have to draw its line."""

    def span(values: list[float]) -> str:
        return f"x{min(values):.1f}-{max(values):.1f} ({len(values)} runs)" if values else "-"

    out: dict[str, dict[str, str]] = {}
    for name, triples in by_set.items():
        jump = [(c, d, detectors.gradnorm_jump(rec, d, after=AFTER)) for c, rec, d in triples]
        healthy = [j for c, d, j in jump if d is None and c == "healthy"]
        out[name] = {
            "healthy": f"x{max(healthy):.1f} ({len(healthy)} runs)" if healthy else "-",
            "diverged": span([j for c, d, j in jump if d is not None]),
            "constant": span([j for c, d, j in jump if d is not None and c == "constant"]),
        }
    return out


def mechanism(triples, after: int = AFTER) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """Which signal leaves the healthy runs' range first: per class, per signal family, the median
    step (over the class's diverging runs) at which the family's largest column first exceeds the
    largest value any healthy run reached from step ``after`` on, and in how many runs it did
    before the divergence. Descriptive (the range comes from these very healthy runs), not a detector."""
    out: dict[str, dict[str, str]] = {}
    for label, name in MECHANISM_SIGNALS.items():
        ceiling = max(
            float(np.nanmax(v[st >= after]))
            for c, rec, d in triples
            if c == "healthy" and d is None
            for st, v, _ in [detectors.signal(rec, name)]
        )
        out[label] = {"healthy max": f"{ceiling:.3g}"}
        for cls in ("attention", "qkln", "mitigated"):
            exits, n = [], 0
            for c, rec, d in triples:
                if c != cls or d is None:
                    continue
                n += 1
                st, v, _ = detectors.signal(rec, name)
                over = np.flatnonzero((st >= after) & (st <= d) & (np.nanmax(v, 1) > ceiling))
                if len(over):
                    exits.append((int(st[over[0]]), d))
            if n:
                first = np.median([e for e, _ in exits]) if exits else None
                ahead = np.median([d - e for e, d in exits]) if exits else None
                med = f"median step {first:.0f}, {ahead:.0f} before" if exits else "-"
                out[label][cls] = f"{len(exits)}/{n}: {med}"
    return out


def intervals(triples) -> list[dict[str, object]]:  # noqa: ANN001
    """The chosen rule at other sampling intervals and bounds (the recordings hold every 5th step)."""
    out = []
    grid = [(5, 1e3), (10, 1e3), (20, 1e3), (50, 1e3), (100, 1e3), (10, 100.0), (10, 300.0), (10, 1e4)]
    for every, bound in grid:
        cfg = replace(CONFIG, every=every)
        parts = [(CHOSEN[0][0], bound)]
        s = detectors.summarize(triples, lambda r, c=cfg, p=parts: detectors.precursor_steps(r, p, c))
        out.append({"every": every, "bound": bound, **{k: v for k, v in s.items() if k != "runs"}})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 short runs (smoke), no cost measurement")
    p.add_argument("--cache", default=runs.DEFAULT_CACHE, help="folder of cached recordings")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    named = {"sweep": runs.quick()} if args.quick else runs.sets()
    plan, held = named["sweep"], named.get("hold-out", [])
    more = {name: rs for name, rs in named.items() if name not in ("sweep", "hold-out")}
    every_plan = plan + held + [r for rs in more.values() for r in rs]
    runs.ensure(every_plan, args.cache, jobs=args.jobs, log=lambda m: print(m, flush=True))

    def triple(cls: str, spec: RunSpec) -> tuple[str, dict[str, object], int | None]:
        rec = runs.load(runs.cache_path(args.cache, spec))
        return cls, rec, divergence_step([float(v) for v in rec["loss"]])

    triples = []
    meta = []
    for cls, spec in plan:
        cls, rec, div = triple(cls, spec)
        triples.append((cls, rec, div))
        meta.append(
            {
                "name": rec["name"],
                "class": cls,
                "spec": rec["spec"],
                "diverged_at": div,
                "steps_run": rec["steps_run"],
                "seconds": rec["seconds"],
            }
        )
    healthy_gn = max(
        float(np.nanmax(np.asarray(rec["grad_norm"])[AFTER:]))
        for c, rec, d in triples
        if c == "healthy" and d is None
    )
    table = detector_table(triples, healthy_gn)
    result: dict[str, object] = {
        "command": "python benchmarks/early_warning.py" + (" --quick" if args.quick else ""),
        "model": "TinyGPT d_model 64, 2 blocks, 4 heads, 64-byte context, batch 16, AdamW (0.9, 0.95, 1e-8), "
        "clip 1.0, warm-up 1,000 steps to the peak rate then constant, 1,500 steps at most",
        "divergence": {"factor": FACTOR, "window": WINDOW},
        "precursor": {
            "signals": [list(p) for p in CHOSEN],
            "config": CONFIG.__dict__,
            "label": CHOSEN_LABEL,
            "oscillation": OSCILLATION_LABEL,
        },
        "gradnorm_threshold": healthy_gn,
        "detectors": table,
        "head_to_head": head_to_head(table),
        "by_class": by_class(triples, table),
        "runs": meta,
    }
    if not args.quick:
        by_set = {"sweep": triples, "hold-out": [triple(c, s) for c, s in held]}
        by_set |= {name: [triple(c, s) for c, s in rs] for name, rs in more.items()}
        result["sets"] = set_cells(by_set, healthy_gn)
        result["jumps"] = jumps(by_set)
    result["holdout"] = runs.describe(held)
    result["candidates"] = candidates.score(triples, held_out=[triple(c, spec) for c, spec in held])
    result["intervals"] = intervals(triples)
    result["mechanism"] = mechanism(triples)
    if not (args.quick or args.no_cost):
        result["cost"] = measure_cost()
    result["elapsed_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "early_warning.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(args.out, "early_warning.md"), "w") as f:
        f.write(markdown(result))
    plot(os.path.join(args.out, "early_warning.png"), panels(triples, table), parts=WITH_OSCILLATION)
    print(markdown(result).split("\n## Per class")[0])
    return 0


def panels(triples, table) -> list[tuple[str, dict, int | None, dict[str, int | None]]]:  # noqa: ANN001
    """One run per class that has one: the first diverging attention run, the first qk-layernorm run
    the precursor with ``peak_lr`` warned on, the healthy run at the highest rate."""
    firsts = {name: {r["run"]: r["first_warning"] for r in s["runs"]} for name, s in table.items()}
    chosen = []
    for cls in ("attention", "qkln", "healthy"):
        pick = [(c, rec, d) for c, rec, d in triples if c == cls and (d is not None) == (cls != "healthy")]
        if cls == "qkln":
            pick = [t for t in pick if firsts["distmon_precursor_peak_lr"][t[1]["name"]] is not None] or pick
        if cls == "healthy":  # the hardest healthy run: mitigated, at the highest rate
            pick.sort(key=lambda t: -t[1]["spec"]["lr"])
        if pick:
            c, rec, d = pick[0]
            chosen.append(
                (f"{cls}: {rec['name']}", rec, d, {LABELS[n]: firsts[n][rec["name"]] for n in table})
            )
    return chosen


def measure_cost() -> dict[str, object]:
    """Sampling's cost on the sweep's model and on a wider one (the attention-logit bound alone, what the
    shipped rule reads, and with every Linear's RMS too); the detector's own update."""
    wide = ModelConfig(d_model=256, n_layers=4, n_heads=8, seq_len=128)
    hooks = [
        {
            "label": "sweep model (d_model 64, 2 blocks, batch 16 x 64)",
            **cost.measure(ModelConfig(), 16, 120),
        },
        {"label": "d_model 256, 4 blocks, batch 8 x 128", **cost.measure(wide, 8, 48)},
    ]
    n = 2 * 4  # e.g. 4 blocks' attention bound + RMS columns
    return {"hooks": hooks, "detector_update_s": cost.detector_cost(n, 10), "detector_signals": n}


if __name__ == "__main__":
    sys.exit(main())
