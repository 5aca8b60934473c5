"""The measurement: every approach's DDP copy, stepped round by round on the same batches."""

import argparse
import copy
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .approaches import APPROACHES, Approach, Distmon, Lightning
from .distmon_internals import exports_next_step
from .fmt import fmt_bytes
from .measure import Profiling, cpu_s, median, now_s
from .memory import mem_available, release_host_memory, tensor_bytes
from .profiling import profile_breakdown
from .results import CopySamples, Health, ProfileBreakdown, RankSamples, SizeInfo, SizeRun, StepMemory
from .sizes import SIZES, timed_rounds


def leave(code: int) -> NoReturn:
    """End a benchmark rank: destroy the process group, flush, exit with ``code``, skipping
    interpreter finalization.

    A gloo worker thread can still be releasing a finished collective when the interpreter
    finalizes; releasing a tensor Python has dropped needs the GIL, and a thread that asks for
    it then is ``pthread_exit``-ed inside C++ code: SIGABRT, "terminate called without an
    active exception" (torch 2.13; pytorch/pytorch#190489). ``fsdp_overhead.py`` ended that way
    in 3 of 47 runs. Everything a rank reports is printed or written before this. The tests'
    ranks leave the same way (``tests/ddp_harness.py``, ``leave``).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def round_order(r: int, k: int) -> list[int]:
    """The order in which round ``r`` steps the ``k`` copies.

    Rounds come in pairs, an order and its reverse, each pair rotated one further: over any
    ``2 k`` rounds every copy runs in every position equally often, and any two copies swap
    places every round pair. A copy that always ran second (after another copy's step freed
    its gradients and the floor read) would carry that position's cost into its ratio.

    Example:
        >>> [round_order(r, 2) for r in range(4)]
        [[0, 1], [1, 0], [1, 0], [0, 1]]
    """
    shift = (r // 2) % k
    order = list(range(shift, k)) + list(range(shift))
    return order[::-1] if r % 2 else order


@dataclass
class Copy:
    """One approach's DDP copy of the model, its optimizer and what this rank measured of it."""

    approach: Approach
    ddp: Any
    opt: Any
    samples: CopySamples = field(default_factory=CopySamples)


class Bench:
    """One rank of the benchmark: the process group, and ``run_size`` for each model size."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu
        if self.cuda:
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = backend

    # -- small utilities -------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def bcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    # -- one size ------------------------------------------------------------------------
    def build(self, size: str) -> tuple[list[Copy], SizeInfo]:
        import torch
        from model import GPT, GPTConfig  # launch/model.py
        from torch.nn.parallel import DistributedDataParallel as DDP

        shape = dict(SIZES[size])
        batch = shape.pop("batch")
        cfg = GPTConfig(**shape)
        torch.manual_seed(1234)
        base = GPT(cfg)
        n_params = sum(p.numel() for p in base.parameters())
        names = [n for n, p in base.named_parameters() if p.requires_grad]
        kinds = [a for a in APPROACHES if a.name in self.args.approaches]
        # memory per copy and rank: parameters, DDP's bucket buffers, 2 AdamW states; gradients live
        # only during a copy's own step (zero_grad(set_to_none=True) right after it)
        if self.cuda:  # per GPU, one rank each
            need, avail = 4 * n_params * 4 * len(kinds), torch.cuda.mem_get_info(self.device)[0]
        else:  # host memory, all ranks of this machine
            need = 4 * n_params * 4 * len(kinds) * int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            avail = mem_available()
        short = self.bcast(bool(avail and need > 0.9 * avail))
        if short:
            raise MemoryError(
                f"{size}: {len(kinds)} copies on {self.world} ranks need ~{fmt_bytes(need)}, "
                f"only {fmt_bytes(avail)} available: skipped"
            )
        bucket_view = self.args.bucket_view
        copies = []
        for kind in kinds:
            module = copy.deepcopy(base).to(self.device)
            ddp = DDP(
                module,
                device_ids=[self.local_rank] if self.cuda else None,
                gradient_as_bucket_view=bucket_view,
            )
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01)
            ap = kind(self.args)
            ap.attach(ddp, opt, names)
            copies.append(Copy(ap, ddp, opt))
        del base
        info = SizeInfo(
            size=size,
            n_params=n_params,
            n_tensors=len(names),
            batch=batch,
            seq_len=cfg.seq_len,
            tokens_per_rank=batch * cfg.seq_len,
            grad_bytes=n_params * 4,
            gpt=shape,
            gradient_as_bucket_view=bucket_view,
            optimizer="AdamW (foreach)",
            bucket_view_reason="--bucket-view",
        )
        for c in copies:
            if isinstance(c.approach, Distmon):
                info.layers[c.approach.name] = c.approach.n_layers
                if c.approach.uninstrumented:
                    info.uninstrumented = c.approach.uninstrumented
            if isinstance(c.approach, Lightning):
                info.lightning = c.approach.source
        return copies, info

    def batch(self, size: str, step: int) -> tuple:
        import torch

        s = SIZES[size]
        g = torch.Generator().manual_seed(10_000 * step + self.rank)
        x = torch.randint(0, s["vocab"], (s["batch"], s["seq_len"] + 1), generator=g)
        return x[:, :-1].to(self.device), x[:, 1:].to(self.device)

    def step(self, c: Copy, x, y, keep_grads: bool = False) -> tuple[float, float]:  # noqa: ANN001
        """One timed training step of copy ``c``: (wall seconds, CPU seconds of all this rank's threads).

        Gradients are freed right after the step (outside the timed region) unless ``keep_grads``,
        so only one copy's gradients exist at a time.
        """
        import torch.distributed as dist

        c.opt.zero_grad(set_to_none=True)
        c.approach.timer.take()
        dist.barrier()
        self.sync()
        t0, c0 = now_s(), time.process_time()
        self.loss(c, x, y).backward()
        c.approach.after_backward()
        c.opt.step()
        self.sync()
        wall, cpu = now_s() - t0, time.process_time() - c0
        if not keep_grads:
            c.opt.zero_grad(set_to_none=True)
        return wall, cpu

    def loss(self, c: Copy, x, y):  # noqa: ANN001, ANN201
        """Copy ``c``'s forward and loss on the batch, under bf16 autocast with ``--amp bf16``."""
        import torch

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.amp == "bf16"):
            return c.ddp(x, y)[1]

    def floor(self, c: Copy) -> tuple[float, float]:
        """One fused read of every gradient byte (the baseline's, after its step): (wall s, CPU s)."""
        import torch

        grads = [p.grad for p in c.approach.params if p.grad is not None]
        self.sync()
        t0, c0 = now_s(), cpu_s()
        torch._foreach_norm(grads)
        self.sync()
        return now_s() - t0, cpu_s() - c0

    def run_size(self, size: str, budget_s: float) -> SizeRun:
        """Build every approach's copy of ``size``, warm up, time the rounds, measure: all ranks' samples."""
        import torch

        copies, info = self.build(size)
        k = len(copies)
        self.log(
            f"\n== {size}: {info.n_params / 1e6:.2f}M parameters in {info.n_tensors} tensors, "
            f"{info.tokens_per_rank} tokens/rank/step, {k} DDP copies"
            f"{', gradient_as_bucket_view=True' if info.gradient_as_bucket_view else ''}"
        )
        step_no = 0

        def round_(order: list[int], record: bool, floors: list | None = None, mem: bool = False) -> None:
            nonlocal step_no
            step_no += 1
            x, y = self.batch(size, step_no)
            for pos, i in enumerate(order):
                c = copies[i]
                if mem:
                    c.samples.mem = self.step_memory(c, x, y)
                    continue
                base = c.approach.name == "baseline"
                dt, dc = self.step(c, x, y, keep_grads=floors is not None and base)
                selfs = c.approach.timer.take()
                if record:
                    c.samples.times.append(dt)
                    c.samples.cpus.append(dc)
                    c.samples.selfs.append(selfs)
                    c.samples.positions.append(pos)
                if floors is not None and base:
                    floors.append(self.floor(c))
                    c.opt.zero_grad(set_to_none=True)

        t_start = now_s()
        # warm-up: DDP rebuilds its buckets after the first iteration, distmon builds layouts
        for _ in range(self.args.warmup):
            round_(list(range(k)), record=False)
        # memory: one step of every copy, measured (not timed)
        round_(list(range(k)), record=False, mem=True)
        floors: list[tuple[float, float]] = []
        t0 = now_s()
        round_(list(range(k)), record=True, floors=floors)
        round_s = now_s() - t0
        n_rounds = self.bcast(
            timed_rounds(size, budget_s, round_s, self.args.budget_scale, fixed=self.args.rounds)
        )
        self.log(f"   one round of {k} steps: {round_s:.1f} s; timing {n_rounds} rounds")
        for r in range(1, n_rounds):
            round_(round_order(r, k), record=True, floors=floors)
            if self.rank == 0 and (r + 1) % max(1, n_rounds // 5) == 0:
                print(f"   round {r + 1}/{n_rounds} ({now_s() - t_start:.0f} s)", flush=True)

        health = self.health(copies)
        for c in copies:
            c.approach.sample_periodic()
            c.samples.periodic = c.approach.periodic()
        profile = self.profile(size, copies, median(copies[0].samples.times)) if self.args.profile else None
        syncs = self.sync_debug(size, copies) if self.cuda else None
        model_ptrs = set()
        for c in copies:
            for p in c.ddp.module.parameters():
                model_ptrs.add(p.untyped_storage().data_ptr())
                if p.grad is not None:
                    model_ptrs.add(p.grad.untyped_storage().data_ptr())
        for c in copies:
            c.samples.persistent = tensor_bytes(c.approach.state(), model_ptrs)

        # gather every rank's numbers; a step's time is the slowest rank's
        mine = RankSamples(copies={c.approach.name: c.samples for c in copies}, floors=floors, health=health)
        allr = self.gather(mine)
        for c in copies:
            c.approach.close()
        copies.clear()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        release_host_memory()
        wall = now_s() - t_start
        return SizeRun(info=info, ranks=allr, rounds=n_rounds, wall_s=wall, profile=profile, sync_debug=syncs)

    # -- does it measure the right thing? -----------------------------------------------------
    def health(self, copies: list[Copy]) -> dict[str, Health]:
        """After the timed rounds every copy has taken the same steps on the same data, so distmon's
        latest global norm must equal the hand-written one's (an independent computation)."""
        out = {c.approach.name: c.approach.health(self.world) for c in copies}
        return {name: h for name, h in out.items() if h is not None}

    # -- memory ----------------------------------------------------------------------------
    def step_memory(self, c: Copy, x, y) -> StepMemory:  # noqa: ANN001
        """Peak memory of one step above the memory in use when it starts."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            self.step(c, x, y)
            return StepMemory(
                peak=torch.cuda.max_memory_allocated() - start, method="torch.cuda.max_memory_allocated"
            )
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(c, x, y)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        mem = sorted(
            (
                e
                for e in events
                if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0
            ),
            key=lambda e: e["ts"],
        )
        # the allocator's running total is not reset between profiler sessions: measure from
        # the value just before the step's first allocation
        start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"] if mem else 0
        return StepMemory(
            peak=max(e["args"]["Total Allocated"] for e in mem) - start if mem else 0,
            method="torch.profiler(profile_memory=True): peak of CPU bytes allocated during the step",
        )

    # -- profile -------------------------------------------------------------------------
    def profile(self, size: str, copies: list[Copy], step_s: float) -> dict[str, ProfileBreakdown]:
        """torch.profiler breakdown of distmon's time (its instrumented sites and their ops)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        out = {}
        # a few steps (~5 s), 2..4: the profiler keeps every op event in memory (a step of the
        # 2,000-tensor model alone has ~50k of them)
        n_steps = self.args.profile_steps or self.bcast(max(2, min(4, int(5.0 / max(step_s, 1e-3)))))
        for c in copies:
            if not isinstance(c.approach, Distmon):
                continue
            steps = []
            Profiling.on = True
            try:
                with profile(activities=acts) as prof:
                    for s in range(n_steps):
                        x, y = self.batch(size, 10_000 + s)
                        with torch.profiler.record_function("bench::step"):
                            steps.append(self.step(c, x, y)[0])
            finally:
                Profiling.on = False
            breakdown = out[c.approach.name] = profile_breakdown(prof, n_steps)
            breakdown.steps = n_steps
            del prof
            gc.collect()
            breakdown.step_ms_profiled = 1e3 * median(steps)
        return out

    # -- GPU: no host sync on non-export steps ------------------------------------------------
    def sync_debug(self, size: str, copies: list[Copy]) -> dict[str, Any]:
        """Under ``torch.cuda.set_sync_debug_mode("error")``: no host sync on distmon's non-export
        steps (with a positive control: the check does catch one)."""
        import torch
        import torch.distributed as dist

        res: dict[str, Any] = {}
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ones(1, device=self.device).item()
            res["control (.item() raises)"] = "NOT caught: the check is blind"
        except RuntimeError:
            res["control (.item() raises)"] = "caught"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for c in copies:
            if c.approach.name not in ("baseline", "distmon", "distmon-detailed", "distmon-activations"):
                continue
            checked, failures = 0, []
            for s in range(12):
                x, y = self.batch(size, 20_000 + s)
                c.opt.zero_grad(set_to_none=True)
                dist.barrier()
                torch.cuda.synchronize()
                export = isinstance(c.approach, Distmon) and exports_next_step(c.approach.mon)
                if not export:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    self.loss(c, x, y).backward()
                    c.opt.step()
                    checked += 0 if export else 1
                except RuntimeError as e:  # a host sync (the model is unusable afterwards)
                    failures.append(str(e).splitlines()[0])
                    break
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            res[c.approach.name] = dict(non_export_steps_checked=checked, host_syncs=failures)
        return res
