"""Never a wrong number, whatever layout and whatever object the user hands distmon (#27): a property
test over the layout space, on real gloo ranks.

``layout_space.cases`` generates layouts combining DDP, FSDP2 and HSDP, tensor parallelism (the
plain parameters declared, undeclared or misdeclared), pipeline stages (the ``PipelineStage`` or
the stage's module passed), experts (DTensors on an ``ep`` mesh, plain per-rank tensors inside
FSDP2 or outside every wrapper, declared or not), fp32 and bf16, and the object passed (the
wrapper, or the module it holds). Each runs on 2, 4 or 8 ranks (the cases of one world size in one
spawn), bare and with distmon, and must be **exact** (every step valid, global and per-layer norms
within 1e-5 of a float64 reference made of every rank's whole gradients deduplicated by value, one
JSONL writer, training bit-identical), or **refused** at construction or **invalid** from the
first step, with a message naming the fix; never valid and wrong. The outcome table is printed
(``pytest -s`` shows it). :func:`test_the_property_catches_a_misread_layout_served_as_valid` breaks
distmon's reading on purpose and shows the property fail.
"""

from __future__ import annotations

import pytest
from ddp_harness import run_ranks
from layout_space import MUST_BE_EXACT, MUST_BE_REFUSED, Case, cases, judge_case, space_job, table

pytestmark = pytest.mark.slow

PER_WORLD = {2: 4, 4: 48, 8: 6}  # 58 layouts: every 2-rank one, 48 of the 84 on 4 ranks, 6 of 12 on 8
TIMEOUT_S = {2: 240, 4: 600, 8: 600}


def run_cases(todo: dict[int, list[Case]], tmp_path, sabotage: bool = False) -> list[tuple[Case, str, str]]:
    rows = []
    for world, some in sorted(todo.items()):
        logs = tmp_path / f"world{world}{'-sabotaged' if sabotage else ''}"
        logs.mkdir()
        ranks = run_ranks(space_job, world, some, str(logs), sabotage, timeout=TIMEOUT_S[world])
        rows += [(case, *judge_case(case, [r[case.name] for r in ranks])) for case in some]
    return rows


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[tuple[Case, str, str]]:
    rows = run_cases(cases(PER_WORLD), tmp_path_factory.mktemp("space"))
    print("\n" + table(rows))
    return rows


def test_every_generated_layout_is_exact_refused_or_invalid_naming_the_fix(outcomes):
    assert len(outcomes) >= 40
    bad = [(case.name, detail) for case, outcome, detail in outcomes if outcome == "VIOLATION"]
    assert not bad, "\n" + table(outcomes)


def test_the_layouts_users_met_wrong_are_exact(outcomes):
    """A stage's module instead of its PipelineStage (DDP, FSDP2, plain) and plain per-rank experts
    once declared: exact, with one writer."""
    got = {case: outcome for case, outcome, _ in outcomes}
    assert all(got[case] == "exact" for case in MUST_BE_EXACT), {c.name: got[c] for c in MUST_BE_EXACT}


def test_undeclared_per_rank_experts_are_refused_naming_the_parameters_and_the_option(outcomes):
    got = {case: (outcome, detail) for case, outcome, detail in outcomes}
    for case in MUST_BE_REFUSED:
        outcome, message = got[case]
        assert outcome == "refused", (case.name, outcome, message)
        assert "moe.experts.w1" in message and "distinct_over" in message, message


def test_most_of_the_space_is_exact(outcomes):
    """What distmon infers or is told: every layout the README says it measures."""
    exact = sum(outcome == "exact" for _, outcome, _ in outcomes)
    assert exact >= 0.6 * len(outcomes), table(outcomes)


# What the sabotage makes distmon get wrong: experts distmon takes for copies of other ranks'
# (no verdict of the job's reading refuses them), a declaration that counts copies twice (a
# first-step check that always agrees lets it through).
SABOTAGED = (
    Case((("edp", 2), ("ep", 2)), experts="plain_fsdp"),
    Case((("tp", 4),), declare="self"),
    Case((("dp", 4),), dp="ddp"),  # and one the sabotage does not touch: still exact
)


def test_the_property_catches_a_misread_layout_served_as_valid(tmp_path):
    """Break the layout reading on purpose: the job's verdicts all say OK and the first-step check
    always agrees. The misread layouts are then served as valid with wrong figures, and the
    property says so; the layout whose reading was right stays exact."""
    rows = run_cases({4: list(SABOTAGED)}, tmp_path, sabotage=True)
    print("\n" + table(rows))
    got = {case: (outcome, detail) for case, outcome, detail in rows}
    for case in SABOTAGED[:2]:
        outcome, detail = got[case]
        assert outcome == "VIOLATION" and "valid and wrong" in detail, (case.name, outcome, detail)
    assert got[SABOTAGED[2]][0] == "exact", got[SABOTAGED[2]]
