"""The reference pages say what the code does: the error catalogue, the JSONL log schema,
``state_dict()``'s keys and the API reference's names, each against the real thing.

Their tables are generated (``test_docs.py`` fails when one is stale); these tests check that
what generates them describes what distmon really writes, raises and exports.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import distmon
from distmon.doc_errors import fix_of, messages
from distmon.export.log_schema import LOG_SCHEMA_VERSION, log_fields
from distmon.verdicts.resume import STATE_FIELDS, disabled_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARNINGS = ("warning", "Python warning")


def _page(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return f.read()


def test_every_refusal_in_the_catalogue_names_its_fix():
    """A refusal (an exception, a report error) says the way out in its message, so the catalogue
    and the user who reads the message see it: say it in the code (``distmon/doc_errors.py``'s
    ``fix_of`` finds it)."""
    missing = [
        f"{m.path} {m.where}: {m.text}" for m in messages() if m.kind not in WARNINGS and not fix_of(m.text)
    ]
    assert missing == [], "refusals that name no fix:\n" + "\n".join(missing)


def test_the_catalogue_holds_every_kind_of_message_site_with_a_stable_anchor():
    """Refusals, option checks, logged and Python warnings, report errors; one anchor each, on the page."""
    found = messages()
    kinds = {m.kind for m in found}
    assert {"ValueError", "TypeError", "RuntimeError", "ImportError", "OSError", "warning"} - kinds <= {
        "OSError"
    }
    assert {"Python warning", "exit status 2", "GradientAnomalyError"} <= kinds, kinds
    texts = [m.text for m in found]
    for expected in (
        "distmon: GradMonitor did not start on any rank: DISTMON_DISABLE is",  # off_switch.py
        "distmon: export_every must be an int >= 1",  # a need() check of config.py
        "distmon: unknown option(s)",
        "distmon: serving metrics at",  # a logged warning
        "distmon report: no *.jsonl file in the directory",  # a report error
    ):
        assert any(t.startswith(expected) for t in texts), expected
    anchors = [m.anchor for m in found]
    assert len(anchors) == len(set(anchors)) and len(found) >= 100, len(found)
    page = _page("errors.md")
    assert all(f"{{#{a}}}" in page for a in anchors)


def test_a_real_log_line_has_the_documented_fields_in_order(tmp_path):
    """A one-process monitor's JSONL lines: the schema's fields in its order, ``"schema"`` last, a
    non-finite norm as ``"nan"``/``"inf"``."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    log = tmp_path / "run.jsonl"
    with distmon.GradMonitor(net, opt, serve="none", export_every=1, log_path=str(log)) as mon:
        for scale in (1.0, float("inf")):
            (net(torch.ones(2, 4)).sum() * scale).backward()
            opt.step()
            opt.zero_grad()
        mon.flush()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [list(line) for line in lines] == [[f.name for f in log_fields()]] * 2
    assert lines[0]["schema"] == LOG_SCHEMA_VERSION and isinstance(lines[0]["grad_norm"], float)
    assert lines[1]["grad_norm"] in ("inf", "nan") and lines[1]["nonfinite"] is True


def test_a_real_state_dict_has_the_documented_keys():
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with distmon.GradMonitor(net, opt, serve="none") as mon:
        state = mon.state_dict()
    assert list(state) == [k for k in STATE_FIELDS if k != "disabled"]
    assert set(disabled_state()) <= set(STATE_FIELDS)
    # the versions the pages state are the code's
    from distmon.verdicts.resume import STATE_VERSION

    assert state["version"] == STATE_VERSION and f"now {STATE_VERSION})" in _page("api.md")
    stability = _page("stability.md")
    assert f"now {STATE_VERSION})" in stability and f"(now {LOG_SCHEMA_VERSION})" in stability
    assert f'**Schema version {LOG_SCHEMA_VERSION}** (`"schema": {LOG_SCHEMA_VERSION}`' in _page(
        "log-schema.md"
    )
    said = f'`{{"version": {STATE_VERSION}, "disabled": True}}`'
    assert said in _page("options.md") and disabled_state() == {"version": STATE_VERSION, "disabled": True}


@pytest.mark.parametrize("name", [n for n in distmon.__all__ if n != "__version__"])
def test_the_api_reference_renders_every_public_name(name):
    assert re.search(rf"^::: distmon\.{name}$", _page("api.md"), re.M), name


def test_the_api_reference_renders_both_callbacks():
    page = _page("api.md")
    for module in ("lightning", "transformers"):
        assert f"::: distmon.integrations.{module}.DistmonCallback" in page, module
