"""The data path of the global gradient norm, hop by hop, from a gradient to its Prometheus gauge.

A *hop* is one place the number (or the sums it is made of) passes to: computed, kept, landed,
copied, decoded, served. Each hop names the chain of calls that does it, outermost first: the
first is called by torch, the optimizer, a thread's loop or Prometheus' client, never by distmon;
each next one by the one before, with no function of distmon's between them. Two paths: DDP's
(every rank holds the whole reduced gradient: it folds its own sums into the step's row when the
optimizer step ends) and FSDP2's (a layout in parts: each rank's shard sums ride the step's
all-reduce and land at the next step). ``docs/how-it-works.md`` renders both tables
(``python -m distmon.doc_tables --write``); ``tests/test_data_path.py`` runs a DDP and an FSDP2
job under a tracer and fails when a chain here is not what the calls are.

Example:
    >>> len(DDP_PATH), DDP_PATH[0].calls[-1]
    (8, 'sq_sums')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hop", "DDP_PATH", "FSDP_PATH", "PATHS", "hop_rows"]


@dataclass(frozen=True)
class Hop:
    """One hop of the number: ``what`` it becomes there, the ``calls`` that take it there (outermost
    first, qualified names), the ``thread`` they run on and ``when``."""

    what: str
    calls: tuple[str, ...]
    thread: str
    when: str


_POST = ("StepHooks._finish", "StepHooks._end", "StepSchedule.after_step")  # the optimizer step ends
_EXPORT = (*_POST, "StepSchedule._count", "StepSchedule.export")  # ... on an export step
_THREAD = ("ExportThread._run", "ExportThread._export")

# what the export thread and a scrape do with a step's row, whatever the layout
_EXPORTED = (
    Hop(
        "the row copied to the host, non-blocking",
        (*_EXPORT, "DeviceRing.copy_to_host"),
        "training",
        "export step",
    ),
    Hop(
        "the snapshot's global norm: the square root of the total",
        (*_THREAD, "RowDecoder.decode"),
        "distmon-export",
        "after the copy",
    ),
    Hop(
        "the gauge's value, with the run's window maximum and histogram",
        (*_THREAD, "MetricsAggregate.add"),
        "distmon-export",
        "after the copy",
    ),
    Hop("`distmon_grad_norm`, read by a scrape", ("GradCollector.collect",), "HTTP worker", "a scrape"),
)

DDP_PATH: tuple[Hop, ...] = (
    Hop(
        "each reduced gradient's fp32 sum of squares, one fused read",
        ("DDPSource._read_reduced", "GradSums.read", "GradSums._sums", "sq_sums"),
        "training",
        "backward's end, behind DDP's finalize",
    ),
    Hop(
        "kept for the step",
        ("DDPSource._read_reduced", "BackwardSums.add_reduced"),
        "training",
        "backward's end",
    ),
    Hop(
        "the per-layer sums, folded into the step's row",
        (*_POST, "StepSchedule.finish_row", "BackwardSums.fold_reduced", "LayerFold.__call__"),
        "training",
        "the optimizer step ends",
    ),
    Hop(
        "landed with their total, the global norm squared",
        (*_POST, "StepSchedule.finish_row", "DeviceRing.land_reduced"),
        "training",
        "the optimizer step ends",
    ),
    *_EXPORTED,
)

FSDP_PATH: tuple[Hop, ...] = (
    Hop(
        "each shard's fp32 sum of squares (the parts this rank counts), one fused read",
        ("FSDPSource._backward_done", "GradSums.read", "GradSums._sums", "sq_sums"),
        "training",
        "backward's end, behind FSDP2's reduce-scatters",
    ),
    Hop(
        "kept for the step",
        ("FSDPSource._backward_done", "BackwardSums.add_reduced"),
        "training",
        "backward's end",
    ),
    Hop(
        "this rank's per-layer shard sums, folded into its send row",
        (
            "StepHooks._pre_hook",
            "StepHooks._begin",
            "StepSchedule.before_step",
            "StepSchedule._pack",
            "BackwardSums.fold_reduced",
            "LayerFold.__call__",
        ),
        "training",
        "the optimizer step begins",
    ),
    Hop(
        "summed over the ranks: the step's all-reduce (SUM), started",
        (
            "StepHooks._pre_hook",
            "StepHooks._begin",
            "StepSchedule.before_step",
            "Exchange.start",
            "RankBuffers.reduce",
        ),
        "training",
        "the optimizer step begins",
    ),
    Hop(
        "the job's per-layer sums landed with their total, the global norm squared",
        (
            "StepHooks._pre_hook",
            "StepHooks._begin",
            "StepSchedule.before_step",
            "Exchange.complete",
            "Exchange._land_parts",
            "DeviceRing.land_reduced",
        ),
        "training",
        "the next optimizer step begins",
    ),
    *_EXPORTED,
)

PATHS = {"DDP": DDP_PATH, "FSDP2": FSDP_PATH}


def hop_rows(path: tuple[Hop, ...]) -> str:
    """One path as a Markdown table: hop, what the number becomes, the calls, thread, when.

    Example:
        >>> hop_rows(DDP_PATH).splitlines()[0]
        '| hop | the number becomes | calls (outermost first) | thread | when |'
    """
    rows = [
        "| hop | the number becomes | calls (outermost first) | thread | when |",
        "|---:|---|---|---|---|",
    ]
    for i, hop in enumerate(path, 1):
        calls = " > ".join(f"`{c}`" for c in hop.calls)
        rows.append(f"| {i} | {hop.what} | {calls} | {hop.thread} | {hop.when} |")
    return "\n".join(rows) + "\n"
