"""Anomaly detectors that run on the device, with state in device tensors and no host sync.

:meth:`DeviceDetector.update` reads a run of finished ring rows (reduced per-layer sums of
squares, the node's ranks' gathered rows and the job-wide figures of every rank that the export's
two reductions brought, ``step/crossrank.py``), writes each row's verdicts into its detector
columns and advances the running state; the host decodes the columns into
:class:`~distmon.snapshot.AnomalyEvent` objects when the rows are exported. The step schedule runs
it at export time over the steps since the last export (or on every step, before
``optimizer.step()``, when a guard needs the verdict).

The rules and their defaults are stated once, in the detection table of docs/detection.md (a test keeps
it in step with :class:`DetectorConfig`). Why each is built the way it is:

- all on log-norms: gradient norms span decades, and ratios are what matter;
- a spike needs both a z-score and a ratio to its reference: the z-score alone fires on tiny
  wiggles of a very steady norm, the ratio alone on a noisy one. The state is updated with
  the deviation clipped at ``spike_zscore`` standard deviations, so ordinary noise never
  poisons it; a step that is itself a spike (judged against the baseline at the start of
  its run of rows) does not update the baseline at all, so a lasting explosion keeps being
  reported, and the guard keeps refusing it, until it has lasted ``spike_adapt_steps``
  consecutive steps: from then on it is the new normal and the baseline learns it (a
  learned baseline stopped reporting a x1e4 explosion after 3 steps). Falling norms
  (early-training decay) only make z negative: never an event;
- the rank-outlier center is the mean of a peer group's log-norms leaving out the largest and
  the smallest (the lower median for 3 and 4 ranks; exact from fixed-size reductions at any
  world size, ``crossrank.py``), the scale the EMA over steps of the ranks' mean squared
  deviation from it, of the ranks between the two extremes from 5 ranks on, leaving out the
  largest deviation up to 4: a rank that stays bad, or is bad from step 1, cannot inflate it;
  a per-step MAD is no scale for a handful of ranks (biased low with 4, degenerate with 2),
  and with 2 ranks "which one is odd" has no answer at all;
- non-finite gradients are flagged by the core per rank and layer; they are reported as an
  event here and never enter the running state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..snapshot import AnomalyEvent, Snapshot
from ..step.crossrank import GroupStat
from ..step.rows import RowPlan, Verdict
from ..step.sums import prefix_ema, run_lengths, stable_run
from .resume import load_tensors, save_tensors

__all__ = ["DetectorConfig", "DeviceDetector", "EventFinder"]


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the device detectors (defaults measured on the demo model; see docs/detection.md).

    Attributes:
        warmup_steps: steps before a spike can be reported (the baselines learn meanwhile).
        ema_alpha: weight of a new step in the EMAs of the log-norms (and of the rank-outlier scale).
        spike_zscore: a spike's z-score of the log-norm against its EMA must exceed this ...
        spike_ratio: ... and the norm must exceed this times its reference (the running median
            of the global norms; a layer's geometric EMA).
        median_window: global norms in the running median.
        vanishing_norm: a global norm below this ...
        vanishing_steps: ... for this many consecutive steps is a ``vanishing`` event.
        spike_adapt_steps: a lasting explosion is reported (and refused by a guard) for this many
            consecutive steps, then becomes the new normal.
        outlier_score: a rank's log local norm this many scales from its peer group's center is a
            ``rank_outlier`` (3+ ranks).
        outlier_min_scale: the floor of the rank-outlier scale.
        scaler_stuck_steps: consecutive ``GradScaler`` skips that make a ``scaler_stuck`` event.

    Example:
        >>> DetectorConfig(spike_zscore=8.0).spike_ratio
        3.0
    """

    warmup_steps: int = 50
    ema_alpha: float = 0.05
    spike_zscore: float = 6.0
    spike_ratio: float = 3.0
    median_window: int = 64
    vanishing_norm: float = 1e-7
    vanishing_steps: int = 20
    spike_adapt_steps: int = 100
    outlier_score: float = 8.0
    outlier_min_scale: float = 0.1
    scaler_stuck_steps: int = 20

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                if not (f.name == "warmup_steps" and v == 0):
                    raise ValueError(
                        f"distmon: detector option {f.name} must be a positive number, got {v!r}"
                    )
        if not self.ema_alpha < 1:
            raise ValueError(f"distmon: ema_alpha must be in (0, 1), got {self.ema_alpha}")
        if self.spike_ratio <= 1:
            raise ValueError(f"distmon: spike_ratio must be > 1, got {self.spike_ratio}")
        counts = ("warmup_steps", "median_window", "vanishing_steps")
        for name in counts + ("scaler_stuck_steps", "spike_adapt_steps"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"distmon: {name} must be an int, got {getattr(self, name)!r}")


CONSISTENCY = (  # ranks 2..128, from benchmarks/consistency_table.py
    0.9997,
    5.7704,
    2.7565,
    4.1753,
    3.2806,
    2.8002,
    2.5025,
    2.2956,
    2.1435,
    2.0260,
    1.9331,
    1.8566,
    1.7926,
    1.7389,
    1.6931,
    1.6524,
    1.6174,
    1.5863,
    1.5582,
    1.5329,
    1.5102,
    1.4897,
    1.4712,
    1.4534,
    1.4377,
    1.4231,
    1.4094,
    1.3971,
    1.3851,
    1.3741,
    1.3638,
    1.3540,
    1.3445,
    1.3360,
    1.3280,
    1.3201,
    1.3126,
    1.3058,
    1.2993,
    1.2929,
    1.2868,
    1.2809,
    1.2756,
    1.2702,
    1.2651,
    1.2602,
    1.2559,
    1.2512,
    1.2471,
    1.2430,
    1.2390,
    1.2353,
    1.2314,
    1.2279,
    1.2243,
    1.2210,
    1.2179,
    1.2147,
    1.2119,
    1.2090,
    1.2060,
    1.2034,
    1.2006,
    1.1982,
    1.1954,
    1.1930,
    1.1908,
    1.1885,
    1.1860,
    1.1841,
    1.1818,
    1.1797,
    1.1777,
    1.1756,
    1.1738,
    1.1719,
    1.1701,
    1.1684,
    1.1666,
    1.1649,
    1.1630,
    1.1614,
    1.1598,
    1.1582,
    1.1568,
    1.1553,
    1.1538,
    1.1525,
    1.1509,
    1.1496,
    1.1481,
    1.1468,
    1.1455,
    1.1443,
    1.1430,
    1.1419,
    1.1407,
    1.1395,
    1.1384,
    1.1373,
    1.1360,
    1.1349,
    1.1339,
    1.1328,
    1.1320,
    1.1308,
    1.1297,
    1.1288,
    1.1278,
    1.1269,
    1.1260,
    1.1251,
    1.1241,
    1.1233,
    1.1224,
    1.1214,
    1.1207,
    1.1198,
    1.1190,
    1.1182,
    1.1174,
    1.1166,
    1.1158,
    1.1150,
    1.1143,
    1.1135,
    1.1128,
)


def _trimmed_consistency(world: int) -> float:
    """sigma^2 / E[the rank-outlier spread (``crossrank.GroupStat.SPREAD``)] for ``world`` Gaussian ranks.

    Makes the rank-outlier score read in standard deviations whatever the world size (the
    trimmed mean of a handful of deviations is far below sigma^2): a measured table up to 128
    ranks, :func:`large_world_consistency` beyond (0.05% from Monte Carlo at 129 ranks:
    ``benchmarks/consistency_table.py --check``). Constant time and memory at any world size;
    ``benchmarks/consistency_table.py`` regenerates the table.

    Example:
        >>> round(_trimmed_consistency(64), 1), round(_trimmed_consistency(4096), 3)
        (1.2, 1.006)
    """
    if world < 2:
        return 1.0
    if world - 2 < len(CONSISTENCY):
        return CONSISTENCY[world - 2]
    return large_world_consistency(world)


def large_world_consistency(n: int) -> float:
    """The consistency constant's approximation beyond the table: the n log-norms' squared
    deviations from their mean add up to ~(n - 1) sigma^2, each extreme's to ~(2 ln n - ln ln n -
    ln(4 pi) / 2) sigma^2, and the middle n - 2 share the rest.

    Example:
        >>> round(large_world_consistency(256), 3)
        1.064
    """
    return (n - 2) / (n - 1 - 4 * math.log(n) + 2 * math.log(math.log(n)) + math.log(4 * math.pi))


def _seed(
    state: torch.Tensor, seeded: torch.Tensor, y: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seed unseeded columns of ``state`` with their first kept value in the run.

    Returns the seeded state, the rows that find the column seeded (for a column seeded in
    this run, the rows after its seeding row), and the rows that update it (kept and seeded).
    A column with no kept value stays unseeded, whatever its state holds.
    """
    first = mask.to(torch.uint8).argmax(0, keepdim=True)
    state = torch.where(seeded, state, y.gather(0, first).squeeze(0))
    judged = seeded | (torch.arange(len(y), device=y.device).view(-1, *[1] * (y.dim() - 1)) > first)
    return state, judged, mask & judged


class DeviceDetector:
    """Running detector state on the device, advanced by runs of finished ring rows.

    :meth:`update` judges the reduced figures (spikes, vanishing, the guard's verdict),
    :meth:`update_ranks` the per-rank ones (rank outliers), once the export's reductions
    brought the job's peer-group figures. Without a guard the schedule hands over all valid rows
    since the last export at once; a guard needs each reduced verdict before its step, so there
    every run of :meth:`update` is one row. Both give the step-by-step recurrence: the running
    mean and variance before each row of a run come in closed form from prefix sums
    (:func:`distmon.step.sums.prefix_ema`). The one approximation of a longer run: values are
    winsorized against the baseline at the run's start (at most ``export_every``
    steps old) rather than the one of the step before, and the global norm's median reference
    is the run start's. Everything is batched tensor math over the run's rows: no host sync,
    no per-step cost on ordinary steps.
    """

    def __init__(
        self,
        cfg: DetectorConfig,
        plan: RowPlan,
        device: torch.device,
        node_ranks: Sequence[int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.step_row, self.fields = plan.step, plan.rank
        world = plan.step.world
        # the ranks whose rows (and outlier scores) this rank holds: its node's
        self.node_ranks = tuple(node_ranks) if node_ranks is not None else tuple(range(plan.step.node_size))
        n = plan.step.n_layers + 1  # global norm first, then layers
        f32 = dict(dtype=torch.float32, device=device)
        self.mean = torch.zeros(n, **f32)
        self.var = torch.full((n,), 0.25, **f32)  # std 0.5 in log units until data arrives
        self.seeded = torch.zeros(n, dtype=torch.bool, device=device)
        self.history = torch.full((cfg.median_window,), math.nan, **f32)
        self.below = torch.zeros((), **f32)
        self.spiking = torch.zeros(n, **f32)  # consecutive spiking steps per column, kept out of the state
        self._device = device
        self.compare_within([list(range(world))])
        self.updates = 0  # host count of rows seen: the warm-up and history slots need no device read
        self.rank_updates = 0  # the same for update_ranks
        self._log_ratio = math.log(cfg.spike_ratio)
        self._log_floor = math.log(cfg.vanishing_norm)
        # longest run at once: history slots must not collide, (1 - alpha)^-k must stay < ~1e6
        self._max_run = min(cfg.median_window, stable_run(cfg.ema_alpha))

    _STATE = ("mean", "var", "seeded", "history", "below", "spiking")  # what it learned, as tensors

    def state_dict(self) -> dict[str, object]:
        """What the detector has learned, as plain lists and numbers (``distmon.verdicts.resume``)."""
        return {
            **save_tensors(self, self._STATE),
            "dev_var": self.dev_var.tolist(),
            "groups": self._groups,
            "updates": self.updates,
            "rank_updates": self.rank_updates,
        }

    def load_state_dict(self, state: Mapping[str, object], same_ranks: bool = True) -> None:
        """Go on from ``state``; the rank-outlier scales only when the ranks are grouped alike."""
        if "spiking" not in state:  # state version 1 called it "held"
            state = {**state, "spiking": state["held"]}
        load_tensors(self, state, self._STATE, "detector", why={"history": "DetectorConfig.median_window"})
        self.updates, self.rank_updates = int(state["updates"]), int(state["rank_updates"])
        if same_ranks and state["groups"] == self._groups:
            load_tensors(self, state, ("dev_var",), "detector")
        else:
            self.rank_updates = 0  # another grouping: the outlier warm-up starts again with its scales

    def compare_within(self, groups: Sequence[Sequence[int]]) -> None:
        """Rank outliers compare only the ranks of each group: those that hold the same shards (the
        same tensor-parallel, pipeline and expert coordinates), never unlike ones. One group of
        every rank by default; a group of fewer than 3 ranks has no outlier to tell apart.

        Example:
            >>> from distmon.step.rows import RowPlan
            >>> det = DeviceDetector(DetectorConfig(), RowPlan.build(n_layers=1, world=4, detector=True),
            ...                      torch.device("cpu"))
            >>> det.compare_within([[0, 2], [1, 3]]); det.dev_var.shape
            torch.Size([2])
        """
        # the groups' ranks, as plain lists: the state_dict's (nothing indexes by them on the device)
        self._groups = [list(g) for g in groups]
        self._sizes = [len(g) for g in groups]
        # per group, the positions of its ranks among the node's rows
        self._group_rows = [
            torch.tensor(
                [i for i, r in enumerate(self.node_ranks) if r in g], dtype=torch.long, device=self._device
            )
            for g in groups
        ]
        # cross-rank log-norm variance of each group, EMA over steps
        self.dev_var = torch.full((len(groups),), math.nan, dtype=torch.float32, device=self._device)
        self._consistency = [_trimmed_consistency(len(g)) for g in groups]

    def update(self, rows: torch.Tensor) -> None:
        """Judge a run of consecutive valid steps' reduced figures, write their columns, advance the state.

        ``rows`` is ``(k, width)``, step rows of the device ring; device ops only.
        """
        window = self.cfg.median_window
        if len(rows) > self._max_run:
            for i in range(0, len(rows), self._max_run):
                self.update(rows[i : i + self._max_run])
            return
        cfg = self.cfg
        k = len(rows)
        armed_from = max(0, cfg.warmup_steps - self.updates)  # first armed row of this run
        x = 0.5 * torch.log(rows[:, self.step_row.total_and_layers])  # log-norms: global, then layers
        finite = torch.isfinite(x)
        a = cfg.ema_alpha
        mean0, _, live = _seed(self.mean, self.seeded, x, finite)
        median = torch.nanmedian(self.history)
        # steps that are spikes against the baseline at the run's start stay out of the state
        # (until spike_adapt_steps in a row make them the new normal)
        z0 = (x - mean0) / torch.sqrt(self.var + 1e-4)
        ref0 = torch.cat([(x[:, :1] - median).nan_to_num(0.0), (x - mean0)[:, 1:]], 1)
        anomalous = live & (z0 > cfg.spike_zscore) & (ref0 > self._log_ratio)
        anomalous[:armed_from] = False
        lasted = run_lengths(anomalous, self.spiking)
        self.spiking.copy_(lasted[-1])
        learn = live & ~(anomalous & (lasted <= cfg.spike_adapt_steps))  # rows the state learns from
        bound = cfg.spike_zscore * torch.sqrt(self.var + 1e-4)
        # winsorized, so one spike does not poison the baseline
        y = torch.maximum(torch.minimum(x, mean0 + bound), mean0 - bound)
        mean, mean_after = prefix_ema(mean0, y, learn, a)
        var, var_after = prefix_ema(self.var, (1 - a) * (y - mean) ** 2, learn, a)
        dev = x - mean
        z = torch.where(live, dev / torch.sqrt(var + 1e-4), 0.0)
        log_ref_dev = torch.cat([(x[:, :1] - median).nan_to_num(0.0), dev[:, 1:]], 1)  # log(norm / reference)
        spike = live & (z > cfg.spike_zscore) & (log_ref_dev > self._log_ratio)
        spike[:armed_from] = False
        layer_z = torch.where(spike[:, 1:], z[:, 1:], -math.inf)
        best_z, best = layer_z.max(1)
        any_layer = spike[:, 1:].any(1)

        # vanishing: consecutive steps under the floor (carried across runs); fires once, on the N-th
        below = finite[:, 0] & (x[:, 0] < self._log_floor)
        count = run_lengths(below, self.below)
        self.below.copy_(count[-1])

        verdicts = {
            Verdict.ZSCORE: z[:, 0],
            Verdict.MEDIAN_RATIO: torch.exp(x[:, 0] - median),
            Verdict.LAYER_ZMAX: z[:, 1:].max(1).values,
            Verdict.SPIKE_GLOBAL: spike[:, 0],
            Verdict.SPIKE_LAYER: torch.where(any_layer, best, -1),
            Verdict.SPIKE_LAYER_Z: torch.where(any_layer, best_z, 0.0),
            Verdict.VANISHING: count == cfg.vanishing_steps,
            Verdict.BLOCK: ~finite[:, 0] | spike.any(1),
        }
        out = rows[:, self.step_row.detector]
        out[:, : Verdict.OUTLIER] = torch.stack(
            [verdicts[c].float() for c in Verdict if c < Verdict.OUTLIER], 1
        )

        self.mean.copy_(mean_after)
        self.var.copy_(var_after)
        self.seeded |= finite.any(0)
        start = self.updates % window  # the run's history slots, wrapping once at most
        n1 = min(k, window - start)
        for run, slots in ((slice(0, n1), slice(start, start + n1)), (slice(n1, k), slice(0, k - n1))):
            if run.stop > run.start:
                seg = self.history[slots]  # a non-finite step keeps the slot's old value
                seg.copy_(torch.where(learn[run, 0], x[run, 0], seg))
        self.updates += k

    def update_ranks(self, rows: torch.Tensor, stats: torch.Tensor) -> None:
        """Judge a run of consecutive valid steps' cross-rank figures (rank outliers), once the export's
        reductions landed: ``stats`` ``(k, groups, GroupStat)`` are the job's peer-group figures of
        the same steps (``crossrank.py``).

        Writes the outlier columns (the job's worst rank and score) and every node rank's score;
        device ops only.
        """
        if len(rows) > self._max_run:
            for i in range(0, len(rows), self._max_run):
                self.update_ranks(rows[i : i + self._max_run], stats[i : i + self._max_run])
            return
        score, rank, top = self._rank_outliers(rows, stats)
        outlier = top > self.cfg.outlier_score
        outlier[: max(0, self.cfg.warmup_steps - self.rank_updates)] = False
        self.rank_updates += len(rows)
        out = rows[:, self.step_row.detector]
        out[:, Verdict.OUTLIER : len(Verdict)] = torch.stack([outlier.float(), rank.float(), top], 1)
        out[:, len(Verdict) :] = score

    def _rank_outliers(self, rows: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row: the node ranks' outlier scores, the job's worst rank and its score; advances the scales.

        A group's worst rank is its largest or its smallest log-norm, the farthest from the
        center: the job learns it from the reductions, with no rank's row leaving its node.
        """
        gathered = self.step_row.rank_rows(rows)
        ok = gathered[..., self.fields.valid] == 1.0
        x = torch.where(ok, 0.5 * torch.log(self.fields.device_totals(gathered)), math.nan)
        x = torch.where(torch.isfinite(x), x, math.nan)  # non-finite ranks are the NaN event's
        score = torch.full_like(x, math.nan)  # NaN: a rank of a group of 2 or fewer has no score
        best_score = torch.zeros(len(rows), dtype=torch.float32, device=rows.device)
        best = torch.zeros_like(best_score)
        for g, rows_of_g in enumerate(self._group_rows):
            if self._sizes[g] < 3:  # with two, each is as far from their median as the other
                continue
            st = stats[:, g]
            scale = self._scale(g, st[:, GroupStat.SPREAD])
            center = st[:, GroupStat.CENTER, None]
            score[:, rows_of_g] = ((x[:, rows_of_g] - center).abs() / scale[:, None]).nan_to_num(0.0)
            worst = (st[:, GroupStat.WORST] / scale).nan_to_num(0.0)
            rank = st[:, GroupStat.WORST_RANK]
            take = (worst > best_score) | ((worst == best_score) & (rank >= 0) & (rank < best))
            best_score = torch.where(take, worst, best_score)
            best = torch.where(take, rank, best)
        if not any(size >= 3 for size in self._sizes):
            best_score.fill_(math.nan)  # no rank to tell apart: no worst score
        return score, best, best_score

    def _scale(self, g: int, spread: torch.Tensor) -> torch.Tensor:
        """Group ``g``'s scale per row: the EMA over steps of its ranks' mean squared deviation from
        their center, of the ranks between the two extremes from 5 ranks on, leaving out the largest
        deviation up to 4 (so a rank that stays bad, or is bad from the start, never inflates it),
        floored; advances the EMA."""
        m2 = spread * self._consistency[g]
        state = self.dev_var[g]
        var0, judged, used = _seed(state, ~torch.isnan(state), m2, torch.isfinite(m2))
        var, var_after = prefix_ema(var0, m2, used, self.cfg.ema_alpha)
        var = torch.where(judged, var, math.nan)  # no scale yet: the floor
        state.copy_(var_after)
        return torch.sqrt(var.nan_to_num(0.0)).clamp(min=self.cfg.outlier_min_scale)


class EventFinder:
    """Host side: detector columns of a row -> events and scores added to the Snapshot.

    Also counts consecutive steps the ``GradScaler`` skipped (host facts, in step order on the
    export thread): routine fp16 overflow is no event, a run of ``scaler_stuck_steps`` is.
    """

    def __init__(self, cfg: DetectorConfig, layers: Sequence[str]) -> None:
        self.cfg = cfg
        self.layers = tuple(layers)
        self.scaler_run = 0  # consecutive steps the GradScaler skipped, up to the latest decoded

    def __call__(self, step: int, c: list[float], snap: Snapshot) -> Snapshot:
        cfg = self.cfg
        events: list[AnomalyEvent] = []
        self.scaler_run = self.scaler_run + 1 if snap.skip_reason == "scaler" else 0
        if self.scaler_run == cfg.scaler_stuck_steps:
            events.append(
                AnomalyEvent(
                    kind="scaler_stuck",
                    step=step,
                    rank=-1,
                    layer="",
                    value=self.scaler_run,
                    threshold=cfg.scaler_stuck_steps,
                )
            )
        if snap.nonfinite and snap.skip_reason != "scaler":
            rank, layer = snap.first_nonfinite or (-1, "")
            events.append(
                AnomalyEvent(
                    kind="nonfinite",
                    step=step,
                    rank=rank,
                    layer=layer,
                    value=snap.grad_norm,
                    threshold=math.inf,
                )
            )
        if c[Verdict.SPIKE_GLOBAL] or c[Verdict.SPIKE_LAYER] >= 0:
            layer = self.layers[int(c[Verdict.SPIKE_LAYER])] if c[Verdict.SPIKE_LAYER] >= 0 else ""
            value = c[Verdict.SPIKE_LAYER_Z] if layer else c[Verdict.ZSCORE]
            events.append(
                AnomalyEvent(
                    kind="spike", step=step, rank=-1, layer=layer, value=value, threshold=cfg.spike_zscore
                )
            )
        if c[Verdict.VANISHING]:
            events.append(
                AnomalyEvent(
                    kind="vanishing",
                    step=step,
                    rank=-1,
                    layer="",
                    value=snap.grad_norm,
                    threshold=cfg.vanishing_norm,
                )
            )
        if c[Verdict.OUTLIER]:
            events.append(
                AnomalyEvent(
                    kind="rank_outlier",
                    step=step,
                    rank=int(c[Verdict.OUTLIER_RANK]),
                    layer="",
                    value=c[Verdict.OUTLIER_SCORE],
                    threshold=cfg.outlier_score,
                )
            )
        return replace(
            snap,
            events=snap.events + tuple(events),
            scores={
                "zscore": c[Verdict.ZSCORE],
                "median_ratio": c[Verdict.MEDIAN_RATIO],
                "layer_zmax": c[Verdict.LAYER_ZMAX],
                "rank_outlier_worst": c[Verdict.OUTLIER_SCORE],
                "rank_outlier_worst_rank": c[Verdict.OUTLIER_RANK],
            },
            rank_outlier_scores=c[len(Verdict) :],
        )
