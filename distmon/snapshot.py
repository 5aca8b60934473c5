"""The host snapshot: the one immutable object every exporter reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

__all__ = ["Snapshot", "AnomalyEvent", "to_jsonable", "AnomalyKind", "SkipReason", "ANOMALY_KINDS"]

AnomalyKind = Literal[
    "nonfinite",
    "spike",
    "vanishing",
    "rank_outlier",
    "scaler_stuck",
    "activation_nonfinite",
    "divergence_warning",
]
ANOMALY_KINDS: tuple[AnomalyKind, ...] = get_args(AnomalyKind)
# who kept the optimizer from taking a step: "" (nobody), a guard, or the GradScaler (Inf/NaN)
SkipReason = Literal["", "guard", "scaler"]


@dataclass(frozen=True, kw_only=True)
class AnomalyEvent:
    """One detection: what, when, where, and the value against its threshold.

    ``rank`` is -1 for cluster-wide events (a spike of the reduced norm); ``layer`` is ``""``
    when the event is about the whole model.
    """

    kind: AnomalyKind
    step: int
    rank: int
    layer: str
    value: float
    threshold: float


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Gradient statistics of one optimizer step, combined over all ranks.

    Attributes:
        step: optimizer steps taken so far (the first step is 1).
        timestamp: unix time at which the step finished on this rank.
        grad_norm: L2 norm of the reduced (all-reduced) gradient, as the optimizer sees it
            (NaN when it was not measured: no backward this step, or this rank's monitor
            code failed; ``valid`` is then False).
        layer_grad_norms: layer -> L2 norm of its reduced gradient (NaN when not measured).
        rank_grad_norms: per rank of ``ranks``, the L2 norm of its local gradient before all-reduce
            (NaN where it was not measured; see ``monitor_errors``). Empty, as are
            ``rank_valid`` and ``rank_outlier_scores``, where no rank's local gradient can be
            read (FSDP2 before torch 2.9: said when the monitor is built).
        rank_layer_grad_norms: ranks x layers local norms (layers in ``layer_grad_norms``
            order), or None with ``rank_layers=False``.
        nonfinite: any local or reduced gradient held a NaN/Inf.
        nonfinite_ranks: ranks of ``ranks`` whose local gradient held a NaN/Inf, and the rank of
            ``first_nonfinite`` wherever it runs.
        nonfinite_rank_count: how many of the job's ranks had a NaN/Inf local gradient.
        first_nonfinite: ``(rank, layer)`` of the first non-finite layer in backward order
            (lowest rank on a tie), or None.
        first_nonfinite_coords: that rank's place in each parallel dimension (``dp_rank``,
            ``tp_rank``, ``pp_stage``, ``ep_rank``; "" where the job has none), in a job of several
            dimensions; None otherwise.
        events: detector verdicts of this step.
        monitor_errors: errors caught in monitor code so far, summed over the job's ranks.
        rank_monitor_errors: the same per rank.
        valid: the step's global figures (``grad_norm``, ``layer_grad_norms``, the detectors'
            verdicts on them) were measured. False when no backward preceded the optimizer step
            or monitor code failed where they are measured; they are then NaN (and do not count
            as non-finite).
        rank_valid: per rank, whether its local figures (``rank_grad_norms``, its row of
            ``rank_layer_grad_norms``) were measured; where not, they are NaN. A rank's local
            figures can be lost while the global ones are exact: a failure in its local
            measurement, or FSDP2 reduce-scattering on every micro-batch (no single
            reduce-scatter input holds the step's local gradient).
        run_id: the run this step belongs to (the ``run_id`` label of every series).
        world_size: the number of ranks of the job.
        scores: detector scores: "zscore" and "median_ratio" of the global norm (NaN until an
            earlier export gave the running median its first norms), "layer_zmax" the largest
            layer z-score, "rank_outlier_worst" the job's largest rank-outlier score (NaN without
            a peer group of 3+ ranks) and "rank_outlier_worst_rank" its rank, on any node.
        rank_outlier_scores: per rank, robust distance of its log-norm from the other ranks'
            (those holding the same shards); NaN in a group of fewer than 3 ranks.
        gradient_noise_scale: B_simple (McCandlish et al. 2018) from the EMAs below, in the units
            of ``batch_size``; NaN without ``batch_size`` or while not yet meaningful.
        layer_gradient_noise_scale: layer -> its B_simple (with ``rank_layers=True``).
        layer_noise_signal: layer -> its EMA |G_l|^2 (these add up to ``noise_signal``).
        activation_rms, activation_absmax: watched module -> its output's RMS and largest absolute
            value on this rank (the serving one), on activation steps (``activations=``); empty
            on other steps.
        first_nonfinite_activation: ``(rank, module)`` of the first watched module, in forward
            order, whose output was non-finite (lowest rank on a tie), or None.
        layer_update_ratio: layer -> ||delta theta|| / ||theta|| of this step's update, on export
            steps with ``update_ratio=True``; empty on other steps.
        attention_logit_bound: attention block -> the bound ``max|q| max|k| / sqrt(d_head)`` of its
            attention logits on this step's forwards, the largest over the ranks (``precursor=``,
            on every ``PrecursorConfig.every``-th step; empty on other steps; NaN/Inf: the
            forward overflowed).
        gradient_cosine: on a sampled step with ``PrecursorConfig(peak_lr=...)``, the mean cosine
            between consecutive steps' gradients over the sampling interval (NaN elsewhere, and
            where no pair was measured).
        divergence_warning: on a sampled step, whether the precursor warns there (a block's bound
            above ``PrecursorConfig.bound`` for ``hold`` samples in a row, or non-finite; or the
            gradient cosine below ``cosine_below`` for ``hold`` samples while ``peak_lr`` is
            ``rate_headroom`` times the rate or more); the first sample of an episode is also a
            ``divergence_warning`` event (its layer the block's name, or ``""`` for the cosine).
        noise_trace, noise_signal: the bias-corrected EMAs of tr(Sigma) (per-example gradient
            variance) and |G|^2 (squared true gradient) whose ratio is the noise scale.
        ranks: the ranks the per-rank lists (``rank_grad_norms``, ``rank_layer_grad_norms``,
            ``rank_valid``, ``rank_monitor_errors``, ``rank_outlier_scores``) describe, in order:
            the ranks of this rank's node (every rank of a job on one node); the other nodes'
            are in their own nodes' snapshots.
        node: the node these ranks run on (its index among the job's nodes, ordered by their
            lowest rank).
        restart: how many times the launcher had restarted the job when this step ran (torchrun's
            ``TORCHELASTIC_RESTART_COUNT``, Slurm's ``SLURM_RESTART_COUNT``; 0 on the first start).
        resumed_from: on the first step exported after ``GradMonitor.load_state_dict``, the step
            the run resumed after (the steps after it in the log before this line were rolled
            back with the checkpoint); None on every other step.
        skipped: the optimizer did not take this step; ``skip_reason`` says who kept it.
        skip_reason: who kept the optimizer from taking the step: ``"guard"`` (``guard="skip"``),
            ``"scaler"`` (the ``GradScaler`` found an Inf/NaN gradient: counted in
            ``distmon_scaler_skipped_steps_total``, not as non-finite), or ``""`` (nobody).
    """

    step: int
    timestamp: float
    grad_norm: float
    layer_grad_norms: dict[str, float] = field(default_factory=dict)
    rank_grad_norms: list[float] = field(default_factory=list)
    rank_layer_grad_norms: list[list[float]] | None = None
    nonfinite: bool = False
    nonfinite_ranks: list[int] = field(default_factory=list)
    first_nonfinite: tuple[int, str] | None = None
    events: tuple[AnomalyEvent, ...] = ()
    monitor_errors: int = 0
    valid: bool = True
    run_id: str = ""
    world_size: int = 1
    scores: dict[str, float] = field(default_factory=dict)
    rank_outlier_scores: list[float] = field(default_factory=list)
    skipped: bool = False
    rank_monitor_errors: list[int] = field(default_factory=list)
    skip_reason: SkipReason = ""
    gradient_noise_scale: float = math.nan
    layer_gradient_noise_scale: dict[str, float] = field(default_factory=dict)
    layer_noise_signal: dict[str, float] = field(default_factory=dict)
    noise_trace: float = math.nan
    noise_signal: float = math.nan
    activation_rms: dict[str, float] = field(default_factory=dict)
    activation_absmax: dict[str, float] = field(default_factory=dict)
    first_nonfinite_activation: tuple[int, str] | None = None
    layer_update_ratio: dict[str, float] = field(default_factory=dict)
    attention_logit_bound: dict[str, float] = field(default_factory=dict)
    gradient_cosine: float = math.nan
    divergence_warning: bool = False
    rank_valid: list[bool] = field(default_factory=list)
    first_nonfinite_coords: dict[str, str] | None = None
    restart: int = 0
    resumed_from: int | None = None
    ranks: list[int] = field(default_factory=list)
    node: int = 0
    nonfinite_rank_count: int = 0


def _clean(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_jsonable(snap: Snapshot) -> dict[str, object]:
    """The snapshot as strict-JSON data: non-finite floats become the strings "nan"/"inf"/"-inf".

    Example:
        >>> s = Snapshot(step=1, timestamp=0.0, grad_norm=float("nan"), nonfinite=True)
        >>> to_jsonable(s)["grad_norm"]
        'nan'
    """
    return _clean(asdict(snap))
