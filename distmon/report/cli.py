"""``python -m distmon``'s command line: ``report LOG... -o DIR`` (:mod:`distmon.report.pictures`),
``check`` (:mod:`distmon.setup.selfcheck`) and ``--version``.

Neither this module nor ``python -m distmon report`` (or ``--version``) imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from .._version import __version__
from .log_lines import MAX_LINE_BYTES, LogError
from .log_reader import describe_runs, describe_skips, read_log
from .pictures import missing_ranks, write_report

__all__ = ["main", "parser", "expand_logs"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def expand_logs(paths: Sequence[str]) -> list[str]:
    """The files to read: each path given, a directory standing for every ``*.jsonl`` directly
    in it (sorted); a file given twice is read once. Raises :class:`LogError` for a directory
    without one.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name in ("run.jsonl", "run.node1.jsonl", "notes.txt"):
        ...     open(os.path.join(d, name), "w").close()
        >>> [os.path.basename(p) for p in expand_logs([d])]
        ['run.jsonl', 'run.node1.jsonl']
    """
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(e.path for e in os.scandir(path) if e.name.endswith(".jsonl") and e.is_file())
            if not found:
                raise LogError(
                    f"no *.jsonl file in the directory {path}: pass the logs, or the directory holding them"
                )
            files += found
        else:
            files.append(path)
    seen: set[str] = set()
    return [p for p in files if not (os.path.realpath(p) in seen or seen.add(os.path.realpath(p)))]


def parser() -> argparse.ArgumentParser:
    """``python -m distmon``'s arguments (the docs' test reads its flags here).

    Example:
        >>> sorted(parser()._subparsers._group_actions[0].choices)
        ['check', 'report']
    """
    parser = argparse.ArgumentParser(prog="python -m distmon", description="distmon tools")
    parser.add_argument("--version", action="version", version=f"distmon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "check",
        help="self-check of the install: a monitor in this process, three steps, the snapshot printed",
        description="Build a GradMonitor on a small model in this process (no torch.distributed, no "
        "endpoint, no log), train three steps and print the last snapshot. Exit status 0: the install works.",
    )
    rep = sub.add_parser(
        "report",
        help="pictures and a summary of a run's JSONL log (log_path=)",
        description="Pictures and a summary of one run of a JSONL log (log_path=). Several files "
        "and directories are read together as the node logs of one job (run.jsonl and the "
        "run.node<n>.jsonl beside it): each step's per-rank figures come from every node log, "
        "the ranks no log reported are named. Logs of several runs (a job restarted into the "
        "same files, or unrelated logs given together) are listed and the latest run is reported.",
    )
    rep.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="the JSONL file distmon wrote (log_path / DISTMON_LOG_PATH), or several node logs of one "
        "job; a directory stands for every *.jsonl directly in it (not in its subdirectories)",
    )
    rep.add_argument("-o", "--out", default="distmon-report", help="output directory (default: %(default)s)")
    which = rep.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="report the latest run with this run_id (default: the latest run)")
    which.add_argument("--run", type=_positive, metavar="N", help="report the N-th run of the log (from 1)")
    rep.add_argument(
        "--max-line-mib",
        type=float,
        default=MAX_LINE_BYTES / 2**20,
        help=f"skip lines longer than this, unread (default: {MAX_LINE_BYTES / 2**20:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m distmon report LOG... -o DIR [--run-id ID | --run N]``, ``python -m
    distmon check``, ``python -m distmon --version``."""
    args = parser().parse_args(argv)
    if args.command == "check":
        from ..setup.selfcheck import run_check

        return run_check()

    def fail(message: str) -> int:
        print(f"distmon report: {message}", file=sys.stderr)
        return 2

    if importlib.util.find_spec("matplotlib") is None:  # said before a long read, imported after it
        return fail("the report needs matplotlib: pip install 'distmon[report]'")
    try:
        paths = expand_logs(args.logs)
        log = read_log(paths, args.run_id, args.run, max(1, int(args.max_line_mib * 2**20)))
    except LogError as e:
        return fail(str(e))
    except OSError as e:
        return fail(
            f"cannot read {e.filename or ' '.join(args.logs)}: {e.strerror or e}; pass the JSONL log "
            "the monitor wrote (log_path=)"
        )
    run = log.run
    if log.run_count > 1:
        held = paths[0] if len(paths) == 1 else f"the {len(paths)} logs"
        print(
            f"distmon report: {held} hold{'s' if len(paths) == 1 else ''} {log.run_count} runs: "
            f"{describe_runs(log.runs, log.run_count)}; "
            f"reporting #{run.span.index} (--run-id ID or --run N picks another)"
        )
    if log.skipped:
        print(f"distmon report: {describe_skips(log.skipped, log.first_skipped)}")
    idle = [node_log.path for i, node_log in enumerate(log.logs) if not run.log_lines[i]]
    if idle:
        more = f" and {len(idle) - 8} more" if len(idle) > 8 else ""
        print(f"distmon report: no line of run #{run.span.index} in {', '.join(idle[:8])}{more}")
    for said in missing_ranks(run):
        print(f"distmon report: missing from the logs: {said}")
    if run.disagreements:
        print(
            f"distmon report: the node logs disagree on job-wide fields at {run.disagreements} steps "
            f"(first: step {run.disagree_first}); node 0's are reported"
        )
    try:
        files = write_report(log, args.out)
    except OSError as e:
        return fail(
            f"cannot write the report to {args.out}: {e.strerror or e}; pass another directory with -o"
        )
    print(f"distmon report: wrote {', '.join(files)} to {args.out}")
    return 0
