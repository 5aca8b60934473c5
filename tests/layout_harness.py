"""N-D parallel layouts on real gloo ranks: a small GPT laid out as the largest jobs lay it out,
trained with and without distmon, and references computed another way.

A *layout* (:class:`Layout`) names the parallel dimensions of a ``(pp, dp, tp)`` device mesh and
what reduces over ``dp``: FSDP2 (``fully_shard``), HSDP (a replicate and a shard dimension), DDP
(``DistributedDataParallel(device_mesh=...)``) or nothing. Tensor parallelism shards each
block's MLP (``fc1`` column-wise, ``fc2`` row-wise, the real ``parallelize_module``); pipeline
parallelism cuts the model into stages the torchtitan way (a copy of the whole model with the
other stages' modules removed, so parameter names stay the model's) and runs a real
``torch.distributed.pipelining`` schedule.

:func:`layout_job` runs on every rank: the same seeded training twice, bare and with distmon, then
with distmon only a window of ordinary steps under the spy (:class:`SyncRecorder`) and one step
with a NaN injected on one rank. It returns what the tests compare:

* per step, this rank's float64 sum of squares of every parameter it holds, the gradient the
  optimizer steps with made whole (``DTensor.full_tensor()``); the test combines the ranks'
  by parameter name (replicas must agree), so stages and shards meet outside the code under test;
* per step, this rank's *local* reference: an unsharded float64 twin of the whole model (weights
  gathered from every rank) run on this rank's batch, each gradient cut to the part this rank
  holds before data-parallel reduction (its tensor-parallel shard); nothing of distmon or of
  the layout's reductions is involved;
* losses and parameters of both runs (compared bitwise in the rank), distmon's clip norm, the
  spy's counts, the JSONL log and a real scrape of rank 0's endpoint.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from ddp_harness import SyncRecorder
from helpers import GPT, close, layer_of, lm_loss, make_batch, scrape_metrics
from torch import nn

VOCAB, DIM, HIDDEN = 24, 8, 16
# the layouts' GPT (helpers.GPT): MLP blocks, which tensor parallelism shards (fc1, fc2)
MODEL = {"vocab": VOCAB, "dim": DIM, "hidden": HIDDEN}
STEPS = 4  # compared steps; then SPY_STEPS ordinary steps under the spy, then the NaN step
SPY_STEPS = 3
BATCH = 4
LAYERS = (
    "emb",
    "blocks.0.ln",
    "blocks.0.fc1",
    "blocks.0.fc2",
    "blocks.1.ln",
    "blocks.1.fc1",
    "blocks.1.fc2",
    "norm",
    "head",
)
# one endpoint on an ephemeral port, exports only when flushed, no lingering for Prometheus
MONITORED = {"serve": "rank0", "port": 0, "export_every": 1000, "export_interval_s": 0, "linger_s": 0}
NAN_LAYER = "blocks.1.fc2"  # its output's gradient is poisoned on one rank: the first NaN in backward


def make_stage(model: GPT, stage: int) -> GPT:
    """Stage 0: the embedding and block 0; stage 1: block 1, the norm and the head."""
    part = copy.deepcopy(model)
    if stage == 0:
        del part.blocks["1"]
        part.norm = part.head = None
    else:
        del part.blocks["0"]
        part.emb = None
    return part


@dataclass(frozen=True)
class Layout:
    """A parallel layout: mesh dimensions (``pp``, ``dp`` or ``dp_replicate``/``dp_shard``,
    ``tp``) and what reduces over the data-parallel ones."""

    name: str
    dims: dict[str, int]
    dp: str | None = None  # "fsdp", "hsdp", "ddp" or None
    schedule: str = "GPipe"  # with a pp dimension: "GPipe" or "1F1B"
    microbatches: int = 2
    dtype: torch.dtype = torch.float32
    # tensor parallelism without a data-parallel wrapper: the plain parameters (embedding, norms,
    # head) are copies over tp, declared so (a group of one rank each: misdeclared)
    declare: str | None = None  # "tp" or "self"
    extra: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return math.prod(self.dims.values())


def torch_limit(layout: Layout) -> str | None:
    """Why the torch running the tests cannot train ``layout`` on CPU with gloo (torch's own
    limits, not distmon's: such a layout is skipped, with this reason), or None."""
    from distmon.compat import TORCH

    if layout.dp in ("fsdp", "hsdp") and TORCH < (2, 7):
        return "torch 2.6's FSDP2 does not run on CPU ('Stream' object has no attribute 'record_event')"
    if "pp" in layout.dims and TORCH == (2, 9):
        return "torch 2.9's pipeline schedules abort on gloo (EnforceNotMet) and refuse 1 micro-batch"
    return None


class Built:
    """One rank's laid-out model: what GradMonitor takes, the optimizer, the training step."""

    def __init__(self, layout: Layout) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.layout = layout
        names = tuple(layout.dims)
        self.mesh = init_device_mesh("cpu", tuple(layout.dims.values()), mesh_dim_names=names)
        coord = dict(zip(names, self.mesh.get_coordinate()))
        self.stage = coord.get("pp")
        self.tp = coord.get("tp")
        self.dp = coord.get(
            "dp", coord.get("dp_replicate", 0) * layout.dims.get("dp_shard", 1) + coord.get("dp_shard", 0)
        )
        torch.manual_seed(0)
        full = GPT(**MODEL).to(layout.dtype)
        self.module = make_stage(full, self.stage) if self.stage is not None else full
        self._parallelize()
        # taken now: torch's TP support in DDP leaves the tensor-parallel parameters out of
        # named_parameters() after the first forward (they stay the ones DDP and SGD step)
        self._named = list(self.module.named_parameters())
        self.opt = torch.optim.SGD(self.trained.parameters(), lr=0.2)
        self.schedule = self._schedule() if self.stage is not None else None

    def _dp_mesh(self) -> object | None:
        dims = self.layout.dims
        if "dp" in dims:
            return self.mesh["dp"]
        if "dp_shard" in dims:
            return self.mesh["dp_replicate", "dp_shard"]
        return None

    def _parallelize(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.tp is not None:
            for block in self.module.blocks.values():
                parallelize_module(
                    block, self.mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
                )
        kind, dp_mesh = self.layout.dp, self._dp_mesh()
        if kind in ("fsdp", "hsdp"):
            for block in self.module.blocks.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.module, mesh=dp_mesh)
        self.trained = self.module  # what the optimizer steps
        self.wrapped = self.module  # what runs forward (and GradMonitor takes, without pp)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.wrapped = DDP(self.module, device_mesh=dp_mesh)
            self.trained = self.wrapped

    def _schedule(self) -> object:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        group = self.mesh["pp"].get_group()
        n = self.layout.dims["pp"]
        self.pipe = PipelineStage(self.wrapped, self.stage, n, torch.device("cpu"), group=group)
        kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[self.layout.schedule]
        return kind(self.pipe, n_microbatches=self.layout.microbatches, loss_fn=lm_loss)

    @property
    def monitored(self) -> object:
        """What GradMonitor takes: the pipeline stage, else the (wrapped) model."""
        return self.pipe if self.stage is not None else self.wrapped

    def monitor_options(self) -> dict:
        declare = self.layout.declare
        if declare is None:
            return {}
        if declare == "tp":
            group = self.mesh["tp"].get_group()
        else:  # every rank claims its copy is its own: a misdeclared layout
            group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        return {"replicated_over": {r"^(emb|norm|head)\.|\.ln\.": group}}

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        return self._named

    def grad_sq(self) -> dict[str, float]:
        """Per parameter this rank holds, the float64 sum of squares of its whole gradient."""
        return {n: float(full_grad(p).pow(2).sum()) for n, p in self.named_params() if p.grad is not None}

    def whole_weights(self) -> dict[str, torch.Tensor]:
        return full_weights(self)

    def local_reference(self, weights: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        return local_reference(self, weights, step)

    def coords(self) -> dict[str, int | None]:
        return {"dp_rank": self.dp, "tp_rank": self.tp, "pp_stage": self.stage}

    def train_step(self, step: int, poison: bool = False) -> float | None:
        """One optimizer step on this rank's batch (the dp coordinate's); the loss where it is known."""
        # contiguous: torch <= 2.10's pipeline stages check their inputs' strides
        x, y = (t.contiguous() for t in make_batch(self.dp, step, batch=BATCH, vocab=VOCAB))
        hook = None
        if poison:
            fc2 = self.module.blocks["1"].fc2
            hook = fc2.register_forward_hook(_poison_output_gradient)
        if self.schedule is None:
            loss = lm_loss(self.wrapped(x), y)
            loss.backward()
            value = float(loss)
        else:
            losses: list[torch.Tensor] = []
            last = self.stage == self.layout.dims["pp"] - 1
            if self.stage == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses)
            value = float(sum(losses) / len(losses)) if last else None
        if hook is not None:
            hook.remove()
        return value


def _poison_output_gradient(module: nn.Module, inputs: object, out: torch.Tensor) -> None:
    out.register_hook(lambda g: g * math.nan)  # returns None: the output itself is unchanged


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer steps with, made whole, in float64."""
    from torch.distributed.tensor import DTensor

    g = param.grad
    if g is None:
        return None
    spec = getattr(param, "_st_info", None)  # DDP's tensor-parallel support localized it
    if spec is not None:
        g = DTensor.from_local(g, spec.mesh, spec.placements)
    return (g.full_tensor() if isinstance(g, DTensor) else g).double()


def full_weights(built: Built) -> dict[str, torch.Tensor]:
    """Every rank's parameters made whole and merged by name: the whole model's weights."""
    from torch.distributed.tensor import DTensor

    mine = {}
    for name, p in built.named_params():
        spec = getattr(p, "_st_info", None)
        t = DTensor.from_local(p.detach(), spec.mesh, spec.placements) if spec is not None else p.detach()
        mine[name] = (t.full_tensor() if isinstance(t, DTensor) else t).double()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def tp_part(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a whole gradient this rank holds before data-parallel reduction: its chunk along
    each tensor-parallel ``Shard`` (data-parallel shards are reduce-scatter outputs, not inputs)."""
    spec = getattr(param, "_st_info", None) or getattr(param, "_spec", None)
    if spec is None:
        return grad
    names = spec.mesh.mesh_dim_names or ()
    for dim, placement in enumerate(spec.placements):
        if names[dim] == "tp" and placement.is_shard():
            size, me = spec.mesh.size(dim), spec.mesh.get_local_rank(dim)
            grad = torch.chunk(grad, size, dim=placement.dim)[me]
    return grad


def local_reference(built: Built, weights: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """This rank's pre-reduction sum of squares per parameter, from a float64 twin on its batch."""
    twin = GPT(**MODEL).double()
    twin.load_state_dict(weights)
    x, y = make_batch(built.dp, step, batch=BATCH, vocab=VOCAB)
    lm_loss(twin(x), y).backward()
    grads = dict(twin.named_parameters())
    return {name: float(tp_part(grads[name].grad, p).pow(2).sum()) for name, p in built.named_params()}


def _train(layout: Layout, monitor_kw: dict | None, build: type = Built) -> dict:
    """STEPS steps bare (``monitor_kw`` None) or with distmon; then, with distmon, the spy window
    and the NaN step. ``build`` lays the model out (:class:`Built` or one with its methods)."""
    import distmon

    built = build(layout)
    out: dict = {"losses": [], "sq": [], "local": [], "clip": []}
    mon = None
    if monitor_kw is not None:
        mon = distmon.GradMonitor(built.monitored, built.opt, **monitor_kw, **built.monitor_options())
    for step in range(1, STEPS + 1):
        weights = built.whole_weights() if mon is not None else None
        out["losses"].append(built.train_step(step))
        if mon is not None:
            out["sq"].append(built.grad_sq())
            out["local"].append(built.local_reference(weights, step))
            out["clip"].append(float(mon.clip_grad_norm_(1e9)))
        built.opt.step()
        built.opt.zero_grad()
    # this rank's own parts (torch.equal on DTensors would be a collective)
    out["params"] = [getattr(p, "_local_tensor", p).detach().clone() for _, p in built.named_params()]
    if mon is None:
        return out
    mon.flush()
    with SyncRecorder() as rec:
        per_step = []
        for step in range(STEPS + 1, STEPS + SPY_STEPS + 1):
            built.train_step(step)
            built.opt.step()
            built.opt.zero_grad()
            per_step.append(len(rec.collectives))
    out["per_step"], out["syncs"] = per_step, rec.describe(rec.syncs)
    out["nan_rank"] = dist.get_world_size() - 1  # on the last stage, the last tp and dp coordinate
    built.train_step(STEPS + SPY_STEPS + 1, poison=dist.get_rank() == out["nan_rank"])
    built.opt.step()
    built.opt.zero_grad()
    mon.flush()
    out["port"] = mon.port
    out["scrape"] = (
        [s for s in scrape_metrics(mon.port) if s[0] == "distmon_rank_grad_norm"] if mon.port else None
    )
    out["coords"] = built.coords()
    mon.close()
    return out


def layout_job(rank: int, world: int, layouts: list[Layout], log_dir: str, build: type = Built) -> dict:
    """Every layout in turn on this rank's process group (one spawn for several layouts)."""
    results = {}
    for layout in layouts:
        log = f"{log_dir}/{layout.name}.jsonl"
        bare = _train(layout, None, build)
        mon = _train(layout, MONITORED | {"log_path": log}, build)
        mon["same_losses"] = bare["losses"] == mon["losses"]
        mon["same_params"] = all(torch.equal(a, b) for a, b in zip(bare["params"], mon.pop("params")))
        if rank == 0:
            with open(log) as f:
                mon["snaps"] = [json.loads(line) for line in f]
        results[layout.name] = mon
        dist.barrier()
    return results


def combined(outs: list[dict], step: int) -> dict[str, float]:
    """The job's sum of squares per parameter at ``step``: the ranks' merged by name, each distinct
    parameter once (its copies on other ranks must agree)."""
    merged: dict[str, float] = {}
    for out in outs:
        for name, sq in out["sq"][step - 1].items():
            if name in merged:
                assert close(sq, merged[name], 1e-9), (name, sq, merged[name])
            merged[name] = sq
    return merged


def by_layer(per_param: dict[str, float], layers: tuple[str, ...] = LAYERS) -> dict[str, float]:
    sq = dict.fromkeys(layers, 0.0)
    for name, v in per_param.items():
        sq[layer_of(name)] += v
    return sq
