"""torch's private names are reached from one module only, ``distmon/compat.py`` (issue #31).

A name torch keeps private (an attribute or module whose name begins with ``_``) may change in any
release without notice. Each use lives in ``compat.py`` with a note (what it is for, the releases
checked, what breaks without it), so that a new torch release is checked in one place. This test
parses every other module of distmon and fails on any of:

- an import of a private torch module or name (``from torch.nn.parallel.distributed import _x``);
- an attribute chain from a name bound to torch (``torch._C...``, ``dist._x``) with a private link;
- a dotted string naming a private torch module (``sys.modules.get("torch._dynamo.config")``);
- a private attribute (``model._comm_hooks``) or a private name in a string (``getattr(p,
  "_local_tensor")``) that distmon does not define itself, that torch's own sources use, and that
  is not reached from another package (``sys._getframe``).

Names of other frameworks (DeepSpeed's, Lightning's) are not torch's and are left alone.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPAT = os.path.join("distmon", "compat.py")
_TORCH_MODULE = re.compile(r"torch(\.\w+)+")
_PRIVATE = re.compile(rb"\b_[A-Za-z]\w*")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def torch_private_names(candidates: frozenset[str]) -> frozenset[str]:
    """Those of the private-looking ``candidates`` that torch's Python sources use anywhere."""
    pattern = re.compile(rb"\b(" + b"|".join(re.escape(c.encode()) for c in sorted(candidates)) + rb")\b")
    names: set[bytes] = set()
    for top, _, files in os.walk(os.path.dirname(torch.__file__)):
        for f in files:
            if f.endswith((".py", ".pyi")):
                with open(os.path.join(top, f), "rb") as fh:
                    names.update(pattern.findall(fh.read()))
    return frozenset(n.decode() for n in names)


def _torch_names(sources: dict[str, str]) -> frozenset[str]:
    """:func:`torch_private_names` of every private-looking identifier in ``sources``."""
    return torch_private_names(
        frozenset(n.decode() for t in sources.values() for n in _PRIVATE.findall(t.encode()))
    )


@functools.cache
def _own_names(text: str) -> frozenset[str]:
    """Names a module defines itself: functions, classes, variables, arguments, ``self._x`` attributes."""
    own: set[str] = set()
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.arg):
            own.add(n.arg)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                own.add(n.attr)
    return frozenset(own)


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts from (``torch`` for ``torch._C._x``), None for a call's result."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@functools.cache
def _module_uses(path: str, text: str, torch_names: frozenset[str]) -> tuple[tuple[str, str | None], ...]:
    """One module's uses: ``(path:line: what, name)``, where a use counts unless distmon defines ``name``."""
    tree = ast.parse(text)
    found: list[tuple[str, str | None]] = []
    torch_bound, other_modules = set(), set()  # names bound to torch (modules, objects), other imports
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                is_torch = a.name.split(".")[0] == "torch"
                (torch_bound if is_torch else other_modules).add(a.asname or a.name.split(".")[0])
                if is_torch and any(map(_private, a.name.split("."))):
                    found.append((f"{path}:{n.lineno}: import {a.name}", None))
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            is_torch = n.module.split(".")[0] == "torch"
            for a in n.names:
                (torch_bound if is_torch else other_modules).add(a.asname or a.name)
            if is_torch and any(map(_private, [*n.module.split("."), *(a.name for a in n.names)])):
                names = ", ".join(a.name for a in n.names)
                found.append((f"{path}:{n.lineno}: from {n.module} import {names}", None))
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            root = _root(n)
            if root in torch_bound:
                found.append((f"{path}:{n.lineno}: {ast.unparse(n)}", None))
            elif root not in other_modules and n.attr in torch_names:
                found.append((f"{path}:{n.lineno}: {ast.unparse(n)}", n.attr))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            text = n.value
            if _TORCH_MODULE.fullmatch(text) and any(map(_private, text.split("."))):
                found.append((f"{path}:{n.lineno}: {text!r}", None))
            elif text.isidentifier() and _private(text) and text in torch_names:
                found.append((f"{path}:{n.lineno}: {text!r}", text))
    return tuple(found)


def private_torch_uses(sources: dict[str, str], torch_names: frozenset[str]) -> list[str]:
    """``path:line: what`` for each private torch name reached in ``sources`` (path: text), compat apart."""
    own = frozenset().union(*map(_own_names, sources.values()))
    found = [
        use
        for path, text in sources.items()
        if path != COMPAT
        for use, name in _module_uses(path, text, torch_names)
        if name is None or name not in own
    ]
    # a chain once, at its longest (``torch._C._x``, not also ``torch._C``)
    return sorted(u for u in set(found) if not any(v != u and v.startswith(u + ".") for v in found))


def _distmon_sources() -> dict[str, str]:
    out = {}
    for top, _, files in os.walk(os.path.join(ROOT, "distmon")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(top, f), encoding="utf-8") as fh:
                    out[os.path.relpath(os.path.join(top, f), ROOT)] = fh.read()
    return out


def test_no_module_but_compat_reaches_a_private_torch_name():
    sources = _distmon_sources()
    assert COMPAT in sources
    assert private_torch_uses(sources, _torch_names(sources)) == []


def test_compat_notes_each_private_name_it_uses():
    """Every private torch name compat.py reaches appears in one of its comments (its note)."""
    with open(os.path.join(ROOT, COMPAT), encoding="utf-8") as f:
        text = f.read()
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    used = {m.split(": ", 1)[1] for m in private_torch_uses({"compat_.py": text}, _torch_names({"c": text}))}
    names = {seg for use in used for seg in re.findall(r"_[A-Za-z]\w*", use) if _private(seg)}
    unnoted = sorted(n for n in names if n not in comments)
    assert used and unnoted == []


def test_the_check_finds_each_kind_of_use():
    """The check fails on each kind of use it is there to catch, and only outside compat.py."""
    base = _distmon_sources()
    uses = {
        "import torch._dynamo": "import torch._dynamo",
        "from torch.nn.parallel.distributed import _find_tensors": "from torch.nn.parallel",
        "from torch.distributed.fsdp._fully_shard import FSDPModule": "from torch.distributed.fsdp._fully",
        "import torch\nx = torch._C._current_graph_task_id()": "torch._C._current_graph_task_id",
        "import torch.distributed as dist\nx = dist._functional_collectives": "dist._functional_collectives",
        "def f(model):\n    return model._comm_hooks": "model._comm_hooks",
        "def f(p):\n    return getattr(p, '_local_tensor', p)": "'_local_tensor'",
        "import sys\nx = sys.modules.get('torch._dynamo.config')": "'torch._dynamo.config'",
    }
    allowed = "import sys\nimport deepspeed\nx = sys._getframe(0)\ny = deepspeed._private_thing\n"
    torch_names = _torch_names({**base, **{str(i): s for i, s in enumerate([*uses, allowed])}})
    for snippet, expected in uses.items():
        found = private_torch_uses({**base, "distmon/injected.py": snippet}, torch_names)
        assert len(found) == 1 and expected in found[0], (snippet, found)
        assert private_torch_uses({**base, COMPAT: base[COMPAT] + "\n" + snippet}, torch_names) == []
    assert private_torch_uses({**base, "distmon/injected.py": allowed}, torch_names) == []
