"""The layout space of the property test (#27): generated parallel layouts, each laid out on real
gloo ranks, trained bare and with distmon, and judged against a reference made another way.

A :class:`Case` combines a device mesh (``pp``, ``dp`` or HSDP's ``dp_replicate``/``dp_shard``,
``tp``, or an expert mesh ``edp`` x ``ep``; one or two pipeline stages), what reduces over the
data-parallel ranks (DDP, FSDP2, HSDP or nothing), tensor parallelism (``fc1`` column-wise,
``fc2`` row-wise, the plain parameters declared replicated over ``tp`` or not, or misdeclared),
pipeline stages (the ``PipelineStage`` or the stage's module passed), mixture-of-experts layers
(DTensor experts on an ``ep`` mesh, or plain per-rank tensors inside FSDP2 or outside every
wrapper, declared or not), the parameters' dtype, and the object handed to ``GradMonitor`` (the
wrapper, or the module a user has in hand: a stage's module, DDP's ``.module``). :func:`cases` generates them.

:func:`space_job` runs many cases in one spawn (every rank, one after the other). Per case and
rank it returns what the property needs, judged by :func:`judge_case` outside the ranks:

* the refusal, if ``GradMonitor`` raised at construction (then nothing was trained);
* else the rows rank 0's JSONL log holds, the log files that exist (one writer: rank 0's), the
  first-step check's message if it refused the figures, and whether the monitored run trained
  bit-identically to the same run without distmon;
* per step, this rank's float64 sum of squares of every parameter's whole gradient (DTensor
  ``full_tensor()``) keyed by name and a hash of its value: merged over the ranks, each distinct
  (name, value) counts once. Stages, shards, copies and per-rank experts meet there, in the test,
  by value alone: the reference shares none of distmon's reading of the layout.

The property (:func:`judge_case`): a case is *exact* (every step valid, global and per-layer norms
within 1e-5 of the reference, one writer, training bit-identical), *refused* (at construction,
the message naming the fix) or *invalid* (every step invalid, the first-step check's message
naming the fix); anything else, above all a valid step with a wrong figure, is a *violation*.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from helpers import GPT, close, layer_of, lm_loss, make_batch, rel_err
from layout_harness import MODEL, VOCAB, full_grad, make_stage
from moe_layouts import EP, EXPERT_WEIGHTS, MoEGPT
from torch import nn

STEPS = 3  # the first-step check runs on step 1; steps 2-3 are ordinary
BATCH = 4
REL = 1e-5
MONITORED = {"serve": "none", "export_every": 1000, "export_interval_s": 0, "linger_s": 0}
# what a refusal or an invalid run must name: the option or the object that resolves it
FIXES = ("distinct_over", "replicated_over", "job_group", "PipelineStage", "DistributedDataParallel(model)")
EXPERTS = r"^moe\.experts\."
TP_PLAIN = r"^(emb|norm|head)\.|\.norm\."


@dataclass(frozen=True)
class Case:
    """One layout: mesh dimensions, the data-parallel wrapper, experts, declarations, the object
    passed to ``GradMonitor`` and the parameters' dtype."""

    dims: tuple[tuple[str, int], ...]
    dp: str = "none"  # "ddp", "fsdp", "hsdp" or "none"
    experts: str = ""  # "", "dtensor", "plain_fsdp", "plain_out_ddp", "plain_out_fsdp"
    declare: str = ""  # "", "tp", "self" (misdeclared), "distinct", "replicated", "both"
    passed: str = "wrapper"  # "wrapper" (PipelineStage, DDP) or "module" (the module it holds)
    dtype: str = "fp32"

    @property
    def world(self) -> int:
        return math.prod(n for _, n in self.dims)

    @property
    def name(self) -> str:
        mesh = "x".join(f"{k}{n}" for k, n in self.dims)
        parts = [
            mesh,
            self.dp,
            self.experts,
            f"decl-{self.declare}" if self.declare else "",
            self.passed,
            self.dtype,
        ]
        return "/".join(p for p in parts if p and p != "none")


def _topologies() -> list[tuple[tuple[tuple[str, int], ...], dict[str, tuple]]]:
    """Each mesh and the choices that make a buildable layout on it."""
    both = ("wrapper", "module")
    return [
        ((("pp", 2),), {"passed": both}),
        ((("dp", 4),), {"dp": ("ddp",), "passed": both}),
        ((("dp", 4),), {"dp": ("fsdp",)}),
        ((("dp", 4),), {"dp": ("none",), "passed": ("module",)}),  # a plain module on 4 ranks
        ((("dp_replicate", 2), ("dp_shard", 2)), {"dp": ("hsdp",)}),
        ((("dp", 2), ("tp", 2)), {"dp": ("ddp",), "declare": ("", "tp"), "passed": both}),
        ((("dp", 2), ("tp", 2)), {"dp": ("fsdp",), "declare": ("", "tp")}),
        ((("tp", 4),), {"declare": ("", "tp", "self")}),
        ((("pp", 2), ("dp", 2)), {"dp": ("ddp", "fsdp"), "passed": both}),
        ((("pp", 1), ("dp", 4)), {"dp": ("ddp", "fsdp"), "passed": both}),  # one stage
        ((("pp", 2), ("tp", 2)), {"declare": ("", "tp"), "passed": both}),
        (
            (("edp", 2), ("ep", EP)),
            {
                "experts": ("dtensor", "plain_fsdp", "plain_out_ddp", "plain_out_fsdp"),
                "declare": ("", "distinct", "replicated", "both"),
            },
        ),
        ((("pp", 2), ("dp", 2), ("tp", 2)), {"dp": ("fsdp",), "passed": both}),
        ((("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)), {"dp": ("hsdp",)}),
        ((("pp", 2), ("dp", 4)), {"dp": ("ddp",), "passed": ("module",)}),
        ((("edp", 4), ("ep", EP)), {"experts": ("plain_fsdp",), "declare": ("", "distinct")}),
    ]


def all_cases() -> list[Case]:
    """Every buildable combination, in a fixed order."""
    out = []
    for dims, choices in _topologies():
        keys = list(choices) + ["dtype"]
        for values in itertools.product(*(choices[k] for k in choices), ("fp32", "bf16")):
            out.append(Case(dims=dims, **dict(zip(keys, values))))
    return out


# The three layouts of #27 that users met wrong or refused, and the refusal that must stay.
MUST_BE_EXACT = (
    Case((("pp", 2), ("dp", 2)), dp="ddp", passed="module"),  # a stage's DDP module, not its PipelineStage
    Case((("pp", 2), ("dp", 2)), dp="fsdp", passed="module"),  # FSDP2 inside the stage, its module passed
    Case((("pp", 2),), passed="module"),  # a plain stage module, 2 stages
    Case((("edp", 2), ("ep", EP)), experts="plain_fsdp", declare="distinct"),  # plain per-rank experts
    Case((("edp", 2), ("ep", EP)), experts="plain_out_ddp", declare="replicated"),
)
MUST_BE_REFUSED = (
    Case((("edp", 2), ("ep", EP)), experts="plain_fsdp"),  # undeclared: names the parameters and the option
    Case((("edp", 2), ("ep", EP)), experts="plain_out_fsdp"),
)


def cases(per_world: dict[int, int], seed: int = 27) -> dict[int, list[Case]]:
    """A sample of the space: ``per_world[w]`` cases on ``w`` ranks, the named ones always in."""
    rng = random.Random(seed)
    every = all_cases()
    out: dict[int, list[Case]] = {}
    for world, n in per_world.items():
        pool = [c for c in every if c.world == world]
        must = [c for c in MUST_BE_EXACT + MUST_BE_REFUSED if c.world == world]
        rest = [c for c in pool if c not in must]
        out[world] = must + rng.sample(rest, max(0, min(n - len(must), len(rest))))
    return out


# -- one case on one rank ------------------------------------------------------------------------


class SpaceBuilt:
    """One rank's model laid out as ``case`` says, its optimizer, its training step, its reference."""

    def __init__(self, case: Case) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.case = case
        names = tuple(k for k, _ in case.dims)
        self.mesh = init_device_mesh("cpu", tuple(n for _, n in case.dims), mesh_dim_names=names)
        self.coord = dict(zip(names, self.mesh.get_coordinate()))
        self.stage = self.coord.get("pp")
        self.tp = self.coord.get("tp")
        self.dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
        # the data-parallel index: ranks that see different batches (tensor-parallel ranks see one)
        dp_dims = [k for k in names if k not in ("pp", "tp")]
        self.dp = 0
        for k in dp_dims:
            self.dp = self.dp * dict(case.dims)[k] + self.coord[k]
        torch.manual_seed(0)
        full = (MoEGPT() if case.experts else GPT(**MODEL)).to(self.dtype)
        self.stages = dict(case.dims).get("pp", 0)
        self.module = make_stage(full, self.stage) if self.stages > 1 else full
        self.groups: dict[str, dist.ProcessGroup] = {}
        if case.experts:
            self._experts()
        else:
            self._dense()
        # taken now: torch's TP support in DDP drops tensor-parallel parameters from
        # named_parameters() after the first forward
        self.named = list(self.module.named_parameters())
        self.opt = torch.optim.SGD(self.trained.parameters(), lr=0.2)
        self.schedule = self._schedule() if self.stage is not None else None

    def _dense(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        case, dims = self.case, dict(self.case.dims)
        if self.tp is not None:
            for block in self.module.blocks.values():
                parallelize_module(
                    block, self.mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
                )
            self.groups["tp"] = self.mesh["tp"].get_group()
        dp_mesh = (
            self.mesh["dp"]
            if "dp" in dims
            else (self.mesh["dp_replicate", "dp_shard"] if "dp_shard" in dims else None)
        )
        self.trained = self.wrapped = self.module
        if case.dp in ("fsdp", "hsdp"):
            for block in self.module.blocks.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.module, mesh=dp_mesh)
        elif case.dp == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.wrapped = self.trained = DDP(self.module, device_mesh=dp_mesh)
        if case.declare == "self":
            alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self.groups["self"] = alone[dist.get_rank()]

    def _experts(self) -> None:
        """Experts split over ``ep`` (this rank's share of the same seeded experts), the dense
        layers data-parallel over every rank."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        case, world = self.case, dist.get_world_size()
        edp_name = case.dims[0][0]
        self.ep = self.coord["ep"]
        self.ep_peers = self.mesh["ep"].mesh.tolist()
        self.groups = {"ep": self.mesh["ep"].get_group(), "edp": self.mesh[edp_name].get_group()}
        moe = self.module.moe
        moe.group = self.groups["ep"]
        for name in EXPERT_WEIGHTS:
            w = getattr(moe.experts, name).detach()
            if case.experts == "dtensor":
                shard = distribute_tensor(w, self.mesh["ep"], [Shard(0)])
            else:  # each ep rank holds different experts under the same names
                shard = w.chunk(dict(case.dims)["ep"])[self.ep].clone()
            setattr(moe.experts, name, nn.Parameter(shard))
        self.trained = self.wrapped = self.module
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        experts = set(moe.experts.parameters())
        if case.experts in ("dtensor", "plain_fsdp"):
            fully_shard(moe.experts, mesh=self.mesh[edp_name])
            for block in self.module.blocks.values():
                fully_shard(block, mesh=dense)
            fully_shard(self.module, mesh=dense)
        elif case.experts == "plain_out_fsdp":
            for block in self.module.blocks.values():
                fully_shard(block, mesh=dense)
            fully_shard(self.module, mesh=dense, ignored_params=experts)
        else:  # plain_out_ddp: DDP leaves the experts to the model's own code
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module._ddp_params_and_buffers_to_ignore = [f"moe.experts.{n}" for n in EXPERT_WEIGHTS]
            self.wrapped = self.trained = DDP(self.module, device_mesh=dense)

    def _schedule(self) -> object:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        group = self.mesh["pp"].get_group()
        self.pipe = PipelineStage(self.wrapped, self.stage, self.stages, torch.device("cpu"), group=group)
        # torch's DDP inside a stage takes one micro-batch (it asserts with more)
        return ScheduleGPipe(self.pipe, n_microbatches=1 if self.case.dp == "ddp" else 2, loss_fn=lm_loss)

    @property
    def monitored(self) -> object:
        """What the user hands GradMonitor."""
        if self.stage is not None:
            return self.pipe if self.case.passed == "wrapper" else self.wrapped
        if self.case.passed == "module" and self.wrapped is not self.module:
            return self.module  # DDP's .module
        return self.wrapped

    def options(self) -> dict:
        declare, g = self.case.declare, self.groups
        if not declare:
            return {}
        if declare in ("tp", "self"):
            return {"replicated_over": {TP_PLAIN: g[declare]}}
        out = {}
        if declare in ("distinct", "both"):
            out["distinct_over"] = {EXPERTS: g["ep"]}
        if declare in ("replicated", "both"):
            out["replicated_over"] = {EXPERTS: g["edp"]}
        return out

    def train_step(self, step: int) -> float | None:
        x, y = make_batch(self.dp, step, batch=BATCH, vocab=VOCAB)
        if self.schedule is None:
            loss = lm_loss(self.wrapped(x), y)
            loss.backward()
            value = float(loss.detach())
        else:
            losses: list[torch.Tensor] = []
            if self.stages == 1:
                self.schedule.step(x, target=y, losses=losses)
            elif self.stage == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses)
            value = float(sum(loss.detach() for loss in losses)) if losses else None
        if self.case.experts.startswith("plain_out"):  # the model's own reduction of the experts
            for p in self.module.moe.experts.parameters():
                dist.all_reduce(p.grad, group=self.groups["edp"])
                p.grad /= dist.get_world_size()
        return value

    def reference(self) -> dict[tuple[str, str], float]:
        """Per parameter this rank holds: (name, hash of its whole gradient's bits) -> float64 sum
        of squares. Copies hash alike; merged over the ranks, each distinct value counts once."""
        out = {}
        for name, p in self.named:
            g = full_grad(p)
            if g is None:
                continue
            key = hashlib.sha1(bytes(g.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest()
            out[(name, key)] = float(g.pow(2).sum())
        return out

    def local_params(self) -> list[torch.Tensor]:
        return [getattr(p, "_local_tensor", p).detach().clone() for _, p in self.named]


def _train(case: Case, log: str | None) -> dict:
    """STEPS steps, with distmon when ``log`` is given (its JSONL path on this rank)."""
    import distmon

    built = SpaceBuilt(case)
    out: dict = {"losses": [], "ref": []}
    mon = None
    if log is not None:
        try:
            mon = distmon.GradMonitor(
                built.monitored, built.opt, log_path=log, **MONITORED, **built.options()
            )
        except Exception as e:  # refused at construction: on every rank alike
            return {"refused": f"{type(e).__name__}: {e}"}
    for step in range(1, STEPS + 1):
        out["losses"].append(built.train_step(step))
        if mon is not None:
            out["ref"].append(built.reference())
        built.opt.step()
        built.opt.zero_grad()
    out["params"] = built.local_params()
    if mon is not None:
        mon.flush()
        out["misread"] = mon._schedule.misread
        mon.close()
    return out


def space_job(rank: int, world: int, todo: list[Case], log_dir: str, sabotage: bool = False) -> dict:
    """Every case in turn on this rank (one spawn, many cases). ``sabotage``: break distmon's
    reading of the layout on purpose (no ruling of the job's reading, a first-step check that
    always agrees), to show that the property catches a wrong figure served as valid."""
    import json

    if sabotage:
        import distmon.layout.census
        import distmon.step.schedule

        distmon.layout.census.rule = lambda records: [(0, -1, 2)] * len(records)
        distmon.step.schedule.agrees = lambda read, direct: True
    results = {}
    for case in todo:
        log = os.path.join(log_dir, f"{case.name.replace('/', '_')}.rank{rank}.jsonl")
        mon = _train(case, log)
        if "refused" not in mon:
            bare = _train(case, None)
            mon["same"] = bare["losses"] == mon["losses"] and all(
                torch.equal(a, b) for a, b in zip(bare["params"], mon.pop("params"))
            )
            mon["wrote"] = os.path.exists(log)
            if rank == 0 and mon["wrote"]:
                with open(log) as f:
                    mon["snaps"] = [json.loads(line) for line in f]
        results[case.name] = mon
        dist.barrier()
    return results


# -- the property ------------------------------------------------------------------------------


def judge_case(case: Case, outs: list[dict]) -> tuple[str, str]:
    """(outcome, detail): "exact", "refused", "invalid" or "VIOLATION" (with what broke it)."""
    refusals = [o.get("refused") for o in outs]
    if any(refusals):
        if not all(refusals) or len(set(refusals)) != 1:
            return "VIOLATION", f"refused on some ranks only, or differently: {refusals}"
        if not any(fix in refusals[0] for fix in FIXES):
            return "VIOLATION", f"refused without naming the fix: {refusals[0]}"
        return "refused", refusals[0]
    if not all(o["same"] for o in outs):
        return "VIOLATION", "training differs from the same run without distmon"
    if [o["wrote"] for o in outs] != [True] + [False] * (len(outs) - 1):
        return "VIOLATION", f"log writers: ranks {[r for r, o in enumerate(outs) if o['wrote']]}"
    snaps = outs[0]["snaps"]
    if [s["step"] for s in snaps] != list(range(1, STEPS + 1)) or any(
        s["world_size"] != case.world for s in snaps
    ):
        return (
            "VIOLATION",
            f"steps {[s['step'] for s in snaps]}, world sizes {[s['world_size'] for s in snaps]}",
        )
    valid = [s["valid"] for s in snaps]
    if not any(valid):
        reason = outs[0]["misread"] or ""
        if all(o["misread"] == reason for o in outs) and any(fix in reason for fix in FIXES):
            return "invalid", reason
        return "VIOLATION", f"invalid without a message naming the fix: {reason!r}"
    worst = 0.0
    for step, snap in enumerate(snaps, 1):
        merged: dict[tuple[str, str], float] = {}
        for o in outs:
            merged.update(o["ref"][step - 1])
        layers: dict[str, float] = {}
        for (name, _), sq in merged.items():
            layers[layer_of(name)] = layers.get(layer_of(name), 0.0) + sq
        want = math.sqrt(sum(layers.values()))
        if not snap["valid"]:
            return "VIOLATION", f"step {step} invalid after valid ones"
        pairs = [("global", snap["grad_norm"], want)]
        pairs += [(k, snap["layer_grad_norms"].get(k), math.sqrt(v)) for k, v in layers.items()]
        if set(snap["layer_grad_norms"]) != set(layers):
            return "VIOLATION", f"layers {sorted(snap['layer_grad_norms'])} != {sorted(layers)}"
        for what, got, ref in pairs:
            if not close(got, ref, REL):
                return "VIOLATION", f"valid and wrong: step {step} {what} {got} vs {ref}"
            worst = max(worst, rel_err(got, ref))
    return "exact", f"within {worst:.1e}"


def table(rows: list[tuple[Case, str, str]]) -> str:
    """The outcome table, one line per case, and the count of each outcome."""
    width = max(len(c.name) for c, _, _ in rows)
    lines = [f"{'ranks':>5}  {'layout'.ljust(width)}  outcome    detail"]
    for case, outcome, detail in sorted(rows, key=lambda row: (row[0].world, row[0].name)):
        lines.append(f"{case.world:>5}  {case.name.ljust(width)}  {outcome.ljust(9)}  {detail[:100]}")
    tally = {k: sum(1 for _, o, _ in rows if o == k) for k in ("exact", "refused", "invalid", "VIOLATION")}
    lines.append(", ".join(f"{k}: {v}" for k, v in tally.items()) + f" (of {len(rows)})")
    return "\n".join(lines)
