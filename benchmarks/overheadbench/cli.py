"""The command line: parse the options, start torchrun when needed, run every size, write the reports."""

import argparse
import datetime
import os
import subprocess
import sys
import tempfile

from .approaches import APPROACHES, DEFAULT, GPU, label
from .gpu import gpu_verdicts, render_gpu_md
from .machine import machine_info
from .measure import now_s
from .paths import BENCH_DIR, REPO, use_checkout
from .report import profile_lines, render_readme, size_table, write_reports
from .results import RunResult, SizeResult
from .runner import Bench, leave
from .sizes import MODES, SIZES
from .stats import analyse
from .verdicts import acceptance

SCRIPT = os.path.join(BENCH_DIR, "overhead.py")  # the entry point torchrun is given


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the mode's defaults filled in.

    Example:
        >>> a = parse(["--smoke", "--out", "/tmp/x", "--approaches", "distmon"])
        >>> a.mode, a.approaches, a.hist_freq, a.profile_steps, a.readme, a.ranks
        ('smoke', ['baseline', 'distmon'], 2, 3, None, 2)
        >>> g = parse(["--gpu"])
        >>> g.approaches[:3], g.ranks, g.amp, g.profile, g.out.endswith("results/gpu")
        (['baseline', 'distmon', 'distmon-detailed'], 1, 'bf16', False, True)
    """
    p = argparse.ArgumentParser(
        description=sys.modules[__package__].__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="~1M, ~5M, 2k-tensor models (default)",
    )
    mode.add_argument(
        "--full", dest="mode", action="store_const", const="full", help="+ ~20M and ~50M models"
    )
    mode.add_argument(
        "--smoke", dest="mode", action="store_const", const="smoke", help="tiny model, a few steps"
    )
    mode.add_argument(
        "--gpu",
        dest="mode",
        action="store_const",
        const="gpu",
        help="issue #35's preset: 20M, 124M, 350M on one GPU, one NCCL rank, bf16 autocast, ~5 min "
        "(--sizes smoke runs it on a tiny model, on CPU too)",
    )
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), help="override the mode's model sizes")
    p.add_argument(
        "--approaches",
        nargs="+",
        default=None,
        choices=[a.name for a in APPROACHES],
        help="subset of approaches (baseline is always run; default: the mode's)",
    )
    p.add_argument(
        "--amp",
        choices=["bf16"],
        default=None,
        help="forward under torch.autocast with this dtype (default: none; bf16 with --gpu)",
    )
    p.add_argument(
        "--rounds", type=int, default=0, help="timed rounds per size (default: from the time budget)"
    )
    p.add_argument("--budget-scale", type=float, default=1.0, help="scale the per-size time budgets")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed warm-up rounds (one more, memory-measuring, round follows)",
    )
    p.add_argument("--repeats", type=int, default=4, help="blocks of rounds for the ratio's min-max")
    p.add_argument("--hist-freq", type=int, default=100, help="wandb-style histogram every N steps")
    p.add_argument(
        "--profile",
        dest="profile",
        action="store_true",
        default=None,
        help="torch.profiler breakdown of distmon's time (default on; off with --gpu)",
    )
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument(
        "--profile-steps", type=int, default=0, help="steps per profiled approach (default: ~15 s worth)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results for --full, benchmarks/results/quick for "
        "--quick, a temporary directory for --smoke)",
    )
    p.add_argument(
        "--readme",
        default=None,
        help="where to write the README 'Performance' section (default: benchmarks/README_performance.md "
        "for --full with the default --out)",
    )
    p.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) (default: DDP's default, False)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks when this script starts torchrun itself (2; 1 with --gpu)",
    )
    p.add_argument("--cpu", action="store_true", help="stay on CPU/gloo even if CUDA is available")
    p.add_argument(
        "--render",
        metavar="RESULTS_JSON",
        default=None,
        help="run nothing: print the README's Performance section from a saved overhead.json",
    )
    args = p.parse_args(argv)
    args.mode = args.mode or "quick"
    gpu = args.mode == "gpu"
    args.approaches = args.approaches or (GPU if gpu else DEFAULT)
    if "baseline" not in args.approaches:
        args.approaches = ["baseline"] + args.approaches
    args.ranks = args.ranks or (1 if gpu else 2)
    if args.profile is None:
        args.profile = not gpu
    if gpu:
        args.amp = args.amp or "bf16"
    default_out = {
        "full": os.path.join(BENCH_DIR, "results"),
        "quick": os.path.join(BENCH_DIR, "results", "quick"),
        "gpu": os.path.join(BENCH_DIR, "results", "gpu"),
    }
    if args.readme is None and args.mode == "full" and args.out is None:
        args.readme = os.path.join(BENCH_DIR, "README_performance.md")
    if args.out is None:  # the GPU results committed are written by the preset's own sizes only
        args.out = (None if args.sizes and gpu else default_out.get(args.mode)) or (
            tempfile.mkdtemp(prefix="distmon-bench-") if os.environ.get("RANK", "0") == "0" else ""
        )
    args.readme = args.readme or None
    if args.mode == "smoke":
        args.warmup = min(args.warmup, 1)
        args.hist_freq = min(args.hist_freq, 2)
        args.profile_steps = args.profile_steps or 3
        args.repeats = min(args.repeats, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    """``benchmarks/overhead.py``: as a plain script it starts torchrun on itself; under torchrun,
    every rank runs the sizes and rank 0 writes the reports."""
    args = parse(argv)
    if args.render:
        print(render_readme(RunResult.load(args.render)))
        return 0
    if "RANK" not in os.environ:  # started as a plain script: become torchrun
        given = list(sys.argv[1:] if argv is None else argv)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.ranks),
            SCRIPT,
            *given,
            "--out",
            args.out,
            "--readme",
            args.readme or "",
        ]
        env = dict(os.environ)
        env.setdefault("DISTMON_BENCH_COMMAND", " ".join(["python", os.path.relpath(SCRIPT, REPO)] + given))
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.call(cmd, env=env)
    use_checkout()
    for k in list(os.environ):  # hermetic: distmon is configured by this script only
        if k.startswith("DISTMON_") and k != "DISTMON_BENCH_COMMAND":
            del os.environ[k]
    import warnings

    warnings.filterwarnings("ignore")
    t0 = now_s()
    bench = Bench(args)
    command = os.environ.get("DISTMON_BENCH_COMMAND") or (
        f"torchrun --nproc-per-node {bench.world} " + " ".join([os.path.relpath(SCRIPT, REPO)] + sys.argv[1:])
    )
    machine = machine_info(bench.cuda, bench.backend, bench.world)
    plan = [(s, b) for s, b in MODES[args.mode]]
    if args.sizes:
        budgets = {**dict(MODES["smoke"]), **dict(MODES["full"]), **dict(MODES[args.mode])}
        plan = [(s, budgets.get(s, 60.0)) for s in args.sizes]
    bench.log(
        f"distmon overhead benchmark, {args.mode} mode: {[s for s, _ in plan]}; {bench.world} ranks, "
        f"{bench.backend}, torch {machine.torch}"
    )
    results, skipped = [], []
    for size, budget in plan:
        try:
            raw = bench.run_size(size, budget)
        except MemoryError as e:  # decided on rank 0 and broadcast: every rank skips alike
            bench.log(f"== {e}")
            skipped.append(str(e))
            continue
        if bench.rank == 0:
            s = analyse(raw, args.repeats)
            results.append(s)
            print_size(s, args.hist_freq)
    if bench.rank == 0:
        res = RunResult(
            machine=machine,
            command=command,
            mode=args.mode,
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            hist_freq=args.hist_freq,
            warmup=args.warmup,
            approaches=args.approaches,
            sizes=results,
            skipped=skipped,
            labels={a: label(a, args.hist_freq) for a in args.approaches},
            wall_s=now_s() - t0,
            load_avg_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        )
        readme = args.readme
        if args.mode == "gpu":
            res.acceptance = gpu_verdicts(results)
            write_reports(res, args.out, None, render_gpu_md)
        else:
            res.acceptance = acceptance(results, bool(machine.gpu)) if "distmon" in args.approaches else []
            write_reports(res, args.out, readme)
        print("\n".join(f"{v}: {w} -- {d}" for w, v, d in res.acceptance))
        print(
            f"\nwrote {os.path.join(args.out, 'overhead.md')}, overhead.json, overhead.png"
            + (f", {readme}" if readme else "")
            + f" in {res.wall_s / 60:.1f} min",
            flush=True,
        )
    leave(0)


def print_size(s: SizeResult, hist_freq: int) -> None:
    """One size's table (and profile) on the log, as soon as it is measured."""
    print("\n".join(size_table(s, hist_freq)), flush=True)
    if s.profile:
        print("\n".join(profile_lines([s])), flush=True)
