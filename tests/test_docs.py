"""The docs document every option and every metric the code has (no silent drift).

The tables of ``docs/`` (options, metrics, the bucket-to-gauge hops, the error catalogue, the
JSONL log schema, ``state_dict()``'s keys, the extras) and ``GradMonitor``'s ``Args:`` are
rendered from the code (``distmon/doc_tables.py``, ``distmon/options.py``); these tests fail when
what is rendered differs from what the code renders now, when a default is declared twice, and
when the site (its API reference rendered from the docstrings included) does not build strictly.
The other pages' names: ``test_doc_drift.py``; their code blocks: ``test_doc_snippets.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

import distmon
from distmon.serve.prometheus_exporter import METRICS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _page(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


def test_every_option_is_declared_once_and_the_docs_table_is_rendered_from_it():
    """GradMonitor's signature, MonitorConfig's fields and the docs' table all follow distmon.options."""
    from distmon.options import OPTIONS, options_table
    from distmon.setup.config import MonitorConfig

    declared = [o.name for o in OPTIONS]
    params = [n for n in inspect.signature(distmon.GradMonitor).parameters if n not in ("model", "optimizer")]
    assert params == declared
    assert [f.name for f in dataclasses.fields(MonitorConfig)] == declared
    stale = "docs/options.md's option table is stale: python -m distmon.doc_tables --write"
    assert options_table() in _page("options.md"), stale


def test_every_environment_variable_is_read_through_the_declaration(monkeypatch):
    from distmon.options import OPTIONS
    from distmon.setup.config import MonitorConfig

    for o in OPTIONS:
        if o.env is None or o.name.startswith("tls") or o.name == "basic_auth_file":
            continue  # the TLS/auth files must pair up and exist: tests/test_http_server.py
        text = {
            int: "7",
            float: "0.5",
            bool: "1",
            str: {"serve": "rank0", "tracker": "tensorboard"}.get(o.name, "x"),
        }[o.env_type]
        monkeypatch.setenv(o.env, text)
        assert getattr(MonitorConfig.from_options(**{o.name: None}), o.name) == o.parse(text), o.name
        monkeypatch.delenv(o.env)


def test_every_metric_is_documented_with_its_type():
    for name, (kind, _labels, _help) in METRICS.items():
        rows = [line for line in _page("metrics.md").splitlines() if line.startswith(f"| `{name}")]
        assert rows, name
        assert f"| {kind} |" in rows[0], name


def test_detector_defaults_stated_in_the_docs_are_the_code_s():
    """Every DetectorConfig threshold appears in the docs' rule table as ``name=default``."""
    stated = dict(re.findall(r"`(\w+)=([0-9.e+-]+)`", _page("detection.md")))
    for f in dataclasses.fields(distmon.DetectorConfig):
        assert f.name in stated, f"docs/detection.md does not state {f.name}'s default"
        assert float(stated[f.name]) == float(f.default), (f.name, stated[f.name], f.default)


def test_public_api_is_small_and_documented():
    assert set(distmon.__all__) == {
        "GradMonitor",
        "Snapshot",
        "AnomalyEvent",
        "DetectorConfig",
        "PrecursorConfig",
        "GradientAnomalyError",
        "__version__",
    }
    for name in distmon.__all__[:-1]:
        assert getattr(distmon, name).__doc__, name


def test_every_generated_table_of_the_docs_is_what_the_code_renders_now():
    """The generated tables of docs/ are the code's (distmon/doc_tables.py's TABLES)."""
    from distmon.doc_tables import stale_tables

    assert stale_tables(DOCS) == [], "stale: run python -m distmon.doc_tables --write"


def test_the_metrics_table_renders_every_declaration():
    """Each METRICS entry is one row of docs/metrics.md: its name, type, labels and help, in order."""
    table = _page("metrics.md").split("<!-- end: metrics -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `distmon_")]
    assert len(rows) == len(METRICS)
    for row, (name, spec) in zip(rows, METRICS.items()):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[0].strip("`").split("_bucket")[0] == name
        assert cells[1:3] == [spec.kind, ", ".join(("run_id", *spec.labels))]
        assert cells[3].replace("\\|", "|") == spec.help


@pytest.mark.slow  # runs series_count for every row of the table (~3 s)
def test_the_sizing_table_is_what_series_count_prints():
    """docs/deployment.md's series counts are benchmarks/series_count.py's (real /metrics bodies), and
    a node's endpoint serves each per-rank family of METRICS once per rank of the node."""
    from distmon.serve.prometheus_exporter import RANK_LABELS

    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "series_count.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.match(r"\| [0-9]", line)]
    assert [r.split(" | ")[0] for r in rows] == ["| 8", "| 1,024", "| 16,384"], out.stdout
    page = _page("deployment.md")
    for row in rows:
        assert row in page, f"docs/deployment.md's sizing table is stale (benchmarks/series_count.py):\n{row}"
    per_rank_families = sum(spec.labels == RANK_LABELS for spec in METRICS.values())
    assert rows[1].split(" | ")[3].startswith(f"{per_rank_families * 8} / "), rows[1]


def test_the_hop_tables_have_one_copy():
    """distmon/step/data_path.py holds the data path's hops (tests/test_data_path.py traces them):
    docs/how-it-works.md renders them, no other file copies them."""
    copies = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("site", "__pycache__")]
        for f in files:
            if f.endswith((".md", ".py")) and f not in ("data_path.py", "test_docs.py"):
                path = os.path.join(top, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                text = re.sub(r"<!-- generated: hops.*?<!-- end: hops -->", "", text, flags=re.S)
                if "| hop | the number becomes |" in text or "| hop | function | thread |" in text:
                    copies.append(os.path.relpath(path, ROOT))
    assert copies == [], "the hop tables are rendered from distmon/step/data_path.py, not copied"


def test_help_gradmonitor_documents_every_option():
    """GradMonitor.__doc__'s Args: model, optimizer, then every option of OPTIONS in order, each with
    its meaning, default and variable (rendered by options_args: help(GradMonitor) shows them)."""
    from distmon.options import OPTIONS, _plain

    doc = distmon.GradMonitor.__doc__
    args = doc.split("    Args:\n", 1)[1].split("\n\n", 1)[0]
    parts = re.split(r"^        (\w+): ", args, flags=re.M)[1:]
    entries = {name: " ".join(text.split()) for name, text in zip(parts[::2], parts[1::2])}
    assert list(entries) == ["model", "optimizer", *(o.name for o in OPTIONS)]
    for o in OPTIONS:
        entry = entries[o.name]
        assert entry.startswith(" ".join(_plain(o.meaning).split())), o.name
        assert f"default: {o.default_text})." in entry, o.name
        assert o.env is None or f"``{o.env}``" in entry, o.name


def test_an_option_is_written_in_options_py_and_the_signature_only():
    """MonitorConfig's fields are generated from OPTIONS (their defaults too), and GradMonitor's
    constructor names each option once, in its signature (no forwarding call restates them)."""
    from distmon import monitor
    from distmon.options import BY_NAME
    from distmon.setup.config import MonitorConfig

    for f in dataclasses.fields(MonitorConfig):
        assert f.default == BY_NAME[f.name].default, f.name
    with open(monitor.__file__, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GradMonitor")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    named = [n.id for n in ast.walk(init) if isinstance(n, ast.Name)]  # an option's parameter, read
    restated = sorted({name for name in named if name in BY_NAME})
    assert restated == [], f"GradMonitor.__init__ restates options {restated}: they come from locals()"
    assert init.end_lineno - init.lineno + 1 <= 60, "GradMonitor.__init__ is wiring: at most 60 lines"


def test_the_docs_site_builds_strictly(tmp_path):
    """mkdocs build --strict: a broken link, anchor or page fails it (CI=true: mkdocs is required); the
    API reference renders ``GradMonitor``'s options from its docstring."""
    if any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers")):
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (launch/install.sh --test does)")
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "how-it-works" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "DISTMON_EXPORT_INTERVAL_S" in api and "{options}" not in api  # GradMonitor's Args rendered
    from distmon.doc_errors import messages  # every catalogue entry has its stable anchor on the site

    errors = (tmp_path / "site" / "errors" / "index.html").read_text(encoding="utf-8")
    assert [m.anchor for m in messages() if f'id="{m.anchor}"' not in errors] == []


def _script(text: str) -> str:
    """The complete script of a page (the code block titled ``train_ddp.py``)."""
    return re.search(r'```python title="train_ddp.py"\n(.*?)```', text, re.S)[1]


@pytest.mark.slow
def test_the_getting_started_script_runs_under_torchrun(tmp_path):
    """docs/getting-started.md's DDP script, as written, on 2 gloo ranks: it trains, serves and reports."""
    script = tmp_path / "train_ddp.py"
    script.write_text(_script(_page("getting-started.md")))
    env = dict(os.environ, STEPS="30", DISTMON_PORT="0", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "distmon: serving metrics at http://127.0.0.1:" in run.stderr
    norm = re.search(r"step 30: global gradient norm (\S+)", run.stdout)
    assert norm and 0 < float(norm[1]) < float("inf"), run.stdout


README = os.path.join(ROOT, "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def test_the_readme_is_a_five_minute_read_that_links_every_page():
    """At most ~150 lines (the code blocks' run markers aside); the two set-up commands as CI runs them;
    a link to every docs page."""
    text = _readme()
    assert len([line for line in text.splitlines() if not line.startswith("<!-- ")]) <= 150
    for command in ("bash launch/demo.sh      # installs", "bash tests/run.sh        # installs test deps"):
        assert f"\n{command}" in text, command  # tests/fresh_install.sh runs the first; .ci/run the second
    pages = sorted(f for f in os.listdir(DOCS) if f.endswith(".md") and f != "index.md")
    assert [p for p in pages if f"(docs/{p})" not in text] == []
    for link in re.findall(r"\]\((?!https?:)([^)#]+)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link


def test_the_readme_s_script_is_the_one_ci_runs():
    """The README's DDP script is docs/getting-started.md's, which the torchrun test runs."""
    assert _script(_readme()) == _script(_page("getting-started.md"))
    assert "torchrun --nproc-per-node 8 train_ddp.py" in _readme()


def test_the_readme_s_metrics_sample_names_served_metrics_and_their_labels():
    """Every series in the README's /metrics sample is a declared metric with its declared labels."""
    sample = _readme().split("## What `/metrics` serves", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    series = re.findall(r"^(distmon_\w+)\{([^}]*)\}", sample, re.M)
    assert len(series) >= 10
    for name, labels in series:
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in METRICS else name
        assert base in METRICS, name
        allowed = {"run_id", *METRICS[base].labels} | ({"le"} if name.endswith("_bucket") else set())
        assert set(re.findall(r"(\w+)=", labels)) <= allowed, name
    for help_line in re.findall(r"^# HELP (\w+) (.*)$", sample, re.M):
        assert METRICS[help_line[0]].help == help_line[1]
