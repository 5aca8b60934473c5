#!/usr/bin/env python3
"""What does distmon cost an FSDP2 training step? Bare FSDP2 against FSDP2 + distmon, interleaved.

Run it (it starts ``torchrun`` itself when not already under it)::

    python benchmarks/fsdp_overhead.py                  # 1M and 5M, 2 ranks, 30 rounds
    python benchmarks/fsdp_overhead.py --sizes 1M --rounds 6   # a quick look
    python benchmarks/fsdp_overhead.py --layout tp-fsdp  # TP + FSDP2, (dp=2, tp=2) mesh, 4 ranks

The models are ``benchmarks/overhead.py``'s GPT sizes (``overheadbench.sizes``), each block a
``fully_shard`` unit and the root another. With ``--layout tp-fsdp`` the ranks form a 2-D
``("dp", "tp")`` device mesh with tp = 2: each block's MLP is tensor-parallel on the tp
sub-mesh (``fc1`` ``ColwiseParallel``, ``fc2`` ``RowwiseParallel``) and ``fully_shard`` shards
over the dp sub-mesh; the two ranks of a tp pair train on the same batch. The attention stays
unsplit over tp: its fused ``qkv`` projection is cut into q, k, v after the matmul, so a
column split over tp would hand a rank parts of q and k instead of whole heads.

Two copies of the same seeded model, one bare and one with
``distmon.GradMonitor(model, opt, serve="none")`` (defaults), train on the same batch: every
round runs one step of each, in a balanced order (ABBA), after a barrier; a step's time is the
slowest rank's. Reported: the median of the per-round ratios (distmon / bare) with its 95%
bootstrap interval, the median extra milliseconds, and the extra time in *gradient passes*:
units of one fused read (``torch._foreach_norm``) of a full-size copy of the gradients distmon
reads on the local side (the reduce-scatter input: each parameter unsharded over dp, its tp
shard under TP), timed alone on each rank. After the timed rounds one more step of the
monitored copy checks distmon's figures: its snapshot must be valid on every rank and its
``grad_norm`` match the norm of the gathered gradients (``full_tensor``); the script exits 1
when they do not.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from overheadbench.paths import use_checkout
from overheadbench.runner import leave, round_order
from overheadbench.sizes import SIZES
from overheadbench.stats import paired_ratio

use_checkout()  # this checkout's distmon and launch/model.py

TP = 2  # the tp dimension of --layout tp-fsdp
LAYOUTS = {"fsdp": ("FSDP2", 2), "tp-fsdp": ("TP + FSDP2", 2 * TP)}  # name -> (title, default ranks)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = [s for s in SIZES if s != "2k-tensors"]
    p.add_argument("--sizes", nargs="+", default=["1M", "5M"], choices=sizes)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per size (after 3 warm-up rounds)")
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp", help="fsdp: FSDP2; tp-fsdp: TP + FSDP2")
    p.add_argument(
        "--ranks", type=int, help="ranks when this script starts torchrun itself (default 2 fsdp, 4 tp-fsdp)"
    )
    args = p.parse_args(argv)
    if args.ranks is None:
        args.ranks = LAYOUTS[args.layout][1]
    if args.layout == "tp-fsdp" and args.ranks % TP:
        p.error(f"--layout tp-fsdp needs a multiple of {TP} ranks (tp = {TP}), got --ranks {args.ranks}")
    return args


def _mesh(layout: str, world: int):  # noqa: ANN202
    """The device mesh: ("dp",) for FSDP2, ("dp", "tp") with tp = TP for TP + FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))


def _parallelize(model, mesh) -> None:  # noqa: ANN001
    """Tensor-parallel MLPs on the mesh's tp dimension (when it has one), then FSDP2 over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        if "tp" in mesh.mesh_dim_names:
            parallelize_module(block.mlp, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def _build(size: str, mesh) -> tuple[list, int, int]:  # noqa: ANN001
    import torch
    from model import GPT, GPTConfig  # launch/model.py

    import distmon

    shape = dict(SIZES[size])
    batch = shape.pop("batch")
    torch.manual_seed(1234)
    base = GPT(GPTConfig(**shape))
    copies = []
    for monitored in (False, True):
        model = copy.deepcopy(base)
        _parallelize(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mon = distmon.GradMonitor(model, opt, serve="none") if monitored else None
        copies.append((model, opt, mon))
    return copies, batch, shape["seq_len"]


def _local_numel(p) -> int:  # noqa: ANN001
    """Elements of ``p``'s gradient in this rank's reduce-scatter input: unsharded over dp, split
    over every other mesh dimension that shards it (tp)."""
    mesh = p.device_mesh
    split = math.prod(
        mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard() and mesh.mesh_dim_names[i] != "dp"
    )
    return p.numel() // split


def _floor_ms(model, reps: int = 20) -> float:  # noqa: ANN001
    """One fused read of a full-size copy of the local gradients, timed alone (median, ms)."""
    import torch

    full = [torch.randn(_local_numel(p)) for p in model.parameters()]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch._foreach_norm(full)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _step(model, opt, x, y) -> float:  # noqa: ANN001
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def _check(model, opt, mon, x, y) -> tuple[bool, float]:  # noqa: ANN001
    """One more step of the monitored copy: (its snapshot valid on every rank, relative error of
    distmon's grad_norm against the norm of the gathered gradients)."""
    _, loss = model(x, y)
    loss.backward()
    ref = math.sqrt(sum(float(p.grad.full_tensor().double().pow(2).sum()) for p in model.parameters()))
    opt.step()
    opt.zero_grad(set_to_none=True)
    snap = mon.flush()
    valid = snap is not None and snap.valid and all(snap.rank_valid) and snap.monitor_errors == 0
    return valid, abs(snap.grad_norm - ref) / ref if snap is not None else math.nan


@dataclass
class Row:
    """One size's figures (times in ms, over the timed rounds; see the module docstring)."""

    size: str
    params: int
    tokens: int  # per dp rank per step
    bare_ms: float
    ratio: float
    ratio_lo: float
    ratio_hi: float
    extra_ms: float
    floor_ms: float
    valid: bool  # distmon's snapshot of the check step was valid on every rank
    norm_err: float  # its grad_norm against the gathered gradients' norm, relative

    @property
    def ok(self) -> bool:
        return self.valid and self.norm_err < 1e-4

    def markdown(self) -> str:
        figures = f"{'valid' if self.valid else 'INVALID'} ({self.norm_err:.1e})"
        return (
            f"| {self.size} | {self.params / 1e6:.2f}M | {self.tokens} | {self.bare_ms:.1f} | "
            f"{self.ratio:.3f} | {self.ratio_lo:.3f}-{self.ratio_hi:.3f} | {self.extra_ms:.1f} | "
            f"{self.floor_ms:.2f} | {self.extra_ms / self.floor_ms:.1f} | {figures} |"
        )


def _time_size(size: str, mesh, rounds: int) -> Row:  # noqa: ANN001
    """``rounds`` interleaved rounds (after 3 warm-up rounds) of ``size``, then the check step."""
    import torch
    import torch.distributed as dist

    copies, batch, seq = _build(size, mesh)
    vocab = SIZES[size]["vocab"]
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # a tp pair shares its batch

    def data() -> tuple:
        return tuple(torch.randint(0, vocab, (batch, seq), generator=g) for _ in "xy")

    per_round = []
    for r in range(rounds + 3):
        x, y = data()
        order = [copies[i] for i in round_order(r, len(copies))]
        times = {id(c): _step(c[0], c[1], x, y) for c in order}
        t = torch.tensor([times[id(c)] for c in copies])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        if r >= 3:
            per_round.append(t.tolist())
    valid, err = _check(*copies[1], *data())
    copies[1][2].close()
    floor = torch.tensor([_floor_ms(copies[0][0])])
    dist.all_reduce(floor, op=dist.ReduceOp.MAX)
    bare, monitored = [t[0] * 1e3 for t in per_round], [t[1] * 1e3 for t in per_round]
    return Row(
        size,
        sum(p.numel() for p in copies[0][0].parameters()),
        batch * seq,
        statistics.median(bare),
        *paired_ratio(monitored, bare),
        statistics.median(m - b for m, b in zip(monitored, bare)),
        float(floor),
        valid,
        err,
    )


def run(args: argparse.Namespace) -> bool:
    """Time every size on this rank; rank 0 prints the table. True when distmon's figures were valid."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = _mesh(args.layout, world)
    rows = [_time_size(size, mesh, args.rounds) for size in args.sizes]
    title = LAYOUTS[args.layout][0]
    if rank == 0:
        shape = " x ".join(f"{n}={mesh.size(i)}" for i, n in enumerate(mesh.mesh_dim_names))
        print(
            f"{title}, {world} gloo ranks (mesh {shape}), torch {torch.__version__}, {args.rounds} "
            f"interleaved rounds (medians; a step's time is the slowest rank's)\n"
        )
        print(
            f"| model | params | tokens/dp rank | bare {title} step ms | distmon ratio | 95% CI | extra ms "
            "| floor ms | extra passes | distmon figures (grad_norm rel. err.) |"
        )
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|---|")
        for row in rows:
            print(row.markdown())
    return all(row.ok for row in rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:  # a plain script: become torchrun
        ranks = f"--nproc-per-node={args.ranks}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", ranks]
        rest = argv if argv is not None else sys.argv[1:]
        return subprocess.call([*cmd, os.path.abspath(__file__), *rest])
    leave(0 if run(args) else 1)


if __name__ == "__main__":
    sys.exit(main())
