"""One optimizer step's life on the device: the source's sums, the collective, the ring row, the export.

A step goes through four points, each called on every rank in the same program order:

1. the source hands each backward's local and reduced sums of squares to
   :class:`~distmon.step.backward.BackwardSums` (from DDP's comm hook, FSDP's reduce-scatter, or
   read at the step);
2. :meth:`StepSchedule.before_step`, when the optimizer step begins (or ``clip_grad_norm_``
   or the guard needs the step's figures): the local sums are folded into layers, this
   rank's row is kept for the next export, and the step's one collective starts
   (:class:`~distmon.step.exchange.Exchange`);
3. :meth:`StepSchedule.after_step`, when the optimizer step ends: the reduced sums are folded
   into the step's ring row; an export step exports;
4. :meth:`StepSchedule.export` (also on ``flush``): rows not yet judged are judged
   (:class:`~distmon.verdicts.judge.Judge`), copied to the host and handed to the export thread.

Every method catches its own failures, counts them and degrades (the step's figures are
marked invalid); the collective is issued whatever failed locally (``exchange.py`` says why).
Should :meth:`StepSchedule.before_step` or :meth:`StepSchedule.after_step` raise all the same,
the step hooks call ``begin_anyway`` / ``end_anyway``: the step still issues its collective and
is counted, as on every other rank.

The data path of the global norm through these points, hop by hop, is
:mod:`distmon.step.data_path` (traced by ``tests/test_data_path.py``). With a guard (or
``clip_grad_norm_``) the step's figures are taken before the optimizer step (``judge_now``,
``finish_total_sq``); ``flush()`` and ``close()`` export on the caller's thread.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ErrorCounter, logger
from ..layout.verify import agrees, refusal
from ..snapshot import SkipReason
from ..sources.base import Source
from ..verdicts.detectors import DeviceDetector
from ..verdicts.judge import Judge
from ..verdicts.noise_scale import NoiseScale
from ..verdicts.precursor import PrecursorDetector
from .activations import ActivationWatch
from .attention_watch import AttentionWatch
from .backward import BackwardSums, StepState
from .exchange import Exchange
from .grad_cosine import GradientCosine
from .release import RELEASE_S
from .ring import DeviceRing, ExportBatch, ExportQueue, StepInfo
from .rows import LOCAL_NONFINITE_ONLY, Head, RowPlan
from .update_ratio import UpdateRatio

__all__ = ["StepSchedule"]


class StepSchedule:
    """The per-step schedule of one monitor on one rank.

    ``step`` counts finished optimizer steps; the step in progress writes ring row
    ``step + 1``. An ordinary step costs the source's two fused passes over the gradients
    (local and reduced), one fold of each into per-layer sums, the copy of this rank's row
    into the rows kept for the next export and a fixed-size all-reduce (rank 0's export vote, a
    layout in parts's shard sums; none when there is neither), whose wait is left to the next
    step. Judging a row waits for the export, batched over the steps since the last one,
    unless a step's figures are needed before its ``optimizer.step()`` (guard,
    ``clip_grad_norm_``). In one process (no group) nothing is issued.

    Example:
        >>> from distmon.layout.grouping import build_grouping
        >>> from distmon.step.loss_scale import LossScale
        >>> from distmon.sources.plain import PlainSource
        >>> net, errors, cpu = torch.nn.Linear(2, 1), ErrorCounter(), torch.device("cpu")
        >>> plan = RowPlan.build(n_layers=1, world=1)
        >>> sums = BackwardSums(n_layers=1, device=cpu, loss_scale=LossScale(), errors=errors)
        >>> source = PlainSource(net, receiver=sums, grouping=build_grouping(net, None, 8))
        >>> schedule = StepSchedule(plan, sums=sums, source=source, group=None, export_every=10,
        ...                        errors=errors, exports=ExportQueue())
        >>> schedule.before_step(); schedule.finish_row_valid()   # an optimizer step, no backward before
        False
        >>> schedule.after_step(); schedule.step
        1
    """

    def __init__(
        self,
        plan: RowPlan,
        *,
        sums: BackwardSums,
        source: Source,
        group: dist.ProcessGroup | None,
        export_every: int,
        errors: ErrorCounter,
        exports: ExportQueue,
        export_interval_s: float = 0.0,
        in_parts: bool = False,
        detector: DeviceDetector | None = None,
        noise: NoiseScale | None = None,
        batch_size: Callable[[], float] | None = None,
        activations: ActivationWatch | None = None,
        activation_every: int = 1,
        update_ratio: UpdateRatio | None = None,
        attention: AttentionWatch | None = None,
        cosine: GradientCosine | None = None,
        precursor: PrecursorDetector | None = None,
        check: Callable[[], tuple[float, float]] | None = None,
        node_group: dist.ProcessGroup | None = None,
        node_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.plan, self.sums, self.source, self.errors = plan, sums, source, errors
        self.export_every = export_every
        self.ring = DeviceRing(export_every, plan.step, sums.device)
        self.exchange = Exchange(
            plan,
            ring=self.ring,
            group=group,
            export_every=export_every,
            export_interval_s=export_interval_s,
            errors=errors,
            order=sums.order,
            in_parts=in_parts,
            node_group=node_group,
            node_ranks=node_ranks,
        )
        self.judge = Judge(
            plan.step,
            detector=detector,
            noise=noise,
            errors=errors,
            cross=self.exchange.cross,
            precursor=precursor,
        )
        self.batch_size = batch_size  # this rank's batch this step, for the gradient noise scale
        self.activations, self.activation_every = activations, activation_every
        self.update_ratio = update_ratio
        # the precursor's attention blocks, read on the forwards of every sample_every-th step, and
        # its consecutive gradients' cosine, read at every step and sampled with them
        self.attention, self.cosine = attention, cosine
        self.sample_every = precursor.cfg.every if precursor is not None else 1
        self.exports = exports  # where the export thread reads each export's host copy
        # a layout in parts' first-step check (verify.py): the job's squared norm as distmon reads
        # the layout and computed another way, from the same gradients
        self._check = check
        self.misread: str | None = None  # why the check refused every figure (None: it did not)
        self._blank = plan.step.blank(sums.device)
        self.ring.reset(1, export_every, self._blank)
        # the send row may hold something other than "none" (it starts zeroed): write it once
        self._act_sent = True
        self._signals_sent = True  # likewise: the send row starts at 0, not "not sampled"
        self.step = 0
        self.measured_steps = 0  # steps whose reduced figures were measured (a backward ran)
        self.scaler_run = 0  # consecutive steps the GradScaler skipped, through the latest
        self._exported_through = 0
        self._judged_through = 0
        self._finished: list[tuple[float, SkipReason]] = [(0.0, "")] * export_every  # per slot
        self._valid = [False] * export_every  # per slot: the reduced figures were measured
        self._new_step()
        self._watch_next()  # step 1's forwards

    def resume_at(self, step: int) -> None:
        """Count on from ``step``, the last step of the run this one resumes.

        Only before a step here measured anything: steps without a backward may have been
        counted (``torch.distributed.checkpoint`` initializes an empty optimizer's state with an
        ``optimizer.step()`` at lr 0 while it loads); their rows are dropped.
        """
        assert self.measured_steps == 0, "resume_at after a measured step"
        self.exchange.complete()  # such a step's collective, before its rows are dropped
        self.ring.reset(1, self.export_every, self._blank)
        self._valid = [False] * self.export_every
        self.step = self._exported_through = self._judged_through = step
        self.exchange.resume_at(step)
        self._new_step()
        self._watch_next()

    @property
    def active(self) -> bool:
        """False once the monitor closed: nothing more is measured."""
        return not self.sums.closed

    def close(self) -> None:
        """Stop measuring; return once the backend's thread let go of the monitor's collectives
        (``release.py``: the program may end right after, and that thread must not take the GIL
        while the interpreter finalizes)."""
        self.sums.close()
        if not self.exchange.buffers.let_go(RELEASE_S):
            logger.warning(
                "distmon: the process group's thread still holds the tensors of distmon's last "
                "collective %.0f s after it completed; if the program ends now, the interpreter "
                "may abort at exit (terminate called without an active exception): end it with "
                "torch.distributed.destroy_process_group(), which waits for that thread",
                RELEASE_S,
            )

    def _new_step(self) -> None:
        self.sums.new_step()

    def _read_gradients(self) -> None:
        """A source that reads the gradients when the step's figures are first needed reads them now."""
        if StepState.READ not in self.sums.state:
            self.sums.state |= StepState.READ
            self.source.read_at_step()

    def fail(self, site: str, local: bool = True, reduced: bool = True) -> None:
        """Count a failure at ``site`` (logged once); this step's figures on this rank become invalid."""
        self.sums.fail(site, local=local, reduced=reduced)

    # -- the optimizer step begins ------------------------------------------------------------
    def before_step(self) -> None:
        """Fold this rank's local sums, keep its row, start the step's collective.

        Once per step, called when the optimizer step begins, on every rank: the source's
        reduction has completed by then, so the collective cannot interleave with its
        collectives.
        """
        if not self.active or StepState.BEGUN in self.sums.state:
            return
        self.sums.state |= StepState.BEGUN
        self._read_gradients()
        self.sums.freeze()
        step = self.step + 1
        if self.cosine is not None:
            try:
                self.cosine.step()  # the gradients the optimizer is about to use
            except Exception:
                self.errors.record("gradient cosine")
                self.cosine.reset()
        ratio = self.update_ratio
        if ratio is not None and self.exchange.scheduled(step):
            try:
                ratio.begin()  # the parameters before this scheduled export step's update (known in advance)
            except Exception:
                self.errors.record("update ratio")
        ex, sums = self.exchange, self.sums
        ex.complete()  # the previous step's collective, before its buffers are written again
        try:
            self._pack(ex, sums)
        except Exception:
            self.fail("rank exchange (pack)")
            ex.invalidate()  # its vote and first bad module: none
            self._act_sent = self._signals_sent = False
        try:
            ex.start(step)
        except Exception:
            self.fail("rank exchange (collective)")
        if self._check is not None:
            self._first_step_check()

    def _first_step_check(self) -> None:
        """Once, on the first step measured on every rank with a finite figure: the global norm as
        distmon reads the layout against a placement-aware one, both from the gradients as they
        are now (a host sync and collectives, at the same point on every rank: the decision rests
        on all-reduced figures, the same everywhere)."""
        try:
            measured_sq = float(self.finish_total_sq())
            if self.ring.row(self.step + 1)[Head.VALID].item() != 1.0 or not math.isfinite(measured_sq):
                return  # not this step: the next one
            check, self._check = self._check, None
            read_sq, direct_sq = check()
            # every rank decides alike: a part some rank computes differently (copies that are
            # not equal) is a misread layout too
            wrong = torch.tensor([0.0 if agrees(read_sq, direct_sq) else 1.0], device=self.sums.device)
            if self.exchange.collective:
                dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=self.exchange.buffers.group)
            if wrong.item():
                self.misread = refusal(read_sq, direct_sq)
                self.errors.note("layout check", 1, self.misread)
                self.ring.row(self.step + 1)[Head.VALID].fill_(0.0)
                self._valid[self.ring.slot(self.step + 1)] = False
        except Exception:
            self._check = None
            self.errors.record("layout check")

    def _pack(self, ex: Exchange, sums: BackwardSums) -> None:
        """This rank's row of the step: its local sums, its shard's reduced sums, its flags."""
        buf = ex.buffers
        sums.fold_local(buf.layer_sq)
        if ex.in_parts:  # the reduced sums of the parts this rank counts
            sums.fold_reduced(buf.parts_sq)
        buf.pack(
            sums.order.device,
            errors=self.errors.count,
            valid=(1.0 if sums.local_exact else LOCAL_NONFINITE_ONLY)
            if sums.local_ok and sums.measured
            else 0.0,
            reduced_ok=sums.reduced_ok and sums.measured,
            batch=float(self.batch_size()) if self.batch_size is not None else 0.0,
        )
        watch = self.activations
        # this rank's first non-finite module travels in its row; the send row keeps "none"
        # between activation steps, so those write nothing
        if watch is not None and (watch.active or self._act_sent):
            buf.send[self.plan.rank.act_first].copy_(watch.first_module if watch.active else watch.none)
            self._act_sent = watch.active
        attention, cosine = self.attention, self.cosine
        # a sampled step's samples travel in its row to the export's MAX over the ranks; between
        # samples the send row keeps -inf ("not sampled"), so those steps write nothing
        on = attention is not None or cosine is not None
        if on and (self.step + 1) % self.sample_every == 0:
            signals = buf.send[self.plan.rank.signals]
            n = self.plan.rank.n_attention
            if attention is not None:
                attention.bounds(signals[:n])
                attention.active = False  # the step's forwards are over: none counts until the next sample
            if cosine is not None:
                cosine.sample(signals[n:])
            self._signals_sent = True
        elif on and self._signals_sent:
            buf.send[self.plan.rank.signals].fill_(-math.inf)
            self._signals_sent = False

    # -- the step's reduced figures -----------------------------------------------------------
    def finish_row(self) -> torch.Tensor:
        """Fold the step in progress's reduced sums into its row and mark it measured or not (once per
        step); returns the row.

        Without a backward this step (an ``optimizer.step()`` alone) the row is marked invalid:
        nothing was measured, and nothing real-looking must be reported.
        """
        step = self.step + 1
        row = self.ring.row(step)
        if StepState.ROW in self.sums.state:
            return row
        self.sums.state |= StepState.ROW
        self._read_gradients()
        sums = self.sums
        try:
            if not self.exchange.in_parts:  # a layout in parts' come with the step's collective
                layers = self.ring.layers(step)
                sums.fold_reduced(layers)  # this rank's, in place: every rank's are the same
                self.ring.land_reduced(step, layers)
            valid = sums.reduced_ok and sums.measured and self.misread is None
        except Exception:
            self.fail("step row", local=False)
            valid = False
        if not valid:
            row[Head.VALID].fill_(0.0)
        self._valid[self.ring.slot(step)] = valid
        return row

    def _reduced_now(self) -> torch.Tensor:
        """The step in progress's row with its reduced sums in (a layout in parts' need its collective)."""
        if self.exchange.in_parts:
            self.before_step()
            self.exchange.complete()  # a stream wait on NCCL; the shards' sums are needed now
        return self.finish_row()

    def finish_total_sq(self) -> torch.Tensor:
        """Finish the step in progress's row (:meth:`finish_row`) and write its total into it: the
        reduced sum of squares, as a 0-d device tensor (no collective)."""
        return self._reduced_now()[Head.TOTAL_SQ]  # written where the reduced sums land

    def judge_now(self) -> torch.Tensor:
        """Judge the step in progress now (a guard's verdict before ``optimizer.step()``); returns its row."""
        self.before_step()
        row = self._reduced_now()
        self._judge(self.step + 1)
        return row

    def finish_row_valid(self) -> bool:
        """Finish the step in progress's row (:meth:`finish_row`); whether it was measured (host state:
        no sync)."""
        self.finish_row()
        return self._valid[self.ring.slot(self.step + 1)]

    # -- the optimizer step ends --------------------------------------------------------------
    def after_step(self, skip: SkipReason = "") -> None:
        """The step ended (optimizer post-hook, or a skip and why: ``"guard"``, ``"scaler"``).

        Closes its row and exports on schedule.
        """
        if not self.active:
            return
        self.before_step()  # a step whose start was not seen still sends its (invalid) row
        row = self.finish_row()
        watch = self.activations
        if watch is not None and watch.active:  # after its row took the first bad module
            try:
                watch.close_step(row[self.plan.step.act])
            except Exception:
                self.errors.record("activation statistics")
                watch.reset()  # what it did not: the next step's statistics start afresh
        if self.update_ratio is not None and self.update_ratio.taken:
            try:
                self.update_ratio.end(row[self.plan.step.upd])
            except Exception:
                self.errors.record("update ratio")
        self._count(skip)

    def _count(self, skip: SkipReason) -> None:
        """The step is over: count it, ready the next one, export on schedule."""
        self.step += 1
        self.measured_steps += self._valid[self.ring.slot(self.step)]
        self.scaler_run = self.scaler_run + 1 if skip == "scaler" else 0
        self._finished[self.ring.slot(self.step)] = (time.time(), skip)
        self._new_step()
        self._watch_next()
        if self.exchange.exports(self.step):
            self.export()

    def _watch_next(self) -> None:
        """Whether the next step's forwards are watched: activations, the precursor's samples."""
        step = self.step + 1
        if self.activations is not None:
            self.activations.active = step % self.activation_every == 0
        if self.attention is not None:
            self.attention.active = step % self.sample_every == 0

    # -- the step's own code raised (the step hooks call these) -------------------------------
    def begin_anyway(self) -> None:
        """:meth:`before_step` raised: begin the step all the same, its collective issued as on every rank.

        This rank's row then says "no figures". A failure on one rank must not leave the ranks'
        collectives unmatched (the job would hang at the next one), nor a step uncounted (every
        later step would be reported under the number of the one before). The caller counts the
        failure; this one's own would be counted here.
        """
        if not self.active:
            return
        self.sums.state |= StepState.BEGUN
        try:
            self._read_gradients()  # and the source's own start of a step (FSDP: the units seen)
        except Exception:
            self.errors.record("step schedule")
        try:
            self.sums.freeze()
            ex, step = self.exchange, self.step + 1
            if ex.started < step:
                ex.complete()
                ex.invalidate()
                self._act_sent = self._signals_sent = False
                ex.start(step)
        except Exception:
            self.errors.record("step schedule")

    def end_anyway(self, step: int, skip: SkipReason = "") -> None:
        """:meth:`after_step` of ``step`` raised: count the step and export on schedule all the same.

        A step not counted yet reports no figures (NaN, not valid); its activation statistics
        and update-ratio copy are dropped, so that the next step's start afresh.
        """
        if not self.active:
            return
        try:
            if self.step < step:
                self.begin_anyway()
                self.sums.state |= StepState.ROW
                self.ring.row(step)[Head.VALID].fill_(0.0)
                self._valid[self.ring.slot(step)] = False
                if self.activations is not None:
                    self.activations.reset()
                if self.attention is not None:
                    self.attention.reset()
                if self.cosine is not None:
                    self.cosine.reset()
                if self.update_ratio is not None:
                    self.update_ratio.taken = False
                self._count(skip)
            elif self.exchange.exports(step) and self._exported_through < step:
                self.export()
        except Exception:
            self.errors.record("step schedule")

    # -- a checkpoint ---------------------------------------------------------------------------
    def learned(self) -> tuple[DeviceDetector | None, NoiseScale | None, PrecursorDetector | None]:
        """What the run has learned through the latest finished step, without a collective and
        without changing the run: callable on one rank alone (a checkpoint saved by rank 0).

        The reduced-figure verdicts of the steps not judged yet are judged on copies (the
        detector's and the rows'), as the next export will judge them; the verdicts that compare
        ranks (rank outliers, the noise scale, the precursor's MAX over the ranks) are as of the
        latest export: the
        other ranks' figures of the steps since are theirs until then. A layout in parts' last
        reduced sums come with its step's collective, already issued on every rank: waited here.
        """
        self.exchange.complete()
        detector = self.judge.detector
        first, last = self._judged_through + 1, self.step
        if detector is not None and last >= first:
            detector = copy.deepcopy(detector)
            a = self.ring.slot(first)
            rows = self.ring.span(first, last).clone()
            Judge(self.plan.step, detector=detector, noise=None, errors=self.errors).judge_reduced(
                rows, self._valid[a : a + len(rows)]
            )
        return detector, self.judge.noise, self.judge.precursor

    # -- exports ------------------------------------------------------------------------------
    def _judge(self, through: int) -> None:
        """Totals and reduced-figure verdicts of the steps up to ``through``, in one batch."""
        first = self._judged_through + 1
        if through < first:
            return
        self._judged_through = through
        a = self.ring.slot(first)
        rows = self.ring.span(first, through)
        self.judge.judge_reduced(rows, self._valid[a : a + len(rows)])

    def export(self, gather: bool = True, timeout_s: float | None = None) -> None:
        """Judge the finished rows not yet exported, copy them to the host (non-blocking), hand them over.

        The steps not yet exported are exchanged first (the node's ranks' rows gathered within
        the node, the job-wide figures in two fixed-size reductions over the job): collectives, so
        with several ranks call it on every rank at the same point. ``gather=False`` (a rank
        closing on an exception, which the others may not share) exports what this rank
        has: its own figures, the other ranks' as not measured. The exported rows are then
        reset to the blank row (ordered after the copy on the device), ready for the steps
        that reuse them. Fewer than ``export_every`` steps are ever pending, so the row of a
        step in progress is never among them. ``timeout_s`` bounds the wait for the other ranks.
        """
        self.exchange.gather_rest(self.step, gather, timeout_s)
        first, last = self._exported_through + 1, self.step
        if last < first:
            return
        self._judge(last)
        a = self.ring.slot(first)
        rows = self.ring.span(first, last)
        self.judge.judge_ranks(rows, self._valid[a : a + len(rows)], a, first)
        self._exported_through = last
        self.exchange.last_export = time.monotonic()
        try:
            steps = tuple(
                StepInfo(s, i, *self._finished[i])
                for s, i in ((s, self.ring.slot(s)) for s in range(first, last + 1))
            )
            copy = self.ring.copy_to_host()
            self.ring.reset(first, last, self._blank)
            if copy is None:
                self.errors.note(
                    "export dropped",
                    len(steps),
                    "distmon: the export thread is two exports behind; this export's steps are "
                    "dropped (counted in distmon_monitor_errors_total) rather than hold training",
                )
            else:
                self.exports.put(ExportBatch(copy, steps))
        except Exception:
            self.errors.record("export")
