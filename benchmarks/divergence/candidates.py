"""Every candidate signal and rule, scored on the same recordings: the table the choice rests on.

Each candidate is a list of ``(signal, bound)`` columns for
:class:`distmon.verdicts.precursor.PrecursorDetector`
(``bound`` None: the scale-free rise rule, a tenfold rise of the smoothed signal over its floor
once armed after 200 steps; a number: the bound rule) at the default sampling (every 10
steps, 2 samples in a row). Scored like every detector (:func:`.detectors.summarize`): per
mechanism, runs warned in time and the median lead; healthy runs warned; gray runs warned.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from distmon.verdicts.precursor import PrecursorConfig

from .detectors import Recording, precursor_steps, summarize

# label, columns, and overrides of the default PrecursorConfig
Candidate = tuple[str, list[tuple[str, float | None]]] | tuple[str, list[tuple[str, float | None]], dict]

CANDIDATES: list[Candidate] = [
    ("attention logit max > 30", [("attn_logit_max", 30.0)]),
    ("attention logit max > 100", [("attn_logit_max", 100.0)]),
    ("attention logit max > 1000", [("attn_logit_max", 1000.0)]),
    ("attention logit max: rise x10", [("attn_logit_max", None)]),
    ("attention bound max|q|max|k|/sqrt(d) > 100", [("attn_bound", 100.0)]),
    ("attention bound max|q|max|k|/sqrt(d) > 1000 (shipped)", [("attn_bound", 1000.0)]),
    ("linear-output RMS, every Linear: rise x10", [("lin_rms", None)]),
    ("linear-output RMS, qkv: rise x10", [("lin_rms:qkv", None)]),
    ("linear-output RMS, attn proj: rise x10", [("lin_rms:proj", None)]),
    ("linear-output RMS, fc2: rise x10", [("lin_rms:fc2", None)]),
    ("linear-output RMS, every Linear: rise x100", [("lin_rms", None)], {"rise": math.log(100.0)}),
    ("linear-output RMS, every Linear: rise x1000", [("lin_rms", None)], {"rise": math.log(1000.0)}),
    ("linear-output max-abs, every Linear: rise x10", [("lin_max", None)]),
    ("output logits log Z: rise 2.3 nats", [("Z", None)]),
    ("output logit max-abs: rise x10", [("logit_max", None)]),
    ("global gradient norm: rise x10", [("grad_norm", None)]),
    ("per-layer gradient norm: rise x10", [("layer_grad_norm", None)]),
    ("update/weight ratio per layer: rise x10", [("update_ratio", None)]),
    ("attention bound > 1000 + log Z rise 2.3 nats", [("attn_bound", 1000.0), ("Z", None)]),
    ("consecutive gradients' cosine, 10-pair mean < -0.1", [("1-grad_cos", 1.1)]),
    ("consecutive gradients' cosine, 10-pair mean < -0.2", [("1-grad_cos", 1.2)]),
    ("consecutive gradients' cosine, 10-pair mean < -0.3", [("1-grad_cos", 1.3)]),
    # the best of a grid (window 10-50 pairs, -0.1 to -0.3, 1-5 samples) on these very runs:
    # the hold-out column says whether it holds on runs that played no part in the choice
    ("consecutive gradients' cosine, 10-pair mean < -0.15, 3 samples", [("1-grad_cos", 1.15)], {"hold": 3}),
]


def score(
    runs: Sequence[tuple[str, Recording, int | None]],
    candidates: Sequence[Candidate] = CANDIDATES,
    cfg: PrecursorConfig | None = None,
    *,
    held_out: Sequence[tuple[str, Recording, int | None]] = (),
) -> list[dict[str, object]]:
    """One row per candidate: per class detected/diverging and median lead, healthy and gray
    warned; with ``held_out`` runs (:func:`.runs.holdout`), the same on them in one cell."""
    cfg = cfg or PrecursorConfig()
    rows = []
    for label, parts, *over in candidates:
        c = replace(cfg, **over[0]) if over else cfg
        warn = functools.partial(precursor_steps, parts=parts, cfg=c)
        s = summarize(runs, warn)
        row: dict[str, object] = {"candidate": label, "all": _cell(s["runs"], None)}
        for cls in ("attention", "qkln", "mitigated"):
            row[cls] = _cell(s["runs"], cls)
        row["healthy_warned"] = f"{s['healthy_runs_warned']}/{s['healthy_runs']}"
        gray = [r for r in s["runs"] if r["class"] == "gray" and r["diverged_at"] is None]
        row["gray_warned"] = f"{sum(r['first_warning'] is not None for r in gray)}/{len(gray)}"
        if held_out:
            h = summarize(held_out, warn)
            warned = f"{h['healthy_runs_warned']}/{h['healthy_runs']}"
            row["held_out"] = f"{_cell(h['runs'], None)}; healthy warned {warned}"
        rows.append(row)
    return rows


def _cell(per_run: list[dict[str, object]], cls: str | None) -> str:
    rows = [r for r in per_run if r["diverged_at"] is not None and (cls is None or r["class"] == cls)]
    leads = [r["lead_steps"] for r in rows if r["lead_steps"] is not None]
    med = f", median lead {np.median(leads):.0f}" if leads else ""
    frac = [r["lead_steps"] / max(r["diverged_at"], 1) for r in rows if r["lead_steps"] is not None]
    pct = f" ({100 * np.median(frac):.0f}%)" if frac else ""
    return f"{len(leads)}/{len(rows)}{med}{pct}"


def table(rows: list[dict[str, object]]) -> str:
    """Markdown table of :func:`score`'s rows (a hold-out column when they have one)."""
    held = bool(rows) and "held_out" in rows[0]
    head = "| candidate | all diverging | attention | qkln | mitigated | healthy warned | gray warned |"
    lines = [head + (" hold-out runs |" if held else ""), "|---" * (8 if held else 7) + "|"]
    for r in rows:
        lines.append(
            f"| {r['candidate']} | {r['all']} | {r['attention']} | {r['qkln']} | {r['mitigated']} | "
            f"{r['healthy_warned']} | {r['gray_warned']} |" + (f" {r['held_out']} |" if held else "")
        )
    return "\n".join(lines)


assert math.isclose(PrecursorConfig().rise, math.log(10.0))  # the "x10" in the labels
