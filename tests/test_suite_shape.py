"""The shape of the tests themselves (issue #40), checked on every run.

Every module of tests/ (jobs included) holds 800 lines at most; every test function asserts
(an ``assert``, ``pytest.raises``/``fail``/``warns``, a ``raise``, or a call of a function of
tests/ that does); what the tests and their jobs share has one copy, in tests/helpers.py (the
small GPT, its loss, layer names, flat tensors, the float64 reference, the scrape), and no test
opens a URL but through its proxy-less opener.
"""

from __future__ import annotations

import ast
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
# names that helpers.py holds and nothing else in tests/ may define again
SHARED = {
    "GPT",
    "TinyLM",
    "lm_loss",
    "layer_of",
    "flat",
    "as_float64",
    "layer_sq",
    "reference_norms",
    "scrape_metrics",
    "sample_value",
    "make_batch",
}
ASSERTING_CALLS = {"raises", "fail", "warns", "xfail"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for top, _, files in os.walk(TESTS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(top, name)
                with open(path, encoding="utf-8") as f:
                    out[os.path.relpath(path, TESTS)] = ast.parse(f.read())
    return dict(sorted(out.items()))


def _called(node: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def _asserts_itself(fn: ast.AST) -> bool:
    if any(isinstance(n, (ast.Assert, ast.Raise)) for n in ast.walk(fn)):
        return True
    return bool(_called(fn) & ASSERTING_CALLS) or any(c.startswith("assert") for c in _called(fn))


def test_every_module_of_the_tests_holds_800_lines_at_most():
    long = {}
    for top, _, files in os.walk(TESTS):
        for name in files:
            if name.endswith((".py", ".sh")):
                with open(os.path.join(top, name), encoding="utf-8") as f:
                    n = len(f.readlines())
                if n > 800:
                    long[os.path.relpath(os.path.join(top, name), TESTS)] = n
    assert not long, long


def test_every_test_function_asserts():
    modules = _modules()
    functions = [n for tree in modules.values() for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    asserting = {fn.name for fn in functions if _asserts_itself(fn)}
    grown = True
    while grown:  # a function that calls one that asserts asserts too (by name, across tests/)
        grown = False
        for fn in functions:
            if fn.name not in asserting and _called(fn) & asserting:
                asserting.add(fn.name)
                grown = True
    silent = [
        f"{path}:{fn.lineno} {fn.name}"
        for path, tree in modules.items()
        if os.path.basename(path).startswith("test_")
        for fn in tree.body
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and fn.name not in asserting
    ]
    assert not silent, silent


def test_what_the_tests_share_has_one_copy_in_helpers():
    again = [
        f"{path}:{n.lineno} {n.name}"
        for path, tree in _modules().items()
        if path != "helpers.py"
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in SHARED
    ]
    assert not again, f"defined again outside tests/helpers.py: {again}"


def test_no_test_opens_a_url_through_a_proxy():
    """urllib's urlopen and default openers honour http_proxy: a test's request to 127.0.0.1
    could go elsewhere. helpers.http_get's opener has no proxy."""
    direct = [
        f"{path}:{n.lineno}"
        for path, tree in _modules().items()
        if path != "helpers.py"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _called(n) & {"urlopen", "build_opener"}
    ]
    assert not direct, direct


def test_the_longest_first_order_names_each_test_module_once():
    """conftest.py's LONGEST_FIRST puts the long modules first on the xdist workers. A name given
    twice takes its later place (the rank table keeps the last), a misspelt one none: a long
    module then starts last, on one worker, while the other idles (test_restarts.py, listed twice,
    ran 21st)."""
    import conftest

    order = conftest.LONGEST_FIRST
    twice = sorted({name for name in order if order.count(name) > 1})
    missing = [name for name in order if not os.path.exists(os.path.join(TESTS, name))]
    assert not twice and not missing, (twice, missing)
