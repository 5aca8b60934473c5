"""The README documents every option and every metric the code has (no silent drift)."""

from __future__ import annotations

import inspect
import os

import distmon
from distmon.prometheus_exporter import METRICS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_every_option_is_declared_once_and_the_readme_table_is_rendered_from_it():
    """GradMonitor's signature, MonitorConfig's fields and the README table all follow distmon.options."""
    import dataclasses

    from distmon.config import MonitorConfig
    from distmon.options import OPTIONS, options_table

    declared = [o.name for o in OPTIONS]
    params = [n for n in inspect.signature(distmon.GradMonitor).parameters if n not in ("model", "optimizer")]
    assert params == declared
    assert [f.name for f in dataclasses.fields(MonitorConfig)] == declared
    stale = "README's option table is stale: python -m distmon.options --write README.md"
    assert options_table() in README, stale


def test_every_environment_variable_is_read_through_the_declaration(monkeypatch):
    from distmon.config import MonitorConfig
    from distmon.options import OPTIONS

    for o in OPTIONS:
        if o.env is None or o.name.startswith("tls") or o.name == "basic_auth_file":
            continue  # the TLS/auth files must pair up and exist: tests/test_http_server.py
        text = {int: "7", float: "0.5", bool: "1", str: "rank0" if o.name == "serve" else "x"}[o.env_type]
        monkeypatch.setenv(o.env, text)
        assert getattr(MonitorConfig.from_options(**{o.name: None}), o.name) == o.parse(text), o.name
        monkeypatch.delenv(o.env)


def test_every_metric_is_documented_with_its_type():
    for name, (kind, _labels, _help) in METRICS.items():
        rows = [line for line in README.splitlines() if line.startswith(f"| `{name}")]
        assert rows, name
        assert f"| {kind} |" in rows[0], name


def test_detector_defaults_stated_in_the_readme_are_the_code_s():
    """Every DetectorConfig threshold appears in the README's rule table as ``name=default``."""
    import dataclasses
    import re

    stated = dict(re.findall(r"`(\w+)=([0-9.e+-]+)`", README))
    for f in dataclasses.fields(distmon.DetectorConfig):
        assert f.name in stated, f"README does not state {f.name}'s default"
        assert float(stated[f.name]) == float(f.default), (f.name, stated[f.name], f.default)


def test_public_api_is_small_and_documented():
    assert set(distmon.__all__) == {
        "GradMonitor",
        "Snapshot",
        "AnomalyEvent",
        "DetectorConfig",
        "GradientAnomalyError",
        "__version__",
    }
    for name in distmon.__all__[:-1]:
        assert getattr(distmon, name).__doc__, name
