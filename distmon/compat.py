"""What differs between the torch releases distmon runs on, in one place.

distmon runs on torch 2.6 and newer and refuses an older torch when it is imported. From 2.9 it is
complete; on 2.6-2.8 everything but FSDP2's per-rank local figures, which need a hook those
releases lack (:data:`FSDP_LOCAL_FIGURES`). CI runs the whole suite on the pinned release (2.13),
the fast tier plus DDP, FSDP2 and N-D parity jobs on 2.9 and 2.11, and the fast tier plus the
FSDP2, layout and framework tests on the newest release that installs here, 2.14
(``tests/run_torch_tiers.sh``).

Each difference is one name here, with what distmon uses it for, the release that made its
fallback unnecessary (delete the fallback once :data:`FLOOR` reaches that release) and what
breaks without it. So is every use of a name torch keeps private (an attribute or module whose
name begins with ``_``): a release may rename or drop one without notice, so each has a note
(what distmon needs it for, the releases it was checked on, what breaks without it) and no
other module of distmon reaches one (``tests/test_private_torch.py`` parses them all to keep it so).
"Checked on 2.6-2.14" means the name is in torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0,
2.12.1, 2.13.0 and 2.14.1 (``bash tests/private_torch_names.sh`` over the CI's cached venvs) and
exercised by the tests on 2.9.1, 2.11.0, 2.13.0 and 2.14.1. Torch is looked up when called,
not bound at import, so that tests which wrap a torch function (the collective and sync
recorders, the failure injector) see the calls.
FSDP2 is imported only by the functions that need it (``import distmon`` must not pay for it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

# Private types for annotations only, never imported at run time (a release without them changes
# no behaviour): FSDP2's _fsdp_param/_fsdp_param_group, DTensor's _dtensor_spec, pipelining's
# _PipelineStageBase. The other modules import them from here.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.pipelining.stage import _PipelineStageBase as PipelineStage
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "FLOOR",
    "COMPLETE",
    "TORCH",
    "require_supported",
    "sq_sums_fp32",
    "ALL_GATHER",
    "all_gather",
    "real_flat",
    "reduced_bucket",
    "root_mesh",
    "fsdp_param_groups",
    "fsdp_divide_factor_set",
    "FSDP_LOCAL_FIGURES",
    "fsdp_reduce_scatter_base",
    "fsdp_pre_divide_factor",
    "queue_callback",
    "default_store",
    "graph_task_id",
    "profiler_enabled",
    "foreach_mul_",
    "foreach_copy_",
    "foreach_sub_",
    "compiled_autograd_on",
    "in_compiled_autograd",
    "uncompiled",
    "WRAPPER_SEGMENTS",
    "spec_of",
    "rank_part",
    "ddp_localized",
    "has_step_hooks",
    "scaler_optimizer_states",
    "pipeline_stage_base",
    "find_tensors",
    "ddp_module_parameters",
    "ddp_comm_hooks",
    "ddp_delays_all_reduce",
    "ddp_python_reducer",
    "fsdp_reduce_scatter_comm",
    "fsdp_reduce_scatter_group",
    "fsdp_param_unsharded",
]

FLOOR = (2, 6)  # the oldest torch distmon runs on: DDP, one process, frameworks, compile; FSDP2 in part
COMPLETE = (2, 9)  # every feature from here (FSDP2's per-rank local figures: FSDP_LOCAL_FIGURES)


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.9.1+cu128"``, ``"2.14.0a0+git..."``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(
            f"distmon: cannot read torch's version {version!r}: reinstall torch "
            "(pip install --force-reinstall torch)"
        )
    return int(m.group(1)), int(m.group(2))


def require_supported(version: str) -> tuple[int, int]:
    """The release of torch ``version``, or an ImportError naming the supported range.

    Example:
        >>> require_supported("2.9.1+cu128")
        (2, 9)
        >>> require_supported("2.5.1")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ImportError: distmon needs torch >= 2.6 (complete from 2.9), this is torch 2.5.1: upgrade torch ...
    """
    release = _release(version)
    if release < FLOOR:
        floor = f"{FLOOR[0]}.{FLOOR[1]}"
        raise ImportError(
            f"distmon needs torch >= {floor} (complete from {COMPLETE[0]}.{COMPLETE[1]}), this is torch "
            f"{version}: upgrade torch (pip install 'torch>={floor}')"
        )
    return release


TORCH = require_supported(str(torch.__version__))  # refused when first imported (a public name used)


# --- the sum of squares of every gradient (the hot path) ----------------------------------------
# torch._foreach_powsum: torch 2.11. Before it, _foreach_norm's squares (one ulp apart).
# Without it: every figure NaN (the fused call raises in every hook).
def sq_sums_fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 sum of squares of each tensor, one fused pass (see :func:`distmon.step.sums.sq_sums`).

    Example:
        >>> [float(s) for s in sq_sums_fp32([torch.tensor([3.0, 4.0])])]
        [25.0]
    """
    if hasattr(torch, "_foreach_powsum"):
        return torch._foreach_powsum(list(tensors), 2, dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)  # torch < 2.11
    torch._foreach_mul_(norms, norms)
    return list(norms)


# --- the export's all-gather ---------------------------------------------------------------------
# dist.all_gather_single: torch 2.13, which deprecates all_gather_into_tensor (same signature).
# Without the fallback: export steps fail (per-rank figures NaN) before 2.13; without the new
# name, a deprecation warning on every export from 2.13.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13): every rank's
    ``input`` end to end in ``output``."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


# --- DDP ---------------------------------------------------------------------------------------
# DDP's buckets hold a complex parameter's gradient as its real view (a real buffer): torch 2.10.
# Before, such a parameter has a complex bucket of its own, whose all-reduce hands back its
# (n, 2) real view. Without the fallbacks, before 2.10: every figure of a DDP model with a
# complex parameter is NaN (a bucket's layout is in real elements), and distmon's default comm
# hook hands DDP that real view, which DDP copies into the complex gradient wrongly.
def reduced_bucket(result: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    """What a comm hook hands DDP for a ``bucket`` all-reduced in place: the all-reduce's
    ``result``, or for a complex bucket the bucket itself (the result is its real view)."""
    return bucket if bucket.is_complex() else result


def real_flat(flat: torch.Tensor) -> torch.Tensor:
    """A gradient bucket's buffer (or its reduced result) as one run of real elements.

    Example:
        >>> real_flat(torch.tensor([1 + 2j])).tolist(), real_flat(torch.ones(2, 2)).shape
        ([1.0, 2.0], torch.Size([4]))
    """
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    return flat if flat.dim() == 1 else flat.view(-1)


# --- device meshes -------------------------------------------------------------------------------
# DeviceMesh._get_root_mesh(): torch 2.10. Before it, _mesh_resources.get_root_mesh(mesh).
# Without it: every model with DTensor parameters or an FSDP2 mesh fails at construction.
def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself when it was not sliced)."""
    method = getattr(mesh, "_get_root_mesh", None)
    if method is not None:
        return method()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.10

    return _mesh_resources.get_root_mesh(mesh)


# --- FSDP2 ---------------------------------------------------------------------------------------
# FSDPState._fsdp_param_groups: torch 2.12 (several parameter groups per fully_shard call, via
# shard_placement_fn). Before it, one optional _fsdp_param_group. Both reached through
# FSDPModule._get_fsdp_state() (checked on 2.6-2.14), the only handle on a unit's parameters,
# reduce-scatter comm and post_backward. Without it: every FSDP2 model fails at construction.
def fsdp_param_groups(module: torch.nn.Module) -> list[object]:
    """The parameter groups (``FSDPParamGroup``) of one ``fully_shard`` module: none, one or several."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch < 2.12
    return [] if group is None else [group]


# FSDPParamGroup.gradient_divide_factor (set_gradient_divide_factor): torch 2.8. Before it,
# set_reduce_scatter_divide_factor kept a PREMUL_SUM op in reduce_scatter_reduce_op.
# Without the fallback: every FSDP2 model fails at construction on torch 2.6-2.7.
def fsdp_divide_factor_set(pgroup: FSDPParamGroup) -> bool:
    """Whether a divide factor was set on an FSDP2 parameter group: its reduction is not the mean."""
    if hasattr(pgroup, "gradient_divide_factor"):
        return pgroup.gradient_divide_factor is not None
    return pgroup.reduce_scatter_reduce_op is not None  # torch < 2.8


# FSDPModule.set_custom_reduce_scatter and _fsdp_api.ReduceScatter: torch 2.9. Nothing before it
# hands distmon the reduce-scatter input, the one place that holds a rank's whole local gradient
# under FSDP2: there, FSDP2's per-rank local figures are refused at construction (global and
# per-layer figures, read from the sharded gradients, are exact on every release).
FSDP_LOCAL_FIGURES = TORCH >= COMPLETE


def fsdp_reduce_scatter_base() -> type:
    """The class a custom FSDP2 reduce-scatter derives from (``object`` before torch 2.9, where
    FSDP2 takes none)."""
    if not FSDP_LOCAL_FIGURES:
        return object
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


# _get_gradient_divide_factors(rs_group, ar_group, dtype, device_type, factor,
# force_sum_reduction_for_comms), from torch.distributed.fsdp._fully_shard._fsdp_collectives, fed
# the group's _reduce_scatter_process_group and (HSDP) _all_reduce_process_group: this signature
# since torch 2.8 (2.7: no factor keywords; 2.6: no device_type either), checked on 2.9-2.14.
# Only the per-rank local figures use it, which need 2.9: no fallback. Without it: fp16 FSDP2
# local figures cannot undo FSDP2's pre-division (refused).
def fsdp_pre_divide_factor(
    pgroup: FSDPParamGroup, reduce_dtype: torch.dtype, device_type: str
) -> float | None:
    """The factor FSDP2 divides a unit's reduce-scatter input by before reducing it (fp16), or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    hsdp = pgroup.mesh_info.mesh.ndim > 1
    return _get_gradient_divide_factors(
        pgroup._reduce_scatter_process_group,
        pgroup._all_reduce_process_group if hsdp else None,
        reduce_dtype,
        device_type=device_type,
        factor=pgroup.gradient_divide_factor,
        force_sum_reduction_for_comms=pgroup.force_sum_reduction_for_comms,
    )[0]


# === torch's private names (every use in distmon; none elsewhere) ===============================
# --- autograd's engine ---------------------------------------------------------------------------
# torch.autograd.Variable._execution_engine.queue_callback: runs a callback once the current
# backward's work is done (FSDP2 and DDP queue theirs the same way); checked on 2.6-2.14. Without
# it: no figure is read where a backward ends (DDP, FSDP2, one process, DeepSpeed: every figure).
def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward's final callbacks queued so far have run."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# torch._C._current_graph_task_id(): the running backward's id, -1 outside one; checked on
# 2.6-2.14. Without it: no activation-checkpoint recomputation told from a forward (activation
# figures counted twice), DDP's second backward through one forward read as reduced, FSDP2's
# shards read before the backward assigned them.
def graph_task_id() -> int:
    """The id of the backward running on this thread, -1 outside any."""
    return torch._C._current_graph_task_id()


# torch._C._autograd._profiler_enabled(): whether a torch.profiler window is open; checked on
# 2.6-2.14. Without it: gloo's collectives are not completed before a profiler window closes
# (heap corruption, the process dies later; see DDP's HookSlot.start and RankBuffers).
def profiler_enabled() -> bool:
    """Whether the autograd profiler (``torch.profiler``) records now."""
    return torch._C._autograd._profiler_enabled()


# --- fused list arithmetic -----------------------------------------------------------------------
# torch._foreach_mul_ / _foreach_copy_ / _foreach_sub_: one kernel per list (the fused form of a
# Python loop over parameters); checked on 2.6-2.14. Without them: a Python loop per tensor on
# the hot path (each would need a replacement, not a fallback). Looked up at each call, so that
# tests which wrap them see the calls.
def foreach_mul_(tensors: list[torch.Tensor], scalar: float) -> None:
    """``t *= scalar`` for every tensor, one fused call."""
    torch._foreach_mul_(tensors, scalar)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` pairwise, one fused call."""
    torch._foreach_copy_(dst, src)


def foreach_sub_(dst: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    """``d -= o`` pairwise, one fused call."""
    torch._foreach_sub_(dst, other)


# --- torch.compile ------------------------------------------------------------------------------
# torch._dynamo.config.compiled_autograd and torch._dynamo.compiled_autograd's
# compiled_autograd_enabled / in_compiled_autograd_region; checked on 2.6-2.14 (read from
# sys.modules: dynamo is never imported for it). Without them: a compiled-autograd backward,
# whose hooks distmon cannot measure exactly, would run measured (wrong figures) instead of refused.
def compiled_autograd_on() -> bool:
    """Whether compiled autograd is switched on for ``torch.compile`` now (never imports dynamo)."""
    config = sys.modules.get("torch._dynamo.config")
    state = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(config, "compiled_autograd", False)) or bool(
        getattr(state, "compiled_autograd_enabled", False)
    )


def in_compiled_autograd() -> bool:
    """Whether a compiled-autograd backward is being traced now (hooks must not measure)."""
    state = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(state, "in_compiled_autograd_region", False))


# OptimizedModule._orig_mod: the module torch.compile(model) wraps (public classes keep no other
# handle on it); checked on 2.6-2.14. Without it: a compiled model is not seen through (no source
# found for a compiled DDP/FSDP2 model).
def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``model`` itself when not compiled).

    Example:
        >>> net = torch.nn.Linear(2, 2); uncompiled(net) is net
        True
    """
    while type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module
    ):
        model = model._orig_mod
    return model


# The name segments torch's wrappers put between a module and its parameters: torch.compile's
# OptimizedModule (_orig_mod), activation checkpointing's CheckpointWrapper
# (_checkpoint_wrapped_module), FSDP1 (_fsdp_wrapped_module); checked on 2.6-2.14. Without them:
# turning a wrapper on renames every layer series (a dashboard's history breaks).
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


# --- DTensor -------------------------------------------------------------------------------------
# DTensor._spec (its placements and mesh, without DTensor's import) and _st_info, the spec DDP's
# tensor-parallel support (_pre_dp_module_transform) keeps on a parameter it localized; checked on
# 2.6-2.14. Without them: tensor-parallel parameters are not recognised (refused or counted whole).
def spec_of(param: torch.Tensor) -> DTensorSpec | None:
    """The DTensor spec of a parameter: its own, or the one DDP's tensor-parallel support
    (``_pre_dp_module_transform``) kept on a parameter it localized (``_st_info``)."""
    spec = getattr(param, "_spec", None)
    if spec is not None and hasattr(spec, "placements"):
        return spec
    return getattr(param, "_st_info", None)


def ddp_localized(param: torch.Tensor) -> bool:
    """Whether DDP's tensor-parallel support localized ``param`` (its gradient comes in late)."""
    return hasattr(param, "_st_info")


# DTensor._local_tensor: a DTensor's shard without to_local()'s autograd Function (~10 us a
# tensor on the hot path); checked on 2.6-2.14. Without it: every tensor-parallel and FSDP2
# gradient read fails (figures NaN).
def rank_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's shard, else ``t`` itself."""
    return getattr(t, "_local_tensor", t)


# --- optimizers and AMP --------------------------------------------------------------------------
# Optimizer._optimizer_step_pre_hooks: present on every torch.optim.Optimizer since step hooks
# exist (a subclass that skipped Optimizer.__init__ lacks it); checked on 2.6-2.14. Without it:
# such an optimizer is accepted and its step hooks fail at the first step instead of construction.
def has_step_hooks(opt: object) -> bool:
    """Whether ``opt`` is a ``torch.optim.Optimizer`` that can take step hooks."""
    return isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks")


# GradScaler._per_optimizer_states: the only record of whether unscale_ ran on an optimizer this
# step; checked on 2.6-2.14. Without it: whether the gradients were unscaled is unknown (None).
def scaler_optimizer_states(scaler: object) -> dict[int, dict[str, object]]:
    """GradScaler's per-optimizer stage records (``{id(opt): {"stage": OptState, ...}}``)."""
    return getattr(scaler, "_per_optimizer_states", {})


# --- pipeline parallelism -----------------------------------------------------------------------
# torch.distributed.pipelining.stage._PipelineStageBase: the base of PipelineStage and of the
# stages the schedules build; checked on 2.6-2.14 (read from sys.modules: never imported for it).
# Without it: a pipeline stage is not recognised (its module measured as a whole job).
def pipeline_stage_base() -> type[PipelineStage] | None:
    """The base class of ``torch.distributed.pipelining`` stages, None when pipelining is not imported."""
    return getattr(sys.modules.get("torch.distributed.pipelining.stage"), "_PipelineStageBase", None)


# --- DDP -----------------------------------------------------------------------------------------
# torch.nn.parallel.distributed._find_tensors: the tensors of a forward's output, as DDP finds
# them for its own reduction; checked on 2.6-2.14. Without it: DDP without a comm hook (NCCL)
# reads nothing (every figure NaN).
def find_tensors(obj: object) -> list[torch.Tensor]:
    """The tensors in a (nested) forward output, as DDP finds them."""
    from torch.nn.parallel.distributed import _find_tensors

    return _find_tensors(obj)


# DistributedDataParallel._module_parameters (the parameters it reduces, those of
# _ddp_params_and_buffers_to_ignore left out), _comm_hooks (its registered comm hook and state),
# _delay_all_reduce_all_params (delay_all_reduce_named_params), _use_python_reducer (compiled
# autograd's Python reducer); checked on 2.6-2.14. Without them: ignored parameters counted,
# a second monitor registering a second comm hook (DDP refuses), delayed reductions read too early.
def ddp_module_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
    """The parameters a DDP model reduces, as it listed them when built (None if it keeps no list)."""
    return getattr(model, "_module_parameters", None)


def ddp_comm_hooks(model: torch.nn.Module) -> list[tuple[object, object]]:
    """The ``(hook, state)`` pairs registered with a DDP model (at most one)."""
    return getattr(model, "_comm_hooks", [])


def ddp_delays_all_reduce(model: torch.nn.Module) -> bool:
    """Whether a DDP model reduces some parameters after backward (``delay_all_reduce_named_params``)."""
    return bool(getattr(model, "_delay_all_reduce_all_params", False))


def ddp_python_reducer(model: torch.nn.Module) -> bool:
    """Whether a DDP model reduces through compiled autograd's Python reducer."""
    return bool(getattr(model, "_use_python_reducer", False))


# --- the default process group's store ------------------------------------------------------------
# torch.distributed.distributed_c10d._get_default_store (the store the default group was set up
# with: torchrun's rendezvous store, a FileStore, a TCPStore); in torch since 1.x, checked on 2.13.
# Without it: a rank exiting without close() cannot tell whether the other ranks exit too, and
# gathers with them blindly (a peer still training never answers: up to 30 s more before it exits).
def default_store() -> dist.Store:
    """The key-value store of the default process group (raises if there is none)."""
    return dist.distributed_c10d._get_default_store()


# --- FSDP2's parameter groups --------------------------------------------------------------------
# FSDPParamGroup._reduce_scatter_comm (the comm set_custom_reduce_scatter replaces: distmon wraps
# it and restores it), _reduce_scatter_process_group (the shard group), FSDPParam._unsharded_param
# (set only once the parameter was unsharded: FSDP's own test in post_backward); checked on
# 2.6-2.14 (_reduce_scatter_comm: 2.9-2.14, where custom reduce-scatters exist). distmon also
# wraps the public post_backward of this private class. Without them: FSDP2 models fail at
# construction (the per-rank local figures cannot be read).
def fsdp_reduce_scatter_comm(pgroup: FSDPParamGroup) -> object:
    """The reduce-scatter comm an FSDP2 parameter group uses now (its default, or a custom one)."""
    return pgroup._reduce_scatter_comm


def fsdp_reduce_scatter_group(pgroup: FSDPParamGroup) -> dist.ProcessGroup:
    """The process group an FSDP2 parameter group reduce-scatters over (its shard group)."""
    return pgroup._reduce_scatter_process_group


def fsdp_param_unsharded(fsdp_param: FSDPParam) -> bool:
    """Whether an ``FSDPParam`` was unsharded (has its unsharded parameter)."""
    return hasattr(fsdp_param, "_unsharded_param")
