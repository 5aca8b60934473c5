"""The monitor's options: defaults, ``DISTMON_*`` environment variables, validation.

Everything is checked here, when the monitor is built, so a typo fails the job at start-up
instead of an hour into training. Explicit keyword arguments win over environment variables,
which win over defaults.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import field, fields, make_dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..errors import ErrorCounter
from ..export.trackers import check_tracker
from ..layout.grouping import Grouping, validate_groups
from ..options import AGREED, BY_NAME, OPTIONS, SERVE_MODES, GuardMode, ServeMode
from ..serve.endpoint_security import EndpointSecurity
from ..sources import Source
from ..step.activations import ActivationWatch, select_modules, validate_activations
from ..step.attention_watch import AttentionWatch, find_attention
from ..step.grad_cosine import GradientCosine
from ..step.update_ratio import UpdateRatio
from ..verdicts.detectors import DetectorConfig
from ..verdicts.precursor import PrecursorConfig

DEFAULT_PORT: int = BY_NAME["port"].default  # type: ignore[assignment]  # an int (options.py)

__all__ = ["MonitorConfig", "SERVE_MODES", "DEFAULT_PORT", "ServeMode", "GuardMode", "Scheduler", "Features"]


class Scheduler(Protocol):
    """What ``lr_scheduler`` must be: something with a ``step()`` (a guard holds it back on skipped steps)."""

    def step(self, *args: object, **kwargs: object) -> object: ...


# The endpoint's security files: set but empty, their variables would turn TLS or basic auth off
# without a word: an error, not "unset".
_FILE_ENV = frozenset(BY_NAME[f.name].env for f in fields(EndpointSecurity))


def _env(name: str) -> str | None:
    """A variable's value; set but empty means unset, except for the endpoint's security files.

    Example:
        >>> os.environ["DISTMON_TLS_CERT"] = ""
        >>> _env("DISTMON_TLS_CERT")
        Traceback (most recent call last):
        ...
        ValueError: distmon: DISTMON_TLS_CERT is set but empty: give the file's path, or unset it
        >>> del os.environ["DISTMON_TLS_CERT"]
    """
    value = os.environ.get(name)
    if value is not None and not value.strip() and name in _FILE_ENV:
        raise ValueError(f"distmon: {name} is set but empty: give the file's path, or unset it")
    return value if value not in (None, "") else None


def _is_regex(text: str) -> bool:
    try:
        re.compile(text)
    except re.error:
        return False
    return True


def _digest(names: tuple[str, ...]) -> str:
    return f"{len(names)} [{hashlib.sha1(chr(10).join(names).encode()).hexdigest()[:10]}]"


class _Checked:
    """What a monitor's options can do, once validated: the methods of :class:`MonitorConfig`."""

    @classmethod
    def from_options(cls, **options: object) -> MonitorConfig:
        """Merge keyword options (``None`` = not given) with the environment and defaults, then validate.

        Example:
            >>> MonitorConfig.from_options(export_every=5, serve="none").export_every
            5
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"distmon: unknown option(s) {unknown}; use one of {sorted(known)}")
        values: dict[str, object] = {}
        for name, value in options.items():
            env = BY_NAME[name].env
            if value is None and env is not None:
                text = _env(env)
                if text is not None:
                    try:
                        value = BY_NAME[name].parse(text)
                    except ValueError as e:
                        raise ValueError(
                            f"distmon: bad {env}={text!r}: {e}; set it to a value of {name}'s type, "
                            "or unset it"
                        ) from None
            if value is not None:
                values[name] = value
        cfg = cls(**values)  # type: ignore[arg-type]  # checked by validate()
        cfg.validate()
        return cfg

    def agreed(
        self, layers: tuple[str, ...], watched: tuple[str, ...], attended: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """The :data:`AGREED` options as every rank must have them, comparable across ranks.

        ``layers`` (what ``groups`` and ``max_layers`` made of the model), ``watched`` (the
        modules ``activations`` selects) and ``attended`` (the attention blocks ``precursor``
        reads) stand for those options: their names' count and digest.

        Example:
            >>> MonitorConfig(export_every=5).agreed(("fc1", "fc2"), ())["export_every"]
            '5'
        """
        shown: dict[str, str] = {}
        for name in AGREED:
            value = getattr(self, name)
            if name == "groups":
                value = f"layer groups {_digest(layers)}"
            elif name == "activations":
                value = f"watched modules {_digest(watched)}" if watched else None
            elif name == "batch_size":
                value = "given" if value is not None else None
            elif name == "scaler":
                value = "a GradScaler" if value is not None else None
            elif name == "activation_every":
                value = value or self.export_every
            elif name in ("replicated_over", "distinct_over"):
                value = sorted(value) if value else None  # the patterns: each rank's groups differ
            elif name == "precursor":  # its settings and the blocks it found
                value = f"{value!r} over attention blocks {_digest(attended)}" if value else None
            elif name == "job_group":
                value = "given" if value is not None else None  # each job's group differs
            shown[name] = repr(value) if not isinstance(value, str) else value
        return shown

    @property
    def security(self) -> EndpointSecurity:
        """The endpoint's TLS and basic-auth settings (raises on options that do not go together).

        Example:
            >>> MonitorConfig(tls_cert="server.pem", tls_key="server.key").security.tls_cert
            'server.pem'
        """
        return EndpointSecurity(self.tls_cert, self.tls_key, self.tls_client_ca, self.basic_auth_file)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option: each option's own check
        (declared with it, ``options.py``), then what needs more than one value or a torch type."""
        for option in OPTIONS:
            value = getattr(self, option.name)
            if option.check is not None and not option.check.test(value):
                check = option.check
                raise check.error(f"distmon: {option.name} must be {check.must}, got {value!r}")

        def need(cond: bool, msg: str, exc: type = ValueError) -> None:
            if not cond:
                raise exc(f"distmon: {msg}")

        need(
            self.comm_hook is None or callable(self.comm_hook),
            f"comm_hook must be a DDP comm hook function (state, bucket) -> Future, got {self.comm_hook!r}",
            TypeError,
        )
        for name in ("replicated_over", "distinct_over"):
            declared = getattr(self, name)
            need(
                declared is None
                or isinstance(declared, dict)
                and all(isinstance(k, str) and _is_regex(k) for k in declared)
                and all(isinstance(g, dist.ProcessGroup) for g in declared.values()),
                f"{name} must be a dict of name regex -> torch.distributed ProcessGroup, got {declared!r}",
                TypeError,
            )
        need(
            self.job_group is None or isinstance(self.job_group, dist.ProcessGroup),
            f"job_group must be a torch.distributed ProcessGroup, got {self.job_group!r}",
            TypeError,
        )
        validate_groups(self.groups)
        _ = self.security  # pairs and types of the TLS/auth options; their files are read at bind time
        schedulers = (
            self.lr_scheduler if isinstance(self.lr_scheduler, (list, tuple)) else [self.lr_scheduler]
        )
        need(
            all(s is None or hasattr(s, "step") for s in schedulers),
            f"lr_scheduler must have a step() method (or be a list of such), got {self.lr_scheduler!r}",
            TypeError,
        )
        need(
            isinstance(self.detect, (bool, DetectorConfig)),
            f"detect must be a bool or a distmon.DetectorConfig, got {self.detect!r}",
            TypeError,
        )
        need(
            self.guard is None or self.detect is not False,
            "guard needs the detectors: pass detect=True or a DetectorConfig",
        )
        check_tracker(self.tracker)
        if self.file_sd_dir is not None:
            need(
                self.serve != "none",
                "file_sd_dir needs a served endpoint; serve='none' was given: leave file_sd_dir out, "
                "or serve",
            )
        need(
            self.scaler is None or isinstance(self.scaler, torch.amp.GradScaler),
            f"scaler must be a torch.amp.GradScaler (the one whose scale() the loss goes through), "
            f"got {self.scaler!r}",
            TypeError,
        )
        need(
            self.scaler is None or self.loss_scale is None,
            "pass scaler= (a GradScaler) or loss_scale= (a fixed scale), not both",
        )
        validate_activations(self.activations)
        need(
            isinstance(self.precursor, (bool, PrecursorConfig)),
            f"precursor must be a bool or a distmon.PrecursorConfig, got {self.precursor!r}",
            TypeError,
        )


# One field per option, with its default, generated from OPTIONS: an option is declared in
# distmon/options.py and in GradMonitor's signature (its type), nowhere else.
MonitorConfig = make_dataclass(
    "MonitorConfig",
    [(o.name, object, field(default=o.default)) for o in OPTIONS],
    bases=(_Checked,),
    frozen=True,
)
MonitorConfig.__module__ = __name__  # make_dataclass's module= is Python 3.12's
MonitorConfig.__doc__ = """Validated options of :class:`distmon.GradMonitor`: one field per option of
:data:`distmon.options.OPTIONS` (its default, its ``DISTMON_*`` variable; its type is the one
``GradMonitor``'s signature states).

Example:
    >>> MonitorConfig(export_every=5).export_every, MonitorConfig().serve
    (5, 'node')
"""


class Features(NamedTuple):
    """The opt-in measurements of one monitor, once their options were checked against the source."""

    batch_of_step: Callable[[], float] | None  # the noise scale: this rank's batch this step
    watch: ActivationWatch | None
    ratio: UpdateRatio | None
    attention: AttentionWatch | None  # the precursor's attention blocks
    cosine: GradientCosine | None  # its consecutive gradients' cosine (PrecursorConfig.peak_lr)
    precursor: PrecursorConfig | None


def features(
    cfg: MonitorConfig,
    source: Source,
    grouping: Grouping,
    errors: ErrorCounter,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> Features:
    """The noise-scale, activation, update-ratio and precursor parts, or the error naming the option.

    What each needs of the source: ``batch_size`` 2+ data-parallel ranks, each rank's local
    figures and a reduction that is the ranks' mean; ``activations`` modules to watch;
    ``update_ratio`` unsharded weights; ``precursor`` attention blocks whose queries and keys it
    can read, or with ``peak_lr`` whole gradients on every rank (its oscillation rule, which
    reads the first optimizer's learning rate).
    """
    batch_of_step = None
    if cfg.batch_size is not None:
        if source.world_size < 2:
            raise ValueError(
                "distmon: batch_size= turns on the gradient noise scale, which compares one rank's "
                "batch with the global one: it needs 2 or more data-parallel ranks"
            )
        if not source.local_figures:
            raise ValueError(
                "distmon: batch_size= turns on the gradient noise scale, which needs each rank's "
                f"local gradient: FSDP2 hands it to distmon from torch 2.9 (this is torch "
                f"{torch.__version__}): upgrade torch, or leave batch_size= out"
            )
        if source.divide_factor_set:
            raise ValueError(
                "distmon: the gradient noise scale needs the reduced gradient to be the mean of "
                "the ranks' gradients; an FSDP gradient divide factor changes that: leave "
                "set_gradient_divide_factor alone, or leave batch_size= out"
            )
        size = cfg.batch_size
        batch_of_step = size if callable(size) else lambda: size
    watch = None
    if cfg.activations:
        watched = select_modules(source.module, cfg.activations)
        if not watched:
            raise ValueError(
                f"distmon: activations={cfg.activations!r} selects no module of the model: give module "
                "types or name patterns (regexes over qualified names) that match, or True"
            )
        watch = ActivationWatch(watched, device=source.device, errors=errors)
    ratio = None
    if cfg.update_ratio:
        if source.in_parts:
            raise ValueError(
                "distmon: update_ratio=True is not supported when ranks hold parts of the model "
                "(FSDP, tensor or pipeline parallelism) yet: a layer's weights are spread over ranks. "
                "Leave update_ratio=False with this layout"
            )
        ratio = UpdateRatio(
            list(grouping.params),
            layer_of=list(grouping.param_layer),
            n_layers=len(grouping.layers),
            device=source.device,
        )
    attention, cosine, precursor = None, None, None
    if cfg.precursor:
        precursor = cfg.precursor if isinstance(cfg.precursor, PrecursorConfig) else PrecursorConfig()
        blocks = find_attention(
            source.module, queries=precursor.queries, keys=precursor.keys, head_dim=precursor.head_dim
        )
        if not blocks and precursor.peak_lr is None:
            raise ValueError(
                "distmon: precursor=True found no attention block in the model (by the names common "
                "models use: q_proj/k_proj, q_norm/k_norm, query/key, wq/wk, a fused "
                "qkv/c_attn/Wqkv/qkv_proj or query_key_value): "
                "pass precursor=PrecursorConfig(queries=r'...', keys=r'...', head_dim=...) naming them, "
                "or PrecursorConfig(peak_lr=...) for the oscillation rule alone"
            )
        if blocks:
            attention = AttentionWatch(blocks, device=source.device, errors=errors)
        if precursor.peak_lr is not None:
            cosine = _gradient_cosine(precursor.peak_lr, source, grouping, optimizers)
    return Features(batch_of_step, watch, ratio, attention=attention, cosine=cosine, precursor=precursor)


def _gradient_cosine(
    peak_lr: float, source: Source, grouping: Grouping, optimizers: Sequence[torch.optim.Optimizer]
) -> GradientCosine:
    """The oscillation rule's reader, or the error naming what it needs."""
    if not source.whole_grads:
        raise ValueError(
            "distmon: PrecursorConfig(peak_lr=...) reads the cosine between consecutive steps' "
            "gradients, which needs every rank to hold each parameter's whole gradient in .grad (one "
            "process, DDP); with FSDP, DeepSpeed, tensor or pipeline parallelism leave peak_lr out "
            "(the attention-logit rule still runs)"
        )
    group = optimizers[0].param_groups[0]  # the rate peak_lr is the peak of
    return GradientCosine(list(grouping.params), source.device, peak_lr=peak_lr, rate=lambda: group["lr"])
