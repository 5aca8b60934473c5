"""``python -m distmon report``: pictures and a summary from a run's JSONL log, a cut one too."""

import math
import os
import subprocess
import sys

import pytest
import torch

import distmon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICTURES = ("global_norm.png", "layer_heatmap.png", "rank_layer_at_worst.png", "rank_norms.png")


def _report(log, out):
    return subprocess.run(
        [sys.executable, "-m", "distmon", "report", str(log), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _not_blank(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    return img.ndim == 3 and float(img[..., :3].std()) > 0.01  # drawn on, not one flat colour


def _single_process_log(path, steps=40, nan_step=30):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with distmon.GradMonitor(net, opt, serve="none", export_every=5, log_path=str(path)):
        for step in range(1, steps + 1):
            loss = net(torch.randn(8, 8)).pow(2).mean()
            (loss * math.nan if step == nan_step else loss).backward()
            opt.step()
            opt.zero_grad()


def test_a_report_of_pictures_and_a_summary_also_from_a_cut_log(tmp_path):
    log = tmp_path / "run.jsonl"
    _single_process_log(log)
    proc = _report(log, tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    for name in PICTURES:
        assert _not_blank(tmp_path / "report" / name), name
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "first non-finite step 30**: rank 0, layer `0`" in summary, summary
    assert "| 30 | nonfinite | 0 | 0 |" in summary, summary
    # a crashed run: the last line cut mid-write
    text = log.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])
    proc = _report(cut, tmp_path / "cut-report")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "cut-report" / "summary.md").read_text()
    assert "1 unreadable line(s) skipped" in summary and "steps 1..39" in summary, summary
    assert _not_blank(tmp_path / "cut-report" / "global_norm.png")


def test_an_empty_or_missing_log_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for log in (tmp_path / "empty.jsonl", tmp_path / "missing.jsonl"):
        proc = _report(log, tmp_path / "r")
        assert proc.returncode == 2 and "distmon" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_demo_run_s_report_names_the_injected_spike_and_shows_the_noise_scale(tmp_path):
    log = tmp_path / "demo.jsonl"
    run = subprocess.run(
        [sys.executable, "launch/train.py", "--nproc", "2", "--preset", "tiny", "--steps", "120"]
        + ["--spike-step", "100", "--log-path", str(log), "--port", "0", "--linger", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    proc = _report(log, tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    for name in PICTURES + ("noise_scale.png",):
        assert _not_blank(tmp_path / "report" / name), name
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| 100 | spike |" in summary, summary
    assert "gradient noise scale at the end" in summary
