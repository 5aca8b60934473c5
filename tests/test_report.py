"""``python -m distmon report``: pictures and a summary from one run of a JSONL log, whatever the log.

Malformed lines are skipped and counted by reason, a log holding several runs (a job restarted
in append mode) is reported one run at a time, memory and time stay bounded on logs with
thousands of layers, every unusable input is one line on stderr and exit code 2, and neither
the report nor ``import distmon`` imports torch.
"""

import contextlib
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

import distmon
from distmon.export.jsonl_log import JsonlLog
from distmon.snapshot import AnomalyEvent, Snapshot, to_jsonable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICTURES = ("global_norm.png", "layer_heatmap.png", "rank_layer_at_worst.png", "rank_norms.png")


def _report(log, out, *extra, timeout=120):
    """``python -m distmon report LOG -o OUT EXTRA...``; ``log`` a path or a list of them."""
    logs = [str(p) for p in log] if isinstance(log, (list, tuple)) else [str(log)]
    return subprocess.run(
        [sys.executable, "-m", "distmon", "report", *logs, "-o", str(out), *extra],
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


@pytest.mark.slow  # draws the report's pictures (matplotlib, 2.5-4.6 s)
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
    (tmp_path / "no-logs").mkdir()
    (tmp_path / "no-logs" / "notes.txt").write_text("")
    out = tmp_path / "out"
    cases = [
        ((tmp_path / "empty.jsonl",), f"{tmp_path / 'empty.jsonl'} is empty"),
        (
            (tmp_path / "missing.jsonl",),
            f"cannot read {tmp_path / 'missing.jsonl'}: No such file or directory",
        ),
        ((tmp_path / "no-logs",), f"no *.jsonl file in the directory {tmp_path / 'no-logs'}"),
        (
            ([good, tmp_path / "missing.jsonl"],),
            f"cannot read {tmp_path / 'missing.jsonl'}: No such file or directory",
        ),
        (
            ([tmp_path / "empty.jsonl", tmp_path / "empty.jsonl", tmp_path / "no-logs"],),
            f"no *.jsonl file in the directory {tmp_path / 'no-logs'}",
        ),
        (([tmp_path / "empty.jsonl", tmp_path / "junk.jsonl"],), "no valid snapshot in "),
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


@pytest.mark.slow  # draws the report's pictures (matplotlib, 2.5-4.6 s)
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


def _older_write(path, snaps):
    """Append as distmon 0.1.0 did: straight after whatever the file ends with (a
    crashed run's cut line swallowed the restarted run's first line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(to_jsonable(s)) + "\n" for s in snaps)  # 0.1.0 wrote no "schema"


@pytest.mark.parametrize("writer", [_write, _older_write], ids=["jsonl_log", "older_release"])
def test_a_restart_that_reuses_the_run_id_after_a_cut_line_is_a_new_run(tmp_path, writer):
    """A requeued job keeps its id and appends to the crashed run's log, whose last line was cut:
    on a line of its own (JsonlLog), or, as older releases did, after the cut line."""
    log = tmp_path / "run.jsonl"
    _write(log, [_snap(s, run_id="job-7", nonfinite=s == 8) for s in range(1, 11)])
    with open(log, "r+b") as f:  # the crash: the last line cut mid-write
        f.truncate(os.path.getsize(log) - 30)
    writer(log, [_snap(s, run_id="job-7") for s in range(1, 6)])
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


def test_a_run_resumed_after_a_kill_at_any_byte_writes_only_whole_lines(tmp_path):
    """#30's kill and resume, the kill landing anywhere in the last export (steps 31..40, each line
    cut at every kind of place over 60 generated offsets, and at line ends): every line the resumed
    job writes is whole JSON, the file holds at most the one cut line, and the report reads one
    run, steps 1..60, resumed after step 30 on the resumed job's first line."""
    from dataclasses import replace

    from distmon.report.log_reader import read_log

    whole = tmp_path / "whole.jsonl"
    for first in range(1, 41, 10):  # the killed job's four exports
        _write(whole, [_snap(s, run_id="job-1", nonfinite=s == 35) for s in range(first, first + 10)])
    data = whole.read_bytes()
    ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    rng = random.Random(30)
    offsets = ends[29:] + [rng.randrange(ends[29], len(data)) for _ in range(60)]
    resumed = [_snap(s, run_id="job-2") for s in range(31, 61)]
    resumed[0] = replace(resumed[0], resumed_from=30)
    _write(os.devnull, resumed)  # a device (no last line to mend) is written as it is
    for case, offset in enumerate(offsets):
        log = tmp_path / f"killed-{case}.jsonl"
        log.write_bytes(data[:offset])
        _write(log, resumed)
        lines = log.read_bytes().split(b"\n")
        kept = sum(1 for end in ends if end <= offset)  # the killed job's whole lines
        cut = offset not in ends
        assert lines[-1] == b"" and len(lines) == kept + cut + len(resumed) + 1, (offset, lines[kept:])
        assert [json.loads(line)["step"] for line in lines[kept + cut : -1]] == list(range(31, 61)), offset
        if cut:
            assert data[ends[kept - 1] : offset] == lines[kept], offset  # the cut line, on its own
        read = read_log(str(log))
        assert read.run_count == 1 and list(read.run.steps) == list(range(1, 61)), offset
        assert read.run.restarts == [(30, kept + cut + 1)], offset
        assert dict(read.skipped) == ({"cut line": 1} if cut else {}), (offset, read.skipped)


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


@pytest.mark.slow  # a 200-step log of 5,000 layers and a 9 MiB line, measured in a subprocess
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
    from distmon.report.log_lines import MAX_LAYERS, OTHER
    from distmon.report.log_reader import read_log
    from distmon.setup.config import MonitorConfig

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
    b'{"step": 2, "ranks": [0, 0]}',
    b'{"step": 2, "ranks": [0], "rank_grad_norms": [1, 2]}',
    b'{"step": 2, "ranks": [5], "world_size": 2}',
    b'{"step": 2, "ranks": [1], "node": -1}',
    b'{"step": 2, "events": [1]}',
    b'{"step": 2, "events": [{"kind": "spike", "step": 2, "rank": 0, "layer": "", "value": "x",'
    b' "threshold": 1}]}',
]


@pytest.mark.slow  # draws the report's pictures (matplotlib, 2.5-4.6 s)
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


@pytest.mark.slow  # fresh interpreters, one per import (~3 s)
def test_the_report_and_import_distmon_do_not_import_torch(tmp_path):
    log = tmp_path / "run.jsonl"
    _write(log, [_snap(1), _snap(2)])
    for code, args in ((_NO_TORCH, [str(log), str(tmp_path / "r")]), (_LAZY, [])):
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]


# --- node logs (#28): one job's logs, one per node, read together as one run -----------------

PER_RANK = (
    "rank_grad_norms",
    "rank_layer_grad_norms",
    "rank_valid",
    "rank_monitor_errors",
    "rank_outlier_scores",
)


def _split(lines, nodes, stem, shuffle=None):
    """Write the node logs of ``lines`` (parsed lines of one log of the whole job) as the format
    says: node n's file (``stem.jsonl``, ``stem.node<n>.jsonl``) holds every job-wide field and its
    ranks' entries of the per-rank lists, with ``"ranks"`` and ``"node"``; its serving rank's own
    fields (timestamp, activations, non-finite ranks) are its own. Returns the files."""
    paths = [f"{stem}.jsonl" if n == 0 else f"{stem}.node{n}.jsonl" for n in range(len(nodes))]
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(p, "w")) for p in paths]
        for line in lines:
            for n, ranks in enumerate(nodes):
                part = dict(line, ranks=ranks, node=n, timestamp=line["timestamp"] + 0.004 * n)
                for name in PER_RANK:
                    if line.get(name):
                        part[name] = [line[name][r] for r in ranks]
                part["nonfinite_ranks"] = [r for r in line["nonfinite_ranks"] if r in ranks]
                if n:
                    part["activation_rms"] = part["activation_absmax"] = {}
                files[n].write(json.dumps(part) + "\n")
    return paths


def _lines_of(path):
    return [json.loads(line) for line in open(path)]


# what the report keeps of a run, every field but those about the files read
_RUN_FIELDS = (
    "steps",
    "grad_norm",
    "noise_scale",
    "layer_norms",
    "rank_norms",
    "columns",
    "folded",
    "capped",
    "most_layers",
    "world_size",
    "most_ranks",
    "events",
    "event_steps",
    "first_nonfinite",
    "flags",
    "event_counts",
    "errors",
    "errors_before",
    "restarts",
    "worst_nonfinite",
    "worst_event",
    "worst_norm",
    "rank_score",
    "rank_score_step",
    "rank_nonfinite",
    "rank_invalid",
    "rank_errors",
    "missing",
    "disagreements",
)


def _same_run(a, b):
    """Field by field, NaN equal to NaN (repr)."""
    for name in _RUN_FIELDS:
        assert repr(getattr(a, name)) == repr(getattr(b, name)), name


def _job_snaps(rng, world, steps, run_id="job"):
    """A job's snapshots with every per-rank field varied (written by the exporter's writer)."""
    layers = [f"l{i}" for i in range(rng.randint(1, 5))]
    snaps = []
    for step in range(1, steps + 1):
        matrix = [[rng.lognormvariate(0, 1) for _ in layers] for _ in range(world)]
        bad = sorted(rng.sample(range(world), rng.randint(0, 2))) if rng.random() < 0.2 else []
        for r in bad:
            matrix[r][rng.randrange(len(layers))] = math.nan
        events = [
            AnomalyEvent(
                kind="rank_outlier", step=step, rank=r, layer="", value=rng.uniform(3, 9), threshold=3.0
            )
            for r in rng.sample(range(world), 1)
            if rng.random() < 0.1
        ]
        snaps.append(
            Snapshot(
                step=step,
                timestamp=1000.0 + step,
                grad_norm=rng.lognormvariate(0, 1),
                layer_grad_norms={n: rng.lognormvariate(0, 1) for n in layers},
                rank_grad_norms=[math.hypot(*row) for row in matrix],
                rank_layer_grad_norms=matrix,
                nonfinite=bool(bad),
                nonfinite_ranks=bad,
                first_nonfinite=(bad[0], layers[0]) if bad else None,
                events=tuple(events),
                rank_outlier_scores=[rng.uniform(0, 6) for _ in range(world)],
                rank_valid=[rng.random() > 0.1 for _ in range(world)],
                rank_monitor_errors=[rng.randint(0, 2) for _ in range(world)],
                run_id=run_id,
                world_size=world,
            )
        )
    return snaps


def test_node_logs_read_together_are_the_whole_job_s_log_over_generated_jobs(tmp_path):
    """Generated jobs (2-12 ranks), their log split into node logs at random (ranks in any order,
    a node of any size, the files given in any order): the merged run is the whole log's run; a
    node left out leaves its ranks NaN and named, everything else as in the whole log."""
    from distmon.report.log_reader import read_log

    rng = random.Random(28)
    for case in range(40):
        world = rng.randint(2, 12)
        whole = tmp_path / f"whole{case}.jsonl"
        _write(whole, _job_snaps(rng, world, rng.randint(1, 12)))
        ranks = list(range(world))
        rng.shuffle(ranks)
        cuts = sorted(rng.sample(range(1, world), rng.randint(1, world - 1)))
        nodes = [sorted(ranks[a:b]) for a, b in zip([0, *cuts], [*cuts, world])]
        nodes.sort()
        if rng.random() < 0.3:
            for node in nodes:
                rng.shuffle(node)  # "ranks" says the order: any order places them right
        os.mkdir(tmp_path / f"split{case}")
        paths = _split(_lines_of(whole), nodes, str(tmp_path / f"split{case}" / "run"))
        reference = read_log(str(whole)).run
        given = paths[:]
        rng.shuffle(given)
        merged = read_log(given).run
        _same_run(reference, merged)
        assert not merged.missing and not merged.disagreements, case
        assert sorted(merged.log_lines.values()) == [len(reference.steps)] * len(nodes)
        # a node's log left out: its ranks are NaN and missing, the rest unchanged
        gone = rng.randrange(len(nodes))
        part = read_log([p for n, p in enumerate(paths) if n != gone]).run
        lost = set(nodes[gone])
        for got, ref in zip(part.rank_norms, reference.rank_norms):
            expect = [math.nan if r in lost else v for r, v in enumerate(ref)]
            assert repr(list(got)) == repr(expect + [math.nan] * (len(got) - len(expect))), case
        named = [[r for a, b in gaps for r in range(a, b + 1)] for gaps in part.missing]
        assert named == [sorted(lost)] and list(part.missing.values()) == [len(reference.steps)], case
        assert list(part.steps) == list(reference.steps) and repr(part.grad_norm) == repr(reference.grad_norm)
        kept = [r for r in range(world) if r not in lost]
        assert [part.rank_invalid[r] for r in kept] == [reference.rank_invalid[r] for r in kept], case


@pytest.mark.slow  # draws the report's pictures (matplotlib, 2.5-4.6 s)
def test_mixed_old_and_new_lines_a_node_log_s_own_fields_and_disagreements(tmp_path):
    """An appended log whose first run is an older distmon's (no "ranks": the whole job) and whose
    second run has node logs; a node's own fields differ without counting; a job-wide field that
    differs is counted and node 0's reported."""
    from distmon.report.log_reader import read_log

    rng = random.Random(7)
    whole = tmp_path / "whole.jsonl"
    _write(whole, _job_snaps(rng, 6, 10, run_id="old") + _job_snaps(rng, 6, 10, run_id="new"))
    lines = _lines_of(whole)
    os.mkdir(tmp_path / "logs")
    node0, node1 = _split(lines[10:], [[0, 1, 2], [3, 4, 5]], str(tmp_path / "logs" / "run"))
    with open(node0) as f:
        new0 = f.read()
    with open(node0, "w") as f:  # the older run's lines as an older distmon wrote them: no "ranks"
        f.write("".join(json.dumps(line) + "\n" for line in lines[:10]) + new0)
    for run_id in ("old", "new"):
        _same_run(read_log(str(whole), run_id).run, read_log([node0, node1], run_id).run)
    proc = _report(tmp_path / "logs", tmp_path / "r")  # a directory: both node logs
    assert proc.returncode == 0, proc.stderr
    assert "hold 2 runs: #1 'old' steps 1..10 (10 lines), #2 'new' steps 1..10 (10 lines)" in proc.stdout
    assert "missing" not in proc.stdout and "disagree" not in proc.stdout, proc.stdout
    # node 1's grad_norm differs at step 4 of the new run: counted, node 0's reported
    rows = _lines_of(node1)
    rows[3]["grad_norm"] = 123.0
    with open(node1, "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    run = read_log([node1, node0]).run
    assert run.disagreements == 1 and run.disagree_first == 4 and run.disagree_fields == ["grad_norm"]
    assert run.grad_norm[3] == read_log(str(whole)).run.grad_norm[3] != 123.0
    proc = _report(tmp_path / "logs", tmp_path / "r")
    assert "disagree on job-wide fields at 1 steps (first: step 4)" in proc.stdout, proc.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "**node logs disagree** on job-wide fields at 1 steps (first: step 4; `grad_norm`)" in summary


@pytest.fixture(scope="module")
def four_rank_log(tmp_path_factory):
    """A real 4-rank job (launch/train.py, gloo): rank 2's gradients scaled x8 from step 20 (the
    outlier), a NaN on rank 3 at step 50; its one log, written by rank 0, of every rank."""
    log = tmp_path_factory.mktemp("job") / "run.jsonl"
    run = subprocess.run(
        [sys.executable, "launch/train.py", "--nproc", "4", "--preset", "tiny", "--steps", "60"]
        + ["--export-every", "5", "--corrupt-rank", "2", "--corrupt-scale", "8", "--corrupt-from", "20"]
        + ["--nan-step", "50", "--nan-rank", "3", "--log-path", str(log), "--port", "0", "--linger", "0"]
        + ["--serve", "none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return log


def _without_logs_table(summary):
    return [line for line in summary.splitlines() if ".jsonl |" not in line and " read" not in line]


@pytest.mark.slow
def test_a_real_job_s_node_logs_report_as_its_whole_log(four_rank_log, tmp_path):
    """The real job's log split into two nodes' logs: the report of the node logs (given as files,
    or as their directory) is the report of the whole log; every rank is in it."""
    from distmon.report.log_reader import read_log

    (tmp_path / "nodes").mkdir()
    paths = _split(_lines_of(four_rank_log), [[0, 1], [2, 3]], str(tmp_path / "nodes" / "run"))
    _same_run(read_log(str(four_rank_log)).run, read_log(paths).run)
    assert _report(four_rank_log, tmp_path / "whole").returncode == 0
    whole = (tmp_path / "whole" / "summary.md").read_text()
    for name, logs in (("files", paths), ("dir", tmp_path / "nodes")):
        proc = _report(logs, tmp_path / name)
        assert proc.returncode == 0 and "missing" not in proc.stdout, proc.stderr + proc.stdout
        summary = (tmp_path / name / "summary.md").read_text()
        assert _without_logs_table(summary) == _without_logs_table(whole), summary
        assert f"| {paths[1]} | 1 | 2-3 | 60 |" in summary, summary
        for picture in PICTURES:
            assert _not_blank(tmp_path / name / picture), picture
    # every rank: rank 2 (scaled) the most outlying, rank 3's NaN, from node 1's log
    assert "- world size 4; 2 logs read" in summary
    assert "| 2 |" in summary.split("Most outlying ranks")[1].splitlines()[4], summary
    assert "**first non-finite step 50**: rank 3" in summary and "rank 3 at " in summary


@pytest.mark.slow
def test_a_node_log_left_out_names_its_ranks_and_other_runs_are_listed(four_rank_log, tmp_path):
    paths = _split(_lines_of(four_rank_log), [[0, 1], [2, 3]], str(tmp_path / "run"))
    proc = _report(paths[0], tmp_path / "r")
    assert proc.returncode == 0, proc.stderr
    assert "missing from the logs: ranks 2-3 at 60 of 60 steps (from step 1)" in proc.stdout, proc.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert (
        "- **ranks missing** (no log read reported them; their figures are NaN and not valid): ranks 2-3 at"
        in (summary)
    )
    assert "first non-finite step 50**: rank 3" in summary  # job-wide: known from node 0's log too
    # another run's log given with them: the latest run is reported, both listed, either picked
    other = tmp_path / "other.jsonl"
    _single_process_log(other, steps=20, nan_step=-1, run_id="later")
    proc = _report([*paths, other], tmp_path / "r2")
    assert proc.returncode == 0, proc.stderr
    assert "the 3 logs hold 2 runs:" in proc.stdout and "reporting #2" in proc.stdout, proc.stdout
    assert f"no line of run #2 in {paths[0]}, {paths[1]}" in proc.stdout, proc.stdout
    proc = _report([*paths, other], tmp_path / "r3", "--run", "1")
    assert proc.returncode == 0 and "missing" not in proc.stdout, proc.stdout
    assert "world size 4" in (tmp_path / "r3" / "summary.md").read_text()


@pytest.mark.parametrize(
    "layer, bound, shown",
    [
        ("blocks.3.attn", 1234.5, ", attention block `blocks.3.attn` (logit bound 1234)"),
        ("blocks.3.attn", math.inf, ", attention block `blocks.3.attn` (logit bound inf)"),
        ("", -0.25, ", consecutive gradients' cosine -0.25 while the rate still rises"),
    ],
    ids=["finite", "non-finite", "oscillation"],
)
def test_a_divergence_warning_is_a_line_of_the_summary_and_marked_on_the_norm(tmp_path, layer, bound, shown):
    """The precursor's first warning: its step, block and bound in the summary's time line; a
    non-finite bound (it warns at once: the log writes it as the string "inf") shown as such; the
    oscillation rule's (no block: the whole gradient) with its cosine."""
    log = tmp_path / "run.jsonl"
    out = JsonlLog(str(log))
    for step in range(1, 31):
        events = ()
        if step in (20, 30):
            event = AnomalyEvent(
                kind="divergence_warning",
                step=step,
                rank=-1,
                layer=layer,
                value=bound,
                threshold=1e3 if layer else -0.2,
            )
            events = (event,)
        out(
            [
                Snapshot(
                    step=step, timestamp=float(step), grad_norm=1.0, run_id="r", world_size=1, events=events
                )
            ]
        )
    out.close()
    proc = _report(log, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    line = "- **divergence warning (precursor) at step 20**" + shown
    assert line + "; 2 warnings in all" in summary, summary
    assert _not_blank(tmp_path / "out" / "global_norm.png")
