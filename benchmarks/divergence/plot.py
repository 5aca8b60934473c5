"""The picture a person reads at a glance: per run, the signal per layer with its bound and the
warning, above the loss with the divergence and every detector's first warning."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .detectors import Recording, signal, spec_of

COLORS = {
    "distmon precursor": "tab:red",
    "distmon precursor, peak_lr=": "tab:green",
    "distmon spike": "tab:purple",
    "Lightning SpikeDetection": "tab:orange",
    "gradient-norm threshold": "tab:brown",
}


def plot(
    path: str,
    panels: Sequence[tuple[str, Recording, int | None, dict[str, int | None]]],
    *,
    parts: Sequence[tuple[str, float | None]],
) -> None:
    """Write a PNG: one column per ``(title, recording, divergence step, {detector: first warning})``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(5.2 * len(panels), 6.4), sharex="col", squeeze=False)
    for col, (title, rec, div, firsts) in enumerate(panels):
        top, bottom = axes[0, col], axes[1, col]
        for name, bound in parts:
            steps, values, names = signal(rec, name)
            if name == "1-grad_cos":  # a cosine: on its own linear axis, as the cosine itself
                right = top.twinx()
                cos = np.where(values[:, 0] > 0, 1.0 - values[:, 0], np.nan)
                right.plot(steps, cos, lw=0.8, color="tab:green", label="consecutive gradients' cosine")
                right.axhline(1.0 - bound, color="tab:green", ls=":", lw=1, label=f"cosine {1.0 - bound:g}")
                right.set_ylim(-1.0, 1.0)
                right.set_ylabel("cosine", color="tab:green", fontsize=8)
                right.tick_params(axis="y", labelsize=7, colors="tab:green")
                right.legend(fontsize=6, loc="lower right")
                continue
            for j, layer in enumerate(names):
                top.plot(steps, values[:, j], lw=1.2, label=f"{name} {layer}")
            if bound is not None:
                top.axhline(bound, color="k", ls=":", lw=1, label=f"bound {bound:g}")
        top.set_yscale("log")
        top.set_title(title, fontsize=10)
        loss = np.asarray(rec["loss"], np.float64)
        bottom.plot(np.arange(len(loss)), loss, color="0.3", lw=0.6, label="training loss (CE)")
        if div is not None:
            for ax in (top, bottom):
                ax.axvline(div, color="k", lw=1.5)
            bottom.text(div, bottom.get_ylim()[1], " diverged", va="top", fontsize=8)
        for label, first in firsts.items():
            if first is not None:
                for ax in (top, bottom):
                    ax.axvline(
                        first,
                        color=COLORS.get(label, "tab:gray"),
                        ls="--",
                        lw=1.2,
                        label=f"{label}: step {first}" if ax is bottom else None,
                    )
        spec = rec["spec"]
        t = np.arange(len(loss))
        run = spec_of(rec)
        lr = np.asarray([run.lr_at(int(i)) for i in t])
        twin = bottom.twinx()
        twin.plot(t, lr, color="tab:blue", lw=0.8, alpha=0.6)
        twin.set_ylabel("learning rate", color="tab:blue", fontsize=8)
        twin.tick_params(axis="y", labelsize=7, colors="tab:blue")
        twin.set_ylim(0, spec["lr"] * 1.1)
        bottom.set_xlabel("step")
        bottom.set_ylim(0, max(6.0, float(np.nanmin([np.nanmax(loss[np.isfinite(loss)]), 12.0]))))
        top.legend(fontsize=6, loc="upper left")
        bottom.legend(fontsize=6, loc="upper right")
    axes[0, 0].set_ylabel("sampled signal (log scale)")
    axes[1, 0].set_ylabel("loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
