"""The device ring: step -> row mapping and the bulk reset of exported rows (wrapping)."""

from __future__ import annotations

import pytest
import torch

from distmon.ring import DeviceRing, RowLayout


@pytest.mark.parametrize("first,last", [(1, 4), (3, 6), (4, 5), (6, 6), (5, 8)])
def test_reset_blanks_exactly_the_rows_of_the_given_steps(first, last):
    ring = DeviceRing(4, RowLayout(n_layers=1, world=1, rank_width=1, n_detector=1), torch.device("cpu"))
    ring.data.copy_(torch.arange(4.0)[:, None] + 10.0)  # row i holds 10 + i everywhere
    blank = torch.tensor([1.0, 0.0, 0.0, 0.0, -1.0])
    ring.reset(first, last, blank)
    blanked = {(s - 1) % 4 for s in range(first, last + 1)}  # steps 1, 5, 9... share row 0
    for i in range(4):
        want = blank.tolist() if i in blanked else [10.0 + i] * 5
        assert ring.data[i].tolist() == want, (first, last, i)
