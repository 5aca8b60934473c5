"""The benchmark's results, typed, and their JSON form (``overhead.json``).

Samples (what each rank measured) travel between ranks as pickles and are not saved; the
analysed results (``SizeResult`` per model, ``RunResult`` per run) are. The JSON keeps the
format of the files under ``benchmarks/results/`` (field names are the JSON keys), and files
saved before a field existed still load: its default stands in (``None`` where a figure was
not measured, e.g. the paired ratio of runs older than it).
"""

import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

FLAT = {"flat": True}  # the field's own fields stand in the parent's JSON object (absent when None)
OMIT_NONE = {"omit_none": True}  # the field is left out of the JSON when None


def to_json(obj: Any) -> Any:
    """The JSON-ready form of a result: dataclasses by field, tuples as lists.

    Example:
        >>> verdicts, order = [Verdict("memory", "PASS", "19.1 KiB")], OrderEffect(1.1, 1.0, 3, 2)
        >>> to_json({"verdicts": verdicts, "order": order})  # doctest: +ELLIPSIS
        {'verdicts': [['memory', 'PASS', '19.1 KiB']], 'order': {'paired_after': 1.1, ...}}
    """
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if is_dataclass(obj) and not isinstance(obj, type):
        return _fields_json(obj)
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def _fields_json(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a JSON object (``FLAT`` fields inlined, ``OMIT_NONE`` ones absent if None)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None and (f.metadata.get("omit_none") or f.metadata.get("flat")):
            continue
        if f.metadata.get("flat"):
            out.update(to_json(value))
        else:
            out[f.name] = to_json(value)
    return out


def _pick(cls: type, d: dict[str, Any], **decoded: Any) -> Any:
    """``cls`` from the keys of ``d`` it has fields for (others ignored), ``decoded`` overriding."""
    names = {f.name for f in fields(cls)}
    return cls(**{**{k: v for k, v in d.items() if k in names}, **decoded})


# ----------------------------------------------------------------------------- samples (per rank)


@dataclass
class StepMemory:
    """Peak memory of one step above the memory in use when it started, and how it was measured."""

    peak: int
    method: str


@dataclass
class CopySamples:
    """What one rank measured of one approach's DDP copy."""

    times: list[float] = field(default_factory=list)  # wall seconds of each timed step
    cpus: list[float] = field(default_factory=list)  # CPU seconds (all of the rank's threads)
    selfs: list[dict[str, float]] = field(default_factory=list)  # own-code seconds per site and step
    positions: list[int] = field(default_factory=list)  # where in each timed round its step ran
    mem: StepMemory | None = None
    persistent: tuple[int, int] = (0, 0)  # (device, host) bytes kept between steps
    periodic: tuple[float, int] = (0.0, 1)  # (CPU seconds of the periodic work, every N steps)


@dataclass(kw_only=True)
class Health:
    """A monitor's latest global norm (and, for distmon, its step, error count, layers, non-finite flag)."""

    step: int | None = field(default=None, metadata=OMIT_NONE)
    grad_norm: float | None
    errors: int | None = field(default=None, metadata=OMIT_NONE)
    n_layers: int | None = field(default=None, metadata=OMIT_NONE)
    nonfinite: bool | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class RankSamples:
    """One rank's measurements of one size: every copy's, the floor's, the monitors' health."""

    copies: dict[str, CopySamples]
    floors: list[tuple[float, float]]  # (wall s, CPU s) of each fused read of the gradients
    health: dict[str, Health]


@dataclass(kw_only=True)
class SizeInfo:
    """The model of one size and how DDP ran it.

    Example:
        >>> info = SizeInfo(size="smoke", n_params=38912, n_tensors=28, batch=4, seq_len=32,
        ...                 tokens_per_rank=128, grad_bytes=155648, gpt={}, gradient_as_bucket_view=False,
        ...                 layers={"distmon": 15})
        >>> d = info.to_json()
        >>> d["layers[distmon]"], "lightning" in d, SizeInfo.from_json(d) == info
        (15, False, True)
    """

    size: str
    n_params: int
    n_tensors: int
    batch: int
    seq_len: int
    tokens_per_rank: int
    grad_bytes: int
    gpt: dict[str, int]
    gradient_as_bucket_view: bool
    optimizer: str = "AdamW (foreach)"
    bucket_view_reason: str = "memory"
    layers: dict[str, int] = field(default_factory=dict)  # distmon approach -> its layers
    uninstrumented: list[str] | None = field(default=None, metadata=OMIT_NONE)  # distmon sites not timed
    lightning: str | None = field(default=None, metadata=OMIT_NONE)  # where grad_norm came from

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in _fields_json(self).items():
            out.update({f"layers[{name}]": n for name, n in v.items()} if k == "layers" else {k: v})
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SizeInfo":
        layers = {k[len("layers[") : -1]: v for k, v in d.items() if k.startswith("layers[")}
        return _pick(cls, d, layers=layers)


@dataclass
class SizeRun:
    """One size, measured: what ``Bench.run_size`` hands to ``stats.analyse`` on rank 0."""

    info: SizeInfo
    ranks: list[RankSamples]
    rounds: int
    wall_s: float
    profile: dict[str, "ProfileBreakdown"] | None
    sync_debug: dict[str, Any] | None


# ----------------------------------------------------------------------------- analysed (saved)


@dataclass
class OrderEffect:
    """The paired median ratio in the rounds where a copy stepped after the baseline, and before it."""

    paired_after: float
    paired_before: float
    n_after: int
    n_before: int


@dataclass(kw_only=True)
class Row:
    """One approach at one size: step times and ratios to bare DDP, own code, memory."""

    median_ms: float
    mean_ms: float
    ratio: float  # median / bare DDP's median; min-max within each block of rounds
    ratio_min: float
    ratio_max: float
    # median of the per-round ratios and its 95% bootstrap interval (None: saved before it was measured)
    paired: float | None = field(default=None, metadata=OMIT_NONE)
    paired_lo: float | None = field(default=None, metadata=OMIT_NONE)
    paired_hi: float | None = field(default=None, metadata=OMIT_NONE)
    # the spread of the per-round ratios: their 25th and 75th percentiles
    paired_q25: float | None = field(default=None, metadata=OMIT_NONE)
    paired_q75: float | None = field(default=None, metadata=OMIT_NONE)
    order: OrderEffect | None = field(default=None, metadata=FLAT)
    extra_ms: float
    extra_passes: float
    cpu_ms: float
    cpu_ratio: float
    cpu_ratio_min: float
    cpu_ratio_max: float
    cpu_extra_ms: float
    cpu_extra_passes: float
    own_ms: float
    own_passes: float
    own_ratio: float
    background_ms: float
    sites_ms: dict[str, float]
    sites_wall_ms: dict[str, float] = field(default_factory=dict)
    peak_over_baseline: int
    persistent_device: int
    persistent_host: int
    kept_bytes: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Row":
        order = _pick(OrderEffect, d) if "n_after" in d else None
        return _pick(cls, d, order=order)


@dataclass(kw_only=True)
class ProfileBreakdown:
    """torch.profiler's view of a few steps of one distmon copy, per step."""

    sites_ms: dict[str, float]  # instrumented sites (and bench::step), host ms
    device_ms: dict[str, float]  # GPU kernels launched from inside a site
    calls_per_step: dict[str, float]
    ops_per_step: dict[str, float] = field(default_factory=dict)  # torch ops called directly from a site
    distmon_ops_ms: dict[str, float]  # self CPU ms of the ops under distmon's sites, top 15
    steps: int | None = field(default=None, metadata=OMIT_NONE)
    step_ms_profiled: float | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class RawTimes:
    """Every timed step, per approach: the slowest rank's wall seconds, the ranks' mean CPU seconds."""

    wall_s: dict[str, list[float]]
    cpu_s: dict[str, list[float]]


@dataclass(kw_only=True)
class SizeResult:
    """One size, analysed: the floor, bare DDP and one ``Row`` per approach."""

    info: SizeInfo
    n_rounds: int
    repeats: int  # blocks of rounds for the min-max
    floor_ms: float
    floor_cpu_ms: float
    health: dict[str, Health]
    baseline_ms: float
    baseline_cpu_ms: float
    rows: dict[str, Row]
    wall_s: float
    profile: dict[str, ProfileBreakdown] | None
    sync_debug: dict[str, Any] | None
    mem_method: str
    raw: RawTimes

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SizeResult":
        return _pick(
            cls,
            d,
            info=SizeInfo.from_json(d["info"]),
            health={k: _pick(Health, v) for k, v in d["health"].items()},
            rows={k: Row.from_json(v) for k, v in d["rows"].items()},
            profile={k: _pick(ProfileBreakdown, v) for k, v in d["profile"].items()}
            if d["profile"]
            else None,
            raw=_pick(RawTimes, d["raw"]),
        )


class Verdict(NamedTuple):
    """One acceptance check: what, PASS/MISS/UNRESOLVED..., the figures behind it."""

    what: str
    verdict: str
    detail: str


@dataclass(kw_only=True)
class Machine:
    """Where the run ran."""

    cpu: str
    cores: int | None
    torch: str
    python: str
    platform: str
    backend: str
    world_size: int
    threads_per_rank: int
    gpu: str | None = None
    load_avg_start: tuple[float, float, float] | None = None
    distmon: str | None = field(default=None, metadata=OMIT_NONE)
    git: str | None = field(default=None, metadata=OMIT_NONE)


@dataclass(kw_only=True)
class RunResult:
    """One run of the benchmark: ``overhead.json``."""

    machine: Machine
    command: str
    mode: str
    date: str
    hist_freq: int
    warmup: int
    approaches: list[str]
    sizes: list[SizeResult]
    skipped: list[str]
    labels: dict[str, str]
    wall_s: float
    load_avg_end: tuple[float, float, float] | None
    acceptance: list[Verdict] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunResult":
        return _pick(
            cls,
            d,
            machine=_pick(Machine, d["machine"]),
            sizes=[SizeResult.from_json(s) for s in d["sizes"]],
            acceptance=[Verdict(*v) for v in d.get("acceptance", [])],
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(to_json(self), f, indent=1, default=str)

    @classmethod
    def load(cls, path: str) -> "RunResult":
        with open(path) as f:
            return cls.from_json(json.load(f))
