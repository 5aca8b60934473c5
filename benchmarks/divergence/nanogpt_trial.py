#!/usr/bin/env python3
"""distmon's divergence precursor as a user would try it: nanoGPT's ``train.py``, at a rate that diverges.

    python benchmarks/divergence/nanogpt_trial.py --nanogpt PATH --write   # the trial (~40 min, 2 cores)
    python benchmarks/divergence/nanogpt_trial.py --nanogpt PATH --quick   # smoke: one 200-iteration run

``PATH`` is a nanoGPT checkout (``train.py`` in it) or its git directory (a bare clone, such as
the one ``git clone --bare https://github.com/karpathy/nanoGPT`` makes): the files of its
``HEAD`` are exported (``git archive``) into a temporary folder; nothing of nanoGPT is kept here.

What it does there:

1. builds a character dataset in nanoGPT's format (``data/stdlib_char/{train,val}.bin``,
   ``meta.pkl``, as ``data/shakespeare_char/prepare.py`` does; that script downloads, this
   machine cannot): the first 1,115,394 bytes of the Python standard library's sorted ``.py``
   sources (``benchmarks/divergence/data.py``'s corpus, the early-warning benchmark's text;
   as long as tiny-shakespeare), decoded as UTF-8, 90/10 train/val;
2. writes the user's patch (:data:`USER_EDITS`: ``import distmon``, one ``GradMonitor(...,
   precursor=True)`` after the optimizer and the DDP wrap, a print of its anomalies,
   ``mon.close()`` at the end) and the trial's own lines (:data:`HARNESS_EDITS`,
   ``nanogpt_harness.py``: the seed, each iteration's loss, a stop 40 iterations past the
   divergence, and in the bare twin read-only probes of the attention and output logits);
3. runs each run twice at once, one thread each: ``train_bare.py`` (train.py + harness +
   probes) and ``train_distmon.py`` (train.py + the user's patch + harness), with
   ``config/train_shakespeare_char.py`` and command-line overrides (:func:`overrides`);
4. judges divergence from the bare twin's loss (``divergence.divergence_step``: the early-warning
   benchmark's definition), checks the monitored twin's loss is bit-identical, reads the
   monitored twin's ``divergence_warning`` events (its JSONL log, and the lines its callback
   printed) and reports the lead.

Recordings are cached under ``benchmarks/results/.divergence-cache/nanogpt/`` (delete to rerun).
``--write`` writes ``benchmarks/results/nanogpt_precursor.{md,json}``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # this checkout's distmon and benchmarks/

import numpy as np  # noqa: E402

from benchmarks.divergence.data import corpus  # noqa: E402
from benchmarks.divergence.divergence import divergence_step  # noqa: E402
from distmon.verdicts.precursor import PrecursorConfig  # noqa: E402

CACHE = os.path.join(ROOT, "benchmarks", "results", ".divergence-cache", "nanogpt")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
N_CHARS = 1_115_394  # tiny-shakespeare's length
DATASET = "stdlib_char"
CACHE_VERSION = 1

# the user's patch of train.py: (anchor, replacement), each anchor found exactly once
USER_EDITS: list[tuple[str, str]] = [
    (
        "from model import GPTConfig, GPT\n",
        "from model import GPTConfig, GPT\nimport distmon\n",
    ),
    (
        "if ddp:\n    model = DDP(model, device_ids=[ddp_local_rank])\n",
        "if ddp:\n    model = DDP(model, device_ids=[ddp_local_rank])\n"
        "mon = distmon.GradMonitor(model, optimizer, precursor=True, serve='none',\n"
        "                          log_path=os.path.join(out_dir, 'distmon.jsonl'))\n"
        'mon.on_anomaly(lambda e, snap: print(f"distmon: {e.kind} at step {e.step} '
        '{e.layer} {e.value:.4g}"))\n',
    ),
    (
        "\nif ddp:\n    destroy_process_group()\n",
        "\nmon.close()\nif ddp:\n    destroy_process_group()\n",
    ),
]

# the trial's own lines, in both twins (not what a user adds)
_PRINT_ITER = (
    '        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")\n'
)
HARNESS_EDITS: list[tuple[str, str]] = [
    (
        "from model import GPTConfig, GPT\n",
        "from model import GPTConfig, GPT\n"
        "from benchmarks.divergence import nanogpt_harness as _trial  # trial harness\n",
    ),
    (
        "torch.manual_seed(1337 + seed_offset)\n",
        "torch.manual_seed(1337 + seed_offset + _trial.seed())  # trial harness: the run's seed\n",
    ),
    (
        _PRINT_ITER,
        _PRINT_ITER
        + "        if _trial.record(iter_num, lossf):  # trial harness: loss; stop 40 past divergence\n"
        "            break\n",
    ),
]
# the bare twin only: read-only probes of the attention and output logits
PROBE_EDITS: list[tuple[str, str]] = [
    (
        "model.to(device)\n",
        "model.to(device)\n_trial.probe(model)  # trial harness: read-only forward hooks\n",
    ),
]


@dataclass(frozen=True)
class Run:
    """One run of the trial: nanoGPT's shakespeare_char config with these overrides."""

    lr: float
    warmup: int
    iters: int
    seed: int
    group: str  # "diverging" or "healthy" (what the run was meant to be; the verdict is the loss's)
    grad_clip: float = 1.0  # train.py's default; 0.0 turns its clipping off

    @property
    def name(self) -> str:
        return f"lr{self.lr:g}-wu{self.warmup}-it{self.iters}-clip{self.grad_clip:g}-s{self.seed}"


MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12)


def overrides(run: Run) -> list[str]:
    """The command-line overrides of ``config/train_shakespeare_char.py`` (nanoGPT's configurator)."""
    values: dict[str, object] = {
        "dataset": DATASET,
        "device": "cpu",
        "compile": False,
        "dtype": "float32",
        **MODEL,
        "learning_rate": float(run.lr),
        "min_lr": float(run.lr) / 10,  # "learning_rate / 10 usually" (the config)
        "warmup_iters": run.warmup,
        "max_iters": run.iters,
        "lr_decay_iters": run.iters,
        "grad_clip": float(run.grad_clip),
        "log_interval": 1,
        "eval_interval": 500,  # a multiple of 10: its forwards fall on iterations distmon does not sample
        "eval_iters": 20,
        "out_dir": f"out-{run.name}",
    }
    return [f"--{k}={v}" for k, v in values.items()]


# The runs (rates found with --lr: nanoGPT's AdamW with weight decay 0.1 and beta2 0.99 stalls
# rather than blows up at 30-300x its rate of 1e-3; its loss passes the divergence bar only at 0.3
# without grad_clip and with a short warm-up): diverging, stalled (attention logits in the
# thousands, the loss stuck, the bar not passed) and healthy (the config's own rate and 3x it).
RUNS = (
    [Run(0.3, 10, 1500, s, "diverging", grad_clip=0.0) for s in range(3)]
    + [Run(0.03, 100, 1500, 0, "stalled")]
    + [Run(lr, 100, 1500, 0, "healthy") for lr in (1e-3, 3e-3)]
)


def apply(text: str, edits: list[tuple[str, str]]) -> str:
    for anchor, new in edits:
        n = text.count(anchor)
        if n != 1:
            raise SystemExit(
                f"nanogpt trial: train.py has {n} copies of {anchor!r} (expected 1): another version?"
            )
        text = text.replace(anchor, new)
    return text


def diff(a: str, b: str, name: str) -> str:
    lines = difflib.unified_diff(
        a.splitlines(keepends=True), b.splitlines(keepends=True), f"a/{name}", f"b/{name}", n=1
    )
    return "".join(lines)


def export_nanogpt(src: str, dest: str) -> str:
    """The nanoGPT files of ``src`` (a checkout or a git directory) into ``dest``; returns the commit."""
    src = os.path.abspath(src)
    if os.path.exists(os.path.join(src, "train.py")):
        commit = _git(["-C", src, "rev-parse", "HEAD"]) or "unknown (not a git checkout)"
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".git", "out*"))
        return commit
    commit = _git(["--git-dir", src, "rev-parse", "HEAD"])
    if not commit:
        raise SystemExit(f"nanogpt trial: {src} is neither a nanoGPT checkout nor a git directory")
    os.makedirs(dest)
    archive = subprocess.run(["git", "--git-dir", src, "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return commit


def _git(args: list[str]) -> str | None:
    r = subprocess.run(["git", *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def build_dataset(nano: str) -> dict[str, object]:
    """``data/stdlib_char`` in nanoGPT's format (as ``data/shakespeare_char/prepare.py`` writes it)."""
    raw = bytes(corpus(N_CHARS).numpy())
    data = raw.decode("utf-8", errors="replace")
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = dict(enumerate(chars))
    n = len(data)
    train, val = data[: int(n * 0.9)], data[int(n * 0.9) :]
    out = os.path.join(nano, "data", DATASET)
    os.makedirs(out, exist_ok=True)
    np.array([stoi[c] for c in train], dtype=np.uint16).tofile(os.path.join(out, "train.bin"))
    np.array([stoi[c] for c in val], dtype=np.uint16).tofile(os.path.join(out, "val.bin"))
    with open(os.path.join(out, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return {"chars": n, "vocab_size": len(chars), "train_tokens": len(train), "val_tokens": len(val)}


def prepare(nanogpt: str, work: str) -> dict[str, object]:
    nano = os.path.join(work, "nanoGPT")
    commit = export_nanogpt(nanogpt, nano)
    with open(os.path.join(nano, "train.py")) as f:
        pristine = f.read()
    user = apply(pristine, USER_EDITS)
    bare = apply(apply(pristine, HARNESS_EDITS), PROBE_EDITS)
    monitored = apply(user, HARNESS_EDITS)
    for name, text in (("train_bare.py", bare), ("train_distmon.py", monitored)):
        with open(os.path.join(nano, name), "w") as f:
            f.write(text)
    return {
        "dir": nano,
        "commit": commit,
        "dataset": build_dataset(nano),
        "user_patch": diff(pristine, user, "train.py"),
        "harness_patch": diff(user, monitored, "train.py"),
        "probe_patch": diff(apply(pristine, HARNESS_EDITS), bare, "train.py"),
    }


def _run_twin(nano: str, run: Run, twin: str, out: str) -> dict[str, object]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        NANOGPT_TRIAL_SEED=str(run.seed),
        NANOGPT_TRIAL_OUT=out,
        DISTMON_DISABLE="",
    )
    env.pop("DISTMON_DISABLE")
    cmd = [sys.executable, f"train_{twin}.py", "config/train_shakespeare_char.py", *overrides(run)]
    t0 = time.perf_counter()
    with open(out + ".stdout", "w") as log:
        r = subprocess.run(cmd, cwd=nano, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        with open(out + ".stdout") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"nanogpt trial: {run.name} ({twin}) exited {r.returncode}:\n{tail}")
    with open(out) as f:
        rec = json.load(f)
    rec["seconds"] = seconds
    rec["command"] = " ".join(cmd)
    with open(out + ".stdout") as f:
        rec["distmon_lines"] = [ln.rstrip("\n") for ln in f if ln.startswith("distmon: ")]
    if twin == "distmon":
        log_path = os.path.join(nano, f"out-{run.name}", "distmon.jsonl")
        with open(log_path) as f:
            rec["distmon_log"] = [_slim(json.loads(ln)) for ln in f if ln.strip()]
    return rec


def _slim(snap: dict[str, object]) -> dict[str, object]:
    """The JSONL fields the trial reads (a line per step)."""
    keep = ("step", "grad_norm", "attention_logit_bound", "divergence_warning", "events", "valid")
    return {k: snap.get(k) for k in keep}


def record(nano: str, run: Run, *, cache: str, bare_only: bool = False) -> dict[str, dict[str, object]]:
    """Both twins of ``run`` (cached)."""
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"{run.name}.v{CACHE_VERSION}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    twins = ["bare"] if bare_only else ["bare", "distmon"]
    with ThreadPoolExecutor(len(twins)) as pool:
        futures = {
            t: pool.submit(_run_twin, nano, run, t, os.path.join(nano, f"{run.name}.{t}.json")) for t in twins
        }
        recs = {t: f.result() for t, f in futures.items()}
    if not bare_only:
        with open(path, "w") as f:
            json.dump(recs, f)
    return recs


# -- the verdicts --------------------------------------------------------------------------------


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def judge(run: Run, recs: dict[str, dict[str, object]]) -> dict[str, object]:
    """One run's row: divergence (bare loss), the precursor's first warning, the lead, the mechanism."""
    bare, mon = recs["bare"], recs.get("distmon")
    loss = [float(v) for v in bare["loss"]]
    d = divergence_step(loss)
    row: dict[str, object] = {**asdict(run), "name": run.name, "iters_run": len(loss), "diverged_at": d}
    row["best_loss"] = float(np.nanmin(loss)) if loss else None
    row["final_loss"] = loss[-1] if loss else None
    row["seconds"] = [round(bare["seconds"], 1)] + ([round(mon["seconds"], 1)] if mon else [])
    # the probes (bare twin): attention bound and logits, output logits, per sampled iteration
    probe = bare["probe"]
    it = np.array([p["iter"] for p in probe])

    def series(key: str) -> np.ndarray:
        return np.array([np.max(p[key]) if key in p else np.nan for p in probe], np.float64)

    bound, attn_logit = series("attn_bound"), series("attn_logit_max")
    absmax, logz = series("out_logit_absmax"), series("log_z_mean")
    upto = it <= (d if d is not None else len(loss))
    row["probe"] = {
        "attn_bound_max": _f(np.nanmax(bound[upto])) if upto.any() else None,
        "attn_logit_max": _f(np.nanmax(attn_logit[upto])) if upto.any() else None,
        "out_logit_absmax_max": _f(np.nanmax(absmax[upto])) if upto.any() else None,
        "log_z_mean_max": _f(np.nanmax(logz[upto])) if upto.any() else None,
        "first_iter_bound_over": _first(it, bound, PrecursorConfig().bound),
        "first_iter_logit_over_100": _first(it, attn_logit, 100.0),
    }
    if d is not None:
        row["probe"]["at_divergence"] = _around(
            it, {"attn_bound": bound, "out_logit_absmax": absmax, "log_z_mean": logz}, d
        )
    if mon is None:
        return row
    mloss = [float(v) for v in mon["loss"]]
    row["bit_identical"] = _same(loss, mloss)
    row["distmon_file"] = mon["distmon_file"]
    log = mon["distmon_log"]
    warn_steps = [e["step"] for s in log for e in s["events"] or [] if e["kind"] == "divergence_warning"]
    other = sorted({e["kind"] for s in log for e in s["events"] or [] if e["kind"] != "divergence_warning"})
    printed = [ln for ln in mon["distmon_lines"] if "divergence_warning" in ln]
    row["printed_warnings"] = len(printed)
    row["warning_events"] = len(warn_steps)
    row["warning_iters"] = [s - 1 for s in warn_steps]  # distmon step s is nanoGPT's iteration s - 1
    row["other_event_kinds"] = other
    row["other_events"] = sum(1 for s in log for e in s["events"] or [] if e["kind"] != "divergence_warning")
    flagged = [s["step"] - 1 for s in log if s.get("divergence_warning")]
    row["warning_samples"] = len(flagged)
    sampled = [
        (s["step"] - 1, max(_num(v) for v in s["attention_logit_bound"].values()))
        for s in log
        if s.get("attention_logit_bound")
    ]
    row["distmon_bound_max"] = _f(max((b for i, b in sampled if d is None or i <= d), default=math.nan))
    # distmon's bound against the probe's, on the same iterations (both twins identical)
    probe_at = dict(zip(it.tolist(), bound.tolist()))
    pairs = [
        (b, probe_at[i])
        for i, b in sampled
        if i in probe_at and math.isfinite(b) and math.isfinite(probe_at[i])
    ]
    row["bound_rel_err_max"] = _f(max((abs(a - b) / b for a, b in pairs if b > 0), default=math.nan))
    row["bound_pairs"] = len(pairs)
    first = row["warning_iters"][0] if row["warning_iters"] else None
    row["first_warning_iter"] = first
    if d is not None:
        before = [w for w in row["warning_iters"] if w <= d]
        row["detected"] = bool(before)
        row["lead"] = d - before[0] if before else None
        row["lead_pct"] = round(100 * (d - before[0]) / d, 1) if before and d > 0 else None
    else:
        row["detected"] = None
        row["false_warnings"] = _episodes(row["warning_iters"])
    return row


def _num(v: object) -> float:
    return float(v) if not isinstance(v, str) else float(v)  # "nan"/"inf" strings in the JSONL


def _f(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _first(it: np.ndarray, values: np.ndarray, bound: float) -> int | None:
    over = ~(values <= bound)  # NaN counts as over (an overflowed forward)
    idx = np.flatnonzero(over)
    return int(it[idx[0]]) if len(idx) else None


def _around(it: np.ndarray, series: dict[str, np.ndarray], d: int) -> dict[str, object]:
    """Each series 200, 100, 50 iterations before the divergence and at it (the nearest sample at
    or before)."""
    out: dict[str, object] = {}
    for back in (200, 100, 50, 0):
        at = d - back
        idx = np.flatnonzero(it <= at)
        if len(idx):
            j = idx[-1]
            out[f"d-{back}"] = {"iter": int(it[j]), **{k: _f(v[j]) for k, v in series.items()}}
    return out


def _episodes(iters: list[int], gap: int = 10) -> int:
    """Warning episodes: warnings at most ``gap`` iterations apart count once (as early_warning)."""
    n, last = 0, None
    for w in sorted(iters):
        if last is None or w - last > gap:
            n += 1
        last = w
    return n


def summarize(rows: list[dict[str, object]]) -> dict[str, object]:
    """Diverged runs (by the loss), and the others by what they were meant to be: healthy or stalled."""
    div = [r for r in rows if r["diverged_at"] is not None]
    healthy = [r for r in rows if r["diverged_at"] is None and r["group"] == "healthy"]
    stalled = [r for r in rows if r["diverged_at"] is None and r["group"] != "healthy"]
    leads = [r["lead"] for r in div if r.get("lead") is not None]
    pcts = [r["lead_pct"] for r in div if r.get("lead_pct") is not None]
    return {
        "diverging_runs": len(div),
        "detected": sum(1 for r in div if r.get("detected")),
        "median_lead_iters": float(np.median(leads)) if leads else None,
        "min_lead_iters": min(leads) if leads else None,
        "median_lead_pct": float(np.median(pcts)) if pcts else None,
        "healthy_runs": len(healthy),
        "healthy_runs_warned": sum(1 for r in healthy if r.get("false_warnings")),
        "false_warning_episodes": sum(r.get("false_warnings") or 0 for r in healthy),
        "stalled_runs": len(stalled),
        "stalled_runs_warned": sum(1 for r in stalled if r.get("warning_events")),
        "bit_identical": sum(1 for r in rows if r.get("bit_identical")),
        "runs": len(rows),
    }


# -- the command line ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", required=True, help="a nanoGPT checkout, or its git directory")
    ap.add_argument(
        "--write", action="store_true", help="write benchmarks/results/nanogpt_precursor.{md,json}"
    )
    ap.add_argument("--quick", action="store_true", help="smoke: one 200-iteration run, nothing written")
    ap.add_argument("--cache", default=CACHE)
    ap.add_argument("--lr", type=float, nargs="*", help="explore: bare runs at these rates (not cached)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="explore: train.py's grad_clip (0: off)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="nanogpt-trial-")
    try:
        info = prepare(args.nanogpt, work)
        print(f"nanoGPT {info['commit']}, dataset {info['dataset']}", flush=True)
        if args.lr:
            for lr in args.lr:
                run = Run(lr, args.warmup, args.iters, args.seed, "explore", args.grad_clip)
                recs = record(info["dir"], run, cache=args.cache, bare_only=True)
                row = judge(run, recs)
                print(
                    json.dumps(
                        {
                            k: row[k]
                            for k in (
                                "name",
                                "diverged_at",
                                "iters_run",
                                "best_loss",
                                "final_loss",
                                "seconds",
                                "probe",
                            )
                        }
                    ),
                    flush=True,
                )
            return
        runs = [Run(0.3, 10, 200, 0, "smoke", grad_clip=0.0)] if args.quick else RUNS
        rows = []
        for run in runs:
            recs = record(info["dir"], run, cache=os.path.join(work, "quick") if args.quick else args.cache)
            rows.append(judge(run, recs))
            r = rows[-1]
            print(
                f"{run.name}: diverged at {r['diverged_at']}, first warning {r.get('first_warning_iter')}, "
                f"lead {r.get('lead')}, bit-identical {r.get('bit_identical')}, {r['seconds']} s",
                flush=True,
            )
        summary = summarize(rows)
        print(json.dumps(summary, indent=1))
        if args.write and not args.quick:
            write(info, rows, summary)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write(info: dict[str, object], rows: list[dict[str, object]], summary: dict[str, object]) -> None:
    """``benchmarks/results/nanogpt_precursor.{json,md}``: every run's row, the summary, the patches."""
    seconds = sum(max(r["seconds"]) for r in rows)  # the recordings' own time (cached or not)
    out = {
        "command": "python benchmarks/divergence/nanogpt_trial.py --nanogpt PATH --write",
        "seconds": round(seconds),
        "nanogpt_commit": info["commit"],
        "dataset": info["dataset"],
        "model": MODEL,
        "precursor": asdict(PrecursorConfig()),
        "summary": summary,
        "runs": rows,
        "user_patch": info["user_patch"],
        "harness_patch": info["harness_patch"],
    }
    with open(os.path.join(RESULTS, "nanogpt_precursor.json"), "w") as f:
        json.dump(out, f, indent=1)
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    md = [
        "# distmon's divergence precursor on nanoGPT's `train.py`, as a user would try it",
        "",
        "`python benchmarks/divergence/nanogpt_trial.py --nanogpt PATH --write` "
        f"(the runs {seconds / 60:.0f} min, twins side by side, 2 shared cores). "
        f"nanoGPT at `{info['commit']}` "
        "(github.com/karpathy/nanoGPT), `config/train_shakespeare_char.py` with the model shrunk for "
        f"a CPU ({model}), float32, no compile; a character dataset of {info['dataset']['chars']:,} "
        "bytes of the Python standard library's sources (this machine cannot download "
        "tiny-shakespeare). Each run twice at once: the bare `train.py` (with read-only probes of the "
        "attention and output logits) and the user's patched one. Divergence from the bare run's loss "
        "alone (its 20-step mean above 1.3 x its best, or non-finite: the early-warning benchmark's "
        "definition); lead = divergence iteration - first `divergence_warning`.",
        "",
        "The user's patch:",
        "",
        "```diff",
        info["user_patch"].rstrip("\n"),
        "```",
        "",
        "| run | meant | diverged at | first warning | lead (iters) | lead / iters to divergence "
        "| bound over 1000 from (probe) | bound max (before divergence) | best / final loss "
        "| loss bit-identical | distmon's bound vs the probe's (max rel. diff) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["name"],
            r["group"],
            _g(r["diverged_at"], "no"),
            _g(r.get("first_warning_iter"), "none"),
            _g(r.get("lead")),
            "-" if r.get("lead_pct") is None else f"{r['lead_pct']}%",
            _g(r["probe"]["first_iter_bound_over"], "never"),
            _g(r.get("distmon_bound_max")),
            f"{_g(r['best_loss'])} / {_g(r['final_loss'])}",
            _g(r.get("bit_identical")),
            f"{_g(r.get('bound_rel_err_max'))} ({r.get('bound_pairs')} samples)",
        ]
        md.append("| " + " | ".join(cells) + " |")
    sm = summary
    md += [
        "",
        f"Diverged: {sm['diverging_runs']}, warned before the divergence: {sm['detected']}; median lead "
        f"{_g(sm['median_lead_iters'])} iterations (min {_g(sm['min_lead_iters'])}), "
        f"{_g(sm['median_lead_pct'])}% of the iterations to divergence. Healthy: {sm['healthy_runs']}, "
        f"warned in {sm['healthy_runs_warned']} ({sm['false_warning_episodes']} warning episodes). "
        f"Stalled (not diverged by the loss's bar): {sm['stalled_runs']}, "
        f"warned in {sm['stalled_runs_warned']}. "
        f"Loss bit-identical to the bare twin in {sm['bit_identical']} of {sm['runs']} runs.",
        "",
    ]
    with open(os.path.join(RESULTS, "nanogpt_precursor.md"), "w") as f:
        f.write("\n".join(md))


def _g(x: object, none: str = "-") -> str:
    return none if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))


if __name__ == "__main__":
    main()
