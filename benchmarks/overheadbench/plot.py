"""``overhead.png``: step-time ratios and own-code cost in gradient passes, per approach and size."""

from .approaches import label
from .results import RunResult
from .verdicts import PASSES_TARGET, RATIO_TARGET


def plot(res: RunResult, path: str) -> str | None:
    """Draw the run to ``path``; None (and a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return None
    sizes = res.sizes
    names = [a for a in res.approaches if a != "baseline"]
    xs = list(range(len(sizes)))
    xt = [f"{s.info.size}\n{s.info.n_params / 1e6:.1f}M params\n{s.info.n_tensors} tensors" for s in sizes]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    markers = "os^vDPX*<>"
    for j, a in enumerate(names):
        kw = dict(
            marker=markers[j % len(markers)],
            label=label(a, res.hist_freq),
            lw=2.8 if a.startswith("distmon") else 1.2,
            ms=7 if a.startswith("distmon") else 5,
        )
        r = [s.rows[a] for s in sizes]
        axes[0].errorbar(
            xs,
            [x.ratio for x in r],
            yerr=[
                [max(0.0, x.ratio - x.ratio_min) for x in r],
                [max(0.0, x.ratio_max - x.ratio) for x in r],
            ],
            capsize=3,
            **kw,
        )
        axes[1].plot(xs, [max(x.own_passes, 1e-3) for x in r], **kw)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(RATIO_TARGET, color="r", lw=0.8, ls="--", label=f"target {RATIO_TARGET}")
    meds = [s.rows[a].ratio for s in sizes for a in names]
    axes[0].set_ylim(max(0.5, min(meds) - 0.1), min(2.0, max(meds) + 0.15))  # long bars are clipped
    axes[0].set_ylabel("step time / bare DDP step time (wall; median, bars: min-max over blocks, clipped)")
    axes[0].set_title("End to end: step-time ratio to bare DDP")
    axes[1].axhline(PASSES_TARGET, color="r", lw=0.8, ls="--", label=f"target {PASSES_TARGET} passes")
    axes[1].axhline(1.0, color="k", lw=0.8, ls=":", label="1 pass = one fused read of all gradients")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("own-code CPU time per step / floor")
    axes[1].set_title("Cost in gradient passes (own code, CPU time)")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(xt, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    m = res.machine
    fig.suptitle(
        f"Gradient monitoring overhead, DDP {m.world_size} ranks ({m.backend}); {m.cpu}, "
        f"{m.cores} cores; torch {m.torch}" + ("" if m.gpu else "; no GPU"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
