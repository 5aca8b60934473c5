#!/usr/bin/env python3
"""The spectral entropy of each weight's update: runs diverging at a constant rate against healthy ones.

    python benchmarks/divergence/update_spectrum.py --write          # 57 runs, ~15 min on 2 cores
    python benchmarks/divergence/update_spectrum.py --sets --write   # early_warning.py's 132 runs and
                                                                     # the late hold-out's 20: ~45 min
                                                                     # the first time, then seconds
    python benchmarks/divergence/update_spectrum.py --wide --write   # 12 runs twice as wide: ~15 min

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class). Huang et al. 2026 ("Mechanism-Driven Monitors for
Preemptive Detection of LLM Training Instability", arXiv 2606.28116) read the geometry of the
weight updates rather than their size: before their attention fault's loss diverges, the spectral
entropy of the query/key weights' update collapses (the update concentrates on a few directions)
while the loss and the gradient norm still look normal. An optimizer oscillating across the
sharpest direction of the loss (the edge of stability) would show the same concentration. Per
step, per weight matrix group (the fused projection split into its queries, keys and values; the
attention output; the MLP's two layers; the output head; the token embeddings) and for the
first-order change of each head's query-key bilinear form ``W_q,h^T W_k,h``
(``dW_q,h^T W_k,h + W_q,h^T dW_k,h``, the term the paper monitors), two readings of the
update's singular values s_i:

- **spectral entropy**: ``-sum p_i log p_i`` with ``p_i = s_i / sum s``, over ``log`` of the
  number of singular values (1: spread evenly; 0: one direction), the paper's reading;
- **participation**: ``(sum s^2)^2 / sum s^4`` over the number of singular values, the same
  question from two matrix products and no decomposition (what a device could compute without
  waiting for the host).

Each is averaged over a group's matrices (the layers, the heads), sampled as the mean of the last
10 steps every 10 steps from step 50 on, held for 2 samples, and read both ways (a fall: the
paper's collapse; a rise). For every reading, the bound fitted to the healthy runs of the stress,
validation and fast warm-up sets (the most extreme value any of them held: the most favourable
case, none warns) is scored on the constant-rate runs of those sets, then once on the runs
recorded later (:func:`.runs.late_holdout`), as ``loss_regression.py`` and ``adam_moments.py`` do.

With ``--sets``, the rows that warned the most constant-rate runs (the MLP layers' participation
falling) are applied to every set of ``benchmarks/early_warning.py``, alone and beside the shipped
precursor, and scored as that benchmark scores a detector. Those runs are recorded into its cache
(``benchmarks/results/.divergence-cache/``, the same recordings, each with the probe's rows
beside it), so that ``early_warning.py`` reads them afterwards.

With ``--wide``, fc2's bound is scored once on runs of a model twice as wide (:func:`.runs.wider`),
as the same share of the width and as the same effective rank: which of the two carries over is
what a monitor's default would rest on.

Writes ``benchmarks/results/update_spectrum.md`` (``--sets`` and ``--wide`` with ``--write``: their
sections); the runs of the first table are not cached.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.adam_moments import WAYS, both_ways, signed_series  # noqa: E402
from benchmarks.divergence.divergence import divergence_step  # noqa: E402
from benchmarks.divergence.loss_regression import (  # noqa: E402
    RUNS,
    fitted_bound,
    page_head,
    probed,
    split,
    timing,
)
from benchmarks.divergence.oscillation_lags import EVERY, START, trailing_means  # noqa: E402
from benchmarks.divergence.sharpness_probe import held, run_and_write  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

SIGNALS = ("spectral entropy", "participation")
# (a weight's name ends with, its rows' part (None: all), the group): one row per group of matrices
MATRICES = (
    ("attn.qkv.weight", 0, "queries"),
    ("attn.qkv.weight", 1, "keys"),
    ("attn.qkv.weight", 2, "values"),
    ("attn.proj.weight", None, "attention output"),
    ("mlp.fc1.weight", None, "mlp fc1"),
    ("mlp.fc2.weight", None, "mlp fc2"),
    ("lm_head.weight", None, "output head"),
    ("tok_emb.weight", None, "token embeddings"),
)
QK = "query-key form, first order"
GROUPS = tuple(dict.fromkeys(g for _, _, g in MATRICES)) + (QK,)
PAGE = os.path.join(os.path.dirname(HERE), "results", "update_spectrum.md")
SETS_HEADING = "## The MLP layers' participation on every set of runs"  # --sets' part
WIDE_HEADING = "## fc2's bound on a model twice as wide"  # --wide's part


def readings(s: torch.Tensor) -> torch.Tensor:
    """:data:`SIGNALS` of the singular values ``s`` (one matrix's, or a batch's on the last dim),
    each in [0, 1]: NaN where every singular value is 0 (no update).

    Example:
        >>> readings(torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)).tolist()
        [1.0, 1.0]
        >>> readings(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)).tolist()
        [0.0, 0.25]
    """
    n = s.shape[-1]
    p = s / s.sum(-1, keepdim=True)
    entropy = torch.special.entr(p).sum(-1) / np.log(n)  # entr(x) = -x log x, 0 at 0
    s2 = s.square()
    participation = s2.sum(-1).square() / s2.square().sum(-1) / n
    return torch.stack([entropy, participation])


class UpdateSpectrum:
    """A ``train`` probe: per step, a row of ``len(SIGNALS)`` x ``len(GROUPS)`` readings of the last
    update's singular values (NaN on the first step). Called before the optimizer's step, it reads
    the parameters as the last step left them: the update of step t-1 is theta_t - theta_{t-1}."""

    def __init__(self, n_heads: int) -> None:
        self.n_heads = n_heads
        self.before: dict[str, torch.Tensor] = {}
        self.rows: list[np.ndarray] = []

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        now = {
            n: p.detach().to(torch.float64, copy=True)
            for n, p in model.named_parameters()
            if n.endswith(tuple(m for m, _, _ in MATRICES))
        }
        row = np.full((len(SIGNALS), len(GROUPS)), np.nan)
        if self.before:
            per_group: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
            for name, w in now.items():
                dw = w - self.before[name]
                for suffix, part, group in MATRICES:
                    if name.endswith(suffix):
                        rows = dw if part is None else dw.chunk(3)[part]
                        per_group[group].append(readings(torch.linalg.svdvals(rows)))
                if name.endswith("attn.qkv.weight"):
                    per_group[QK].append(self._qk(w, dw))
            for g, group in enumerate(GROUPS):
                row[:, g] = torch.stack(per_group[group]).reshape(-1, len(SIGNALS)).mean(0).numpy()
        self.before = now
        self.rows.append(row)

    def _qk(self, w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
        """The readings of each head's ``dW_q,h^T W_k,h + W_q,h^T dW_k,h`` (rank at most the head's
        width: only its top ``head`` singular values), averaged over the heads."""
        (wq, wk, _), (dq, dk, _) = w.chunk(3), dw.chunk(3)
        heads = lambda m: m.reshape(self.n_heads, -1, m.shape[-1])  # noqa: E731
        wq, wk, dq, dk = map(heads, (wq, wk, dq, dk))
        first = dq.transpose(1, 2) @ wk + wq.transpose(1, 2) @ dk  # (heads, d_model, d_model)
        s = torch.linalg.svdvals(first)[:, : wq.shape[1]]
        return readings(s).mean(-1)


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step, peak rate, warm-up, and :class:`UpdateSpectrum`'s rows."""
    spectrum = UpdateSpectrum(spec.model.n_heads)
    rec = train(spec, distmon_watch=False, record_every=10**9, probe=spectrum)
    return probed(spec, rec, readings=np.stack(spectrum.rows))


def _series_one(
    run: dict[str, object], signal: int, group: int, sign: float
) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`.adam_moments.signed_series`, from the sampled steps' own readings alone (not the mean
    of the last 10).

    Example:
        >>> rows = np.zeros((71, len(SIGNALS), len(GROUPS)))
        >>> rows[60, 1, 2] = 1.0   # step 60 alone
        >>> [v.tolist() for v in _series_one({"readings": rows}, 1, 2, -1.0)]
        [[50, 60, 70], [-0.0, -1.0, -0.0]]
    """
    steps, _ = trailing_means(run["readings"][:, signal, group])
    return steps, sign * run["readings"][steps, signal, group]


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    fit, fresh, strays = split(results)
    lines = page_head(
        "The spectral entropy of each weight's update, per matrix group",
        "`python benchmarks/divergence/update_spectrum.py --write`. Per step, per matrix group: the "
        "spectral entropy and the participation of the last update's singular values (each in [0, 1], "
        "the mean over the group's matrices); sampled as the mean of the last "
        f"{EVERY} steps every {EVERY} steps from step {START} on, read as a fall and as a rise; a "
        "warning once past the bound for 2 samples in a row (before the divergence, for the "
        "diverging runs).",
        fit,
        fresh,
        strays,
        ("signal", "towards trouble", "matrix group", "fitted bound (set by)"),
    )
    table, rows = both_ways(fit, fresh, SIGNALS, GROUPS, WAYS[::-1])  # a fall first: the paper's collapse
    lines += table + timing(fit, fresh, rows, START)
    return "\n".join(lines) + "\n"


def _child(spec_json: str, path: str) -> None:
    """Record one run of ``early_warning.py``'s sets into its cache (``runs._child``'s recording,
    the same training) and the probe's rows beside it (:func:`rows_path`), the rows first."""
    from benchmarks.divergence.detectors import spec_of
    from benchmarks.divergence.runs import save

    spec = spec_of({"spec": json.loads(spec_json)})
    spectrum = UpdateSpectrum(spec.model.n_heads)
    rec = train(spec, probe=spectrum)
    np.save(rows_path(path), np.stack(spectrum.rows))
    save(path, rec)


def rows_path(path: str) -> str:
    """Where :func:`_child` keeps the probe's rows of the recording at ``path``."""
    return path.removesuffix(".npz") + ".spectrum.npy"


def _warnings(steps: np.ndarray, values: np.ndarray, bound: float) -> list[int]:
    """Every sample from :data:`START` on that is past ``bound`` with the sample before it.

    Example:
        >>> _warnings(np.array([40, 50, 60, 70, 80]), np.array([2.0, 2.0, 0.0, 2.0, 2.0]), 1.0)
        [50, 80]
    """
    return [int(st) for st, val in held(steps, values, falls=False, start=START) if val > bound]


def _recorded(plans: dict[str, list[tuple[str, RunSpec]]], cache: str, jobs: int) -> dict[str, list[tuple]]:
    """Per set of ``plans``: ``(class, recording, divergence step, the probe's rows)`` of each run,
    recorded into ``cache`` first where it is not yet (:func:`_child`)."""
    from benchmarks.divergence import runs

    plan = [r for plan in plans.values() for r in plan]
    runs.ensure(plan, cache, jobs=jobs, child="benchmarks.divergence.update_spectrum")
    return {
        name: [
            (cls, rec, divergence_step([float(v) for v in rec["loss"]]), np.load(rows_path(path)))
            for cls, spec in plan
            for path in [runs.cache_path(cache, spec)]
            for rec in [runs.load(path)]
        ]
        for name, plan in plans.items()
    }


FITTED_TO = ("stress", "validation", "fast warm-ups")  # the sets whose healthy runs set the bounds


def _fit(loaded: dict[str, list[tuple]]) -> list[dict[str, object]]:
    """The runs the bounds are fitted to, as the first table's: the healthy runs of the
    :data:`FITTED_TO` sets of ``loaded`` (:func:`_recorded`)."""
    return [
        {"name": rec["name"], "diverged": div, "readings": rows}
        for name in FITTED_TO
        for cls, rec, div, rows in loaded[name]
        if cls == "healthy" and div is None
    ]


def _rule(series: Callable, edge: float, rows_of: dict[str, np.ndarray]) -> Callable[[dict], list[int]]:
    """A recording's warnings: the probe's rows of the run (``rows_of`` by name) sampled by
    ``series``, past ``edge`` (:func:`_warnings`)."""
    return lambda rec: _warnings(*series({"readings": rows_of[rec["name"]]}), edge)


def _shipped() -> Callable[[dict], list[int]]:
    """A recording's warnings by the shipped precursor with ``peak_lr=``, as ``early_warning.py`` scores."""
    from benchmarks.divergence import detectors
    from benchmarks.early_warning import OSCILLATION, WITH_OSCILLATION

    return partial(detectors.precursor_steps, parts=WITH_OSCILLATION, cfg=OSCILLATION, schedule=True)


def on_every_set(cache: str, jobs: int) -> str:
    """The page's second part: the falls of the MLP layers' participation (their bounds fitted as
    the table fits them, to the same healthy runs; for fc2 also read at the sampled steps alone,
    as a monitor that reads one step in 10 would) on every set of ``early_warning.py`` and on the
    late hold-out, alone and beside the shipped precursor with ``peak_lr=``, as that benchmark
    scores a detector."""
    from benchmarks.divergence import detectors, runs

    plans = {**runs.sets(), "late hold-out": runs.late_holdout()}
    loaded = _recorded(plans, cache, jobs)
    fit = _fit(loaded)
    rows_of = {rec["name"]: rows for plan in loaded.values() for _, rec, _, rows in plan}
    participation = SIGNALS.index("participation")
    rules: dict[str, object] = {}
    readings = (
        ("mlp fc1", signed_series, ""),
        ("mlp fc2", signed_series, ""),
        ("mlp fc2", _series_one, ", one step in 10"),  # what a monitor sampling every 10 steps reads
    )
    for group, sampled, how in readings:
        series = partial(sampled, signal=participation, group=GROUPS.index(group), sign=-1.0)
        edge, _ = fitted_bound(fit, series, START)
        rules[f"{group} participation{how} below {-edge:.4g}"] = _rule(series, edge, rows_of)
    precursor = _shipped()
    table = {"precursor, peak_lr=": precursor}
    for label, rule in rules.items():
        table[label] = rule
        table[f"precursor, peak_lr=, or {label}"] = partial(
            lambda rec, rule: sorted(set(precursor(rec)) | set(rule(rec))), rule=rule
        )
    names = (*plans, "all")
    lines = [
        "",
        SETS_HEADING,
        "",
        "`python benchmarks/divergence/update_spectrum.py --sets`. Each bound fitted as above (to the "
        "healthy runs of the stress, validation and fast warm-up sets), applied alone and beside the "
        "precursor with `peak_lr=`, to the sets of `early_warning.py` and to the late hold-out (whose "
        "runs no rule of the precursor's was chosen on); scored as `early_warning.py` scores a detector: "
        "detected / diverging runs, median lead; healthy runs warned.",
        "",
        "| rule | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for label, warn in table.items():
        cells = []
        for name in names:
            triples = [
                (cls, rec, div)
                for plan in (loaded.values() if name == "all" else [loaded[name]])
                for cls, rec, div, _ in plan
            ]
            got = detectors.summarize(triples, warn)
            lead = f", {got['median_lead_steps']:g}" if got["detected"] else ""
            cells.append(
                f"{got['detected']}/{got['diverging_runs']}{lead}; healthy "
                f"{got['healthy_runs_warned']}/{got['healthy_runs']}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def on_a_wider_model(cache: str, jobs: int) -> str:
    """The page's third part: fc2's participation bound, fitted at d_model 64 as the first table fits
    it, scored once on :func:`.runs.wider` (d_model 128) two ways: as the same share of the width, and
    as the same effective rank (``participation x width``); the shipped precursor with ``peak_lr=``
    beside it."""
    from benchmarks.divergence import detectors, runs

    plans = {name: plan for name, plan in runs.sets().items() if name in FITTED_TO}
    wider = runs.wider()
    loaded = _recorded({**plans, "wider": wider}, cache, jobs)
    fit = _fit(loaded)
    group, participation = GROUPS.index("mlp fc2"), SIGNALS.index("participation")
    series = partial(signed_series, signal=participation, group=group, sign=-1.0)
    share = -fitted_bound(fit, series, START)[0]
    width = wider[0][1].model.d_model
    rank = share * runs.BASE.model.d_model  # the fitted runs' width
    bounds = {
        f"the same share of the width: participation below {share:.4g}": share,
        f"the same effective rank, {rank:.3g}: participation below {rank / width:.4g}": rank / width,
    }
    rows_of = {rec["name"]: rows for _, rec, _, rows in loaded["wider"]}
    # a run of no class: healthy if its loss did not diverge, as summarize counts healthy runs
    triples = [("wide" if div is not None else "healthy", rec, div) for _, rec, div, _ in loaded["wider"]]
    table = {label: _rule(series, -edge, rows_of) for label, edge in bounds.items()}
    table["precursor, peak_lr="] = _shipped()
    lines = [
        "",
        WIDE_HEADING,
        "",
        f"`python benchmarks/divergence/update_spectrum.py --wide --write`. fc2's bound, fitted at d_model "
        f"{runs.BASE.model.d_model} as above, scored once on runs of d_model {width} "
        f"(`runs.wider()`, warmed up in 100 steps: {runs.describe(wider)}); a run diverges or "
        "not by its loss alone.",
        "",
        "| rule | detected / diverging | median lead (steps) | healthy runs warned |",
        "|---|---|---|---|",
    ]
    for label, warn in table.items():
        got = detectors.summarize(triples, warn)
        lead = f"{got['median_lead_steps']:g}" if got["detected"] else "-"
        healthy = f"{got['healthy_runs_warned']}/{got['healthy_runs']}"
        lines.append(f"| {label} | {got['detected']}/{got['diverging_runs']} | {lead} | {healthy} |")
    lines += [
        "",
        "| run | diverged at | fc2 participation: lowest held (step), before any divergence |",
        "|---|---|---|",
    ]
    for _, rec, div, rows in loaded["wider"]:
        held_values = held(*series({"readings": rows}), falls=False, start=START)
        before = [(st, -v) for st, v in held_values if div is None or st <= div]
        low = min(before, key=lambda sv: sv[1]) if before else None
        lines.append(f"| {rec['name']} | {div} | " + (f"{low[1]:.4f} ({low[0]})" if low else "-") + " |")
    return "\n".join(lines) + "\n"


def with_section(page: str, heading: str, part: str) -> str:
    """``page`` with its section under ``heading`` (up to the next ``## `` heading) replaced by
    ``part`` (a blank line, ``heading``, its text), or with ``part`` added at its end.

    Example:
        >>> page = with_section("# T\\n", "## A", "\\n## A\\nold\\n") + "\\n## B\\nb\\n"
        >>> with_section(page, "## A", "\\n## A\\nnew\\n")
        '# T\\n\\n## A\\nnew\\n\\n## B\\nb\\n'
    """
    before, found, after = page.partition("\n" + heading + "\n")
    rest = ("\n## " + after.split("\n## ", 1)[1]) if found and "\n## " in after else ""
    return before.rstrip("\n") + "\n" + part + rest


PARTS = {"--sets": (SETS_HEADING, on_every_set), "--wide": (WIDE_HEADING, on_a_wider_model)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flag = next((f for f in PARTS if f in argv), None)
    if flag is None:
        return run_and_write("update_spectrum", __doc__, RUNS, probe, markdown, argv)
    from benchmarks.divergence.runs import DEFAULT_CACHE

    heading, make = PARTS[flag]
    part = make(DEFAULT_CACHE, jobs=2)
    print(part)
    if "--write" in argv:
        with open(PAGE) as f:
            page = with_section(f.read(), heading, part)
        with open(PAGE, "w") as f:
            f.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
