"""The device ring: step -> row mapping and the bulk reset of exported rows (wrapping)."""

from __future__ import annotations

import pytest
import torch

from distmon.step.ring import DeviceRing
from distmon.step.rows import RowPlan


@pytest.mark.parametrize("first,last", [(1, 4), (3, 6), (4, 5), (6, 6), (5, 8)])
def test_reset_blanks_exactly_the_rows_of_the_given_steps(first, last):
    step_row = RowPlan.build(n_layers=1, world=1, rank_layers=False).step
    ring = DeviceRing(4, step_row, torch.device("cpu"))
    ring.data.copy_(torch.arange(4.0)[:, None] + 10.0)  # row i holds 10 + i everywhere
    blank = -torch.arange(float(step_row.width))  # 0, -1, -2, ...: unlike any ring row
    ring.reset(first, last, blank)
    blanked = {(s - 1) % 4 for s in range(first, last + 1)}  # steps 1, 5, 9... share row 0
    for i in range(4):
        want = blank.tolist() if i in blanked else [10.0 + i] * step_row.width
        assert ring.data[i].tolist() == want, (first, last, i)
