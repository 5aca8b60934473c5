"""Who each rank is: run id, hostname, local rank, GPU UUID; exchanged once at construction."""

from __future__ import annotations

import ctypes
import os
import pickle
import secrets
import socket
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..compat import all_gather
from ..layout.placements import Coordinates

__all__ = [
    "RankInfo",
    "Nodes",
    "resolve_run_id",
    "restart_count",
    "local_rank_info",
    "gather_objects",
    "nodes_of",
    "node_group",
]


@dataclass(frozen=True)
class RankInfo:
    """Identity of one rank, as exported in per-rank label sets."""

    rank: int
    local_rank: int
    hostname: str
    gpu_uuid: str  # "GPU-..." as DCGM reports it, "" off GPU
    node: str = ""  # hostname, plus torchrun's node rank (GROUP_RANK) or Slurm's node id when set
    coords: Coordinates | None = None  # its place in each parallel dimension (several of them)
    node_index: int = 0  # its node's place among the job's nodes (ordered by their lowest rank)
    # the job's lowest rank on its node: the one that serves and logs for it (``LOCAL_RANK`` counts
    # every process on the host, other jobs' too: a job declared with ``job_group=`` may hold none of 0)
    lead: bool = True

    def labels(self) -> dict[str, str]:
        out = {
            "rank": str(self.rank),
            "local_rank": str(self.local_rank),
            "hostname": self.hostname,
            "node": str(self.node_index),
        }
        if self.gpu_uuid:
            out["gpu_uuid"] = self.gpu_uuid
        if self.coords is not None:
            out.update(self.coords.labels())
        return out


def resolve_run_id(explicit: str | None) -> str:
    """The run id: explicit option/``DISTMON_RUN_ID``, else torchrun's, else Slurm's, else generated.

    torchrun sets ``TORCHELASTIC_RUN_ID=none`` when no ``--rdzv-id`` is given; that is not an id.

    Example:
        >>> resolve_run_id("exp-42")
        'exp-42'
    """
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":
        return elastic
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def restart_count() -> int:
    """How many times the launcher restarted this job: torchrun's count, else Slurm's, else 0.

    Example:
        >>> import os; os.environ["TORCHELASTIC_RESTART_COUNT"] = "2"; restart_count()
        2
        >>> del os.environ["TORCHELASTIC_RESTART_COUNT"]
    """
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _gpu_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def local_rank_info(group: dist.ProcessGroup | None, device: torch.device) -> RankInfo:
    """This process's identity in ``group`` (rank 0 of a single process without ``torch.distributed``).

    Its node is its launcher's: torchrun's agent (``GROUP_RANK``: several agents on one host are
    several nodes), else Slurm's node (``SLURM_NODEID``), else its host. Without ``LOCAL_RANK``
    (ranks started by ``torch.multiprocessing``) the local rank is its place on its node, set by
    :func:`nodes_of`.
    """
    host = socket.gethostname()
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID"))
    local = os.environ.get("LOCAL_RANK", "")
    return RankInfo(
        rank=dist.get_rank(group) if group is not None else 0,
        local_rank=int(local) if local.isdigit() else -1,
        hostname=host,
        gpu_uuid=_gpu_uuid(device),
        node=f"{host}/{node_rank}" if node_rank is not None else host,
    )


@dataclass(frozen=True)
class Nodes:
    """Where the ranks of a group run: each rank's node index (nodes ordered by their lowest rank).

    Example:
        >>> n = Nodes((0, 0, 1, 1)); n.count, n.ranks_of(1), n.lead(2), n.lead(3)
        (2, (2, 3), True, False)
    """

    index: tuple[int, ...]  # per rank of the group

    @property
    def count(self) -> int:
        return max(self.index) + 1

    def ranks_of(self, node: int) -> tuple[int, ...]:
        """The group ranks on ``node``, in order."""
        return tuple(r for r, n in enumerate(self.index) if n == node)

    def lead(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank of its node: the one that serves and logs for it."""
        return self.ranks_of(self.index[rank])[0] == rank


def nodes_of(me: RankInfo, group: dist.ProcessGroup | None) -> tuple[RankInfo, Nodes]:
    """Every rank's node (one small exchange at construction, on every rank); ``me`` with its node
    index, whether it leads its node in the job and, without ``LOCAL_RANK``, its place on its node as
    its local rank."""
    keys = gather_objects(me.node, group)
    first: dict[str, int] = {}
    for key in keys:
        first.setdefault(key, len(first))
    nodes = Nodes(tuple(first[k] for k in keys))
    local = me.local_rank if me.local_rank >= 0 else nodes.ranks_of(nodes.index[me.rank]).index(me.rank)
    return replace(me, node_index=nodes.index[me.rank], local_rank=local, lead=nodes.lead(me.rank)), nodes


def node_group(nodes: Nodes, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group of this rank's node within ``group`` (the job's), over which an export
    gathers the node's rows; None when the rank is alone on its node or the job is one node.

    Made at start-up, on the node's ranks only (``use_local_synchronization``: the other nodes'
    ranks take no part), right after :func:`nodes_of`, which every rank reaches.
    """
    if group is None:
        return None
    mine = nodes.ranks_of(nodes.index[dist.get_rank(group)])
    if len(mine) == 1 or len(mine) == dist.get_world_size(group):
        return None
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group([ranks[r] for r in mine], use_local_synchronization=True)


def gather_objects(payload: object, group: dist.ProcessGroup | None) -> list:
    """All ranks' ``payload`` (picklable) in rank order: at construction only (nothing without a group).

    ``dist.all_gather_object`` would do, but it turns bytes back into objects through numpy,
    which distmon does not depend on (a fresh environment has no numpy): the pickles travel
    as bytes padded to the longest one (a MAX all-reduce of the length, then one all-gather)
    and are read back from host memory.
    """
    if group is None:
        return [payload]
    data = pickle.dumps(payload)
    device = _collective_device(group)
    longest = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    size = int(longest.item())
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * size, dtype=torch.uint8, device=device)
    all_gather(everyone, mine.to(device), group=group, async_op=False)
    host = everyone.cpu()
    # a pickle ends at its STOP opcode: the padding after it is never read
    return [pickle.loads(ctypes.string_at(host.data_ptr() + r * size, size)) for r in range(world)]


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s backend takes tensors: the host for gloo (or a CPU+GPU group), else the
    accelerator."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()  # xccl, hccl, ...: their device
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
