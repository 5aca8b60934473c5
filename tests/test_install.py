"""docs/install.md: the wheel a user builds installs distmon whole, and the one-line checks work.

``python -m distmon --version`` and ``python -m distmon check`` as the page shows them (their
output, the page's sample), and a wheel built from this checkout (as ``python -m build`` would,
without its isolated environment: ``pip wheel --no-build-isolation``, offline) installed into a
fresh install location (``pip install --target``), where ``python -m distmon check`` passes with
the installed copy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, cwd: str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_") and k != "PYTHONPATH"}
    env = {**clean, **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def _sample() -> list[str]:
    """The output docs/install.md shows for ``python -m distmon check``."""
    with open(os.path.join(ROOT, "docs", "install.md"), encoding="utf-8") as f:
        page = f.read()
    return page.split("its exit status is 0", 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def test_python_m_distmon_version_names_the_package_version():
    import distmon

    run = _run("-m", "distmon", "--version")
    assert run.returncode == 0 and run.stdout.strip() == f"distmon {distmon.__version__}", run


@pytest.mark.slow
def test_python_m_distmon_check_prints_a_snapshot():
    """Exit status 0, the versions line, and the snapshot the page shows (the same seeded model)."""
    run = _run("-m", "distmon", "check")
    assert run.returncode == 0, run.stdout + run.stderr
    head, snap = run.stdout.splitlines()[:2]
    assert re.fullmatch(r"distmon \S+ on torch \S+ \(Python \S+\): ok", head), head
    shown_head, shown = _sample()
    assert re.fullmatch(r"distmon \S+ on torch \S+ \(Python \S+\): ok", shown_head), shown_head
    got, said = json.loads(snap), json.loads(shown)
    assert got.keys() == said.keys() and got["step"] == said["step"] == 3 and got["valid"]
    assert got["grad_norm"] == pytest.approx(said["grad_norm"], rel=1e-6), (got, said)


@pytest.mark.slow
def test_the_wheel_installs_distmon_whole_into_a_fresh_environment(tmp_path):
    """Every subpackage in the wheel and nothing else; installed into a fresh location (torch from
    the system's site-packages), ``python -m distmon check`` passes with the installed copy."""
    out = tmp_path / "dist"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("distmon-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {os.path.dirname(n) for n in names if n.endswith("/__init__.py")}
    expected = {"distmon"} | {
        f"distmon/{d}"
        for d in os.listdir(os.path.join(ROOT, "distmon"))
        if os.path.isfile(os.path.join(ROOT, "distmon", d, "__init__.py"))
    }
    assert packages == expected, packages ^ expected
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "launch/", "docs/"))]
    site = tmp_path / "site"  # a fresh install location, ahead of the checkout's editable install
    installed = _run(
        "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)
    )
    assert installed.returncode == 0, installed.stderr
    env = {"PYTHONPATH": str(site)}
    where = _run("-c", "import distmon; print(distmon.__file__)", cwd=str(tmp_path), env=env)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # the wheel's, not the checkout's
    check = _run("-m", "distmon", "check", cwd=str(tmp_path), env=env)
    assert check.returncode == 0 and ": ok" in check.stdout, check.stdout + check.stderr
