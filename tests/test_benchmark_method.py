"""The overhead benchmark's method: the order of a round's steps and the order check.

In-process and fast: these are the parts of the overhead benchmark (``benchmarks/overheadbench``)
whose mistakes no timing shows. Round orders that never swapped two copies once hid a cost of a
step's place in the round inside one copy's ratio (with two copies the old rotation and reversal
cancelled).
"""

import doctest
import importlib
import itertools
import os
import pkgutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import overheadbench  # noqa: E402
from overheadbench.runner import round_order  # noqa: E402
from overheadbench.stats import order_effect  # noqa: E402


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_every_copy_runs_in_every_place_equally_often(k):
    for start in range(2 * k):  # any 2k consecutive rounds, not only from round 0
        counts = {(c, p): 0 for c in range(k) for p in range(k)}
        for r in range(start, start + 2 * k):
            order = round_order(r, k)
            assert sorted(order) == list(range(k)), order
            for p, c in enumerate(order):
                counts[(c, p)] += 1
        assert set(counts.values()) == {2}, (k, start, counts)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_any_two_copies_swap_places_every_pair_of_rounds(k):
    for pair in range(3 * k):
        first, second = round_order(2 * pair, k), round_order(2 * pair + 1, k)
        for a, b in itertools.combinations(range(k), 2):
            assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b))


def test_two_copies_alternate_abba():
    assert [round_order(r, 2) for r in range(8)] == [[0, 1], [1, 0], [1, 0], [0, 1]] * 2


def test_order_check_separates_a_cost_of_the_place_from_a_cost_of_the_copy():
    # a copy 2% dearer than the baseline, and whichever steps second pays 10% more:
    # ratio 1.02 * 1.1 after the baseline, 1.02 / 1.1 before it
    rounds = 40
    orders = [round_order(r, 2) for r in range(rounds)]
    pos_base = [o.index(0) for o in orders]
    pos_copy = [o.index(1) for o in orders]
    base = [1.0 * (1.1 if p else 1.0) for p in pos_base]
    copy = [1.02 * (1.1 if p else 1.0) for p in pos_copy]
    out = order_effect(copy, base, pos_copy, pos_base)
    assert out.n_after == out.n_before == rounds // 2
    assert out.paired_after == pytest.approx(1.02 * 1.1)
    assert out.paired_before == pytest.approx(1.02 / 1.1)
    # the copy's own cost is the geometric mean of the two; the place's is their ratio's root
    assert (out.paired_after * out.paired_before) ** 0.5 == pytest.approx(1.02)
    assert order_effect(copy, base, [], []) is None


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.iter_modules(overheadbench.__path__)))
def test_the_examples_in_the_package_docstrings_hold(module):
    # benchmarks/ is outside pytest's doctest paths: its examples run here
    result = doctest.testmod(importlib.import_module(f"overheadbench.{module}"))
    assert result.failed == 0, module
