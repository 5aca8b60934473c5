"""The shape of the code that reviews hold distmon to (issue #21), checked on every run.

Calls pass at most four arguments by position (more is wiring nobody can read: name them);
no parameter or attribute is typed ``Any``; the composition root stays wiring only; no source
file of the benchmarks or the deployment grows past a size one can read; ``import distmon``
pulls in no FSDP and no DeepSpeed (a single process must not pay ~2 s, ~4 s for them); the
whole repository passes the configured ruff rules and ruff's formatting (pinned in the test extra).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(folder: str) -> list[str]:
    out = []
    for top, _, files in os.walk(os.path.join(ROOT, folder)):
        out += [os.path.join(top, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_no_call_in_distmon_passes_more_than_four_positional_arguments():
    crowded = []
    for path in _sources("distmon"):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                n = sum(not isinstance(a, ast.Starred) for a in node.args)
                if n > 4:
                    crowded.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node.func)} with {n}")
    assert crowded == []


def test_nothing_in_distmon_is_typed_any():
    typed_any = []
    for path in _sources("distmon"):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "Any":
                typed_any.append(f"{_rel(path)}:{node.lineno}")
    assert typed_any == []


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str)


def test_the_composition_root_is_wiring_only_and_files_stay_readable():
    with open(os.path.join(ROOT, "distmon", "monitor.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    # wiring and the public API's methods (each a few lines that delegate, with its docstring),
    # counted in statements, not lines: docstrings and formatting cost nothing, logic does
    statements = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not _is_docstring(n)]
    assert len(statements) <= 150
    loops = [n.lineno for n in statements if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
    assert loops == [], "a loop is logic: it belongs in the module that holds what it loops over"
    # source files; generated data (the dashboard JSON, benchmark results) is not read by people
    for path in _sources("distmon") + _sources("benchmarks") + _sources("deploy"):
        with open(path, encoding="utf-8") as f:
            assert len(f.readlines()) <= 800, _rel(path)


def test_the_folders_show_the_stages_and_each_maps_what_it_holds():
    """At most 12 modules at the top of the package; every folder's ``__init__`` names each of its
    modules (a short map a newcomer reads first)."""
    top = [name for name in os.listdir(os.path.join(ROOT, "distmon")) if name.endswith(".py")]
    assert len(top) <= 12, sorted(top)
    folders = [
        e.path for e in os.scandir(os.path.join(ROOT, "distmon")) if e.is_dir() and e.name != "__pycache__"
    ]
    assert len(folders) >= 6, folders
    for folder in folders:
        with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
            mapped = ast.get_docstring(ast.parse(f.read())) or ""
        modules = [n for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py"]
        missing = [m for m in modules if f"``{m}``" not in mapped]
        assert not missing, f"{_rel(folder)}/__init__.py does not map {missing}"


IMPORTS = [
    "import distmon",
    "import distmon; distmon.GradMonitor, distmon.Snapshot, distmon.DetectorConfig",
    "import distmon.report, distmon.report.log_reader",
]


def _imported(code: str, prefix: str) -> str:
    """The modules starting with ``prefix`` that running ``code`` imports, in a fresh interpreter."""
    names = f"sorted(m for m in sys.modules if m.startswith({prefix!r}))"
    probe = f"import sys; {code}; print({names})"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.slow  # fresh interpreters (~5 s with the next test): the fast tier stays under 90 s
@pytest.mark.parametrize("code", IMPORTS)
def test_import_distmon_pulls_in_no_fsdp(code):
    assert _imported(code, "torch.distributed.fsdp") == "[]"


@pytest.mark.slow
@pytest.mark.parametrize("code", IMPORTS[:2])
def test_import_distmon_pulls_in_no_deepspeed(code):
    """DeepSpeed takes ~4 s to import (and starts its accelerator): only a job that uses it pays."""
    assert _imported(code, "deepspeed") == "[]"


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_the_repository_passes_ruff(args):
    """``ruff check .`` and ``ruff format --check .`` with pyproject.toml's rules (import order, line
    length, ...): what a reviewer would otherwise point out by hand."""
    if importlib.util.find_spec("ruff") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ruff is not installed: pip install -e '.[test]' (launch/install.sh --test does)")
        pytest.skip("ruff not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout}{out.stderr}"
