"""Every option of :class:`distmon.GradMonitor`, declared once: its variable, its default, its meaning.

Everything else follows from :data:`OPTIONS`: :class:`distmon.setup.config.MonitorConfig`'s fields and
defaults, the ``DISTMON_*`` variables it reads, the ``Args:`` of ``GradMonitor``'s docstring
(:func:`options_args`, so ``help(GradMonitor)`` documents every option) and the option table of
``docs/options.md`` (:func:`options_table`; ``python -m distmon.doc_tables --write`` renders it, a test
compares). ``agreed`` marks the options every rank must set alike (compared at start-up).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Literal, get_args

__all__ = [
    "Option",
    "Check",
    "OPTIONS",
    "BY_NAME",
    "AGREED",
    "ServeMode",
    "GuardMode",
    "SERVE_MODES",
    "GUARD_MODES",
    "option_label",
    "options_table",
    "options_args",
]

ServeMode = Literal["rank0", "node", "all", "none"]
GuardMode = Literal["skip", "raise"]
SERVE_MODES: tuple[ServeMode, ...] = get_args(ServeMode)
GUARD_MODES: tuple[GuardMode | None, ...] = (None, *get_args(GuardMode))


def _bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"distmon: {name}={text!r} is not a boolean (use 1/0, true/false)")


_PARSE: dict[type, Callable[[str, str], object]] = {
    int: lambda name, text: int(text),
    float: lambda name, text: float(text),
    str: lambda name, text: text,
    bool: _bool,
}


@dataclass(frozen=True)
class Check:
    """What an option's value must be: ``test(value)`` holds, or ``MonitorConfig`` raises ``error``
    saying ``<option> must be <must>, got <value>``.

    Example:
        >>> Check(lambda v: v in (1, 2), "1 or 2").test(3)
        False
    """

    test: Callable[[object], bool]
    must: str
    error: type[Exception] = ValueError


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(low: int, optional: bool = False) -> Check:
    """An int (not a bool) >= ``low`` (or None, if ``optional``)."""
    return Check(
        lambda v: (optional and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low),
        f"an int >= {low}",
    )


_BOOL = Check(lambda v: isinstance(v, bool), "a bool", TypeError)


@dataclass(frozen=True)
class Option:
    """One option: its name, its default, its documentation, its ``DISTMON_*`` variable (and the type
    it is read as); ``shown``: the default in words, where the value (None) stands for something."""

    name: str
    default: object  # MonitorConfig's field default (None where something else decides: see shown)
    meaning: str
    _: KW_ONLY
    env: str | None = None
    env_type: type = str
    agreed: bool = False  # every rank must set it alike: it shapes the rows or the guard's verdict
    shown: str | None = None
    check: Check | None = None  # what its value must be (options that need more: MonitorConfig.validate)

    def parse(self, text: str) -> object:
        """The variable's text as the option's value (``ValueError`` if it is not one)."""
        assert self.env is not None
        return _PARSE[self.env_type](self.env, text)

    @property
    def default_text(self) -> str:
        """The default as the docs state it.

        Example:
            >>> BY_NAME["serve"].default_text, BY_NAME["export_interval_s"].default_text
            ('`node`', '5')
        """
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, str):
            return f"`{self.default}`"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


OPTIONS: tuple[Option, ...] = (
    Option(
        "comm_hook",
        None,
        "the DDP comm hook distmon wraps, called exactly as given (DDP accepts one hook: pass yours here)",
        shown="DDP's own reduction",
    ),
    Option("comm_state", None, "the state `comm_hook` is called with", shown="DDP's process group"),
    Option(
        "replicated_over",
        None,
        "`{regex: process_group}`: parameters (qualified names matching) whose gradient the "
        "model's own code makes identical over that group, where no DDP/FSDP wrapper reduces them "
        "(experts reduced over their expert-data-parallel group, tensor parallelism's replicated "
        "modules): one copy counts; the copies must be identical at construction "
        "([Parallel layouts](layouts.md))",
        agreed=True,
    ),
    Option(
        "distinct_over",
        None,
        "`{regex: process_group}`: parameters (qualified names matching) of which each rank of that "
        "group holds a different part under the same name (plain per-rank experts over their "
        "expert-parallel group, inside FSDP2 or outside every wrapper): each rank's part counts "
        "([Parallel layouts](layouts.md)). Undeclared, distmon refuses to guess",
        agreed=True,
    ),
    Option(
        "job_group",
        None,
        "the process group that is the monitored job. Leave it out: a job is its default group "
        "(one log writer, `world_size` the job's), whatever part of it the model passed holds. "
        "Only for independent jobs that share one default group (a sweep trained side by side), "
        "each a DDP model over exactly its group",
        shown="the default group",
        agreed=True,
    ),
    Option(
        "export_every",
        10,
        "steps between host copies of the device ring (snapshots of every step arrive in batches)",
        env="DISTMON_EXPORT_EVERY",
        env_type=int,
        agreed=True,
        check=_whole(1),
    ),
    Option(
        "export_interval_s",
        5.0,
        "also export once this many seconds passed since the last export, so slow steps reach "
        "Prometheus within one scrape interval plus this plus a step (two on a GPU): rank 0 reads "
        "its clock when a step begins and its vote rides that step's all-reduce (one float), so "
        "every rank exports at the same next step; 0: by step count only (a DDP step then sends "
        "no collective between exports)",
        env="DISTMON_EXPORT_INTERVAL_S",
        env_type=float,
        agreed=True,
        check=Check(lambda v: _number(v) and v >= 0, "a number >= 0 (0: by step count only)"),
    ),
    Option(
        "groups",
        None,
        "how parameters fold into layers: None (module qualified name, e.g. `blocks.3.mlp.fc1`), a "
        "callable `(name, param) -> group`, or `[(regex, group), ...]` rules (first match wins, "
        "`\\1` allowed)",
        agreed=True,
        shown="owning module",
    ),
    Option(
        "max_layers",
        128,
        "cap on layer groups (Prometheus cardinality); later groups fold into `other`",
        agreed=True,
        check=Check(lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
    ),
    Option(
        "rank_layers",
        True,
        "also gather the rank x layer matrix of each node's ranks at exports (else per-rank totals only)",
        agreed=True,
        check=_BOOL,
    ),
    Option(
        "serve",
        "node",
        "`node`: the first rank of each node (torchrun agent) serves its node's per-rank series, "
        "global rank 0 also the job-wide ones (one endpoint on one node); `rank0`: global rank 0 "
        "alone (the job-wide series and its own node's ranks'); `all`: every rank serves its own "
        "(ports `port + local rank`); `none`",
        env="DISTMON_SERVE",
        agreed=True,
        check=Check(lambda v: v in SERVE_MODES, f"one of {SERVE_MODES}"),
    ),
    Option(
        "port",
        9290,
        'HTTP port; 0 = ephemeral; with `serve="all"` local rank i uses port + i; bound port in `mon.port`',
        env="DISTMON_PORT",
        env_type=int,
        check=Check(lambda v: isinstance(v, int) and 0 <= v <= 65535, "an int in 0..65535 (0 = ephemeral)"),
    ),
    Option(
        "addr",
        "127.0.0.1",
        "bind address; `0.0.0.0` to be scraped from other hosts (the Slurm/Kubernetes launchers set it)",
        env="DISTMON_ADDR",
        check=Check(lambda v: isinstance(v, str) and bool(v), "a host address"),
    ),
    Option(
        "port_fallback",
        True,
        "a taken port (two jobs on one node) does not stop the job: the next free port (else an "
        "ephemeral one) is taken, named in a warning, in `mon.port` and in the file_sd target; "
        "False: raise `OSError` (`errno.EADDRINUSE`) at construction instead",
        env="DISTMON_PORT_FALLBACK",
        env_type=bool,
    ),
    Option(
        "tls_cert",
        None,
        "PEM certificate (chain): the endpoint speaks HTTPS only (TLS 1.2+); needs `tls_key` "
        "([Securing the endpoint](deployment.md#securing-the-endpoint))",
        env="DISTMON_TLS_CERT",
    ),
    Option(
        "tls_key",
        None,
        "the certificate's unencrypted PEM private key; needs `tls_cert`",
        env="DISTMON_TLS_KEY",
    ),
    Option(
        "tls_client_ca",
        None,
        "PEM CA certificate(s): clients must present a certificate signed by one of them (mutual "
        "TLS); needs `tls_cert`",
        env="DISTMON_TLS_CLIENT_CA",
    ),
    Option(
        "basic_auth_file",
        None,
        "htpasswd file of `user:bcrypt-hash` lines (`htpasswd -nbB user password`): requests need "
        "HTTP basic auth as one of those users (needs `pip install bcrypt`); use with TLS",
        env="DISTMON_BASIC_AUTH_FILE",
    ),
    Option(
        "run_id",
        None,
        "the `run_id` label; rank 0's value wins",
        env="DISTMON_RUN_ID",
        shown="torchrun's `TORCHELASTIC_RUN_ID`, else `SLURM_JOB_ID`, else generated",
        check=Check(lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "a non-empty string"),
    ),
    Option(
        "log_path",
        None,
        'JSONL file of every step\'s snapshot (non-finite floats as `"nan"`/`"inf"`), written by rank 0; '
        "with several nodes the first rank of node n writes its ranks' in `<stem>.node<n><suffix>` beside "
        "it (`python -m distmon report` reads them together)",
        env="DISTMON_LOG_PATH",
    ),
    Option(
        "tracker",
        None,
        "your experiment tracker, handed every step's figures (global, per-layer and node 0's "
        "per-rank norms, non-finite flags and the first bad rank, scores, noise scale, update "
        "ratios, activations, events) at their own step, from global rank 0, on a thread of its "
        "own behind a bounded queue: a TensorBoard `SummaryWriter`, a W&B run, an MLflow run, a "
        "callable `fn(figures, step)`, a name that makes one (`tensorboard[:DIR]`, "
        "`wandb[:PROJECT]`, `mlflow[:EXPERIMENT]`), or a list of them ([Trackers](trackers.md))",
        env="DISTMON_TRACKER",
        shown="none",
    ),
    Option(
        "file_sd_dir",
        None,
        "Prometheus `file_sd` directory: rank 0 writes `{run_id}.json` listing every serving "
        "endpoint, removes it after a clean finish",
        env="DISTMON_FILE_SD_DIR",
    ),
    Option(
        "linger_s",
        30.0,
        "after a clean `close()`, keep serving until Prometheus scraped the final state "
        "(`distmon_run_finished=1`) twice, at most this many seconds; no wait when `/metrics` was "
        "never scraped during the run; with `file_sd_dir`, every endpoint serves the whole time (rank "
        "0 withdraws the target file after it); 0: stop at once. Announced on stderr (a warning)",
        env="DISTMON_LINGER_S",
        env_type=float,
        check=Check(lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, "a number >= 0"),
    ),
    Option(
        "window_s",
        60.0,
        "window of `distmon_grad_norm_window_max`, seconds",
        check=Check(lambda v: isinstance(v, (int, float)) and v > 0, "a number > 0"),
    ),
    Option(
        "detect",
        True,
        "detectors on (True), off (False), or a `distmon.DetectorConfig` with thresholds",
        agreed=True,
    ),
    Option(
        "guard",
        None,
        '`"skip"`: do not take an optimizer step whose reduced gradient is non-finite or spiked '
        '(parameters, optimizer state and `lr_scheduler` untouched on every rank); `"raise"`: '
        "raise `distmon.GradientAnomalyError` from `optimizer.step()` on every rank. Costs one small "
        "host sync per step",
        agreed=True,
        check=Check(lambda v: v in GUARD_MODES, f"one of {GUARD_MODES}"),
    ),
    Option("lr_scheduler", None, "the scheduler (or list of schedulers) to hold back on skipped steps"),
    Option(
        "scaler",
        None,
        "the `torch.amp.GradScaler` the loss goes through: figures are divided by its scale, its "
        "skipped steps recorded ([Mixed precision](getting-started.md#mixed-precision))",
        agreed=True,
    ),
    Option(
        "loss_scale",
        None,
        "a fixed factor your loss is multiplied by before `backward()` (not with `scaler`); figures "
        "are divided by it",
        agreed=True,
        check=Check(
            lambda v: v is None or (_number(v) and v > 0),
            "a positive finite number (the factor your loss is multiplied by before backward)",
        ),
    ),
    Option(
        "batch_size",
        None,
        "this rank's batch per optimizer step, in your units (sequences or tokens, accumulation "
        "included), or a callable returning it: turns on the gradient noise scale "
        "([Gradient noise scale](metrics.md#gradient-noise-scale)); needs 2+ ranks",
        agreed=True,
        check=Check(
            lambda v: v is None or callable(v) or (_number(v) and v > 0),
            "a positive number (this rank's batch per optimizer step, in your units: sequences or "
            "tokens, accumulation included) or a callable returning it",
        ),
    ),
    Option(
        "gns_alpha",
        0.05,
        "EMA weight of the noise scale's two terms; figures are NaN until `1/gns_alpha` steps went in",
        agreed=True,
        check=Check(lambda v: isinstance(v, (int, float)) and 0 < v < 1, "in (0, 1)"),
    ),
    Option(
        "activations",
        None,
        "watch forward outputs: `True` (each block of the model's first `ModuleList`, else each "
        "top-level child), or a list of module types and/or name regexes; per module output RMS and "
        "max-abs, and the first module whose output went non-finite "
        "([Forward activations](metrics.md#forward-activations))",
        agreed=True,
    ),
    Option(
        "activation_every",
        None,
        "steps between watched forwards",
        agreed=True,
        shown="`export_every`",
        check=_whole(1, optional=True),
    ),
    Option(
        "update_ratio",
        False,
        "per-layer update-to-weight ratio `\\|Δθ\\|/\\|θ\\|` on every `export_every`-th step (one "
        "copy of the parameters is kept for it; not when ranks hold parts of the model: FSDP, tensor "
        "or pipeline parallelism)",
        agreed=True,
        check=_BOOL,
    ),
    Option(
        "precursor",
        False,
        "a warning before the loss diverges: each attention block's logit bound "
        "`max|q| max|k| / sqrt(d_head)`, read on the forwards of every 10th step, warns "
        "(`divergence_warning`) once above 1000 for 2 samples. `True`: the blocks found by the "
        "names common models use; a `PrecursorConfig`: its patterns, bound, sampling, and with "
        "`peak_lr=` the oscillation rule (consecutive gradients' cosine while the warm-up still "
        "raises the rate; one process and DDP) ([Detection](detection.md#divergence-precursor))",
        env="DISTMON_PRECURSOR",
        env_type=bool,
        agreed=True,
    ),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
AGREED: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.agreed)


def option_label(name: str) -> str:
    """An option as a user may have set it: ``export_every (DISTMON_EXPORT_EVERY)``.

    Example:
        >>> option_label("export_every"), option_label("guard")
        ('export_every (DISTMON_EXPORT_EVERY)', 'guard')
    """
    env = BY_NAME[name].env if name in BY_NAME else None
    return f"{name} ({env})" if env else name


def options_table() -> str:
    """The option table of ``docs/options.md`` (Markdown), from :data:`OPTIONS`.

    Example:
        >>> options_table().splitlines()[2].startswith("| `comm_hook` |")
        True
    """
    rows = ["| option | env | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        env = f"`{o.env}`" if o.env else ""
        rows.append(f"| `{o.name}` | {env} | {o.default_text} | {o.meaning} |")
    return "\n".join(rows) + "\n"


_LINK = re.compile(r"\[([^]]+)\]\(([\w-]+\.md)(#[\w-]+)?\)")


def _plain(markdown: str) -> str:
    """A meaning as plain text: a link to a docs page as its text and the page's path."""
    text = _LINK.sub(lambda m: f"{m[1]}: docs/{m[2]}", markdown)
    return text.replace("\\|", "|")  # a pipe escaped for the Markdown table


def options_args(indent: str = "        ") -> str:
    """The keyword options as docstring ``Args:`` entries, from :data:`OPTIONS` (``GradMonitor.__doc__``).

    Example:
        >>> print(options_args("").splitlines()[0])
        comm_hook: the DDP comm hook distmon wraps, called exactly as given (DDP accepts one hook: pass
    """
    entries = []
    for o in OPTIONS:
        env = f"``{o.env}``; " if o.env else ""
        first = f"{o.name}: {_plain(o.meaning)} ({env}default: {o.default_text})."
        lines = textwrap.wrap(first, width=96, subsequent_indent="    ", break_on_hyphens=False)
        entries.append("\n".join(indent + line for line in lines))
    return "\n".join(entries)
