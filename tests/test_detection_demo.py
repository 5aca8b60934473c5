"""Detection on the real demo model (launch/train.py under torchrun, 3 gloo ranks).

Thresholds: the ``DetectorConfig`` defaults (the README's detection table states them).
Every run is 500 steps of the tiny preset; apart from the injected fault, each must produce
zero events.
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from detector_calibration import run_demo  # noqa: E402

STEPS = 500
BASE = ["--preset", "tiny", "--steps", str(STEPS)]
LAYER = "blocks.0.attn.proj"


def _events(snaps):
    return [(e["step"], e["kind"], e["rank"], e["layer"]) for s in snaps for e in s["events"]]


def test_spike_then_nan_are_reported_where_they_were_injected(tmp_path):
    """Seed 0: x100 on one layer at step 300; NaN on rank 2 in another layer at the last step."""
    snaps = run_demo(
        BASE
        + [
            "--seed",
            "0",
            "--spike-step",
            "300",
            "--spike-factor",
            "100",
            "--spike-layer",
            LAYER,
            "--nan-step",
            str(STEPS),
            "--nan-rank",
            "2",
            "--nan-layer",
            "blocks.1.mlp.fc2",
        ],
        3,
        str(tmp_path / "a.jsonl"),
    )
    assert [s["step"] for s in snaps] == list(range(1, STEPS + 1))
    assert _events(snaps) == [(300, "spike", -1, LAYER), (STEPS, "nonfinite", 2, "blocks.1.mlp.fc2")]
    last = snaps[-1]
    assert last["nonfinite"] and last["nonfinite_ranks"] == [2]
    assert last["first_nonfinite"] == [2, "blocks.1.mlp.fc2"]
    assert len(last["rank_layer_grad_norms"]) == 3  # the JSONL carries the rank x layer matrix


def test_corrupted_rank_is_the_outlier_and_nothing_else_fires(tmp_path):
    """Seed 1: rank 1's batch scaled x4 from step 350 on."""
    snaps = run_demo(
        BASE + ["--seed", "1", "--corrupt-rank", "1", "--corrupt-scale", "4", "--corrupt-from", "350"],
        3,
        str(tmp_path / "b.jsonl"),
    )
    events = _events(snaps)
    assert events, "the corrupted rank was not reported"
    assert events[0][:3] == (350, "rank_outlier", 1)
    assert {(kind, rank) for _, kind, rank, _ in events} == {("rank_outlier", 1)}


def test_no_false_positives_on_a_clean_run(tmp_path):
    """One clean seed here (the suite's time budget); ``benchmarks/detector_calibration.py``
    runs clean seeds 0-2 by default and reports each one's largest score against its threshold."""
    snaps = run_demo(BASE + ["--seed", "2"], 3, str(tmp_path / "c.jsonl"))
    assert len(snaps) == STEPS
    assert _events(snaps) == []
