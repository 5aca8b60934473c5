"""Host side: one exported step row (a list of floats) -> a :class:`~distmon.snapshot.Snapshot`.

Every figure is read by name from the row plan (``rows.py``). A figure that was not measured
is NaN, never a real-looking number: the global ones when the step's reduced gradient was not
measured (``valid`` False), a rank's own ones when its local gradient was not (``rank_valid``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ..layout.placements import Coordinates
from ..snapshot import AnomalyEvent, Snapshot
from ..step.backward import LayerOrder
from ..step.ring import StepInfo
from ..step.rows import Early, Head, Job, Noise, Oscillation, RowPlan, earliest_nonfinite
from ..verdicts.detectors import EventFinder
from ..verdicts.precursor import PrecursorConfig

__all__ = ["RowDecoder"]


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else math.nan  # NaN stays NaN, inf stays inf


class RowDecoder:
    """Decodes step rows of one monitor into snapshots (on the export thread).

    ``order`` holds each layer's position in backward order (known once the source saw a
    backward); ``detector`` turns the detector columns into events and scores; ``node_ranks`` the
    ranks whose rows a row holds (its node's) and ``node`` this rank's node. The job-wide
    figures (the first non-finite rank and layer, error and non-finite counts) come from the
    row's job columns, what the export's reductions brought from every rank. Without
    ``local_figures`` (a source that cannot measure each rank's local gradient: FSDP2 before
    torch 2.9) the per-rank figures are left out (empty), not NaN.

    Example:
        >>> import torch
        >>> plan = RowPlan.build(n_layers=1, world=1)
        >>> dec = RowDecoder(plan, layers=["fc"], run_id="r", order=LayerOrder(1, torch.device("cpu")))
        >>> row = [1.0, 4.0, 4.0] + [4.0, 0.0, 1.0]   # head, layers, rank 0: layer sums, errors, valid
        >>> row += [1, 1, 0, 0, -1, -1, -1, -1, float("nan"), float("nan")]   # job: 1 rank, nothing bad
        >>> snap = dec.decode(StepInfo(1, 0, 0.0, ""), row)
        >>> snap.grad_norm, snap.rank_grad_norms, snap.valid
        (2.0, [2.0], True)
    """

    def __init__(
        self,
        plan: RowPlan,
        *,
        layers: Sequence[str],
        run_id: str,
        order: LayerOrder,
        detector: EventFinder | None = None,
        watched: Sequence[str] = (),
        coords: Sequence[Coordinates | None] | None = None,
        local_figures: bool = True,
        restart: int = 0,
        node_ranks: Sequence[int] | None = None,
        node: int = 0,
        attended: Sequence[str] = (),
        precursor: PrecursorConfig | None = None,
    ) -> None:
        self.plan = plan
        self.attended = tuple(attended)  # the attention blocks the precursor reads
        self.precursor = precursor
        self.node_ranks = (
            tuple(node_ranks) if node_ranks is not None else tuple(range(plan.step.node_size))
        )  # the node's ranks
        self.node = node  # this rank's node (its index among the job's nodes)
        self.restart = restart  # the launcher's restart count, on every snapshot
        self.resumed_from: int | None = None  # set by a resume, put on the next snapshot only
        self.layers = tuple(layers)
        self.run_id = run_id
        self.order = order
        self.detector = detector
        self.watched = tuple(watched)  # modules whose forward outputs are watched
        self.coords = coords  # each rank's place in each parallel dimension (several of them)
        self.local_figures = local_figures

    def decode(self, info: StepInfo, row: list[float]) -> Snapshot:
        step, f = self.plan.step, self.plan.rank
        layer_sq = row[step.layers]
        gathered = row[step.ranks]
        job = row[step.job]
        order = self.order.host
        ranks = [gathered[i * f.width : (i + 1) * f.width] for i in range(step.node_size)]
        rank_norms: list[float] = []
        rank_layers: list[list[float]] = []
        bad: list[tuple[int, int]] = []  # (rank, layer) of the node ranks
        rank_errors: list[int] = []
        measured = row[Head.VALID] == 1.0  # this rank measured the reduced gradient (what it reports)
        rank_valid: list[bool] = []
        for r, vals, total in zip(self.node_ranks, ranks, f.totals(ranks)):
            rank_errors.append(int(vals[f.errors]))
            ok = vals[f.valid] == 1.0
            rank_valid.append(ok)
            rank_norms.append(_sqrt(total) if ok else math.nan)
            if f.n_layer_cols:
                rank_layers.append([_sqrt(v) if ok else math.nan for v in vals[f.layers]])
            # a rank whose norm is not measured may still say where its gradient went non-finite
            first_bad = f.first_nonfinite_layer(vals, order) if vals[f.valid] > 0.0 else -1
            if first_bad >= 0:
                bad.append((r, first_bad))
        if not self.local_figures:  # refused at construction: absent, never NaN
            rank_norms, rank_valid = [], []
        grad_norm = _sqrt(row[Head.TOTAL_SQ]) if measured else math.nan
        # the job's figures came with the export's reductions; without them (they failed), the
        # node ranks' own say what they can
        reduced = job[Job.REPORTED] == job[Job.REPORTED]
        first: tuple[int, str] | None = None
        if reduced and job[Job.FIRST_RANK] >= 0:
            first = (int(job[Job.FIRST_RANK]), self.layers[int(job[Job.FIRST_LAYER])])
        elif not reduced and bad:
            r, layer = min(bad, key=lambda rl: (order[rl[1]], rl[0]))
            first = (r, self.layers[layer])
        elif measured and not math.isfinite(grad_norm):
            # finite on every rank, non-finite after reduction (e.g. fp16 overflow): rank -1
            layer = earliest_nonfinite(layer_sq, order)
            if layer >= 0:
                first = (-1, self.layers[layer])
        bad_ranks = sorted(
            {r for r, _ in bad} | ({first[0]} if first is not None and first[0] >= 0 else set())
        )
        where = self.coords[first[0]] if self.coords and first is not None and first[0] >= 0 else None
        snap = Snapshot(
            step=info.step,
            timestamp=info.timestamp,
            grad_norm=grad_norm,
            layer_grad_norms={
                name: _sqrt(v) if measured else math.nan for name, v in zip(self.layers, layer_sq)
            },
            rank_grad_norms=rank_norms,
            rank_layer_grad_norms=rank_layers if f.n_layer_cols else None,
            nonfinite=first is not None or (measured and not math.isfinite(grad_norm)),
            nonfinite_ranks=bad_ranks,
            nonfinite_rank_count=int(job[Job.NONFINITE_RANKS]) if reduced else len(bad_ranks),
            first_nonfinite=first,
            first_nonfinite_coords=where.labels() if where is not None else None,
            monitor_errors=int(job[Job.ERRORS]) if reduced else sum(rank_errors),
            rank_monitor_errors=rank_errors,
            valid=measured,
            rank_valid=rank_valid,
            run_id=self.run_id,
            world_size=step.world,
            skipped=bool(info.skip),
            skip_reason=info.skip,
            restart=self.restart,
            resumed_from=self.resumed_from,
            ranks=list(self.node_ranks),
            node=self.node,
        )
        self.resumed_from = None
        if step.noise.stop > step.noise.start:
            snap = self._noise(row[step.noise], snap)
        if self.detector is not None:
            snap = self.detector(info.step, row[step.detector], snap)
            if not self.local_figures:
                snap = replace(snap, rank_outlier_scores=[])
        if step.n_watched:
            snap = self._activations(info.step, row[step.act], job, snap)
        if step.upd.stop > step.upd.start:
            ratios = row[step.upd]
            if not all(math.isnan(v) for v in ratios):  # a scheduled export step (Exchange.scheduled)
                snap = replace(snap, layer_update_ratio=dict(zip(self.layers, ratios)))
        if self.precursor is not None and info.step % self.precursor.every == 0:
            snap = self._precursor(info.step, row[step.precursor], snap)
        return snap

    def _precursor(self, step: int, cols: list[float], snap: Snapshot) -> Snapshot:
        """A sampled step: the blocks' logit bounds and the gradient cosine; the first warning of an
        episode is an event (the warning column: a block's, or past them the cosine's)."""
        n, k = len(self.attended), self.plan.step.n_signals
        bounds, oscillation, early = cols[:n], cols[n:k], cols[k:]
        cosine = 1.0 - oscillation[Oscillation.ONE_MINUS_COS] if oscillation else math.nan
        events = snap.events
        if early[Early.FIRST] == 1.0:
            column = int(early[Early.BLOCK])
            block = column < n
            events += (
                AnomalyEvent(
                    kind="divergence_warning",
                    step=step,
                    rank=-1,
                    layer=self.attended[column] if block else "",
                    value=bounds[column] if block else cosine,
                    threshold=self.precursor.bound if block else self.precursor.cosine_below,
                ),
            )
        return replace(
            snap,
            attention_logit_bound=dict(zip(self.attended, bounds)),
            gradient_cosine=cosine,
            divergence_warning=early[Early.WARN] == 1.0,
            events=events,
        )

    def _noise(self, noise: list[float], snap: Snapshot) -> Snapshot:
        n, k = len(self.layers), len(Noise)
        return replace(
            snap,
            gradient_noise_scale=noise[Noise.SCALE],
            noise_trace=noise[Noise.TRACE],
            noise_signal=noise[Noise.SIGNAL],
            layer_gradient_noise_scale=dict(zip(self.layers, noise[k : k + n])),
            layer_noise_signal=dict(zip(self.layers, noise[k + n :])),
        )

    def _activations(self, step: int, act: list[float], job: list[float], snap: Snapshot) -> Snapshot:
        n = len(self.watched)
        first = None
        events = snap.events
        if job[Job.ACT_RANK] >= 0:  # earliest in forward order, lowest rank on a tie (NaN: not reduced)
            r = int(job[Job.ACT_RANK])
            first = (r, self.watched[int(job[Job.ACT_MODULE])])
            events += (
                AnomalyEvent(
                    kind="activation_nonfinite",
                    step=step,
                    rank=r,
                    layer=first[1],
                    value=math.nan,
                    threshold=math.inf,
                ),
            )
        if all(math.isnan(v) for v in act[:n]):  # not an activation step
            return replace(snap, first_nonfinite_activation=first, events=events)
        return replace(
            snap,
            activation_rms=dict(zip(self.watched, act[:n])),
            activation_absmax=dict(zip(self.watched, act[n : 2 * n])),
            first_nonfinite_activation=first,
            events=events,
        )
