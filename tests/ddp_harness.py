"""Run real DDP ranks for distmon's tests.

`run_ranks(fn, world_size, *args)` starts `world_size` processes with
`torch.multiprocessing` (start method "forkserver", see `START_METHOD`), initialises a gloo process group
in each (FileStore in a fresh temporary directory by default, or TCP on a free
127.0.0.1 port), calls `fn(rank, world_size, *args)` and returns the list of the
ranks' return values (in rank order; they travel back as pickle files).

A rank that raises fails the calling test with that rank's traceback. A job that
does not finish within `timeout` seconds is killed and fails the test with the
Python stacks of every rank (dumped by `faulthandler` a few seconds before the
deadline), so a hang - e.g. a collective issued on one rank only - fails CI
instead of blocking it.

`fn` must be a module-level function (spawned children import it by name).

Also here (the model, the float64 reference and the scrape are `helpers.py`'s):

* `free_port()`
* `leave()`: a rank's way out, without interpreter finalization
* `SyncRecorder`: a context manager that records host syncs (`Tensor.item`,
  `.tolist`, `.cpu`, `.numpy`, implicit conversions, CUDA/accelerator
  synchronizes) and collectives (`torch.distributed.*`, the functional
  collectives, and the `ProcessGroup` methods underneath) made on behalf of
  distmon code, from any thread.
* `in_distmon_code()`: whether the caller's stack is attributed to distmon.
"""

import contextlib
import datetime
import faulthandler
import os
import pickle
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LAUNCH_DIR = os.path.join(REPO_ROOT, "launch")
# The children inherit sys.path from the parent (forkserver, as spawn), so this makes `distmon`, the test
# modules and launch/'s scripts importable in every rank without installing the package.
for _p in (REPO_ROOT, TESTS_DIR, LAUNCH_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from train import free_port  # noqa: E402,F401  (launch/train.py; re-exported for the tests)

DEFAULT_TIMEOUT_S = 120.0

# "forkserver": each rank is forked from a server process that imported torch once (per pytest
# process), instead of a fresh interpreter importing it again ("spawn": ~1.2 CPU-s a rank, the
# largest share of a short job on CI's 2 cores). The server has imported torch and nothing more
# (no Python thread, no process group), so a fork of it is what spawn would build, less the imports; the
# environment, which the server would otherwise fix at its start, is the caller's
# (`_rank_entry`). Spawn's semantics otherwise: `fn` is imported by name in the child.
START_METHOD = "forkserver"
mp.set_forkserver_preload(["torch", "torch.distributed", "ddp_harness"])


class RankFailure(AssertionError):
    """A rank raised, died, or the job timed out."""


def leave(code):
    """Destroy the process group and exit with ``code`` without interpreter finalization.

    A rank's results are written before this. In finalization torch 2.13's gloo worker threads
    can still drop the last reference to a finished work's tensors and abort the process
    ("terminate called without an active exception", SIGABRT with no Python frame;
    pytorch/pytorch#190489, #179291): seen once in four full-suite runs, after the job. The
    benchmarks leave the same way (``benchmarks/overheadbench/runner.py``, ``leave``).
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_entry(rank, fn, world_size, workdir, init_method, args, timeout_s, env, caller_env):
    # The caller's environment now, not the fork server's at its start (as spawn would give).
    os.environ.clear()
    os.environ.update(caller_env)
    # The server's stdout and stderr are those of the test that started it: the rank writes to a
    # file that run_ranks hands to the calling test's output instead (as a spawned child's would be).
    out = os.open(os.path.join(workdir, f"output-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # Hermetic: distmon must be configured by the test's arguments only.
    for k in list(os.environ):
        if k.startswith("DISTMON_") or k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
            del os.environ[k]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
    )
    os.environ.update(env or {})
    torch.set_num_threads(1)
    stack_file = open(os.path.join(workdir, f"stacks-{rank}.txt"), "w")
    # Dump every thread's stack on a fatal signal (a C++ abort, say), and shortly before the
    # parent gives up on us.
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.dump_traceback_later(max(5.0, timeout_s - 8.0), exit=False, file=stack_file)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        # Collectives stuck on a desynchronised peer raise before the harness timeout.
        timeout=datetime.timedelta(seconds=max(10.0, timeout_s * 0.6)),
    )
    result = fn(rank, world_size, *args)
    tmp = os.path.join(workdir, f"result-{rank}.pkl.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(workdir, f"result-{rank}.pkl"))
    leave(0)


def _pass_on_output(workdir, world_size):
    """The ranks' stdout and stderr, to the calling test's stderr (pytest shows it on failure)."""
    for r in range(world_size):
        try:
            with open(os.path.join(workdir, f"output-{r}.txt"), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if text:
            sys.stderr.write(f"--- rank {r} output ---\n{text}")


def _stacks(workdir, world_size):
    out = []
    for r in range(world_size):
        p = os.path.join(workdir, f"stacks-{r}.txt")
        try:
            with open(p) as f:
                txt = f.read().strip()
        except OSError:
            txt = ""
        out.append(f"--- rank {r} stacks ---\n{txt or '(none dumped)'}")
    return "\n".join(out)


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT_S, init="file", env=None):
    """Run fn(rank, world_size, *args) on `world_size` spawned gloo ranks.

    Returns [result_of_rank_0, ...]. Raises RankFailure (an AssertionError, so
    pytest reports it as a test failure) with the failing rank's traceback, or
    with every rank's stacks on timeout.
    """
    workdir = tempfile.mkdtemp(prefix="distmon-ranks-")
    if init == "file":
        init_method = "file://" + os.path.join(workdir, "filestore")
    elif init == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        raise ValueError(init)
    ctx = mp.start_processes(
        _rank_entry,
        args=(fn, world_size, workdir, init_method, args, float(timeout), env, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                time.sleep(0.5)  # let faulthandler finish writing
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise RankFailure(
                    f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish "
                    f"within {timeout:.0f} s (hang?); ranks still running: {alive}\n"
                    + _stacks(workdir, world_size)
                )
            try:
                if ctx.join(timeout=min(1.0, left)):
                    break
            except mp.ProcessRaisedException as e:
                raise RankFailure(
                    f"rank {e.error_index} of {world_size} raised in {getattr(fn, '__name__', fn)}:\n{e}"
                ) from None
            except mp.ProcessExitedException as e:
                raise RankFailure(
                    f"rank {e.error_index} of {world_size} died in "
                    f"{getattr(fn, '__name__', fn)} (exit code {e.exit_code}, "
                    f"signal {e.signal_name})\n" + _stacks(workdir, world_size)
                ) from None
        results = []
        for r in range(world_size):
            with open(os.path.join(workdir, f"result-{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        _pass_on_output(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------
# Attribution of calls to distmon code
# --------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DDP_HOOKS_DIR = os.path.join(_TORCH_DIR, "distributed", "algorithms", "ddp_comm_hooks") + os.sep
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_SITE_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})
_THIS_FILE = os.path.abspath(__file__)


def distmon_dir():
    import distmon

    return os.path.dirname(os.path.abspath(distmon.__file__)) + os.sep


def _reduction_on_ddp_behalf():
    """Code objects that perform the training's own gradient reduction: distmon's default inner
    hook reproduces DDP's built-in reduction (which would run without distmon), and its FSDP
    reduce-scatter and post_backward wrappers call FSDP's own, so their collectives are the
    training's, not the monitor's."""
    from distmon.sources.ddp import _allreduce, _bucket_future
    from distmon.sources.fsdp import _MeasuringReduceScatter, _NotingPostBackward

    return {
        _allreduce.__code__,
        _bucket_future.__code__,  # the reduced bucket as the hook's result, as torch's allreduce_hook
        _MeasuringReduceScatter.__call__.__code__,
        _NotingPostBackward.__call__.__code__,
    }


def ddp_own_reduction(on):
    """Whether distmon leaves DDP's own reduction alone on gloo in this process (no comm hook: the
    path it takes on NCCL), or wraps it in its comm hook (its path on gloo)."""
    from distmon.sources import ddp

    (ddp.HOOKLESS_BACKENDS.add if on else ddp.HOOKLESS_BACKENDS.discard)("gloo")


def in_distmon_code(frame, dm_dir):
    """True iff the nearest frame (walking outward from `frame`) that is not
    library plumbing belongs to distmon.

    torch internals, the standard library and this harness are skipped; the DDP
    comm hooks shipped with torch (allreduce_hook, fp16_compress_hook ...),
    distmon's default inner hook (DDP's own reduction, see
    `_reduction_on_ddp_behalf`) and any other code (the test, the user's hook,
    the training loop) end the walk as "not distmon". So the gradient
    all-reduce is DDP's collective, not the monitor's, while a
    `dist.all_gather_into_tensor` written in distmon - or an `.item()` inside a
    torch helper that distmon called - is the monitor's.
    """
    ddp_reduction = _reduction_on_ddp_behalf()
    f = frame
    while f is not None:
        if f.f_code in ddp_reduction:
            return False
        fn = f.f_code.co_filename
        if fn.startswith(dm_dir):
            return True
        if fn.startswith(_DDP_HOOKS_DIR):
            return False
        if fn.startswith(_TORCH_DIR) or fn == _THIS_FILE:
            f = f.f_back
            continue
        if fn.startswith(_SITE_DIRS):  # other installed packages are not distmon
            return False
        if fn.startswith(_STDLIB_DIRS) or fn.startswith("<"):
            f = f.f_back
            continue
        return False
    return False


def _short_stack(frame, limit=12):
    return "".join(traceback.format_stack(frame, limit=limit))


_SYNC_TENSOR_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__repr__",
    "__format__",
    "__array__",
)

_COLLECTIVE_NAMES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "_all_gather_base",
    "all_gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
)

_FUNCTIONAL_COLLECTIVE_NAMES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_inplace",
    "all_gather_tensor",
    "all_gather_tensor_inplace",
    "all_gather_into_tensor_coalesced",
    "all_gather_inplace",
    "all_gather_single",
    "all_gather_single_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "all_to_all_single",
    "broadcast",
    "permute_tensor",
)

_PG_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "send",
    "recv",
    "recv_anysource",
)


class SyncRecorder:
    """Record host syncs and collectives issued by distmon code, in any thread.

    ``rec.syncs`` and ``rec.collectives`` are lists of ``(name, thread_name,
    stack_text)``; ``rec.sizes[i]`` holds the element counts of collective i's tensor
    arguments. Only calls attributed to distmon by `in_distmon_code` are
    recorded. Nested instrumented calls (``dist.all_gather_into_tensor`` ->
    ``ProcessGroup._allgather_base``) count once, at the outermost call.
    """

    def __init__(self, dm_dir=None):
        self.dm_dir = dm_dir or distmon_dir()
        self.syncs = []
        self.collectives = []
        self.sizes = []  # per collective: the element counts of its tensor arguments (output, input)
        self._undo = []
        self._tls = threading.local()
        self._lock = threading.Lock()

    # -- patching helpers
    def _set(self, owner, name, new):
        had = name in vars(owner)
        old = vars(owner).get(name)
        try:
            setattr(owner, name, new)
        except (TypeError, AttributeError):
            return False
        self._undo.append((owner, name, had, old))
        return True

    def _wrap(self, orig, name, kind):
        rec = self

        def wrapper(*args, **kwargs):
            depth = getattr(rec._tls, "depth", 0)
            if depth == 0:
                caller = sys._getframe(1)
                if in_distmon_code(caller, rec.dm_dir):
                    entry = (name, threading.current_thread().name, _short_stack(caller))
                    with rec._lock:
                        (rec.syncs if kind == "sync" else rec.collectives).append(entry)
                        if kind != "sync":
                            rec.sizes.append([a.numel() for a in args if isinstance(a, torch.Tensor)])
            rec._tls.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                rec._tls.depth = depth

        wrapper.__wrapped__ = orig
        wrapper.__name__ = getattr(orig, "__name__", name)
        return wrapper

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        # Host syncs on tensors.
        for name in _SYNC_TENSOR_METHODS:
            orig = getattr(torch.Tensor, name, None)
            if orig is not None:
                self._set(torch.Tensor, name, self._wrap(orig, f"Tensor.{name}", "sync"))
        # Device synchronizes (present in CPU builds too; calling them there may raise).
        for owner, name in (
            (torch.cuda, "synchronize"),
            (getattr(torch, "accelerator", None), "synchronize"),
            (getattr(torch, "cpu", None), "synchronize"),
            (getattr(torch, "xpu", None), "synchronize"),
            (torch.cuda.Stream, "synchronize"),
            (torch.cuda.Event, "synchronize"),
        ):
            if owner is not None and getattr(owner, name, None) is not None:
                label = getattr(owner, "__name__", str(owner))
                self._set(owner, name, self._wrap(getattr(owner, name), f"{label}.{name}", "sync"))

        # Collectives: the public functions (wherever they are bound, including
        # `from torch.distributed import x` inside distmon modules), the
        # functional collectives, and the ProcessGroup methods underneath.
        replaced = {}
        for name in _COLLECTIVE_NAMES:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            w = self._wrap(orig, f"dist.{name}", "coll")
            replaced[id(orig)] = w
            self._set(c10d, name, w)
            if getattr(dist, name, None) is orig:
                self._set(dist, name, w)
        try:
            import torch.distributed._functional_collectives as fc
        except Exception:  # pragma: no cover
            fc = None
        if fc is not None:
            for name in _FUNCTIONAL_COLLECTIVE_NAMES:
                orig = getattr(fc, name, None)
                if orig is not None:
                    w = self._wrap(orig, f"funcol.{name}", "coll")
                    replaced[id(orig)] = w
                    self._set(fc, name, w)
        for modname, mod in list(sys.modules.items()):
            if mod is None or not (modname == "distmon" or modname.startswith("distmon.")):
                continue
            for attr, val in list(vars(mod).items()):
                if id(val) in replaced and not isinstance(val, type(mod)):
                    self._set(mod, attr, replaced[id(val)])
        PG = torch._C._distributed_c10d.ProcessGroup
        for name in _PG_METHODS:
            orig = getattr(PG, name, None)
            if orig is not None:
                self._set(PG, name, self._wrap(orig, f"ProcessGroup.{name}", "coll"))
        return self

    def __exit__(self, *exc):
        for owner, name, had, old in reversed(self._undo):
            if had:
                setattr(owner, name, old)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        self._undo.clear()
        return False

    def describe(self, entries):
        return "\n".join(f"[{n} in thread {t}]\n{s}" for n, t, s in entries)


def gloo_s_threads_last() -> None:
    """Make every thread of this rank but the training thread run only when the training thread
    does not (``SCHED_IDLE``, all on one CPU): gloo's worker thread, once it completed a
    collective, drops it only after the training thread went on, as a thread the OS did not
    schedule in time would."""
    cpu = dist.get_rank() % os.cpu_count()
    me = threading.get_native_id()
    os.sched_setaffinity(0, {cpu})
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, {cpu})
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
