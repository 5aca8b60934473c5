"""From every rank's samples to one row per approach: medians, paired ratios, own code, memory."""

import math
import random
import statistics

from .measure import median
from .results import OrderEffect, RawTimes, Row, SizeResult, SizeRun


def paired_ratio(t: list[float], base: list[float], n_boot: int = 2000) -> tuple[float, float, float]:
    """Median of the per-round ratios ``t[i] / base[i]`` and its 95% bootstrap confidence interval.

    Each round times both copies back to back, so a ratio within a round cancels the machine's
    slow drifts (other jobs, thermal state) that make a ratio of whole-run medians wander.

    Example:
        >>> med, lo, hi = paired_ratio([1.02, 1.01, 1.03, 1.02], [1.0, 1.0, 1.0, 1.0])
        >>> round(med, 3), lo <= med <= hi
        (1.02, True)
    """
    ratios = [a / b for a, b in zip(t, base)]
    rng = random.Random(0)  # the same data gives the same interval
    meds = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(n_boot))
    return median(ratios), meds[int(0.025 * n_boot)], meds[int(0.975 * n_boot) - 1]


def quartiles(t: list[float], base: list[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles of the per-round ratios ``t[i] / base[i]`` (their spread).

    Example:
        >>> quartiles([1.0, 1.1, 1.2, 1.3, 1.4], [1.0] * 5)
        (1.1, 1.3)
    """
    ratios = sorted(a / b for a, b in zip(t, base))
    if len(ratios) < 2:
        return (ratios[0], ratios[0]) if ratios else (math.nan, math.nan)
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]


def order_effect(
    t: list[float], base: list[float], pos: list[int], base_pos: list[int]
) -> OrderEffect | None:
    """The paired median ratio of the rounds where the copy stepped after the baseline, and before it.

    With both orders equally often, a cost that belongs to a position in the round, not to the
    copy, shows as ``after / before`` far from 1, and cancels in the ratio over all rounds.
    None when the positions were not recorded.

    Example:
        >>> order_effect([1.1, 1.0], [1.0, 1.0], [1, 0], [0, 1])
        OrderEffect(paired_after=1.1, paired_before=1.0, n_after=1, n_before=1)
    """
    if not pos or len(pos) != len(t):
        return None
    after = [a / b for a, b, p, q in zip(t, base, pos, base_pos) if p > q]
    before = [a / b for a, b, p, q in zip(t, base, pos, base_pos) if p < q]
    return OrderEffect(
        paired_after=median(after) if after else math.nan,
        paired_before=median(before) if before else math.nan,
        n_after=len(after),
        n_before=len(before),
    )


def block_ratios(t: list[float], base: list[float], blocks: list[list[int]]) -> tuple[float, float, float]:
    """(ratio of medians, min and max of the same ratio within each block of rounds).

    Example:
        >>> block_ratios([2.0, 2.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0], [[0, 1], [2, 3]])
        (1.25, 1.0, 1.5)
    """
    per_block = [median([t[i] for i in b]) / median([base[i] for i in b]) for b in blocks if b]
    return median(t) / median(base), min(per_block), max(per_block)


# periodic site -> the site it runs nested in
PERIODIC = {
    "periodic::distmon::export": "distmon::after_step",
    "wall::periodic::distmon::export": "wall::distmon::after_step",
}


def unnest(sites: dict[str, float]) -> dict[str, float]:
    """One step's own-code sites without the periodic work (it is amortized separately).

    Example:
        >>> unnest({"distmon::after_step": 5.0, "periodic::distmon::export": 4.0})
        {'distmon::after_step': 1.0}
    """
    out = dict(sites)
    for site, parent in PERIODIC.items():
        if site in out:
            out[parent] = out.get(parent, 0.0) - out.pop(site)
    return out


def analyse(run: SizeRun, repeats: int) -> SizeResult:
    """Every rank's samples of one size, as one ``Row`` per approach against bare DDP."""
    ranks = run.ranks
    names = list(ranks[0].copies)
    n = len(ranks[0].copies["baseline"].times)
    # wall: the slowest rank's step; CPU: mean over ranks (CPU seconds of all of a rank's threads)
    wall = {a: [max(r.copies[a].times[i] for r in ranks) for i in range(n)] for a in names}
    cpu = {a: [statistics.mean(r.copies[a].cpus[i] for r in ranks) for i in range(n)] for a in names}
    n_fl = len(ranks[0].floors)
    floor_ms = 1e3 * median([max(r.floors[i][0] for r in ranks) for i in range(n_fl)])
    floor_cpu_ms = 1e3 * median([statistics.mean(r.floors[i][1] for r in ranks) for i in range(n_fl)])
    base_ms, base_cpu_ms = 1e3 * median(wall["baseline"]), 1e3 * median(cpu["baseline"])
    reps = max(1, min(repeats, n))
    blocks = [list(range(j * n // reps, (j + 1) * n // reps)) for j in range(reps)]
    base_pos = ranks[0].copies["baseline"].positions  # the same order on every rank
    rows = {}
    for a in names:
        ratio, rmin, rmax = block_ratios(wall[a], wall["baseline"], blocks)
        paired, plo, phi = paired_ratio(wall[a], wall["baseline"])
        q25, q75 = quartiles(wall[a], wall["baseline"])
        order = order_effect(wall[a], wall["baseline"], ranks[0].copies[a].positions, base_pos)
        cratio, cmin, cmax = block_ratios(cpu[a], cpu["baseline"], blocks)
        med, cmed = 1e3 * median(wall[a]), 1e3 * median(cpu[a])
        # own code: CPU time inside the approach's code per step, mean over ranks; sites named
        # background::* run off the training thread and are reported apart
        # periodic sites run nested in another site on some steps: taken out of the step they fell
        # in, added back below amortized over every step the approach took (timed or not)
        selfs = [[unnest(r.copies[a].selfs[i]) for i in range(n)] for r in ranks]
        site_names = sorted(
            {k for r in selfs for st in r for k in st},
            key=lambda k: (k.startswith("wall::"), k.startswith("background::"), k),
        )
        site_ms = {
            k: median([1e3 * statistics.mean(r[i].get(k, 0.0) for r in selfs) for i in range(n)])
            for k in site_names
        }
        own = [
            1e3
            * statistics.mean(
                sum(v for k, v in r[i].items() if not k.startswith(("background::", "wall::"))) for r in selfs
            )
            for i in range(n)
        ]
        periodic_ms = statistics.mean(1e3 * r.copies[a].periodic[0] / r.copies[a].periodic[1] for r in ranks)
        if periodic_ms:
            site_ms["amortized::export"] = periodic_ms
        own_ms = median(own) + periodic_ms
        persistent_device = max(r.copies[a].persistent[0] for r in ranks)
        persistent_host = max(r.copies[a].persistent[1] for r in ranks)
        rows[a] = Row(
            median_ms=med,
            mean_ms=1e3 * statistics.mean(wall[a]),
            ratio=ratio,
            ratio_min=rmin,
            ratio_max=rmax,
            paired=paired,
            paired_lo=plo,
            paired_hi=phi,
            paired_q25=q25,
            paired_q75=q75,
            order=order,
            extra_ms=med - base_ms,
            extra_passes=(med - base_ms) / floor_ms,
            cpu_ms=cmed,
            cpu_ratio=cratio,
            cpu_ratio_min=cmin,
            cpu_ratio_max=cmax,
            cpu_extra_ms=cmed - base_cpu_ms,
            cpu_extra_passes=(cmed - base_cpu_ms) / floor_cpu_ms,
            own_ms=own_ms,
            own_passes=own_ms / floor_cpu_ms,
            own_ratio=1 + own_ms / base_cpu_ms,
            background_ms=sum(v for k, v in site_ms.items() if k.startswith("background::")),
            sites_ms={k: v for k, v in site_ms.items() if not k.startswith("wall::")},
            sites_wall_ms={k[len("wall::") :]: v for k, v in site_ms.items() if k.startswith("wall::")},
            peak_over_baseline=max(r.copies[a].mem.peak for r in ranks)
            - max(r.copies["baseline"].mem.peak for r in ranks),
            persistent_device=persistent_device,
            persistent_host=persistent_host,
            kept_bytes=persistent_device + persistent_host,
        )
    return SizeResult(
        info=run.info,
        n_rounds=n,
        repeats=len(blocks),
        floor_ms=floor_ms,
        floor_cpu_ms=floor_cpu_ms,
        health=ranks[0].health,
        baseline_ms=base_ms,
        baseline_cpu_ms=base_cpu_ms,
        rows=rows,
        wall_s=run.wall_s,
        profile=run.profile,
        sync_debug=run.sync_debug,
        mem_method=ranks[0].copies["baseline"].mem.method,
        raw=RawTimes(wall_s=wall, cpu_s=cpu),
    )
