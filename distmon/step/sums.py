"""Pure tensor math of the monitor: fused sums of squares and their fold into layers.

Nothing here knows about DDP, process groups or exporters; every function takes tensors and
returns or writes tensors on the same device, without a host sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compat import sq_sums_fp32

__all__ = [
    "sq_sums",
    "rows_sq_sum",
    "sparse_sq_sum",
    "fold_layers",
    "first_nonfinite",
    "stable_run",
    "prefix_ema",
    "ema_after",
    "run_lengths",
    "Runs",
    "LayerFold",
]


# On the CPU, torch's fused fp32 reduction (``_foreach_powsum``, ``vector_norm``: what
# ``clip_grad_norm_`` uses too) accumulates along the tensor, with an error that grows with its
# size: 6e-6 relative at 0.4M elements, 5e-3 at 40M (benchmarks/cpu_accuracy.py), and 2e-6 at
# 8K bf16 elements (their squares share few significant bits: roundings add up instead of
# cancelling). A tensor of more than two rows is reduced as rows (4,096 elements, 256 for
# 16-bit types), each row's norm on its own, then their squares summed by torch's pairwise
# sum: within 1e-7 at any size, for the same cost per byte. A GPU's fused kernel reduces in a
# tree already: one call there.
CPU_ROW = 4096
CPU_ROW_16 = 256  # for 16-bit gradients (bf16, fp16)


def cpu_row(t: torch.Tensor) -> int:
    """The row length :func:`rows_sq_sum` reduces ``t`` in."""
    return CPU_ROW if t.element_size() >= 4 else CPU_ROW_16


def sq_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 sum of squares of each tensor, as 0-d tensors (one fused pass over the bytes).

    A sum of squares is non-finite exactly when an element is non-finite (or when the sum
    overflows fp32, i.e. an element above ~1e19: an exploded gradient either way). Sources
    pass complex gradients as their real views (``torch.view_as_real``), made once with
    their layout, so ``|z|^2 = re^2 + im^2`` is what is summed. On the CPU, tensors of more
    than two rows (:func:`cpu_row`) are summed by rows (:func:`rows_sq_sum`), for accuracy.

    Example:
        >>> [float(s) for s in sq_sums([torch.tensor([3.0, 4.0]), torch.view_as_real(torch.tensor([1j]))])]
        [25.0, 1.0]
    """
    if not tensors or tensors[0].device.type != "cpu":
        return sq_sums_fp32(tensors)  # torch._foreach_powsum, or its fallback before torch 2.11
    large = [t.numel() > 2 * cpu_row(t) for t in tensors]
    if not any(large):
        return sq_sums_fp32(tensors)
    small = iter(sq_sums_fp32([t for t, big in zip(tensors, large) if not big]) if not all(large) else ())
    return [rows_sq_sum(t) if big else next(small) for t, big in zip(tensors, large)]


def rows_sq_sum(t: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of ``t`` from rows of :func:`cpu_row` elements: each row's norm
    alone, their squares summed pairwise (a CPU's fused reduction drifts over many elements;
    rows keep every accumulation short).

    Example:
        >>> g = torch.full((3 * CPU_ROW + 5,), 0.5)
        >>> float(rows_sq_sum(g)) == (3 * CPU_ROW + 5) * 0.25
        True
    """
    flat, row = t.reshape(-1), cpu_row(t)
    k = flat.numel() // row
    rows = torch.linalg.vector_norm(flat[: k * row].view(k, row), dim=1, dtype=torch.float32)
    total = rows.square_().sum()
    if flat.numel() > k * row:
        total = total + sq_sums_fp32([flat[k * row :]])[0]
    return total


def sparse_sq_sum(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of a sparse COO gradient: of its values once coalesced.

    An embedding's sparse gradient repeats the rows of repeated indices; the gradient is
    their sum, so duplicates are added up (``coalesce``) before squaring.

    Example:
        >>> g = torch.sparse_coo_tensor([[0, 0, 2]], [[1.0], [2.0], [2.0]], (3, 1))
        >>> float(sparse_sq_sum(g))  # rows (1 + 2) and 2: 9 + 4
        13.0
    """
    values = grad.coalesce().values()
    return sq_sums([torch.view_as_real(values) if values.is_complex() else values])[0]


def fold_layers(
    sums: Sequence[torch.Tensor],
    layer_of: torch.Tensor,
    *,
    stage: torch.Tensor,
    zeros: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write into ``out`` the per-layer totals of 0-d ``sums`` (``sums[i]`` belongs to layer ``layer_of[i]``).

    Two ops whatever the number of sums: a stack into the preallocated ``stage``, then one
    ``index_add`` from ``zeros`` (shaped like ``out``). ``index_add`` rather than a 0/1 matmul,
    because ``NaN * 0`` would spread one bad parameter's NaN into every layer.

    Example:
        >>> out = torch.empty(2)
        >>> fold_layers([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)],
        ...             torch.tensor([1, 0, 1]), stage=torch.empty(3), zeros=torch.zeros(2), out=out)
        >>> out.tolist()
        [2.0, 5.0]
    """
    torch.stack(list(sums), out=stage)
    torch.index_add(zeros, 0, layer_of, stage, out=out)


def first_nonfinite(layer_sq: torch.Tensor, layer_order: torch.Tensor, out: torch.Tensor) -> None:
    """Write into the 0-d ``out`` the layer index that is non-finite and earliest in ``layer_order``.

    ``layer_order[l]`` is layer l's position in backward order; ``out`` becomes -1 when every
    layer is finite. Done on the device so the answer travels with the step's packed row.

    Example:
        >>> out = torch.empty(())
        >>> first_nonfinite(torch.tensor([1.0, float("nan"), float("inf")]),
        ...                 torch.tensor([0.0, 2.0, 1.0]), out)
        >>> int(out)
        2
    """
    bad = ~torch.isfinite(layer_sq)
    pos, idx = torch.where(bad, layer_order, torch.inf).min(0)
    out.copy_(torch.where(torch.isfinite(pos), idx.to(out.dtype), -1.0))


def stable_run(alpha: float) -> int:
    """The most rows :func:`prefix_ema` should take at once: ``(1 - alpha)^-n`` stays below ~1e6.

    Example:
        >>> stable_run(0.05)
        269
    """
    return max(1, int(13.8 / -math.log(1 - alpha)))


def prefix_ema(
    state: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The EMA ``s <- (1 - alpha) s + alpha y_t`` over the rows of ``y`` where ``mask``, in closed form.

    Returns ``(before, after)``: the state before each row (``(k, ...)``) and after the last.
    Rows masked out leave the state as it was, and their (possibly non-finite) values never
    enter a product. Exact, with prefix sums instead of a loop over rows: the state before
    row t is ``(1 - alpha)^N_t (state + sum_{s<t} alpha y_s (1 - alpha)^-N_{s+1})`` with ``N_t``
    the kept rows before t (give it runs of at most :func:`stable_run` rows, so that
    ``(1 - alpha)^-N`` stays moderate).

    Example:
        >>> before, after = prefix_ema(torch.tensor([0.0]), torch.tensor([[1.0], [1.0]]),
        ...                            torch.tensor([[True], [True]]), 0.5)
        >>> before.flatten().tolist(), after.tolist()  # 0 -> 0.5 -> 0.75
        ([0.0, 0.5], [0.75])
    """
    m = mask.to(y.dtype)
    kept_through = m.cumsum(0)
    contrib = torch.where(mask, alpha * y, 0.0) * (1 - alpha) ** -kept_through
    through = contrib.cumsum(0)
    before = (1 - alpha) ** (kept_through - m) * (state + through - contrib)
    return before, (1 - alpha) ** kept_through[-1] * (state + through[-1])


def run_lengths(flag: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """Length of the run of consecutive True ``flag`` rows ending at each row (0 where False).

    ``carried`` is the run length at the end of the previous rows (continued by a leading run).

    Example:
        >>> run_lengths(torch.tensor([True, True, False, True]), torch.tensor(2.0)).tolist()
        [3.0, 4.0, 0.0, 1.0]
    """
    count = flag.float().cumsum(0)
    reset = ~flag
    return (
        count
        - torch.where(reset, count, 0.0).cummax(0).values
        + torch.where(reset.cumsum(0) == 0, carried, 0.0)
    )


def ema_after(state: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """The EMA's state after each row of ``y`` (rows where ``mask`` is False leave it), from ``state``.

    :func:`prefix_ema` in runs of :func:`stable_run` rows: the state after a row is the state
    before the next.

    Example:
        >>> ema_after(torch.tensor([0.0]), torch.tensor([[1.0], [1.0]]), torch.tensor([[True], [False]]), 0.5)
        tensor([[0.5000],
                [0.5000]])
    """
    chunk, out = stable_run(alpha), []
    for i in range(0, len(y), chunk):
        before, state = prefix_ema(state, y[i : i + chunk], mask[i : i + chunk], alpha)
        out += [before[1:], state.unsqueeze(0)]
    return torch.cat(out)


@dataclass
class Runs:
    """A set of views measured by one fused call, and the layer each view belongs to.

    A source (one DDP bucket, say) measures its views in one ``sq_sums`` call; ``seq`` numbers
    the sets in creation order, so a backward's sets fold in the same order whatever order
    they were measured in.
    """

    layer_ids: tuple[int, ...]  # layer of each view
    seq: int
    device: torch.device  # where the views live

    @functools.cached_property
    def layers(self) -> torch.Tensor:
        """:attr:`layer_ids` on the device (int64), made once."""
        return torch.tensor(self.layer_ids, dtype=torch.int64, device=self.device)


@dataclass(frozen=True)
class _FoldPlan:
    """How the sums of one combination of run sets become per-layer sums."""

    order: list[int] | None  # every layer exactly once: the sums in layer order, one stack folds them
    layer_of: torch.Tensor  # otherwise: the layer of each sum, for an index_add
    stage: torch.Tensor  # ...from this scratch


class LayerFold:
    """Folds the per-view sums of a backward's run sets into per-layer sums, two ops at most.

    Each combination of run sets seen (DDP's buckets before and after its rebuild, say) gets
    one cached plan. When every layer is exactly one view (a module's parameters end to end,
    the usual case), the fold is one stack in layer order; otherwise a stack and an
    ``index_add``. Layers without a view get 0.

    Example:
        >>> fold = LayerFold(2, torch.device("cpu"))
        >>> runs = Runs((1, 0), seq=0, device=torch.device("cpu"))
        >>> out = torch.empty(2)
        >>> fold([(runs, [torch.tensor(4.0), torch.tensor(9.0)])], out)
        >>> out.tolist()
        [9.0, 4.0]
    """

    def __init__(self, n_layers: int, device: torch.device) -> None:
        self.n_layers = n_layers
        self.device = device
        self._plans: dict[tuple[int, ...], _FoldPlan] = {}
        self._zeros = torch.zeros(n_layers, dtype=torch.float32, device=device)

    def __call__(self, pending: list[tuple[Runs, list[torch.Tensor]]], out: torch.Tensor) -> None:
        """Write into ``out`` the per-layer totals of ``pending`` (sorted in place by ``seq``)."""
        if not pending:
            out.zero_()
            return
        if len(pending) > 1:
            pending.sort(key=lambda entry: entry[0].seq)
        key = tuple(runs.seq for runs, _ in pending)
        plan = self._plans.get(key) or self._plan(key, pending)
        sums = [s for _, run_sums in pending for s in run_sums]
        if plan.order is not None:
            torch.stack([sums[i] for i in plan.order], out=out)
        else:
            fold_layers(sums, plan.layer_of, stage=plan.stage, zeros=self._zeros, out=out)

    def _plan(self, key: tuple[int, ...], pending: list[tuple[Runs, list[torch.Tensor]]]) -> _FoldPlan:
        ids = [layer for runs, _ in pending for layer in runs.layer_ids]
        bijective = sorted(ids) == list(range(self.n_layers))
        plan = _FoldPlan(
            order=sorted(range(len(ids)), key=ids.__getitem__) if bijective else None,
            layer_of=torch.cat([runs.layers for runs, _ in pending]),
            stage=torch.zeros(len(ids), device=self.device),
        )
        self._plans[key] = plan
        return plan
