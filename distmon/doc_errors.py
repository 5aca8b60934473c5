"""The error catalogue of ``docs/errors.md``: every refusal and warning distmon raises, read from its source.

An AST pass over ``distmon/`` finds each message site: ``raise SomeError("distmon: ...")`` and an
exception built to be raised later (``return ValueError("distmon: ...")``), the options' checks
(each option's ``Check`` in ``options.py``, ``need(condition, "...")`` in ``setup/config.py``),
``logger.warning``/``logger.exception``, ``warnings.warn`` and ``ErrorCounter.note``, and the
report's errors (``LogError``, ``fail``). For each it renders the message (placeholders as
``{name}``; module constants and ``option_name(...)`` resolved), the exception class or "warning",
where it is raised (module and function), the condition in the code, and the fix the message names:
every refusal must name one (a test fails on one that does not: say the way out in the message, not
in a page). Each entry has a stable anchor made of its message's words, so a user who pastes an
error finds its entry.

``python -m distmon.doc_tables --write`` renders it into ``docs/errors.md`` with the other tables.

Example:
    >>> m = next(m for m in messages() if m.anchor == "unknown-option-s-use-one-of")
    >>> m.kind, m.where, m.text.split(";")[0]
    ('TypeError', '_Checked.from_options', 'distmon: unknown option(s) {unknown}')
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Message", "messages", "catalogue", "fix_of", "STAGES"]

ROOT = os.path.dirname(os.path.abspath(__file__))

# where in a monitor's life a module's messages come from (a folder, else a file of the package root)
STAGES: dict[str, str] = {
    "compat.py": "Importing distmon",
    "options.py": "Building a monitor",
    "setup": "Building a monitor",
    "layout": "Building a monitor",
    "sources": "Building a monitor",
    "monitor.py": "The monitor's methods",
    "step": "During training",
    "errors.py": "During training",  # the errors caught in distmon's own code: counted, logged once
    "verdicts": "Detectors and checkpoints",
    "export": "Exporting: the log and the callbacks",
    "serve": "Serving /metrics",
    "integrations": "Lightning and the Hugging Face Trainer",
    "report": "python -m distmon report",
}
_LOGGED = {"logger.warning": "warning", "logger.exception": "warning", "logger.error": "warning"}
# imperative words a message's way out starts with (after a colon, a semicolon or a parenthesis)
_VERBS = frozenset(
    "pass use set unset call build declare shard wrap install give close lower load keep check "
    "upgrade launch remove add make put leave apply move create start turn omit clip replace see "
    "free shorten rotate restart raise divide name fix reinstall pick report catch write resume pip".split()
)
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


@dataclass(frozen=True)
class Message:
    """One message site: what is raised or logged, where, when, and the message."""

    kind: str  # the exception class, or "warning" (logged on stderr) or "Python warning"
    text: str  # the message, placeholders as {name}
    path: str  # the module, relative to the repository: distmon/sources/fsdp.py
    where: str  # the function (Class.method), or "module"
    condition: str  # the code's condition for it, or ""
    anchor: str = ""

    @property
    def stage(self) -> str:
        """The part of distmon's life the message belongs to (a section of the catalogue)."""
        parts = self.path.split("/")
        return STAGES.get(parts[1], STAGES.get(parts[-1], "Other"))


def _body(text: str) -> str:
    """A message without its ``distmon:`` (or ``distmon report:``) prefix."""
    return re.sub(r"^distmon(?: report)?: ", "", text)


def fix_of(text: str) -> str | None:
    """The way out a message names: from an imperative (``pass``, ``use``, ``set``, ...) that starts
    one of its clauses to the end of that sentence, else the clause that states what is required
    (``must``, ``needs``, ``expected``); None when it names neither.

    Example:
        >>> fix_of("distmon: no module holds parameters: pass the model fully_shard was applied to")
        'pass the model fully_shard was applied to'
        >>> fix_of("distmon: export_every must be an int >= 1, got {export_every}")
        'export_every must be an int >= 1'
        >>> fix_of("distmon: something failed") is None
        True
    """
    body = _body(text)
    for m in re.finditer(r"(?:^|[:;,.]\s+|\s\(|\)\s)[`'\"(]?([A-Za-z]+)(?![\w=])", body):
        if m[1].lower() in _VERBS:
            start = m.start(1)
            end = re.search(r"\.(?:\s|$)", body[start:])
            return _balanced(body[start : start + end.start() if end else None])
    for clause in re.split(r"[:;]\s+|\.\s+", body):
        clause = re.sub(r", got .*$", "", clause.strip().rstrip(".;:)"))
        if re.search(r"\b(?:must|needs|need|expected|takes|only)\b", clause) and not re.search(
            r"\b(?:must not|cannot)\b", clause
        ):
            return _balanced(re.sub(r"^\{[^}]*\}\s*\(?", "", clause))
    return None


def _balanced(text: str) -> str:
    """``text`` without a trailing period, and without a closing parenthesis it does not open."""
    text = text.strip().rstrip(".")
    while text.endswith(")") and text.count(")") > text.count("("):
        text = text[:-1].rstrip(".")
    return text


def _slug(text: str, where: str, taken: set[str]) -> str:
    """A stable anchor: the message's first words, lowercase, placeholders and punctuation out."""
    words = re.findall(r"[a-z0-9]+", _PLACEHOLDER.sub(" ", _body(text)).lower().replace("'", ""))
    base = "-".join(words[:7])
    if len(words) < 3:  # a message of placeholders: its function names it
        base = "-".join([*words, *re.findall(r"[a-z0-9]+", where.lower())])
    anchor, n = base, 2
    while anchor in taken:
        anchor, n = f"{base}-{n}", n + 1
    taken.add(anchor)
    return anchor


class _Module:
    """One parsed module: its string constants, its parents map, its imports of other modules' names."""

    def __init__(self, path: str, index: dict[str, _Module]) -> None:
        self.path, self.index = path, index
        with open(path, encoding="utf-8") as f:
            self.tree = ast.parse(f.read())
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.constants: dict[str, ast.expr] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # name -> (module path, name there)
        for node in self.tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                self.constants[node.targets[0].id] = node.value
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = os.path.dirname(path)
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
                target = os.path.join(base, *(node.module or "").split(".")) + ".py"
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (target, alias.name)

    def constant(self, name: str) -> ast.expr | None:
        if name in self.constants:
            return self.constants[name]
        if name in self.imported:
            path, there = self.imported[name]
            module = self.index.get(path)
            return module.constant(there) if module is not None else None
        return None

    def function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def qualname(self, node: ast.AST) -> str:
        names = []
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
        return ".".join(reversed(names)) or "module"

    def text(self, node: ast.expr | None, scope: ast.AST | None, depth: int = 0) -> str:
        """``node`` as message text: constants kept, formatted values as ``{name}`` placeholders."""
        if node is None or depth > 4:
            return "{…}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(
                v.value if isinstance(v, ast.Constant) else self._value(v.value, scope, depth)
                for v in node.values
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.text(node.left, scope, depth + 1) + self.text(node.right, scope, depth + 1)
        if isinstance(node, ast.Name):
            return self._named(node.id, scope, depth)
        return "{" + _short(node) + "}"

    def _named(self, name: str, scope: ast.AST | None, depth: int) -> str:
        local = _local_string(scope, name) if scope is not None else None
        value = local if local is not None else self.constant(name)
        if isinstance(value, (ast.Constant, ast.JoinedStr, ast.BinOp)):
            text = self.text(value, scope, depth + 1)
            if not text.startswith("{"):
                return text
        return "{" + name + "}"

    def _value(self, node: ast.expr, scope: ast.AST | None, depth: int) -> str:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("option_name", "option_label")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            from .options import option_label

            return option_label(node.args[0].value)
        if isinstance(node, ast.Name):
            return self._named(node.id, scope, depth)
        return "{" + _short(node) + "}"


def _short(node: ast.expr) -> str:
    """A placeholder's name: a short expression as written (``self.`` left out), else the last name it
    reads (``self.tls_cert`` -> ``tls_cert``, ``len(missing)`` as is, a long call -> ``name(…)``)."""
    written = ast.unparse(node).replace("self.", "")
    if len(written) <= 24:
        return written
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _short(node.func) + "(…)"
    if isinstance(node, ast.Subscript):
        return _short(node.value)
    return "…"


def _local_string(scope: ast.AST, name: str) -> ast.expr | None:
    """The string a function assigns to ``name`` once (a message built in steps), else None."""
    values = [
        n.value
        for n in ast.walk(scope)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    return values[0] if len(values) == 1 and isinstance(values[0], (ast.Constant, ast.JoinedStr)) else None


def _condition(module: _Module, node: ast.AST, given: ast.expr | None = None) -> str:
    """The code's condition for reaching ``node`` inside its function: the nearest ``if`` (negated in
    its ``else``), ``except`` clause, or the check a ``need(...)`` makes."""
    if given is not None:
        return f"not ({ast.unparse(given)})"
    child = node
    while child in module.parent:
        up = module.parent[child]
        if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            return ""
        if isinstance(up, ast.If):
            test = ast.unparse(up.test)
            return test if child in up.body else f"not ({test})" if child in up.orelse else test
        if isinstance(up, ast.ExceptHandler):
            return f"except {ast.unparse(up.type)}" if up.type is not None else "on any exception"
        child = up
    return ""


def _logged(module: _Module, call: ast.Call, scope: ast.AST | None) -> str:
    """A ``logger.warning(format, args...)`` message with its ``%`` fields as placeholders."""
    text = module.text(call.args[0], scope)
    args = iter(call.args[1:])

    def field(m: re.Match[str]) -> str:
        if m[0] == "%%":
            return "%"
        arg = next(args, None)
        return "{…}" if arg is None else "{" + _short(arg) + "}"

    return re.sub(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifgr]", field, text)


def _sites(module: _Module, rel: str) -> Iterator[Message]:
    report = rel.startswith("distmon/report/")
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = ast.unparse(node.func)
        name = func.rsplit(".", 1)[-1]
        scope = module.function(node)
        where, given = module.qualname(node), None
        if func in _LOGGED:
            kind, text = "warning", _logged(module, node, scope)
        elif func == "warnings.warn":
            kind, text = "Python warning", module.text(node.args[0], scope)
        elif name == "note" and len(node.args) == 3:  # ErrorCounter.note(site, n, message)
            kind, text = "warning", module.text(node.args[2], scope)
        elif func == "need" and len(node.args) >= 2:  # setup/config.py's checks
            exc = node.args[2] if len(node.args) > 2 else None
            kind = ast.unparse(exc) if exc is not None else "ValueError"
            text, given = "distmon: " + module.text(node.args[1], scope), node.args[0]
        elif func == "check.error":  # MonitorConfig.validate's one raise for every option's Check
            yield from _option_checks(rel, where)
            continue
        elif report and func == "fail":
            kind, text = "exit status 2", "distmon report: " + module.text(node.args[0], scope)
        elif report and name == "LogError":
            kind, text = "exit status 2", "distmon report: " + module.text(node.args[0], scope)
        elif name.endswith(("Error", "Exception")) and name[:1].isupper():
            kind, text = name, module.text(node.args[0], scope)
        else:
            continue
        if not text.startswith("distmon") or not _PLACEHOLDER.sub("", _body(text)).strip(" :;"):
            continue  # not distmon's, or a message passed through (its source is listed)
        yield Message(kind, " ".join(text.split()), rel, where, condition=_condition(module, node, given))


def messages(root: str = ROOT) -> list[Message]:
    """Every message site of the package at ``root``, in module order, each with its anchor."""
    paths = sorted(
        os.path.join(top, f) for top, _, files in os.walk(root) for f in files if f.endswith(".py")
    )
    index: dict[str, _Module] = {}
    for path in paths:
        index[path] = _Module(path, index)
    found: list[Message] = []
    seen: set[tuple[str, str, str]] = set()
    for path in paths:
        rel = "distmon/" + os.path.relpath(path, root).replace(os.sep, "/")
        for m in _sites(index[path], rel):
            if (m.kind, m.text, m.where) not in seen:  # a message raised at two places of one function
                seen.add((m.kind, m.text, m.where))
                found.append(m)
    order = list(dict.fromkeys(STAGES.values())) + ["Other"]
    found.sort(key=lambda m: order.index(m.stage))  # stable: module order within a stage
    taken: set[str] = set()
    return [dataclasses.replace(m, anchor=_slug(m.text, m.where, taken)) for m in found]


def _option_checks(rel: str, where: str) -> list[Message]:
    """Each option's ``Check`` (``options.py``) as the message ``MonitorConfig.validate`` raises."""
    from .options import OPTIONS

    return [
        Message(
            kind=o.check.error.__name__,
            text=f"distmon: {o.name} must be {o.check.must}, got {{value}}",
            path=rel,
            where=where,
            condition=f"not ({o.name} is {o.check.must})",
        )
        for o in OPTIONS
        if o.check is not None
    ]


def _title(text: str) -> str:
    """A heading for a message: its first clause, without the ``distmon:`` prefix."""
    body = _body(text)
    head = re.split(r"(?<=\S)[:;](?=\s)|\s\(|\. ", body, maxsplit=1)[0].strip()
    head = head if len(head) <= 90 else head[:87].rsplit(" ", 1)[0] + " …"
    head = _PLACEHOLDER.sub(lambda m: "‹" + m[0][1:-1] + "›", head)  # braces would end the {#anchor}
    return head.replace("`", "'").replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")


def catalogue(root: str = ROOT) -> str:
    """The catalogue (Markdown): a section per stage, an entry per message site.

    Example:
        >>> catalogue().startswith("## Importing distmon")
        True
    """
    out, stage = [], None
    for m in messages(root):
        if m.stage != stage:
            stage = m.stage
            out.append(f"## {stage}\n")
        fix = fix_of(m.text)
        lines = [
            f"### {_title(m.text)} {{#{m.anchor}}}\n",
            f"`{m.kind}` from `{m.where}` (`{m.path}`)" + (f", when `{m.condition}`" if m.condition else ""),
            "",
            "```text",
            m.text,
            "```",
            "",
        ]
        if fix:
            lines += [f"**Fix:** {fix.replace('`', '')}", ""]
        out.append("\n".join(lines))
    return "\n".join(out)
