"""What each tracker must hold, from a JSONL log line, for the tracker tests (issue #43).

The names and values are derived here from the log's own fields, as docs/trackers.md lists them,
not by distmon's code (``distmon/export/tracker_figures.py``), so a name or value distmon gets
wrong fails the tests.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def _num(value: float | str) -> float:
    return float(value)  # the log writes non-finite floats as "nan"/"inf"


def expected_figures(line: dict[str, object]) -> dict[str, float]:
    """The figures of one JSONL line, by the names docs/trackers.md lists."""
    e: dict[str, float] = {}
    if line["valid"]:
        e["distmon/grad_norm"] = _num(line["grad_norm"])
        e.update({f"distmon.layer_grad_norm/{k}": _num(v) for k, v in line["layer_grad_norms"].items()})
    for r, v, ok in zip(line["ranks"], line["rank_grad_norms"], line["rank_valid"]):
        if ok:
            e[f"distmon.rank_grad_norm/{r}"] = _num(v)
    e["distmon/nonfinite"] = float(line["nonfinite"] and line["skip_reason"] != "scaler")
    e["distmon/nonfinite_rank_count"] = float(line["nonfinite_rank_count"])
    e["distmon/skipped"] = float(line["skipped"])
    e["distmon/monitor_errors"] = float(line["monitor_errors"])
    if line["first_nonfinite"]:
        e["distmon/first_nonfinite_rank"] = float(line["first_nonfinite"][0])
    for key, name in (("zscore", "grad_norm_zscore"), ("median_ratio", "grad_norm_median_ratio")):
        if key in line["scores"] and not math.isnan(_num(line["scores"][key])):
            e[f"distmon/{name}"] = _num(line["scores"][key])
    for key, name in (
        ("gradient_noise_scale", "gradient_noise_scale"),
        ("noise_trace", "gradient_noise_trace"),
        ("noise_signal", "gradient_noise_signal"),
    ):
        if not math.isnan(_num(line[key])):
            e[f"distmon/{name}"] = _num(line[key])
    for field, family in (
        ("layer_gradient_noise_scale", "layer_gradient_noise_scale"),
        ("layer_update_ratio", "layer_update_ratio"),
        ("activation_rms", "activation_rms"),
        ("activation_absmax", "activation_absmax"),
    ):
        for k, v in line[field].items():
            if not math.isnan(_num(v)):
                e[f"distmon.{family}/{k}"] = _num(v)
    for r, v in zip(line["ranks"], line["rank_outlier_scores"]):
        if not math.isnan(_num(v)):
            e[f"distmon.rank_outlier_score/{r}"] = _num(v)
    for event in line["events"]:
        key = f"distmon.anomalies/{event['kind']}"
        e[key] = e.get(key, 0.0) + 1.0
    return e


def tensorboard_figures(logdir: Path, prefix: str = "") -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """(tag -> step -> value, step -> events text) of every event file under ``logdir``, read with
    TensorBoard's own ``EventAccumulator`` (every event kept): float64 tensor summaries (what
    distmon's TensorBoard tracker writes) and float32 scalars (what Lightning's ``TensorBoardLogger``
    and the HF Trainer's ``TensorBoardCallback`` write); ``prefix`` is taken off the tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    got: dict[str, dict[int, float]] = defaultdict(dict)
    texts: dict[int, str] = {}
    for tag in acc.Tags()["tensors"]:
        name = tag.removeprefix(prefix)
        for ev in acc.Tensors(tag):
            value = tensor_util.make_ndarray(ev.tensor_proto)
            if name.startswith("distmon/events"):  # torch's add_text writes <tag>/text_summary
                texts[ev.step] = b"".join(value.reshape(-1)).decode()
            elif value.dtype.kind == "f":
                got[name][ev.step] = float(value)
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            got[tag.removeprefix(prefix)][ev.step] = ev.value
    return got, texts
