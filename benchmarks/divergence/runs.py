"""The sweep: which runs, in which class, and their cached recordings.

Every run is the same tiny GPT (d_model 64, 2 blocks, 4 heads, 64-byte context, batch 16,
~0.1M parameters) with AdamW (0.9, 0.95, eps 1e-8), no weight decay, clipping at 1.0, a
linear warm-up over 1,000 steps to the peak learning rate then constant, 1,500 steps at most:
the learning rate sweeps upward through the stable range, and the run diverges (or not) where
its mechanism sets in. Classes:

- ``attention`` (no qk-layernorm, no z-loss, peak 0.7 and 1.0): the attention logits grow
  first (x1e4 and more), hundreds of steps before the loss diverges;
- ``qkln`` (qk-layernorm, no z-loss, peak 0.5 and 1.0: the issue's case b): attention logits
  stay bounded (tens); the linear outputs grow x1e4-1e5 (as they do in the healthy mitigated
  runs), the gradient norm and log Z rise in the last ~100 steps, and the loss diverges. Not
  Wortsman's output-logit divergence: ``mitigated`` (qk-layernorm and z-loss 1e-4 at peak
  0.5) diverges at about the same steps, z-loss or not;
- ``healthy``: the same model at stable rates (peak 0.003 and 0.01, no mitigation), and with
  qk-layernorm and z-loss 1e-4 at peaks 0.2 and 0.3;
- ``gray``: no mitigation at peak 0.3: attention logits grow x1e5, the loss ends 15-25% above
  its best, not the 30% that :mod:`.divergence` calls a divergence; reported apart;
- ``constant`` (:func:`stress` and :func:`validation` only): qk-layernorm warmed up to 0.5 in
  100 steps, diverging at that constant rate ~100 steps later.

:func:`sweep` and :func:`holdout` are the runs every candidate signal was scored on;
:func:`stress` the runs recorded while the oscillation rule (``PrecursorConfig(peak_lr=...)``)
was chosen, :func:`validation` those recorded after it was fixed.

A recording is one ``.npz`` per run under the cache folder (its arrays, and its metadata as
JSON), written by a child process so two runs share the two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from .model import ModelConfig
from .train import RunSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CACHE = os.path.join(ROOT, "benchmarks", "results", ".divergence-cache")

BASE = RunSpec(lr=0.01)
PLAIN = ModelConfig()
QKLN = ModelConfig(qk_layernorm=True)
MITIGATED = ModelConfig(qk_layernorm=True, z_loss=1e-4)


def sweep(seeds: int = 6) -> list[tuple[str, RunSpec]]:
    """(class, spec) of every run of the full sweep: 24 + 2 meant to diverge, 20 healthy, 3 gray."""
    runs: list[tuple[str, RunSpec]] = []
    for s in range(seeds):
        runs += [("attention", replace(BASE, lr=lr, seed=s, model=PLAIN)) for lr in (0.7, 1.0)]
        runs += [("qkln", replace(BASE, lr=lr, seed=s, model=QKLN)) for lr in (0.5, 1.0)]
    for s in range(5):
        runs += [("healthy", replace(BASE, lr=lr, seed=s, model=PLAIN)) for lr in (0.003, 0.01)]
        runs += [("healthy", replace(BASE, lr=lr, seed=s, model=MITIGATED)) for lr in (0.2, 0.3)]
    runs += [("gray", replace(BASE, lr=0.3, seed=s, model=PLAIN)) for s in range(3)]
    runs += [("mitigated", replace(BASE, lr=0.5, seed=s, model=MITIGATED)) for s in range(2)]
    return runs


def holdout() -> list[tuple[str, RunSpec]]:
    """Runs that played no part in choosing any rule: seeds the sweep does not use, for the
    classes where the choice is close (qk-layernorm diverging at 0.5/1.0 and with z-loss at 0.5;
    qk-layernorm + z-loss healthy at 0.2/0.3), and a few plain healthy runs."""
    runs: list[tuple[str, RunSpec]] = []
    for s in range(6, 10):
        runs += [("qkln", replace(BASE, lr=lr, seed=s, model=QKLN)) for lr in (0.5, 1.0)]
    runs += [("mitigated", replace(BASE, lr=0.5, seed=s, model=MITIGATED)) for s in range(2, 6)]
    for s in range(5, 10):
        runs += [("healthy", replace(BASE, lr=lr, seed=s, model=MITIGATED)) for lr in (0.2, 0.3)]
    for s in range(5, 7):
        runs += [("healthy", replace(BASE, lr=lr, seed=s, model=PLAIN)) for lr in (0.003, 0.01)]
    return runs


def describe(plan: Iterable[tuple[str, RunSpec]]) -> str:
    """The runs of ``plan`` in words, per class and model: their peak rates and seeds.

    Example:
        >>> describe(holdout()).split("; ")[0]
        'qkln (qk-layernorm): peak 0.5/1, seeds 6-9'
    """
    groups: dict[tuple[str, str], tuple[set[float], set[int]]] = {}
    for cls, spec in plan:
        m = spec.model
        model = ("qk-layernorm" if m.qk_layernorm else "no mitigation") + (
            f" + z-loss {m.z_loss:g}" if m.z_loss else ""
        )
        lrs, seeds = groups.setdefault((cls, model), (set(), set()))
        lrs.add(spec.lr)
        seeds.add(spec.seed)
    return "; ".join(
        f"{cls} ({model}): peak {'/'.join(f'{lr:g}' for lr in sorted(lrs))}, seeds {min(seeds)}-{max(seeds)}"
        for (cls, model), (lrs, seeds) in groups.items()
    )


def stress() -> list[tuple[str, RunSpec]]:
    """Runs at the edges of the oscillation rule (``PrecursorConfig(peak_lr=...)``), recorded while
    it was being chosen: qk-layernorm + z-loss warmed up to 0.35/0.4 (near the critical rate
    ~0.47; healthy if they do not diverge) or to 0.3 in 300 steps; qk-layernorm to 0.6 in
    1,000 steps and to 1.0 in 2,000; to 0.5 in 100 steps (then diverging at a constant rate,
    which the rule does not see); no mitigation at 0.7."""
    runs: list[tuple[str, RunSpec]] = []
    for s in (10, 11, 12):
        runs += [("healthy", replace(BASE, lr=lr, seed=s, model=MITIGATED)) for lr in (0.35, 0.4)]
        runs += [("healthy", replace(BASE, lr=0.3, warmup=300, seed=s, model=MITIGATED))]
        runs += [("qkln", replace(BASE, lr=0.6, seed=s, model=QKLN))]
        runs += [("qkln", replace(BASE, lr=1.0, warmup=2000, steps=2500, seed=s, model=QKLN))]
        runs += [("constant", replace(BASE, lr=0.5, warmup=100, seed=s, model=QKLN))]
    runs += [("attention", replace(BASE, lr=0.7, seed=s, model=PLAIN)) for s in (10, 11)]
    return runs


def validation() -> list[tuple[str, RunSpec]]:
    """Runs recorded after the oscillation rule and its settings were fixed, and scored once: other
    seeds, peaks and warm-ups (qk-layernorm to 0.7 and to 0.8 over 1,500 steps, with z-loss to
    0.6; healthy with z-loss to 0.38 in 500 steps and to 0.4, without to 0.35; 0.5 in 100
    steps; no mitigation at 1.0)."""
    runs: list[tuple[str, RunSpec]] = []
    for s in (13, 14, 15):
        runs += [("qkln", replace(BASE, lr=0.7, seed=s, model=QKLN))]
        runs += [("qkln", replace(BASE, lr=0.8, warmup=1500, steps=2000, seed=s, model=QKLN))]
        runs += [("mitigated", replace(BASE, lr=0.6, seed=s, model=MITIGATED))]
        runs += [("healthy", replace(BASE, lr=0.38, warmup=500, seed=s, model=MITIGATED))]
        runs += [("healthy", replace(BASE, lr=0.4, seed=s, model=MITIGATED))]
        runs += [("healthy", replace(BASE, lr=0.35, seed=s, model=QKLN))]
        runs += [("constant", replace(BASE, lr=0.5, warmup=100, seed=s, model=QKLN))]
        runs += [("attention", replace(BASE, lr=1.0, seed=s, model=PLAIN))]
    return runs


def fast_warmups() -> list[tuple[str, RunSpec]]:
    """Short warm-ups (50-200 steps), recorded after both rules were fixed and scored once: healthy
    if they do not diverge (qk-layernorm with and without z-loss to 0.3 in 100 steps, with z-loss
    to 0.2 in 50, 0.35 in 100 and 0.4 in 200; no mitigation to 0.01 in 100), and diverging at
    (or near) a constant rate (qk-layernorm to 0.5 in 100, 0.6 in 200 and 0.45 in 50; with
    z-loss to 0.5 in 100). They test a gradient-norm jump rule for the constant-rate class
    (``early_warning.py``'s jump table: it cannot tell the two apart)."""
    runs: list[tuple[str, RunSpec]] = []
    for s in (16, 17):
        runs += [("healthy", replace(BASE, lr=0.3, warmup=100, seed=s, model=m)) for m in (MITIGATED, QKLN)]
        runs += [("constant", replace(BASE, lr=0.5, warmup=100, seed=s, model=QKLN))]
    healthy = [(0.2, 50, MITIGATED), (0.01, 100, PLAIN), (0.35, 100, MITIGATED), (0.4, 200, MITIGATED)]
    runs += [("healthy", replace(BASE, lr=lr, warmup=wu, seed=16, model=m)) for lr, wu, m in healthy]
    diverging = [(0.6, 200, QKLN), (0.45, 50, QKLN), (0.5, 100, MITIGATED)]
    runs += [("constant", replace(BASE, lr=lr, warmup=wu, seed=16, model=m)) for lr, wu, m in diverging]
    return runs


def late_holdout() -> list[tuple[str, RunSpec]]:
    """Runs recorded after ``loss_regression.py`` fitted its bounds to the stress, validation and fast
    warm-up runs, and scored once (seeds 18-20): diverging at (or near) a constant rate (qk-layernorm
    to 0.5 in 100 steps, to 0.45 in 50, to 0.6 in 200; with z-loss to 0.5 in 100), and healthy
    close to the critical rate ~0.47 (qk-layernorm + z-loss to 0.4 in 1,000 and 200 steps, to 0.38
    in 500, to 0.35 in 100; qk-layernorm to 0.35 in 1,000 and 0.3 in 100) or far below it (no
    mitigation to 0.01 in 100)."""
    runs: list[tuple[str, RunSpec]] = []
    for s in (18, 19, 20):
        runs += [("constant", replace(BASE, lr=0.5, warmup=100, seed=s, model=QKLN))]
        runs += [("healthy", replace(BASE, lr=0.4, seed=s, model=MITIGATED))]
    diverging = [(0.45, 50, QKLN), (0.6, 200, QKLN), (0.5, 100, MITIGATED)]
    healthy = [(0.4, 200, MITIGATED), (0.38, 500, MITIGATED), (0.35, 100, MITIGATED), (0.35, 1000, QKLN)]
    healthy += [(0.3, 100, QKLN), (0.01, 100, PLAIN)]
    for s in (18, 19):
        runs += [("constant", replace(BASE, lr=lr, warmup=wu, seed=s, model=m)) for lr, wu, m in diverging]
    runs += [("healthy", replace(BASE, lr=lr, warmup=wu, seed=18, model=m)) for lr, wu, m in healthy]
    runs += [("healthy", replace(BASE, lr=lr, warmup=wu, seed=19, model=m)) for lr, wu, m in healthy[:2]]
    return runs


def sets() -> dict[str, list[tuple[str, RunSpec]]]:
    """The sets of runs ``early_warning.py`` scores, by name, in the order its tables give them.

    Example:
        >>> list(sets())
        ['sweep', 'hold-out', 'stress', 'validation', 'fast warm-ups']
    """
    return {
        "sweep": sweep(),
        "hold-out": holdout(),
        "stress": stress(),
        "validation": validation(),
        "fast warm-ups": fast_warmups(),
    }


def wider() -> list[tuple[str, RunSpec]]:
    """Twice the width (d_model 128), qk-layernorm, warmed up in 100 steps to 0.05-0.5 (seeds 21-22):
    recorded after ``update_spectrum.py`` fitted its bounds at d_model 64, to score them once at
    another width. The class is ``wide``: whether a run diverges is the loss's verdict alone."""
    model = replace(QKLN, d_model=128)
    return [
        ("wide", replace(BASE, lr=lr, warmup=100, seed=s, model=model))
        for s in (21, 22)
        for lr in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
    ]


def quick() -> list[tuple[str, RunSpec]]:
    """A smoke sweep (well under a minute): one short run per class, fast rates."""
    short = replace(BASE, steps=150, warmup=100)
    return [
        ("attention", replace(short, lr=1.0, model=PLAIN)),
        ("healthy", replace(short, lr=0.003, model=PLAIN)),
    ]


def cache_path(cache: str, spec: RunSpec) -> str:
    return os.path.join(cache, f"{spec.name}-n{spec.steps}.npz")


def save(path: str, rec: dict[str, object]) -> None:
    """Write a recording (``train``'s dict) as one compressed ``.npz``."""
    arrays = {f"a_{k}": v for k, v in rec["arrays"].items()}
    meta = {k: v for k, v in rec.items() if k not in ("arrays", "loss", "grad_norm")}
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, loss=rec["loss"], grad_norm=rec["grad_norm"], meta=json.dumps(meta), **arrays)
    os.replace(tmp, path)


def load(path: str) -> dict[str, object]:
    """Read a recording written by :func:`save`."""
    with np.load(path) as z:
        rec = json.loads(str(z["meta"]))
        rec["loss"], rec["grad_norm"] = z["loss"], z["grad_norm"]
        rec["arrays"] = {k[2:]: z[k] for k in z.files if k.startswith("a_")}
    return rec


def _child(spec_json: str, path: str) -> None:
    from .detectors import spec_of
    from .train import train

    save(path, train(spec_of({"spec": json.loads(spec_json)})))


def ensure(
    runs: Iterable[tuple[str, RunSpec]],
    cache: str,
    *,
    jobs: int = 2,
    log=print,  # noqa: ANN001
    child: str = __name__,
) -> None:
    """Record every run not yet in ``cache``, ``jobs`` child processes at a time (one thread each):
    ``_child(spec_json, path)`` of the module ``child`` records one (another module's may record
    more beside it, as ``update_spectrum.py``'s does)."""
    os.makedirs(cache, exist_ok=True)
    todo = [spec for _, spec in runs if not os.path.exists(cache_path(cache, spec))]
    running: list[tuple[subprocess.Popen, RunSpec, float]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    while todo or running:
        while todo and len(running) < jobs:
            spec = todo.pop(0)
            code = f"import sys; from {child} import _child; _child(*sys.argv[1:3])"
            args = [sys.executable, "-c", code, json.dumps(spec.as_dict()), cache_path(cache, spec)]
            running.append((subprocess.Popen(args, env=env, cwd=ROOT), spec, time.perf_counter()))
        time.sleep(0.5)
        for item in list(running):
            proc, spec, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                status = "ok" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
                log(f"  {spec.name}: {status} in {time.perf_counter() - t0:.0f} s ({len(todo)} to go)")
