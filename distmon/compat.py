"""What differs between the torch releases distmon runs on, in one place.

distmon runs on torch 2.6 and newer and refuses an older torch when it is imported. From 2.9 it is
complete; on 2.6-2.8 everything but FSDP2's per-rank local figures, which need a hook those
releases lack (:data:`FSDP_LOCAL_FIGURES`). CI runs the whole suite on the pinned release and
the fast tier plus DDP, FSDP2 and N-D parity jobs on 2.9 and 2.11 (``tests/run_torch_tiers.sh``).

Each difference is one name here, with what distmon uses it for, the release that made its
fallback unnecessary (delete the fallback once :data:`FLOOR` reaches that release) and what
breaks without it. Torch is looked up when called, not bound at import, so that tests which
wrap a torch function (the collective and sync recorders, the failure injector) see the calls.
FSDP2 is imported only by the functions that need it (``import distmon`` must not pay for it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

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
]

FLOOR = (2, 6)  # the oldest torch distmon runs on: DDP, one process, frameworks, compile; FSDP2 in part
COMPLETE = (2, 9)  # every feature from here (FSDP2's per-rank local figures: FSDP_LOCAL_FIGURES)


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.9.1+cu128"``, ``"2.14.0a0+git..."``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"distmon: cannot read torch's version {version!r}")
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


TORCH = require_supported(str(torch.__version__))  # refused at import: nothing runs half-way


# --- the sum of squares of every gradient (the hot path) ----------------------------------------
# torch._foreach_powsum: torch 2.11. Before it, _foreach_norm's squares (one ulp apart).
# Without it: every figure NaN (the fused call raises in every hook).
def sq_sums_fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 sum of squares of each tensor, one fused pass (see :func:`distmon.sums.sq_sums`).

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
def root_mesh(mesh: object) -> object:
    """The mesh ``mesh`` was sliced from (itself when it was not sliced)."""
    method = getattr(mesh, "_get_root_mesh", None)
    if method is not None:
        return method()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.10

    return _mesh_resources.get_root_mesh(mesh)


# --- FSDP2 ---------------------------------------------------------------------------------------
# FSDPState._fsdp_param_groups: torch 2.12 (several parameter groups per fully_shard call, via
# shard_placement_fn). Before it, one optional _fsdp_param_group.
# Without it: every FSDP2 model fails at construction.
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
def fsdp_divide_factor_set(pgroup: object) -> bool:
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
# force_sum_reduction_for_comms): this signature since torch 2.8 (2.7: no factor keywords; 2.6:
# no device_type either). Only the per-rank local figures use it, which need 2.9: no fallback.
def fsdp_pre_divide_factor(pgroup: object, reduce_dtype: torch.dtype, device_type: str) -> float | None:
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
