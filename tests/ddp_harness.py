"""Run real DDP ranks for distmon's tests.

`run_ranks(fn, world_size, *args)` starts `world_size` processes with
`torch.multiprocessing` (start method "spawn"), initialises a gloo process group
in each (FileStore in a fresh temporary directory by default, or TCP on a free
127.0.0.1 port), calls `fn(rank, world_size, *args)` and returns the list of the
ranks' return values (in rank order; they travel back as pickle files).

A rank that raises fails the calling test with that rank's traceback. A job that
does not finish within `timeout` seconds is killed and fails the test with the
Python stacks of every rank (dumped by `faulthandler` a few seconds before the
deadline), so a hang - e.g. a collective issued on one rank only - fails CI
instead of blocking it.

`fn` must be a module-level function (spawned children import it by name).

Also here, because several test files use them:

* `free_port()`
* `scrape_metrics()` / `sample_value()`: a real HTTP scrape of a local /metrics, parsed
* `SyncRecorder`: a context manager that records host syncs (`Tensor.item`,
  `.tolist`, `.cpu`, `.numpy`, implicit conversions, CUDA/accelerator
  synchronizes) and collectives (`torch.distributed.*`, the functional
  collectives, and the `ProcessGroup` methods underneath) made on behalf of
  distmon code, from any thread.
* `in_distmon_code()`: whether the caller's stack is attributed to distmon.
"""

import datetime
import faulthandler
import os
import pickle
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# The children inherit sys.path from the parent (spawn), so this makes `distmon`
# and the test modules importable in every rank without installing the package.
for _p in (REPO_ROOT, TESTS_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DEFAULT_TIMEOUT_S = 120.0


class RankFailure(AssertionError):
    """A rank raised, died, or the job timed out."""


def free_port(host="127.0.0.1"):
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape_metrics(port, timeout=10.0):
    """[(sample name, labels, value)] of a real HTTP scrape of 127.0.0.1:port/metrics (no proxy)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return [
        (s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
    ]


def sample_value(samples, name, **labels):
    """The value of the one sample ``name`` whose labels include ``labels``."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


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


def _rank_entry(rank, fn, world_size, workdir, init_method, args, timeout_s, env):
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
        args=(fn, world_size, workdir, init_method, args, float(timeout), env),
        nprocs=world_size,
        join=False,
        start_method="spawn",
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


# --------------------------------------------------------------------------
# A tiny model, data, and the independent reference norms
# --------------------------------------------------------------------------

import math  # noqa: E402

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

VOCAB = 24
DIM = 16
# ~2 KB buckets on a ~7 KB model: several buckets (after DDP's rebuild at step 2).
BUCKET_CAP_MB = 0.002


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h + self.fc(torch.tanh(self.ln(h)))


class Phase(nn.Module):
    """A complex parameter: h + re(rot) + im(rot) / 2, so its gradient has both parts."""

    def __init__(self, dim):
        super().__init__()
        self.rot = nn.Parameter(0.1 * torch.randn(dim, dtype=torch.cfloat))

    def forward(self, h):
        return h + self.rot.real + 0.5 * self.rot.imag


class TinyLM(nn.Module):
    """Embedding -> [complex phase] -> residual (LayerNorm, Linear) blocks -> [optional branch]
    -> LayerNorm -> head.

    Layers in model order: emb, [phase], blocks.0.ln, blocks.0.fc, blocks.1.ln, blocks.1.fc,
    [extra], norm, head. ``sparse=True`` gives the embedding sparse gradients. Each block is
    called as a module (a test may compile, wrap or shard it); ``checkpoint=True`` calls it
    under ``torch.utils.checkpoint`` (non-reentrant).
    """

    def __init__(
        self,
        vocab=VOCAB,
        dim=DIM,
        n_blocks=2,
        tied=False,
        branch=False,
        sparse=False,
        complex_param=False,
        checkpoint=False,
    ):
        super().__init__()
        self.checkpoint = checkpoint
        self.emb = nn.Embedding(vocab, dim, sparse=sparse)
        self.phase = Phase(dim) if complex_param else None
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.extra = nn.Linear(dim, dim) if branch else None
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx, use_extra=True):
        h = self.emb(idx)
        if self.phase is not None:
            h = self.phase(h)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False) if self.checkpoint else b(h)
        if self.extra is not None and use_extra:
            h = h + torch.relu(self.extra(h))
        return self.head(self.norm(h))


def make_batch(rank, step, micro=0, seed=0, batch=4, seq=6, vocab=VOCAB):
    """Deterministic, different on every rank / step / micro-batch."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * rank + 101 * step + micro)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layer_of(param_name):
    """Default grouping: the module that directly owns the parameter."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def as_float64(grad):
    """A gradient as a dense real float64 tensor: a sparse one densified (duplicate indices
    summed), a complex one as its (real, imag) pairs, so its L2 norm is that of the gradient."""
    g = grad.detach()
    if g.is_sparse:
        g = g.to_dense()
    if g.is_complex():
        g = torch.view_as_real(g)
    return g.double()


def reference_norms(named_grads):
    """(total, {layer: norm}) in float64 from (name, grad-or-None) pairs in model order.

    total uses torch.nn.utils.get_total_norm; a None gradient counts as zero.
    Computed here, never by distmon.
    """
    grads = [as_float64(g) for _, g in named_grads if g is not None]
    total = float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0
    by_layer = {}
    for name, g in named_grads:
        by_layer.setdefault(layer_of(name), [])
        if g is not None:
            by_layer[layer_of(name)].append(as_float64(g))
    layers = {k: (float(torch.nn.utils.get_total_norm(v, 2.0)) if v else 0.0) for k, v in by_layer.items()}
    return total, layers


def sync_twin(twin, module):
    """Copy module's current parameters into its un-wrapped twin."""
    src = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for n, p in twin.named_parameters(remove_duplicate=False):
            p.copy_(src[n])


SNAPSHOT_FIELDS = (
    "step",
    "timestamp",
    "grad_norm",
    "layer_grad_norms",
    "rank_grad_norms",
    "rank_layer_grad_norms",
    "nonfinite",
    "nonfinite_ranks",
    "first_nonfinite",
    "run_id",
    "world_size",
)
MISSING = "<field missing from Snapshot>"


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def snapshot_dict(snap):
    """A distmon Snapshot as plain picklable data (None stays None)."""
    if snap is None:
        return None
    return {f: _plain(getattr(snap, f, MISSING)) for f in SNAPSHOT_FIELDS}


def rel_err(actual, expected, abs_floor=1e-12):
    if not isinstance(actual, (int, float)) or isinstance(actual, bool):
        return math.inf
    if math.isnan(actual) or math.isnan(expected):
        return 0.0 if (math.isnan(actual) and math.isnan(expected)) else math.inf
    return abs(actual - expected) / max(abs(expected), abs_floor)


def close(actual, expected, rel=1e-5, abs_tol=1e-9):
    """|actual - expected| <= max(rel * |expected|, abs_tol) for real numbers."""
    if not isinstance(actual, (int, float)) or isinstance(actual, bool):
        return False
    if not math.isfinite(expected) or not math.isfinite(actual):
        return False
    return abs(actual - expected) <= max(rel * abs(expected), abs_tol)
