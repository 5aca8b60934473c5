"""torch.profiler's events of a few distmon steps, folded into per-step ms per instrumented site."""

from typing import Any

from .results import ProfileBreakdown


def profile_breakdown(prof: Any, n_steps: int) -> ProfileBreakdown:
    """Per-step ms of each instrumented site, and self time of the ops under distmon's sites.

    Reads the profiler's raw (kineto) events and nests them per thread by time, instead of
    building torch's FunctionEvent tree (gigabytes for a few steps of a 2,000-tensor model).
    """
    events = prof.profiler.kineto_results.events()
    sites: dict[str, float] = {}
    counts: dict[str, int] = {}
    ops: dict[str, float] = {}
    top_ops: dict[str, int] = {}
    launches: dict[int, str] = {}  # CUDA runtime correlation id -> site
    gpu: list = []
    by_thread: dict[int, list] = {}
    for e in events:
        if str(e.device_type()).endswith("CPU"):
            by_thread.setdefault(e.start_thread_id(), []).append((e.start_ns(), -e.duration_ns(), e))
        else:
            gpu.append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda t: (t[0], t[1]))
        stack: list = []  # [end_ns, name, site, child_ns, dur_ns]

        def close(item: list) -> None:
            end, name, site, child, dur = item
            own = dur - child
            if name.startswith(("distmon::", "background::", "bench::")):
                if name.startswith("distmon::"):
                    ops[f"(python in {name})"] = ops.get(f"(python in {name})", 0.0) + own
            elif site:
                ops[name] = ops.get(name, 0.0) + own

        for start, neg, e in evs:
            while stack and stack[-1][0] <= start:
                close(stack.pop())
            dur = -neg
            name = e.name()
            parent_site = stack[-1][2] if stack else None
            if stack:
                stack[-1][3] += dur
                if stack[-1][1].startswith("distmon::"):  # an op called directly from distmon's Python
                    top_ops[stack[-1][1]] = top_ops.get(stack[-1][1], 0) + 1
            site = name if name.startswith("distmon::") else parent_site
            if name == "bench::step" or name.startswith(("distmon::", "background::")):
                sites[name] = sites.get(name, 0.0) + dur
                counts[name] = counts.get(name, 0) + 1
            if site and "LaunchKernel" in name:
                try:
                    launches[e.correlation_id()] = site
                except Exception:
                    pass
            stack.append([start + dur, name, site, 0, dur])
        while stack:
            close(stack.pop())
    device: dict[str, float] = {}
    for e in gpu:  # GPU kernels launched from inside a distmon site
        try:
            site = launches.get(e.linked_correlation_id())
        except Exception:
            site = None
        if site:
            device[site] = device.get(site, 0.0) + e.duration_ns()

    def per_step_ms(d: dict[str, float]) -> dict[str, float]:
        return {k: v / 1e6 / n_steps for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return ProfileBreakdown(
        sites_ms=per_step_ms(sites),
        device_ms=per_step_ms(device),
        calls_per_step={k: v / n_steps for k, v in counts.items()},
        ops_per_step={k: v / n_steps for k, v in top_ops.items()},
        distmon_ops_ms=dict(list(per_step_ms(ops).items())[:15]),
    )
