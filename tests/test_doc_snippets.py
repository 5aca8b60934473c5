"""Every code block of the README and docs/ runs in the suite, or says why not.

Each fenced block carries a marker on the line above it (an HTML comment, invisible on the site
and on GitHub):

- ``<!-- run -->``: this test runs the Python block as written, in one process, after
  :data:`PRELUDE` (a small model ``net`` = ``model``, its optimizer ``opt`` = ``optimizer``, a
  ``loader`` of batches, ``loss_fn``, ``x``, ``y``, ``loss``, ``rank`` = ``local_rank`` = 0, a
  checkpoint ``path``, and a process group of one rank, so ``DDP(net)`` works);
- ``<!-- run: after training -->``: the same, with ``mon``, a monitor of ``model`` that measured
  three steps;
- ``<!-- run: yaml -->``: the YAML parses;
- ``<!-- tested: tests/FILE.py::TEST -->``: that test runs or checks it (the test must exist);
- ``<!-- not run: WHY -->``: not run, and why (8 GPUs, the network, a fragment of your code).

Blocks inside generated tables (the error catalogue's messages) are the code's own text.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"<!-- (run(?:: (?:after training|yaml))?|tested: (\S+?)::(\w+)[^>]*|not run: [^>]+) -->")

PRELUDE = """
import os, tempfile
import torch
import torch.distributed as dist
import distmon
if not dist.is_initialized():  # one rank: DDP(net) works as in a job
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = net
opt = optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
loader = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
x, y = loader[0]
loss_fn = torch.nn.functional.mse_loss
loss = loss_fn(model(x), y)
rank = local_rank = 0
path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
"""
AFTER_TRAINING = """
mon = distmon.GradMonitor(model, opt, serve="none", export_every=1)
for x_, y_ in loader:
    loss_fn(model(x_), y_).backward(); opt.step(); opt.zero_grad()
"""
RUNNER = """
import json, sys, traceback
blocks, failed = json.load(open(sys.argv[1])), []
for where, code in blocks:
    ns = {"__name__": "__doc_block__"}
    try:
        exec(compile(code, where, "exec"), ns)
        for value in list(ns.values()):  # a block that leaves a monitor open: closed here
            if type(value).__name__ == "GradMonitor":
                value.close()
    except BaseException:
        failed.append((where, traceback.format_exc(limit=4)))
print(json.dumps(failed))
"""


def _pages() -> dict[str, str]:
    names = ["README.md"] + [
        f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
    ]
    out = {}
    for name in names:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            out[name] = f.read()
    return out


def blocks() -> list[tuple[str, int, str, str, str]]:
    """``(page, line, language, code, marker)`` of every fenced block outside a generated table."""
    out = []
    for page, text in _pages().items():
        generated = [
            (m.start(), m.end()) for m in re.finditer(r"<!-- generated: (\w+).*?<!-- end: \1 -->", text, re.S)
        ]
        for m in re.finditer(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", text, flags=re.S | re.M):
            if any(a <= m.start() < b for a, b in generated):
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            code = re.sub(rf"^{m[1]}", "", m[3], flags=re.M)
            out.append((page, text.count("\n", 0, m.start()) + 1, m[2], code, before))
    return out


def test_every_block_is_run_or_says_why_not():
    """A marker above every block; a ``tested:`` one names a test that exists; every ``run`` block
    is Python (or YAML for ``run: yaml``)."""
    bad = []
    for page, line, lang, _code, before in blocks():
        m = MARKER.fullmatch(before)
        if m is None:
            bad.append(f"{page}:{line}: no <!-- run/tested/not run --> marker above the block")
        elif m[2]:
            path = os.path.join(ROOT, m[2])
            with open(path, encoding="utf-8") as f:
                defined = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
            if m[3] not in defined:
                bad.append(f"{page}:{line}: {m[2]} has no test {m[3]}")
        elif m[1].startswith("run") and lang != ("yaml" if m[1] == "run: yaml" else "python"):
            bad.append(f"{page}:{line}: a {lang or 'plain'} block marked {m[1]}")
    assert bad == [], "\n".join(bad)
    assert sum(b[4].startswith("<!-- run") for b in blocks()) >= 5  # the runnable ones are run below


def test_the_yaml_blocks_parse():
    yaml = pytest.importorskip("yaml")
    for page, line, _lang, code, before in blocks():
        if before == "<!-- run: yaml -->":
            assert yaml.safe_load(code), f"{page}:{line}"


@pytest.mark.slow
def test_the_python_blocks_marked_run_run_as_written(tmp_path):
    """Every ``run`` block, in one process (each in a fresh namespace after the prelude), with the
    monitor's endpoint on an ephemeral port and no linger."""
    from ddp_harness import free_port

    prelude = PRELUDE.format(port=free_port())
    runnable = [
        (f"{page}:{line}", prelude + (AFTER_TRAINING if "after training" in before else "") + code)
        for page, line, lang, code, before in blocks()
        if before in ("<!-- run -->", "<!-- run: after training -->")
    ]
    assert len(runnable) >= 5, runnable
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(runnable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMON_")}
    env.update(DISTMON_PORT="0", DISTMON_LINGER_S="0", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(listing)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert failed == [], "\n\n".join(f"{where}:\n{trace}" for where, trace in failed)
