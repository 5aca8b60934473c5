"""``python -m distmon report``: pictures and a summary from one run of a JSONL log, whatever the log.

Malformed lines are skipped and counted by reason, a log holding several runs (a job restarted
in append mode) is reported one run at a time, memory and time stay bounded on logs with
thousands of layers, every unusable input is one line on stderr and exit code 2, and neither
the report nor ``import distmon`` imports torch.
"""

import math
import os
import random
import subprocess
import sys

import pytest
import torch

import distmon
from distmon.jsonl_log import JsonlLog
from distmon.snapshot import Snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICTURES = ("global_norm.png", "layer_heatmap.png", "rank_layer_at_worst.png", "rank_norms.png")


def _report(log, out, *extra, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "distmon", "report", str(log), "-o", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _not_blank(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    return img.ndim == 3 and float(img[..., :3].std()) > 0.01  # drawn on, not one flat colour


def _single_process_log(path, steps=40, nan_step=30, run_id=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with distmon.GradMonitor(net, opt, serve="none", export_every=5, log_path=str(path), run_id=run_id):
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
    # every layer is NaN: the first in backward order is the last Linear
    assert "first non-finite step 30**: rank 0, layer `2`" in summary, summary
    assert "| 30 | nonfinite | 0 | 2 |" in summary, summary
    # a crashed run: the last line cut mid-write
    text = log.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])
    proc = _report(cut, tmp_path / "cut-report")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "cut-report" / "summary.md").read_text()
    assert "1 line skipped: 1 cut line (line 40)" in summary and "steps 1..39" in summary, summary
    assert "1 line skipped: 1 cut line (line 40)" in proc.stdout, proc.stdout
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


def _snap(step, run_id="r", layers=None, ranks=1, nonfinite=False):
    layers = layers or {"a": 1.0 + step, "b": 2.0}
    norm = math.hypot(*layers.values())
    matrix = [list(layers.values())] * ranks
    return Snapshot(
        step=step,
        timestamp=0.0,
        grad_norm=norm,
        layer_grad_norms=layers,
        rank_grad_norms=[norm] * ranks,
        rank_layer_grad_norms=matrix,
        nonfinite=nonfinite,
        run_id=run_id,
        world_size=ranks,
    )


def _write(path, snaps):
    """Append with the exporter's own writer (JsonlLog appends, as a restarted job does)."""
    log = JsonlLog(str(path))
    log(snaps)
    log.close()


MALFORMED = {  # issue #24: each of these was a traceback or refused the whole log
    "a JSON list": (b"[1, 2]", "not a JSON object"),
    "no step": (b'{"grad_norm": 1.0}', "`step` missing or not an integer >= 0"),
    "layers as a list": (
        b'{"step": 3, "layer_grad_norms": [1.0]}',
        "`layer_grad_norms` is not an object of numbers",
    ),
    "an event without value": (
        b'{"step": 3, "events": [{"kind": "spike", "step": 3, "rank": -1, "layer": "", "threshold": 6}]}',
        "an event's `value` is missing or of the wrong type",
    ),
    "a non-UTF-8 byte": (b'{"step": 3, "run_id": "r\xff"}', "not UTF-8"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_line_is_skipped_and_counted_with_its_reason(tmp_path, case):
    line, reason = MALFORMED[case]
    log = tmp_path / "run.jsonl"
    _write(log, [_snap(1), _snap(2)])
    with open(log, "ab") as f:
        f.write(line + b"\n")
    _write(log, [_snap(4), _snap(5)])
    proc = _report(log, tmp_path / "r")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert f"1 line skipped: 1 {reason} (line 3)" in proc.stdout, proc.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "steps 1..5 (4 logged)" in summary and f"1 {reason} (line 3)" in summary, summary


def test_every_unusable_input_is_one_line_on_stderr_and_exit_code_2(tmp_path):
    good = tmp_path / "good.jsonl"
    _write(good, [_snap(1), _snap(2)])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "junk.jsonl").write_bytes(b"[1, 2]\n\xff\n")
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "out"
    cases = [
        ((tmp_path / "empty.jsonl",), f"{tmp_path / 'empty.jsonl'} is empty"),
        (
            (tmp_path / "missing.jsonl",),
            f"cannot read {tmp_path / 'missing.jsonl'}: No such file or directory",
        ),
        ((tmp_path,), f"cannot read {tmp_path}: Is a directory"),
        (
            (tmp_path / "junk.jsonl",),
            f"no valid snapshot in {tmp_path / 'junk.jsonl'}: "
            "2 lines skipped: 1 not a JSON object (line 1), 1 not UTF-8 (line 2)",
        ),
        ((good, "--run-id", "nope"), f"no run 'nope' in {good}; it holds #1 'r' steps 1..2 (2 lines)"),
        ((good, "--run", "5"), f"no run #5 in {good}"),
        (
            (good, "-o", str(tmp_path / "a-file" / "out")),
            f"cannot write the report to {tmp_path / 'a-file' / 'out'}",
        ),
    ]
    for (log, *extra), expected in cases:
        proc = _report(log, out, *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (expected, proc.stderr)
        assert lines[0].startswith(f"distmon report: {expected}"), (expected, lines)


def test_a_restarted_job_s_log_is_reported_one_run_at_a_time(tmp_path):
    """Two real monitors appending to one log: the report is of the latest unless told."""
    log = tmp_path / "run.jsonl"
    _single_process_log(log, steps=40, nan_step=30, run_id="first")
    _single_process_log(log, steps=20, nan_step=-1, run_id="second")
    proc = _report(log, tmp_path / "latest")
    assert proc.returncode == 0, proc.stderr
    assert (
        "holds 2 runs: #1 'first' steps 1..40 (40 lines), #2 'second' steps 1..20 (20 lines); reporting #2"
        in proc.stdout
    ), proc.stdout
    summary = (tmp_path / "latest" / "summary.md").read_text()
    assert "# distmon run second" in summary and "steps 1..20 (20 logged)" in summary, summary
    assert "non-finite" not in summary and "## Events (0)" in summary, summary
    for choice in (["--run-id", "first"], ["--run", "1"]):
        proc = _report(log, tmp_path / "first", *choice)
        assert proc.returncode == 0, proc.stderr
        summary = (tmp_path / "first" / "summary.md").read_text()
        assert "steps 1..40 (40 logged)" in summary and "first non-finite step 30**" in summary, summary


def test_a_restart_that_reuses_the_run_id_after_a_cut_line_is_a_new_run(tmp_path):
    """A requeued job keeps its id and appends its first line to the crashed run's cut one."""
    log = tmp_path / "run.jsonl"
    _write(log, [_snap(s, run_id="job-7", nonfinite=s == 8) for s in range(1, 11)])
    with open(log, "r+b") as f:  # the crash: the last line cut mid-write
        f.truncate(os.path.getsize(log) - 30)
    _write(log, [_snap(s, run_id="job-7") for s in range(1, 6)])
    proc = _report(log, tmp_path / "r")
    assert proc.returncode == 0, proc.stderr
    assert "holds 2 runs: #1 'job-7' steps 1..9 (9 lines), #2 'job-7' steps 1..5 (5 lines)" in proc.stdout
    assert "1 line skipped: 1 cut line (line 10)" in proc.stdout, proc.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "steps 1..5 (5 logged)" in summary and "non-finite" not in summary, summary


def test_a_resumed_run_is_one_run_its_rolled_back_steps_replaced_and_the_resume_marked(tmp_path):
    """#30: a job killed at step 40 after a checkpoint at 30; a new job (another run id) resumes
    from it and appends: one run, steps 1..60, the killed job's 31..40 (a NaN at 35) replaced."""
    from dataclasses import replace

    log = tmp_path / "run.jsonl"
    _write(log, [_snap(s, run_id="job-1", nonfinite=s == 35) for s in range(1, 41)])
    resumed = [_snap(s, run_id="job-2") for s in range(31, 61)]
    _write(log, [replace(resumed[0], resumed_from=30)] + resumed[1:])
    proc = _report(log, tmp_path / "r")
    assert proc.returncode == 0, proc.stderr
    assert "holds" not in proc.stdout, proc.stdout  # one run
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "steps 1..60 (60 logged)" in summary, summary
    assert "resumed from a checkpoint 1 time: after step 30 (line 41)" in summary, summary
    assert "non-finite" not in summary, summary  # step 35 was rolled back with the checkpoint


def _wide_log(path, layers=3000, ranks=8, steps=30):
    rng = random.Random(0)
    names = [f"blocks.{i}.fc" for i in range(layers)]
    snaps = [
        _snap(s, "wide", {n: rng.lognormvariate(0.0, 1.0) for n in names}, ranks) for s in range(1, steps + 1)
    ]
    _write(path, snaps)
    return snaps


# The report in a fresh child; its only child's peak RSS (MiB) on stdout's last line.
_MEASURE = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[2:], timeout=float(sys.argv[1]));"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024); sys.exit(p.returncode)"
)


def test_thousands_of_layers_and_a_giant_line_take_bounded_time_and_memory(tmp_path):
    """3,000 layers x 8 ranks, then a line of a million layers: folded, skipped, not loaded."""
    log = tmp_path / "wide.jsonl"
    _wide_log(log)
    with open(log, "ab") as f:  # 14 MB: past the 8 MiB line cap
        f.write(
            b'{"step": 31, "layer_grad_norms": {'
            + b", ".join(b'"l%d": 1.0' % i for i in range(10**6))
            + b"}}\n"
        )
    cmd = [sys.executable, "-m", "distmon", "report", str(log), "-o", str(tmp_path / "r")]
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, "120", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_mib = int(proc.stdout.strip().splitlines()[-1])
    assert peak_mib < 1024, peak_mib  # about 200 MiB; before: 3.5 GB for 200 steps, killed on the giant line
    assert "1 line skipped: 1 longer than 8 MiB (line 31)" in proc.stdout, proc.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "the first 127 drawn, the rest folded into `other`" in summary, summary
    assert _not_blank(tmp_path / "r" / "layer_heatmap.png")


def test_layers_past_the_cap_fold_into_other_as_the_exporter_folds_them(tmp_path):
    from distmon.config import MonitorConfig
    from distmon.log_reader import MAX_LAYERS, OTHER, read_log

    assert MAX_LAYERS == MonitorConfig().max_layers
    snaps = _wide_log(tmp_path / "wide.jsonl", layers=300, ranks=2, steps=5)
    run = read_log(str(tmp_path / "wide.jsonl")).run
    names = list(snaps[0].layer_grad_norms)
    assert run.layers == names[: MAX_LAYERS - 1] + [OTHER]
    for snap, stored in zip(snaps, run.layer_norms):
        values = list(snap.layer_grad_norms.values())
        kept = [stored[slot] for slot in run.order]
        assert kept[:-1] == values[: MAX_LAYERS - 1]
        reference = float(torch.tensor(values[MAX_LAYERS - 1 :], dtype=torch.float64).norm())
        assert kept[-1] == pytest.approx(reference, rel=1e-12)
    assert run.capped
    # the exporter's own "other" (max_layers) is drawn as a layer, not folded again
    _write(tmp_path / "own.jsonl", [_snap(s, layers={"a": 1.0, OTHER: 2.0, "b": 3.0}) for s in (1, 2)])
    run = read_log(str(tmp_path / "own.jsonl")).run
    assert run.layers == ["a", "b", OTHER] and not run.capped
    assert [[row[slot] for slot in run.order] for row in run.layer_norms] == [[1.0, 3.0, 2.0]] * 2


ODD_LINES = [
    b"[" * 200_000,  # nesting past the parser's recursion limit
    b"null",
    b'"text"',
    b'{"step": true}',
    b'{"step": -1}',
    b'{"step": 2.0}',
    b'{"step": 2, "world_size": 0}',
    b'{"step": 2, "grad_norm": "big"}',
    b'{"step": 2, "layer_grad_norms": {"a": 1}, "rank_layer_grad_norms": [[1, 2]]}',
    b'{"step": 2, "first_nonfinite": [0]}',
    b'{"step": 2, "events": [1]}',
    b'{"step": 2, "events": [{"kind": "spike", "step": 2, "rank": 0, "layer": "", "value": "x",'
    b' "threshold": 1}]}',
]


def test_odd_lines_are_skipped_and_odd_but_valid_logs_are_drawn(tmp_path, capsys):
    from distmon.report import main

    for i, line in enumerate(ODD_LINES):
        log = tmp_path / f"odd{i}.jsonl"
        log.write_bytes(b'{"step": 1, "grad_norm": 1.0}\n' + line + b'\n{"step": 3, "grad_norm": 2.0}\n')
        assert main(["report", str(log), "-o", str(tmp_path / "r")]) == 0, line[:80]
        assert "1 line skipped: 1 " in capsys.readouterr().out, line[:80]
    valid = {
        "one step, all NaN": [b'{"step": 5, "grad_norm": "nan", "layer_grad_norms": {"a": "nan"}}'],
        "layers that change": [
            b'{"step": 1, "layer_grad_norms": {"a": 1}}',
            b'{"step": 2, "layer_grad_norms": {"b": 2}}',
        ],
        "huge steps": [
            b'{"step": 4503599627370000, "grad_norm": 1}',
            b'{"step": 4503599627370001, "grad_norm": 2}',
        ],
    }
    for name, lines in valid.items():
        log = tmp_path / "valid.jsonl"
        log.write_bytes(b"\n".join(lines) + b"\n")
        assert main(["report", str(log), "-o", str(tmp_path / name)]) == 0, name
        assert " skipped: " not in capsys.readouterr().out, name


_NO_TORCH = """
import runpy, sys
sys.argv = ["distmon", "report", sys.argv[1], "-o", sys.argv[2]]
try:
    runpy.run_module("distmon", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m == "distmon.monitor")
assert not heavy, heavy
"""

_LAZY = """
import sys
import distmon
assert "torch" not in sys.modules and distmon.__version__
assert set(distmon.__all__) <= set(dir(distmon)), dir(distmon)
try:
    distmon.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
from distmon import GradMonitor, Snapshot
from distmon.snapshot import Snapshot as S
assert Snapshot is S and "torch" in sys.modules
from distmon import *
assert GradientAnomalyError and DetectorConfig and AnomalyEvent
"""


def test_the_report_and_import_distmon_do_not_import_torch(tmp_path):
    log = tmp_path / "run.jsonl"
    _write(log, [_snap(1), _snap(2)])
    for code, args in ((_NO_TORCH, [str(log), str(tmp_path / "r")]), (_LAZY, [])):
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
