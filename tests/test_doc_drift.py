"""The README and docs/ name only what exists: closed lists from the code against what pages mention.

Each test takes one closed list from the code and fails on a page that names something outside
it (in backticks, or in a code block where said):

- options (``distmon/options.py``'s ``OPTIONS``) and detector thresholds (``DetectorConfig``),
  wherever a page writes ``name=value`` or calls ``GradMonitor(...)``/``DistmonCallback(...)``,
  and the defaults a page states for them;
- metrics (``METRICS``) and the labels a ``metric{label}`` selector or a "label(s) ..." phrase names;
- ``DISTMON_*`` variables: each one a page names is read by the code, each one the code reads
  is named by a page;
- the flags of ``python -m distmon`` (its argparse parser) and of the repository's scripts;
- files of the repository (``distmon/...``, ``tests/...``, a module's ``name.py``);
- ``distmon.*`` modules and names (imported), ``Class.member`` of distmon's classes and
  ``mon.member`` of ``GradMonitor`` (read from the source), ``torch.*`` names (imported);
- the snake_case and CamelCase names a page puts in backticks: distmon's own (options, fields,
  labels, functions, classes, modules) or, for the names of torch, the frameworks and
  Prometheus, the short :data:`FOREIGN` list below (a name in neither is a renamed or removed
  one, or one to add there).

The generated tables are left out here: ``test_docs.py`` compares them with the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

# Names of torch, the frameworks, Prometheus and the tools that pages put in backticks: not
# distmon's, so no list of the code holds them. A name a page uses that is neither distmon's
# nor here fails test_every_backticked_name_is_distmon_s_or_a_known_foreign_one.
FOREIGN = frozenset(
    """
    AcceleratedOptimizer BF16_Optimizer ColwiseParallel DTensor DeepSpeedPlugin
    FP16_UnfusedOptimizer
    GradScaler ModelParallelStrategy Partial PartialState PipelineStage Replicate RowwiseParallel
    Schedule1F1B ScheduleGPipe ScheduleInterleaved1F1B ScheduleLoopedBFS SequenceParallel Shard
    Stateful Trainer TrainingArguments Work
    _checkpoint_wrapped_module _ddp_params_and_buffers_to_ignore _hp_grad _hp_mapping _orig_mod
    allreduce_hook basic_auth body_size_limit clip_grads_with_norm_ compiled_autograd context_parallel
    device_mesh dp_shard_cp fully_shard get_sample_value get_total_norm gradient_as_bucket_view
    gradient_clip_val gradient_clipping honor_labels max_grad_norm no_backward_sync no_sync
    non_blocking overlap_comm parallelize_module python_reducer remote_write safe_get_full_grad
    sample_limit scale_grads scrape_timeout scrape_ set_gradient_divide_factor
    set_requires_gradient_sync set_sync_debug_mode shard_placement_fn stage_module tls_config
    use_local_synchronization full_tensor to_local restore_callback_states_from_checkpoint
    resume_from_checkpoint ckpt_path use_cpu ignored_params deepspeed_plugin was_step_applied
    skipped_steps get_global_grad_norm accumulate clip_grad_norm_ clip_gradients setup_module
    setup_optimizers get_group init_device_mesh __address__ __init__ rule_group
    __meta_kubernetes_pod_label_training_kubeflow_org_job_name prometheus_rule_group_last_duration_seconds
    init_process_group _create_c10d_store StaticTCPRendezvous PrefixStore SpikeDetection
    report_to log_freq on_log SummaryWriter MlflowClient log_metrics global_step define_metric
    WandbLogger TensorBoardLogger TensorBoardCallback WandbCallback get_reporting_integration_callbacks
    """.split()
)
# flags of other programs (torchrun, Prometheus, transformers' scripts) that pages name
FOREIGN_FLAGS = frozenset(
    "--rdzv-id --standalone --max-restarts --use_cpu --enable-feature --web.enable-remote-write-receiver "
    "--help".split()
)
# repository files a page names as outputs or as other programs' files: no file of the checkout
NOT_FILES = frozenset(
    "run.jsonl run.node1.jsonl summary.md web.yml users users.new "
    "benchmarks/results/gpu/".split()  # where `overhead.py --gpu` writes: no GPU run committed yet
)


# -- the pages ----------------------------------------------------------------------------------


@functools.cache
def raw_pages() -> dict[str, str]:
    """The README and every page of docs/, as written (generated tables included)."""
    names = ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(DOCS)) if f.endswith(".md")]
    out = {}
    for name in names:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            out[name] = f.read()
    return out


def pages() -> dict[str, str]:
    """The pages without their generated tables: those are the code's own (test_docs.py compares them)."""
    return {
        name: re.sub(r"<!-- generated: (\w+).*?<!-- end: \1 -->", "", text, flags=re.S)
        for name, text in raw_pages().items()
    }


def prose(text: str) -> str:
    """A page without its code blocks and HTML comments."""
    text = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def spans() -> list[tuple[str, str]]:
    """Every backticked span of every page's prose: ``(page, span)``; a tracker's name (the closed
    list :func:`tracker_names`) is :func:`test_every_tracker_name_a_page_names_exists`'s."""
    return [
        (page, m)
        for page, text in pages().items()
        for m in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose(text))
        if not is_tracker_name(m)
    ]


def blocks(lang: str | None = None) -> list[tuple[str, str, str]]:
    """Every fenced code block: ``(page, language, code)``."""
    out = []
    for page, text in pages().items():
        for m in re.finditer(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", text, flags=re.S | re.M):
            if lang is None or m[2] == lang:
                out.append((page, m[2], re.sub(rf"^{m[1]}", "", m[3], flags=re.M)))
    return out


# -- the closed lists from the code -------------------------------------------------------------


@functools.cache
def source_index() -> dict[str, set[str]]:
    """distmon's names from its source (no import): module short names, top-level names, and each
    class's members (methods, class attributes, annotated fields) under ``Class``."""
    index: dict[str, set[str]] = {"": set()}
    for top, _, files in os.walk(os.path.join(ROOT, "distmon")):
        for f in files:
            if not f.endswith(".py"):
                continue
            with open(os.path.join(top, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            module = f[:-3] if f != "__init__.py" else os.path.basename(top)
            index[""].add(module)
            members = index.setdefault(module, set())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    index[""].add(node.name)
                    members.add(node.name)
                if isinstance(node, ast.ClassDef):
                    cls = index.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                            cls.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            cls.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            cls.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    for sub in ast.walk(node):  # self.x = ... in its methods
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                            if sub.value.id == "self" and isinstance(sub.ctx, ast.Store):
                                cls.add(sub.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in tree.body:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = {t.id for t in targets if isinstance(t, ast.Name)}
                    index[""].update(names)
                    members.update(names)
    return index


def options() -> set[str]:
    from distmon.options import OPTIONS

    return {o.name for o in OPTIONS}


def detector_fields() -> set[str]:
    import distmon

    return {f.name for f in dataclasses.fields(distmon.DetectorConfig)}


def snapshot_fields() -> set[str]:
    import distmon

    return {f.name for f in dataclasses.fields(distmon.Snapshot)} | {
        f.name for f in dataclasses.fields(distmon.AnomalyEvent)
    }


def monitor_members() -> set[str]:
    return source_index()["GradMonitor"]


def labels() -> set[str]:
    from distmon.layout.placements import Coordinates
    from distmon.serve.prometheus_exporter import METRICS

    coords = set(Coordinates(0, 0, 0, 0).labels()) if _coords_sig() else set()
    return {"run_id", "le", *(lb for spec in METRICS.values() for lb in spec.labels)} | coords


def _coords_sig() -> bool:
    from distmon.layout.placements import Coordinates

    return len(dataclasses.fields(Coordinates)) == 4


def metric_names() -> set[str]:
    from distmon.serve.prometheus_exporter import METRICS

    return set(METRICS)


@functools.cache
def tracker_names() -> set[str]:
    """The names a tracker is handed (``export/tracker_figures.py``): its ``distmon/<figure>``
    constants (and the suffixes the tools add to the events' text), ``distmon.<family>``, and the
    W&B step key."""
    from distmon.export import tracker_figures as tf

    with open(tf.__file__, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    singles = {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"distmon/\w+", n.value)
    }
    events = {
        f"{tf.EVENTS}/text_summary",
        f"{tf.EVENTS}/<step>",
        "distmon/...",
        "distmon/*",
        "distmon.*",
        "distmon.<kind>/<item>",
    }
    return singles | events | {f"distmon.{family}" for family in tf.FAMILIES} | {tf.STEP_KEY}


def is_tracker_name(span: str) -> bool:
    """``distmon/grad_norm``, ``distmon.layer_grad_norm/<layer>``, ``train/distmon/grad_norm``,
    ``distmon/rank_outlier_worst_*``, ..."""
    name = re.sub(r"^train/", "", span)
    if name.endswith("*") and name != "distmon/*":
        return any(n.startswith(name[:-1]) for n in tracker_names())
    return name in tracker_names() or name.split("/", 1)[0] in tracker_names()


def alert_names() -> set[str]:
    """The alerts of ``deploy/prometheus/rules/``."""
    folder = os.path.join(ROOT, "deploy", "prometheus", "rules")
    return {
        m
        for f in os.listdir(folder)
        for m in re.findall(r"alert: (\w+)", open(os.path.join(folder, f), encoding="utf-8").read())
    }


def attention_names() -> set[str]:
    """The module and attribute names the precursor looks for (``step/attention_watch.py``)."""
    from distmon.step import attention_watch as aw

    return {
        *(n for pair in aw.PAIRS for n in pair),
        *aw.FUSED,
        *aw.HEAD_SIZE,
        *aw.HEADS,
        *aw.KV_HEADS,
        aw.PER_KV,
    }


_ENV = re.compile(r"\bDISTMON_[A-Z0-9_]*[A-Z0-9]\b")


@functools.cache
def env_read() -> dict[str, str]:
    """Every ``DISTMON_*`` variable the code reads: variable -> where (a string constant of the
    package; ``$VAR``/``${VAR`` in a launch or test script; ``os.environ`` in a test or launch
    module). Not the benchmarks' (set for their own children)."""
    found: dict[str, str] = {}
    for top, _, files in os.walk(os.path.join(ROOT, "distmon")):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(top, f)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(_ENV.pattern, node.value):
                        found.setdefault(node.value, os.path.relpath(path, ROOT))
    for folder in ("launch", "tests"):
        for top, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                path = os.path.join(top, f)
                if not f.endswith((".sh", ".py", ".sbatch")) or f == "test_doc_drift.py":
                    continue
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                pattern = r"\$\{?(DISTMON_\w+)|os\.environ(?:\.get)?\(?\[?[\"'](DISTMON_\w+)"
                for m in re.finditer(pattern, text):
                    found.setdefault(m[1] or m[2], os.path.relpath(path, ROOT))
    return found


@functools.cache
def repo_files() -> set[str]:
    out = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if d not in (".git", "__pycache__", "site", "build") and not d.endswith(".egg-info")
        ]
        for f in files:
            out.add(os.path.relpath(os.path.join(top, f), ROOT))
    return out


# -- the checks ---------------------------------------------------------------------------------


def test_every_option_a_page_sets_exists():
    """``name=value`` in backticks, and the keywords of ``GradMonitor(...)``/``DistmonCallback(...)``
    in backticks or Python blocks, name options (or detector thresholds, snapshot fields)."""
    known = options() | detector_fields() | snapshot_fields() | set().union(*source_index().values())
    bad = []
    for page, span in spans():
        if re.match(r"[a-z][a-z0-9_]*=", span):  # `export_every=10`, `skipped=True, skip_reason=...`
            for name in re.findall(r"(?:^|,\s*)([a-z][a-z0-9_]*)=(?!=)", span):
                if name not in known and name not in FOREIGN:
                    bad.append((page, span))
        for call in re.findall(r"(?:GradMonitor|DistmonCallback)\((.*)\)", span):
            bad += [(page, span) for name in re.findall(r"\b(\w+)=", call) if name not in options()]
    for page, _, code in blocks("python"):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("GradMonitor", "DistmonCallback")
            ):
                bad += [
                    (page, f"{ast.unparse(node.func)}({k.arg}=...)")
                    for k in node.keywords
                    if k.arg not in options()
                ]
    assert bad == [], f"pages set options that do not exist: {bad}"


def _default_claims() -> list[tuple[str, str, str, str]]:
    """``(page, name, value, context)`` where a page states an option's or threshold's default."""
    out = []
    for page, text in pages().items():
        body = prose(text)
        patterns = [
            r"`(\w+)=([^`]+)` \(the default\)",  # `port_fallback=True` (the default)
            r"the default `(\w+)=([^`]+)`",  # the default `activation_every=export_every=10`
            r"`(\w+)`[^.;`]{0,30}?, ([\w.]+) by default",  # `linger_s` seconds, 30 by default
            r"`(\w+)` \(([\d.e+-]+)\)",  # `port` (9290)
        ]
        for pattern in patterns:
            for m in re.finditer(pattern, body):
                out.append((page, m[1], m[2].split("=")[-1].strip('"'), m[0]))
    return out


def test_every_default_a_page_states_is_the_code_s():
    """A default stated in prose (``(the default)``, ``N by default``, ``` `name` (N) ```) equals the
    option's (``OPTIONS``) or the threshold's (``DetectorConfig``); detection.md's are test_docs'."""
    import distmon
    from distmon.options import BY_NAME

    thresholds = {f.name: f.default for f in dataclasses.fields(distmon.DetectorConfig)}
    wrong, checked = [], 0
    for page, name, value, context in _default_claims():
        if name in BY_NAME:
            default = BY_NAME[name].default
            if name == "activation_every":  # None: export_every's
                default = BY_NAME["export_every"].default
        elif name in thresholds:
            default = thresholds[name]
        else:
            continue
        checked += 1
        if isinstance(default, (bool, str)) or default is None:
            same = value == str(default)
        else:
            same = re.fullmatch(r"[\d.e+-]+", value) is not None and float(value) == float(default)
        if not same:
            wrong.append((page, context, f"the code's default: {default!r}"))
    assert checked >= 5, checked  # the patterns still find the pages' claims
    assert wrong == [], f"pages state defaults the code does not have: {wrong}"


def test_every_metric_and_label_a_page_names_exists():
    """``distmon_*`` names in backticks and blocks are metrics (histograms with their suffixes), the
    labels of a ``metric{...}`` selector are that metric's, and a "label(s)" phrase names labels."""
    from distmon.serve.prometheus_exporter import METRICS

    bad = []
    texts = [(p, s) for p, s in spans()] + [(p, c) for p, lang, c in blocks() if lang != "text"]
    for page, text in texts:
        for name, selector in re.findall(r"\b(distmon_[a-z0-9_]+)(\{[^}]*\})?", text):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in METRICS and not (base in METRICS and METRICS[base].kind == "histogram"):
                bad.append((page, name))
                continue
            allowed = {"run_id", *METRICS[base if base in METRICS else name].labels, "le"} | labels()
            for label in re.findall(r"([a-z_]+)\s*(?:=~?|!=|[,}])", selector):
                if label not in allowed:
                    bad.append((page, f"{name}{selector}"))
    for page, text in pages().items():
        for phrase in re.findall(r"\blabel(?:s|led|ed)?\b((?:[^.;:]|\.\w){0,90})", prose(text)):
            for name in re.findall(r"`([a-z_]+)`", phrase):
                if name.startswith("distmon") or name in labels() or name in FOREIGN:
                    continue
                bad.append((page, f"label {name!r}"))
    assert bad == [], f"pages name metrics or labels that do not exist: {bad}"


def test_every_distmon_variable_a_page_names_is_read_and_every_one_read_is_documented():
    """Generated tables included (the options table names the options' variables)."""
    read = env_read()
    named: dict[str, str] = {}
    for page, text in raw_pages().items():
        for var in _ENV.findall(text):
            named.setdefault(var, page)
    assert {v: p for v, p in named.items() if v not in read} == {}, "named by a page, read by no code"
    assert {v: p for v, p in read.items() if v not in named} == {}, "read by the code, named by no page"


def _distmon_flags() -> set[str]:
    from distmon.report.cli import parser

    top = parser()
    flags = {s for a in top._actions for s in a.option_strings}
    for sub in top._subparsers._group_actions[0].choices.values():
        flags |= {s for a in sub._actions for s in a.option_strings}
    return flags


def test_every_flag_a_page_gives_a_command_exists():
    """Flags of ``python -m distmon`` are its parser's; a flag given to ``python path.py`` or
    ``bash path.sh`` appears in that script's folder's code (``launch/demo.sh`` passes its own to
    ``launch/train.py``); a flag on its own appears quoted in some script of the repository."""
    ours = _distmon_flags()
    code = {
        f: open(os.path.join(ROOT, f), encoding="utf-8").read()
        for f in repo_files()
        if f.endswith((".py", ".sh", ".sbatch"))
    }
    bad = []
    commands = [(p, s) for p, s in spans()] + [
        (p, line) for p, lang, c in blocks() if lang in ("bash", "") for line in c.splitlines()
    ]
    for page, text in commands:
        flags = re.findall(r"(?<![\w-])(--[a-z][\w.-]*)", text)
        if not flags:
            continue
        if re.search(r"python -m distmon(?![.\w])", text):
            bad += [(page, text, f) for f in flags if f not in ours]
            continue
        module = re.search(r"python3? -m (distmon(?:\.\w+)+)", text)  # python -m distmon.doc_tables
        script = re.search(r"(?:python3?|bash)\s+((?:[\w.-]+/)*[\w.-]+\.(?:py|sh))", text)
        if module:
            where = [code.get(module[1].replace(".", "/") + ".py", "")]
            bad += [
                (page, text, f)
                for f in flags
                if not any(re.search(rf"[\"']{re.escape(f)}[\"'=\s]", t) for t in where)
            ]
            continue
        if script:
            folder = os.path.dirname(script[1]).split("/")[0] or "."
            where = [t for f, t in code.items() if f.startswith(folder + "/") or folder == "."]
            bad += [
                (page, text, f)
                for f in flags
                if not any(re.search(rf"[\"']{re.escape(f)}[\"'=\s]", t) for t in where)
            ]
        elif not re.match(
            r"\s*(torchrun|pip|python -m (pytest|torch|build)|accelerate|mkdocs|ruff|curl|openssl|htpasswd)",
            text,
        ):
            bad += [
                (page, text, f)
                for f in flags
                if f.split("=")[0] not in FOREIGN_FLAGS
                and not any(re.search(rf"[\"']{re.escape(f)}[\"'=]", t) for t in code.values())
            ]
    assert bad == [], f"pages give flags that no command has: {bad}"


def test_every_repository_file_a_page_names_exists():
    """``dir/...`` paths of the repository, and ``name.py``/``name.sh``/``name.sbatch``/``.yml``
    files named alone (found anywhere in the checkout), exist; a ``.md#anchor`` names a heading."""
    files = repo_files()
    tops = {f.split("/")[0] for f in files} | {f.split("/")[0] + "/" for f in files if "/" in f}
    names = {os.path.basename(f) for f in files}
    bad = []
    for page, span in spans():
        for path in re.findall(r"(?<![\w.~/:-])((?:[\w.-]+/)+[\w.*-]*(?:#[\w-]+)?)", span):
            # a path of the checkout (its first folder is one), or any relative path to a file:
            # a page cites the repository, never a file only the team has
            cited = re.search(r"\.(md|py|sh|sbatch|ya?ml|json|toml|png|txt)(#|$)", path)
            if (path.split("/")[0] not in tops and not cited) or path in NOT_FILES:
                continue
            path, _, anchor = path.partition("#")
            if path.startswith("torch/"):  # torch's source, as installed
                import torch

                if not os.path.exists(os.path.join(os.path.dirname(torch.__path__[0]), path)):
                    bad.append((page, span))
                continue
            if "*" in path:
                pattern = re.compile(re.escape(path).replace(r"\*", "[^/]*"))
                ok = any(pattern.fullmatch(f) for f in files)
            else:  # from the checkout's root, or from distmon/ (a page about the package: step/rows.py)
                ok = any(
                    where in files or any(f.startswith(where + "/") for f in files)
                    for where in (path.rstrip("/"), "distmon/" + path.rstrip("/"))
                )
            if ok and anchor:
                with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
                    heads = [
                        re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", fh.read(), re.M)
                    ]
                ok = anchor in heads
            if not ok:
                bad.append((page, span))
        for name in re.findall(r"(?<![\w/.-])([\w-]+\.(?:py|sh|sbatch|yml|yaml|toml))\b", span):
            if name not in names and name not in NOT_FILES:
                bad.append((page, span))
    assert bad == [], f"pages name files the repository does not have: {bad}"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module or a name in one: ``distmon.*`` from the source (no import: the
    integrations would import their frameworks), ``torch.*`` imported."""
    parts = dotted.split(".")
    if parts[0] == "distmon":
        import distmon

        for i in range(len(parts), 0, -1):
            base = os.path.join(ROOT, *parts[:i])
            if os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")):
                rest = parts[i:]
                if not rest:
                    return True
                members = [*distmon.__all__, "__all__"] if i == 1 else source_index().get(parts[i - 1], set())
                return rest[0] in members and all(r in source_index().get(rest[0], {r}) for r in rest[1:2])
        return False
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_name_a_page_names_exists():
    """``distmon.*`` and ``torch.*`` dotted names import; ``Class.member`` of a distmon class and
    ``mon.member`` name members the source defines (Python blocks included)."""
    index = source_index()
    bad = []
    texts = [(p, s) for p, s in spans()] + [(p, c) for p, lang, c in blocks("python")]
    for page, text in texts:
        for dotted in re.findall(r"(?<![\w.])((?:distmon|torch)(?:\.\w+)+)", text):
            if not _resolves(dotted):
                bad.append((page, dotted))
        for owner, member in re.findall(r"(?<![\w.])([A-Z]\w+|mon|hostinfo)\.(\w+)", text):
            owner = "GradMonitor" if owner == "mon" else owner
            if owner in index and member not in index[owner] and member not in ("py", "md", "sh"):
                bad.append((page, f"{owner}.{member}"))
    assert bad == [], f"pages name modules, functions or members that do not exist: {bad}"


def helper_names() -> set[str]:
    """The top-level names of the suite's helper modules (``tests/*.py`` but the ``test_*``
    modules: ``run_ranks``, ``SyncRecorder``), which docs/development.md names for contributors."""
    out = set()
    folder = os.path.join(ROOT, "tests")
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py") and not f.startswith("test_"):
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            out |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return out


def _vocabulary() -> set[str]:
    import builtins

    from distmon.snapshot import ANOMALY_KINDS
    from distmon.verdicts.resume import STATE_FIELDS

    index = source_index()
    return (
        options()
        | detector_fields()
        | snapshot_fields()
        | labels()
        | metric_names()
        | set(STATE_FIELDS)
        | set(ANOMALY_KINDS)
        | alert_names()
        | attention_names()
        | set(dir(builtins))  # ValueError, ...
        | set().union(*index.values())
        | helper_names()
        | FOREIGN
    )


def test_every_backticked_name_is_distmon_s_or_a_known_foreign_one():
    """A backticked ``snake_case`` or ``CamelCase`` name (alone, or first in a call or a dotted
    name) is distmon's (options, fields, labels, metrics, functions, classes, modules, members) or in
    FOREIGN: a renamed or removed name fails here."""
    known = _vocabulary()
    bad = []
    for page, span in spans():
        m = re.fullmatch(r"([A-Za-z_][\w]*)(?:\(.*\)|\[.*\])?\.?", span.strip())
        if not m:
            continue
        name = m[1]
        snake = "_" in name.strip("_") and name.lower() == name
        camel = re.fullmatch(r"_?[A-Z][a-z0-9]+[A-Z]\w*", name) is not None
        if (snake or camel) and name not in known and not name.isupper():
            bad.append((page, span))
    assert bad == [], f"pages name things distmon does not have (or add a foreign name to FOREIGN): {bad}"


def test_every_tracker_name_a_page_names_exists():
    """A backticked ``distmon/...`` or ``distmon.<family>`` name is one a tracker is handed, and
    docs/trackers.md names every single figure and family the code hands over."""
    named = [  # distmon/... (no file), distmon.<word>/..., distmon.<word> where no module or name is
        (page, m)
        for page, text in pages().items()
        for m in re.findall(r"(?<!`)`((?:train/)?distmon[./][^`\n]*)`(?!`)", prose(text))
        if not os.path.exists(os.path.join(ROOT, m.split("#")[0]))
        and not re.search(r"\.(py|md)\b", m)
        and ("/" in m or not _resolves(m.split("(")[0]))
    ]
    assert [(page, span) for page, span in named if not is_tracker_name(span)] == []
    trackers_page = set(re.findall(r"`([^`\n]+)`", prose(pages()["docs/trackers.md"])))
    missing = {n for n in tracker_names() if not any(s == n or s.startswith(n + "/") for s in trackers_page)}
    assert missing <= {"distmon/...", "distmon/*", "distmon.*", "distmon.<kind>/<item>"} | {
        n for n in tracker_names() if n.startswith("distmon/events/")
    }, missing


def test_the_options_every_rank_must_set_alike_are_the_agreed_ones():
    """docs/options.md's two lists: the options every rank must set alike are ``AGREED``
    (``agreed=True`` in distmon/options.py), the ones that may differ are all the others."""
    from distmon.options import AGREED

    section = pages()["docs/options.md"].split("## Options every rank must set alike", 1)[1]
    alike, rest = section.split(" shape\n", 1) if " shape\n" in section else section.split(" shape ", 1)
    differ = rest.split("Options that may\ndiffer:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`(\w+)`", alike)) == set(AGREED)
    assert set(re.findall(r"`(\w+)`", differ)) == options() - set(AGREED)


def test_the_home_page_links_every_page():
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", pages()["docs/index.md"]))
    assert {p[len("docs/") :] for p in pages() if p.startswith("docs/")} - linked == {"index.md"}


@pytest.mark.parametrize("kind", ["options", "detector thresholds", "metrics", "variables"])
def test_the_closed_lists_are_not_empty(kind):
    """Each list the checks above compare with holds what it should (a broken reader would pass them)."""
    sizes = {
        "options": len(options()),
        "detector thresholds": len(detector_fields()),
        "metrics": len(metric_names()),
        "variables": len(env_read()),
    }
    assert sizes[kind] >= 10, sizes


# -- each check fails on a page that names what does not exist -----------------------------------

# a check -> the line of a page that must fail it (a renamed option, a stale default, ...)
_MUTANTS = {
    "test_every_option_a_page_sets_exists": "Set `export_evry=10`.",
    "test_every_default_a_page_states_is_the_code_s": "`port` (9291) is where it serves.",
    "test_every_metric_and_label_a_page_names_exists": "Read `distmon_grad_norms{run_id}`.",
    "test_every_distmon_variable_a_page_names_is_read_and_every_one_read_is_documented": (
        "Set `DISTMON_EXPORT_EVRY`."
    ),
    "test_every_flag_a_page_gives_a_command_exists": "Run `python -m distmon report --no-such-flag`.",
    "test_every_repository_file_a_page_names_exists": "See `distmon/step/no_such_module.py`.",
    "test_every_module_and_name_a_page_names_exists": "Call `distmon.step.schedule.no_such_function`.",
    "test_every_backticked_name_is_distmon_s_or_a_known_foreign_one": "Call `no_such_helper()`.",
    "test_every_tracker_name_a_page_names_exists": "Its chart is `distmon/no_such_figure`.",
    "test_the_home_page_links_every_page": "A page docs/index.md does not link.",
}


@pytest.mark.parametrize("check", sorted(_MUTANTS))
def test_each_check_fails_on_a_page_that_names_what_does_not_exist(check, monkeypatch):
    """The checks above, each given one page more (``docs/mutant.md``, unlinked) holding a line
    that names something distmon does not have: each must fail on it."""
    pages_now = {**raw_pages(), "docs/mutant.md": f"# Mutant\n\n{_MUTANTS[check]}\n"}
    monkeypatch.setattr(f"{__name__}.raw_pages", lambda: pages_now)
    with pytest.raises(AssertionError):
        globals()[check]()


def test_the_alike_list_fails_when_an_agreed_option_is_left_out(monkeypatch):
    head, section = raw_pages()["docs/options.md"].split("## Options every rank must set alike", 1)
    section = section.replace("`precursor`", "precursor", 1)  # an agreed option, no longer listed
    pages_now = {**raw_pages(), "docs/options.md": f"{head}## Options every rank must set alike{section}"}
    monkeypatch.setattr(f"{__name__}.raw_pages", lambda: pages_now)
    with pytest.raises(AssertionError):
        test_the_options_every_rank_must_set_alike_are_the_agreed_ones()
