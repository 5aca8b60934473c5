"""The job's reading of its layout at start-up (#27), in one process: the judgement of a parameter's
holders (:func:`distmon.layout.census.rule`) on every kind of disagreement between the reading of the
object passed and the values the ranks hold, and the value fingerprints it rests on. The
protocol on real ranks is the property test's (``tests/test_layout_property.py``).
"""

from __future__ import annotations

import torch

from distmon.layout.census import (
    COUNTED,
    DECLARED,
    DISTINCT,
    FP0,
    LAYER,
    N_FIELDS,
    NAME,
    RANK,
    SLOT,
    UNDECLARED,
    Ruling,
    distinct_sq,
    fingerprint,
    rule,
)


def rec(
    rank: int,
    value: int,
    counted: bool,
    *,
    name: int = 7,
    slot: int = 1,
    declared: bool = False,
    layer: int = 5,
    undeclared: bool = False,
    distinct: int = 0,
) -> tuple[int, ...]:
    """One rank's record of one parameter, as the owner of its name receives it."""
    out = [0] * N_FIELDS
    out[NAME], out[SLOT], out[RANK], out[LAYER] = name, slot, rank, layer
    out[FP0] = value  # a fingerprint of the values (FP1 left 0)
    out[COUNTED], out[DECLARED], out[UNDECLARED] = int(counted), int(declared), int(undeclared)
    out[DISTINCT] = distinct
    return tuple(out)


def codes(records: list[tuple[int, ...]]) -> list[int]:
    return [code for code, _, _ in rule(records)]


def test_copies_counted_once_and_a_stage_s_own_parameters_pass():
    # DDP's group: identical values, rank 0 counts; another stage's parameter held by its ranks only
    records = [rec(0, 11, True), rec(1, 11, False), rec(2, 12, True, name=8), rec(3, 12, False, name=8)]
    assert codes(records) == [Ruling.OK] * 4
    assert [holders for _, _, holders in rule(records)] == [2, 2, 2, 2]


def test_a_copy_of_a_part_that_nobody_counts_is_counted_on_its_lowest_rank():
    # taken for a copy along a mesh dimension whose other coordinates hold no such parameter
    assert codes([rec(2, 11, False), rec(3, 11, False)]) == [Ruling.COUNT, Ruling.OK]


def test_values_that_differ_where_copies_were_expected_are_refused():
    # plain per-rank experts in FSDP2 on an expert-data-parallel mesh: ep rank 1 taken for a copy
    assert codes([rec(0, 11, True), rec(1, 12, False)]) == [Ruling.OK, Ruling.COPIES_DIFFER]
    # several values, none counted: nothing says which is which
    assert codes([rec(0, 11, False), rec(1, 12, False)]) == [Ruling.AMBIGUOUS] * 2


def test_one_value_counted_twice_is_refused_unless_declared():
    # two DDP jobs on pairs of ranks, seeded alike
    assert codes([rec(0, 11, True), rec(2, 11, True)]) == [Ruling.OK, Ruling.COUNTED_TWICE]
    # declared (a distinct part that starts alike, or a misdeclaration the first step catches)
    assert codes([rec(0, 11, True, declared=True), rec(2, 11, True, declared=True)]) == [Ruling.OK] * 2


def test_one_value_counted_by_ranks_declared_distinct_over_different_groups_is_refused():
    # plain experts outside FSDP2 declared distinct over ep only: the expert-data-parallel copies
    # (ranks 0 and 2, in ep groups {0, 1} and {2, 3}) both count (the first step would say so)
    ep01, ep23 = 101, 123
    records = [rec(0, 11, True, declared=True, distinct=ep01), rec(2, 11, True, declared=True, distinct=ep23)]
    assert codes(records) == [Ruling.OK, Ruling.COUNTED_TWICE]
    # one group: different parts that start alike
    same = [rec(0, 11, True, declared=True, distinct=ep01), rec(1, 11, True, declared=True, distinct=ep01)]
    assert codes(same) == [Ruling.OK, Ruling.OK]


def test_different_values_each_counted_at_one_place_are_refused_unless_declared():
    assert codes([rec(0, 11, True), rec(1, 12, True)]) == [Ruling.OK, Ruling.AMBIGUOUS]
    # experts declared replicated over their edp group: the ep groups hold different ones
    declared = [rec(0, 11, True, declared=True), rec(1, 12, True, declared=True)]
    assert codes(declared) == [Ruling.OK] * 2
    # different positions (shards) are different parts whatever their values
    assert codes([rec(0, 11, True, slot=1), rec(1, 11, True, slot=2)]) == [Ruling.OK] * 2


def test_an_undeclared_plain_parameter_is_its_rank_s_own_unless_another_rank_holds_it():
    assert codes([rec(0, 11, True, undeclared=True)]) == [Ruling.OK]
    shared = [rec(0, 11, True, undeclared=True), rec(1, 11, True, undeclared=True)]
    assert codes(shared) == [Ruling.UNDECLARED] * 2


def test_a_parameter_grouped_into_another_layer_on_another_rank_is_an_option_difference():
    assert codes([rec(0, 11, True), rec(1, 11, False, layer=6)]) == [Ruling.OK, Ruling.LAYER]


def test_fingerprints_are_equal_for_equal_bits_only():
    a = torch.randn(5, 3)
    assert torch.equal(fingerprint(a), fingerprint(a.clone()))
    assert not torch.equal(fingerprint(a), fingerprint(a.flip(0)))  # same sum, other places
    b = a.clone()
    b[2, 1] = torch.nextafter(b[2, 1], torch.tensor(10.0))  # one bit
    assert not torch.equal(fingerprint(a), fingerprint(b))
    for t in (a.bfloat16(), a.double(), torch.complex(a, a), a.t(), a.to_sparse()):
        assert torch.equal(fingerprint(t), fingerprint(t.clone()))
    big = torch.randn(3 * (1 << 20) + 7)  # several chunks
    assert torch.equal(fingerprint(big), fingerprint(big.clone()))
    assert not torch.equal(fingerprint(big), fingerprint(big.roll(1)))


def test_the_value_counted_norm_of_one_process_is_its_own():
    assert distinct_sq([1, 2], [torch.ones(2), None], None) == 2.0
