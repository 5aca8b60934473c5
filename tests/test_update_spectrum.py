"""The update-spectrum probe (`benchmarks/divergence/update_spectrum.py`) reads what it claims (fast).

``UpdateSpectrum`` against numpy's SVD of each step's change of the weights, cut by module name
and head; its table on generated runs whose answers are known.
"""

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_early_warning_alternatives import probe_run  # noqa: E402


def _spectrum_reference(s):  # noqa: ANN001, ANN202
    """Spectral entropy (natural log, over log n) and participation of singular values ``s``, in numpy."""
    p = s / s.sum()
    p = p[p > 0]
    return [
        float(-(p * np.log(p)).sum() / math.log(len(s))),
        float((s**2).sum() ** 2 / (s**4).sum() / len(s)),
    ]


@pytest.mark.parametrize("seed", range(3))
def test_the_update_spectrum_reads_the_singular_values_of_each_step_s_change_of_the_weights(seed):
    """``UpdateSpectrum`` on a real TinyGPT (qk-layernorm) trained by AdamW at a high rate, against a
    reference in numpy that never reads the probe's layout: each step's update from the parameters
    the step before left (by module name: the fused projection's rows cut in three, the query rows
    first), numpy's SVD, and each head's query-key form ``W_q,h^T W_k,h`` changed to first order by
    ``dW_q,h^T W_k,h + W_q,h^T dW_k,h`` (heads cut from the rows by the model's own head count; the
    form's rank is at most the head's width: only that many singular values). The first step reads NaN."""
    from benchmarks.divergence.model import ModelConfig, TinyGPT
    from benchmarks.divergence.update_spectrum import GROUPS, QK, SIGNALS, UpdateSpectrum

    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, n_heads=2, seq_len=8, qk_layernorm=True)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    probe, thetas = UpdateSpectrum(cfg.n_heads), []
    for _ in range(5):
        x = torch.randint(0, 256, (4, 8))
        model(x, x.roll(-1, 1))[1].backward()
        probe(opt, model)
        thetas.append({n: p.detach().double().numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    leaf = {"proj": "attention output", "fc1": "mlp fc1", "fc2": "mlp fc2", "lm_head": "output head"}
    head = cfg.d_model // cfg.n_heads
    for t, row in enumerate(probe.rows):
        assert row.shape == (len(SIGNALS), len(GROUPS))
        if t == 0:
            assert np.isnan(row).all()
            continue
        want = {g: [] for g in GROUPS}
        for name, module in model.named_modules():
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or "pos_emb" in name:
                continue
            w, before = thetas[t][f"{name}.weight"], thetas[t - 1][f"{name}.weight"]
            dw = w - before
            if name.endswith("qkv"):
                d = cfg.d_model
                for part, group in enumerate(("queries", "keys", "values")):
                    want[group].append(
                        _spectrum_reference(np.linalg.svd(dw[part * d : (part + 1) * d], compute_uv=False))
                    )
                for h in range(cfg.n_heads):
                    rows = slice(h * head, (h + 1) * head)
                    wq, wk = w[:d][rows], w[d : 2 * d][rows]
                    dq, dk = dw[:d][rows], dw[d : 2 * d][rows]
                    first = dq.T @ wk + wq.T @ dk
                    want[QK].append(_spectrum_reference(np.linalg.svd(first, compute_uv=False)[:head]))
            else:
                group = (
                    "token embeddings"
                    if isinstance(module, torch.nn.Embedding)
                    else leaf[name.rsplit(".", 1)[-1]]
                )
                want[group].append(_spectrum_reference(np.linalg.svd(dw, compute_uv=False)))
        for g, group in enumerate(GROUPS):
            assert row[:, g] == pytest.approx(np.mean(want[group], axis=0), rel=1e-6, abs=1e-9), (t, group)


def test_the_update_spectrum_table_reads_each_reading_both_ways_and_fits_the_healthy_extreme():
    """``update_spectrum.markdown`` on generated runs whose answers are known: every reading 0.8 but
    where a run departs; a constant-rate run whose keys' spectral entropy collapses to 0.1 at step 150
    and which diverges at 300 is warned on that row's fall (lead 140: held past 0.8 from the sample
    at 160, which already averages 10 collapsed steps); a healthy run whose output head's
    participation rises to 0.95 sets that rise's bound and is not warned by it."""
    from benchmarks.divergence import update_spectrum as us

    def run(name, diverged, turn=None):  # noqa: ANN001, ANN202
        return probe_run((len(us.SIGNALS), len(us.GROUPS)), name, diverged, turn, fill=0.8)

    keys, head = us.GROUPS.index("keys"), us.GROUPS.index("output head")
    text = us.markdown(
        [
            ("constant", run("c1", 300, ((0, keys), (150, 400), 0.1))),
            ("healthy", run("h1", None, ((1, head), (200, 230), 0.95))),
        ]
    )
    rows = {tuple(line.split(" | ")[:3]): line for line in text.splitlines() if line.startswith("| ")}
    assert len(rows) == 1 + 2 * len(us.SIGNALS) * len(us.GROUPS), text  # and the header
    assert rows[("| spectral entropy", "falls", "keys")].endswith(
        "| 0.8 (h1) | 1/1 | 140 | 0/1 | 0/0 | - | 0/0 |"
    ), text
    assert rows[("| spectral entropy", "rises", "keys")].endswith(
        "| 0.8 (h1) | 0/1 | - | 0/1 | 0/0 | - | 0/0 |"
    ), text
    assert rows[("| participation", "rises", "output head")].endswith(
        "| 0.95 (h1) | 0/1 | - | 0/1 | 0/0 | - | 0/0 |"
    ), text
