"""Mixture-of-experts layouts on real gloo ranks, on top of :mod:`layout_harness`.

The harness's GPT gains a MoE layer (``moe``: a router ``Linear`` and ``E`` experts' two-layer
MLPs stacked as ``experts.w1`` ``[E, D, H]`` and ``experts.w2`` ``[E, H, D]``, as torchtitan's
``GroupedExperts``) as a residual module after the blocks. Experts are split over an expert-
parallel dimension ``ep`` of an ``(edp, ep)`` mesh; routing is soft (every token to every
expert, weighted by the gate: the all-to-all splits stay equal) and the dispatch is a real,
autograd-aware ``all_to_all_single`` over the ``ep`` group: each rank's experts compute on
every ``ep`` peer's tokens, and send the outputs back.

Two ways to reduce the experts' gradients over the expert-data-parallel dimension:

* ``dp="fsdp"`` (torchtitan): the experts are DTensors ``Shard(0)`` over ``ep``, then
  ``fully_shard(experts, mesh=mesh["efsdp"])`` with torchtitan's gradient divide factor (the
  data-parallel degree); the dense parameters ``fully_shard`` over a 4-rank ``dp`` mesh. The
  experts compute on their local shards (``to_local()``).
* ``dp="ddp"`` (DeepSpeed, Megatron): the dense parameters in ``DistributedDataParallel`` over
  the whole job (a flattened ``(edp, ep)`` mesh: ``ep_rank`` comes from it), the experts plain
  tensors (this rank's ``ep`` shard) that DDP ignores; the model's own code averages their
  gradients over the ``edp`` group after backward, and distmon is told so with
  ``replicated_over`` (``declare="edp"``; ``"self"``: a group of one rank, misdeclared).

:class:`MoEBuilt` is what :func:`layout_harness.layout_job` takes as ``build``; its references:

* whole gradients: the experts' made whole (DTensor ``full_tensor()``), or each distinct plain
  ``ep`` shard keyed ``name#ep<j>`` (:func:`layout_harness.layer_of` still names its layer);
* local: a float64 twin with all ``E`` experts on one rank, no collective. A rank's dense
  gradient before data-parallel reduction comes from its own batch; its experts' from every
  token they computed on: the batches of all its ``ep`` peers (the twin's loss summed over
  them), sliced to its experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import GPT, lm_loss, make_batch
from layout_harness import (
    BATCH,
    DIM,
    HIDDEN,
    LAYERS,
    MODEL,
    VOCAB,
    Built,
    Layout,
    _poison_output_gradient,
    full_weights,
    layout_job,
)
from torch import nn

N_EXPERTS, EP = 4, 2
MOE_LAYERS = LAYERS + ("moe.router", "moe.experts")
NAN_LAYER = "moe.experts"  # its output's gradient is poisoned on one rank: the first NaN in backward
EXPERT_WEIGHTS = ("w1", "w2")


def is_expert(name: str) -> bool:
    return name.startswith("moe.experts.")


class Experts(nn.Module):
    """``n`` experts' two-layer MLPs stacked on dim 0; each applied to every token it is given."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, DIM, HIDDEN) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(n, HIDDEN, DIM) * HIDDEN**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[N, D]`` -> every local expert's output ``[n, N, D]``."""
        w1, w2 = (getattr(w, "to_local", lambda w=w: w)() for w in (self.w1, self.w2))  # ep shards
        return torch.einsum("enh,ehd->end", torch.tanh(torch.einsum("nd,edh->enh", tokens, w1)), w2)


class MoE(nn.Module):
    """A router over ``N_EXPERTS`` experts, of which this rank holds its ``ep`` group's share."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, N_EXPERTS)
        self.experts = Experts(N_EXPERTS)
        self.group: dist.ProcessGroup | None = None  # the ep group (None: every expert here)

    def _all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        return t if self.group is None else all_to_all_single(torch.empty_like(t), t, group=self.group)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, DIM)
        n, ep = tokens.shape[0], 1 if self.group is None else self.group.size()
        gate = torch.softmax(self.router(tokens), dim=-1)
        arrived = self._all_to_all(tokens.repeat(ep, 1))  # every ep peer's tokens, peer by peer
        out = self.experts(arrived)  # [local experts, ep * n, D]
        local = out.shape[0]
        back = self._all_to_all(out.transpose(0, 1).reshape(ep * n, local * DIM))
        # peer j's experts are j * local ... (Shard(0)): [n, N_EXPERTS, D] in expert order
        y = back.reshape(ep, n, local, DIM).transpose(0, 1).reshape(n, N_EXPERTS, DIM)
        return (gate.unsqueeze(-1) * y).sum(1).reshape(h.shape)


class MoEGPT(GPT):
    """The harness's GPT with a residual MoE layer after its blocks."""

    def __init__(self) -> None:
        super().__init__(**MODEL)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks.values():
            h = block(h)
        h = h + self.moe(h)
        return self.head(self.norm(h))


class MoEBuilt(Built):
    """One rank's MoE model laid out as ``layout.dp`` says (``"fsdp"`` or ``"ddp"``) on an
    ``(efsdp|edp, ep)`` mesh; the harness's interface (:class:`layout_harness.Built`)."""

    def __init__(self, layout: Layout) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.layout = layout
        names = tuple(layout.dims)  # (expert-data-parallel, "ep")
        self.mesh = init_device_mesh("cpu", tuple(layout.dims.values()), mesh_dim_names=names)
        self.edp, self.ep = self.mesh.get_coordinate()
        self.dp, self.tp, self.stage, self.schedule = dist.get_rank(), None, None, None
        self.ep_peers = self.mesh[names[1]].mesh.tolist()  # their batches meet this rank's experts
        torch.manual_seed(0)
        self.module = MoEGPT().to(layout.dtype)
        self.module.moe.group = self.mesh["ep"].get_group()
        self._parallelize()
        self._named = list(self.module.named_parameters())
        self.opt = torch.optim.SGD(self.trained.parameters(), lr=0.2)

    def _parallelize(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        experts, world = self.module.moe.experts, dist.get_world_size()
        for name in EXPERT_WEIGHTS:
            w = getattr(experts, name).detach()
            if self.layout.dp == "fsdp":
                shard = distribute_tensor(w, self.mesh["ep"], [Shard(0)])
            else:
                shard = w.chunk(EP)[self.ep].clone()
            setattr(experts, name, nn.Parameter(shard))
        if self.layout.dp == "fsdp":
            fully_shard(experts, mesh=self.mesh["efsdp"])
            # torchtitan: the experts' gradients divided by the data-parallel degree, as the dense
            # ones; a sum then a division (gloo has no PREMUL_SUM)
            experts.set_gradient_divide_factor(float(world))
            experts.set_force_sum_reduction_for_comms(True)
            dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            for block in self.module.blocks.values():
                fully_shard(block, mesh=dense)
            fully_shard(self.module, mesh=dense)
            self.trained = self.wrapped = self.module
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.module._ddp_params_and_buffers_to_ignore = [f"moe.experts.{n}" for n in EXPERT_WEIGHTS]
        self.groups = _edp_groups(self.mesh)
        self.wrapped = self.trained = DDP(self.module, device_mesh=self.mesh._flatten("dp"))

    def monitor_options(self) -> dict:
        if self.layout.declare is None:
            return {}
        return {"replicated_over": {r"^moe\.experts\.": self.groups[self.layout.declare]}}

    def train_step(self, step: int, poison: bool = False) -> float:
        """One optimizer step on this rank's batch; with DDP, the model's own reduction of the
        experts' gradients: summed over the edp group, divided by the job's size as DDP divides."""
        x, y = make_batch(self.dp, step, batch=BATCH, vocab=VOCAB)
        hook = self.module.moe.experts.register_forward_hook(_poison_output_gradient) if poison else None
        loss = lm_loss(self.wrapped(x), y)
        loss.backward()
        if hook is not None:
            hook.remove()
        if self.layout.dp == "ddp":
            for p in self.module.moe.experts.parameters():
                dist.all_reduce(p.grad, group=self.groups["edp"])
                p.grad /= dist.get_world_size()
        return float(loss)

    def _key(self, name: str) -> str:
        """A plain expert shard's reference key: each distinct ``ep`` shard once."""
        return f"{name}#ep{self.ep}" if self.layout.dp == "ddp" and is_expert(name) else name

    def grad_sq(self) -> dict[str, float]:
        return {self._key(n): sq for n, sq in super().grad_sq().items()}

    def whole_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (every ``ep`` shard of the experts), on every rank."""
        if self.layout.dp == "fsdp":
            return full_weights(self)
        mine = {self._key(n): p.detach().double() for n, p in self.named_params()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {k: v for d in everyone for k, v in d.items()}
        return {
            n: torch.cat([merged[f"{n}#ep{j}"] for j in range(EP)]) if is_expert(n) else merged[n]
            for n, _ in self.named_params()
        }

    def local_reference(self, weights: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """This rank's pre-reduction sums of squares from a float64 twin with every expert: the
        dense parameters' from its own batch, its experts' from its ep peers' batches."""
        twin = MoEGPT().double()
        twin.load_state_dict(weights)
        x, y = make_batch(self.dp, step, batch=BATCH, vocab=VOCAB)
        lm_loss(twin(x), y).backward()
        grads = {n: p.grad.clone() for n, p in twin.named_parameters()}
        twin.zero_grad()
        batches = [make_batch(r, step, batch=BATCH, vocab=VOCAB) for r in self.ep_peers]
        sum(lm_loss(twin(x), y) for x, y in batches).backward()
        for n, p in twin.named_parameters():
            if is_expert(n):
                grads[n] = p.grad.chunk(EP)[self.ep]
        return {self._key(n): float(grads[n].pow(2).sum()) for n, _ in self.named_params()}

    def coords(self) -> dict[str, int | None]:
        return super().coords() | {"ep_rank": self.ep}


def _edp_groups(mesh: object) -> dict[str, dist.ProcessGroup]:
    """The expert-data-parallel group (this rank's ``edp`` slice of the mesh) and, for a
    misdeclared layout, this rank's group of one (every group made on every rank, in one order)."""
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return {"edp": mesh["edp"].get_group(), "self": alone[dist.get_rank()]}


def undeclared_refusal() -> str:
    """The error GradMonitor raises for the DDP layout with the experts left undeclared."""
    import distmon

    built = MoEBuilt(Layout("ep_ddp_undeclared", {"edp": EP, "ep": EP}, dp="ddp"))
    try:
        distmon.GradMonitor(built.monitored, built.opt, serve="none").close()
    except ValueError as e:
        return str(e)
    return "accepted"


def moe_job(rank: int, world: int, layouts: list[Layout], log_dir: str) -> dict:
    """Every MoE layout in turn (:func:`layout_harness.layout_job`), then the undeclared one."""
    results = layout_job(rank, world, layouts, log_dir, MoEBuilt)
    results["undeclared"] = undeclared_refusal()
    return results
