#!/usr/bin/env python3
"""Spectral alignment (Qiu et al. 2025) on runs that diverge at a constant rate and runs that do not.

    python benchmarks/divergence/spectral_alignment.py --write   # 28 runs, ~10 min on 2 cores

The precursor is blind to runs warmed up quickly to a rate too high for them (``docs/detection.md``,
"Where it is blind": the ``constant`` class). Qiu et al., "Spectral Alignment as Predictor of
Loss Explosion in Neural Network Training" (arXiv 2510.04202), watch the alignment between each
layer's inputs and the principal singular vector of its weight, and report that a collapse in
the sign diversity of that alignment comes well before a loss explosion. As read here: for every
``nn.Linear`` with weight ``W`` and top right singular vector ``v1``, every ``EVERY`` steps, each
input token's cosine ``a_i = x_i . v1 / |x_i|`` over the step's batch, and

- its **sign diversity** ``1 - |2p - 1|``, ``p`` the share of tokens with ``a_i > 0`` (1: half
  each way; 0: every token on one side, the collapse; ``v1``'s own sign does not matter);
- its **magnitude** ``mean |a_i|`` (how far the inputs lean into the weight's top direction).

Runs: the constant class of the stress, validation and fast warm-up sets (11) and the healthy
runs of the fast warm-up and validation sets (17, warm-ups of 50-1,000 steps, 1,500 steps each).
For each layer and signal the table gives the rule "past a bound for 2 samples in a row" with
the bound set at the healthy runs' extreme from step ``FROM`` on (so no healthy run warns: a
bound tuned on the very runs it is scored on, the most favourable case), and how many constant
runs it warns before their divergence.

Writes ``benchmarks/results/spectral_alignment.md``; the runs are not cached.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.divergence.runs import fast_warmups, stress, validation  # noqa: E402
from benchmarks.divergence.sharpness_probe import held, run_and_write  # noqa: E402
from benchmarks.divergence.train import RunSpec, train  # noqa: E402

EVERY = 10
FROM = 100  # the first sample judged: the fastest warm-ups of the constant class end at 50-100
RUNS = [r for r in stress() + validation() + fast_warmups() if r[0] == "constant"]
RUNS += [r for r in fast_warmups() + validation() if r[0] == "healthy"]
# (name, falls towards trouble), in the order of a sample's per-layer pair
SIGNALS = (("sign diversity", True), ("magnitude", False))


def alignment(x: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """``(sign diversity, mean |a|)`` of the inputs ``x`` (tokens x in) against ``weight``'s top
    right singular vector, in float64.

    Example:
        >>> w = torch.diag(torch.tensor([3.0, 1.0]))            # top right singular vector: e1
        >>> x = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [2.0, 5.0], [-0.5, -0.5]])  # 2 tokens each way
        >>> [round(v, 4) for v in alignment(x, w)]      # |a|: 1, 1/sqrt(2), 2/sqrt(29), 1/sqrt(2)
        [1.0, 0.6964]
        >>> alignment(torch.tensor([[1.0, 1.0], [2.0, -1.0]]), w)[0]   # every token on one side
        0.0
    """
    v1 = torch.linalg.svd(weight.double(), full_matrices=False).Vh[0]
    x = x.double()
    a = (x @ v1) / x.norm(dim=1).clamp_min(1e-300)
    p = float((a > 0).double().mean())
    return 1.0 - abs(2.0 * p - 1.0), float(a.abs().mean())


class SpectralAlignment:
    """A ``train`` probe: every ``every`` steps, :func:`alignment` of every ``nn.Linear`` (its inputs of
    that step's forward, its weight before the step). Hooks go on at the first call (step 0's
    forward is not seen), so the first sample is step ``every``."""

    def __init__(self, every: int = EVERY) -> None:
        self.every, self.step = every, 0
        self.linears: dict[str, torch.nn.Linear] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.samples: list[tuple[int, dict[str, tuple[float, float]]]] = []

    def _keep(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.inputs[name] = args[0].detach()  # a reference: no copy

        return hook

    @torch.no_grad()
    def __call__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        step, self.step = self.step, self.step + 1
        if not self.linears:
            self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            for n, m in self.linears.items():
                m.register_forward_pre_hook(self._keep(n))
        elif step % self.every == 0:
            self.samples.append(
                (
                    step,
                    {
                        n: alignment(self.inputs[n].reshape(-1, m.in_features), m.weight)
                        for n, m in self.linears.items()
                    },
                )
            )


def probe(spec: RunSpec) -> dict[str, object]:
    """One run: its divergence step and the probe's samples."""
    sa = SpectralAlignment()
    rec = train(spec, distmon_watch=False, record_every=10**9, probe=sa)
    return {"name": spec.name, "diverged": rec["diverged"], "samples": sa.samples}


def markdown(results: list[tuple[str, dict[str, object]]]) -> str:
    layers = list(results[0][1]["samples"][0][1])

    def series(r: dict[str, object], layer: str, k: int) -> tuple[list[int], list[float]]:
        div = r["diverged"]
        rows = [(st, s[layer][k]) for st, s in r["samples"] if div is None or st < div]
        return [st for st, _ in rows], [v for _, v in rows]

    lines = [
        "# Spectral alignment: runs diverging at a constant rate against healthy ones",
        "",
        "`python benchmarks/divergence/spectral_alignment.py --write`. Every "
        f"{EVERY} steps, per `nn.Linear`: the cosine `a_i` of each input token with the top right "
        "singular vector of the weight (Qiu et al. 2025, arXiv 2510.04202); its sign diversity "
        "`1 - |2p - 1|` (`p` the share of positive `a_i`; 0: collapsed to one side) and its magnitude, "
        "the mean of `abs(a_i)`.",
        "",
        f"Per run, the lowest sign diversity of each layer from step {FROM} to the divergence "
        "(healthy runs: to their end):",
        "",
        "| run | class | diverged at | " + " | ".join(layers) + " |",
        "|---|---|---|" + "---|" * len(layers),
    ]
    for cls, r in results:
        lows = []
        for layer in layers:
            judged = [x for st, x in zip(*series(r, layer, 0)) if st >= FROM]
            lows.append(f"{min(judged):.2f}" if judged else "-")
        lines.append(f"| {r['name']} | {cls} | {r['diverged']} | " + " | ".join(lows) + " |")
    constant = [r for cls, r in results if cls == "constant"]
    healthy = [r for cls, r in results if cls == "healthy"]
    lines += [
        "",
        f"The rule per layer and signal: past the healthy runs' extreme (held 2 samples, from step {FROM} "
        f"on) before the divergence; how many of the {len(constant)} constant-rate runs it warns, "
        "and their median lead in steps.",
        "",
        "| layer | "
        + " | ".join(f"{s}: healthy extreme | {s}: constant runs warned" for s, _ in SIGNALS)
        + " |",
        "|---|" + "---|---|" * len(SIGNALS),
    ]
    best: dict[str, tuple[int, str]] = {signal: (0, "") for signal, _ in SIGNALS}
    collapsed = 0  # layers whose sign diversity reaches 0 in a healthy run (held 2 samples)
    for layer in layers:
        cells = []
        for k, (signal, falls) in enumerate(SIGNALS):
            extreme = (min if falls else max)(
                h for r in healthy for _, h in held(*series(r, layer, k), falls, FROM)
            )
            leads = []
            for r in constant:
                kept = held(*series(r, layer, k), falls, FROM)
                hit = [st for st, h in kept if (h < extreme if falls else h > extreme)]
                leads += [r["diverged"] - hit[0]] if hit else []
            median = f", median lead {statistics.median(leads):g}" if leads else ""
            cells += [f"{extreme:.3g}", f"{len(leads)}/{len(constant)}{median}"]
            if falls and extreme == 0:
                collapsed += 1
            best[signal] = max(best[signal], (len(leads), layer))
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The best layer of each signal, with a bound fitted to these healthy runs: "
        + "; ".join(
            f"{s}, {layer}: {n} of {len(constant)}" if n else f"{s}: none of {len(constant)}"
            for s, (n, layer) in best.items()
        )
        + f". The sign diversity of healthy runs collapses to 0 in {collapsed} of {len(layers)} layers.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_and_write("spectral_alignment", __doc__, RUNS, probe, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
