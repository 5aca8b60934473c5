"""What a monitor carries across a restart: its step count and what its detectors have learned.

Runs are preempted, crash and resume from their last checkpoint many times. A monitor built
after a resume must count on from the checkpoint's step and judge against the baselines the run
had learned; otherwise its first spikes are judged against nothing, the noise scale is NaN again
for ``1/gns_alpha`` steps and the step count falls back. :func:`monitor_state` is what
``GradMonitor.state_dict()`` returns: plain lists and numbers (``torch.save``,
``torch.distributed.checkpoint`` and the Hugging Face Trainer's JSON keep them alike), the same on
every rank, because every rank judges the same rows. :func:`load_monitor_state` checks a state
against the monitor it goes into, maps what is well defined and refuses the rest.

What is kept, and how a different job maps:

======================  ==============================================================
step                    the optimizer steps the run had taken: the next one is step + 1
detector                EMAs of every log-norm, the median window, spike and vanishing
                        runs; the rank-outlier scales only on the same ranks' grouping
                        (another world size: they start afresh, said in a warning)
noise                   the noise scale's EMAs and their counts (world-size free)
precursor               the divergence precursor's smoothed signals, floors and runs
scaler_run              consecutive steps the GradScaler skipped (``scaler_stuck``)
layers                  must equal the monitor's (the same model and ``groups=``): refused
                        otherwise, naming the first difference
======================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import logger

if TYPE_CHECKING:  # they import this module for their own state
    from .detectors import DeviceDetector
    from .noise_scale import NoiseScale
    from .precursor import PrecursorDetector

__all__ = [
    "STATE_VERSION",
    "save_tensors",
    "load_tensors",
    "monitor_state",
    "disabled_state",
    "load_monitor_state",
    "STATE_FIELDS",
    "state_table",
]

# raise it when a field changes meaning or name; load_monitor_state reads every version up to it
# (2: the detector's "held" is "spiking")
STATE_VERSION = 2

# GradMonitor.state_dict()'s keys and what each holds (docs/api.md's table is rendered from it; a
# test compares it with a real state)
STATE_FIELDS: dict[str, str] = {
    "version": "int: the format's version, `STATE_VERSION`; a distmon reads every version up to its own",
    "step": "int: optimizer steps the run had taken; the resumed monitor's next step is this + 1",
    "layers": "list of str: the layer groups, in model order; must equal the resuming monitor's",
    "world_size": "int: the job's ranks; another world size keeps all but the rank-outlier scales",
    "detector": "dict of lists and numbers, or None (detect=False): the detectors' EMAs of every "
    "log-norm, the median window, the spike and vanishing runs, the rank-outlier scales",
    "noise": "dict of lists and numbers, or None (no batch_size): the noise scale's EMAs and counts",
    "precursor": "dict of lists and numbers, or None (precursor off): the divergence precursor's "
    "EMAs of each signal's log (each attention block's logit bound, with peak_lr= the oscillation "
    "rule's 1 - cosine), its runs and its sample count",
    "scaler_run": "int: consecutive steps the GradScaler skipped (scaler_stuck)",
    "disabled": "True, only in the state of a disabled monitor (DISTMON_DISABLE), which holds "
    "`version` and this alone: a monitor that loads it starts afresh",
}


def save_tensors(owner: object, names: Sequence[str]) -> dict[str, list]:
    """``owner``'s tensor attributes ``names`` as plain lists (one host copy each: at a checkpoint).

    Example:
        >>> class Ema:
        ...     mean = torch.tensor([0.5, 1.0])
        >>> save_tensors(Ema(), ["mean"])
        {'mean': [0.5, 1.0]}
    """
    return {name: getattr(owner, name).tolist() for name in names}


def load_tensors(
    owner: object,
    state: Mapping[str, object],
    names: Sequence[str],
    part: str,
    why: Mapping[str, str] | None = None,
) -> None:
    """Copy lists from ``state`` into ``owner``'s tensor attributes ``names``, all or none: every size
    must match first (``why`` names the setting a tensor's size comes from, for the error)."""
    values = {}
    for name in names:
        into: torch.Tensor = getattr(owner, name)
        values[name] = value = torch.tensor(state[name], dtype=into.dtype)
        if value.shape != into.shape:
            raise ValueError(
                f"distmon: the state's {part}.{name} has shape {tuple(value.shape)}, this monitor's "
                f"{tuple(into.shape)}: it was taken with another {(why or {}).get(name, 'setting')}; resume "
                "with the setting it was taken with"
            )
    for name, value in values.items():
        getattr(owner, name).copy_(value)


def monitor_state(
    *,
    step: int,
    layers: Sequence[str],
    world: int,
    detector: DeviceDetector | None,
    noise: NoiseScale | None,
    scaler_run: int,
    precursor: PrecursorDetector | None = None,
) -> dict[str, object]:
    """A monitor's state (see the module docstring); ``detector``/``noise``/``precursor`` are None
    when off."""
    return {
        "version": STATE_VERSION,
        "step": step,
        "layers": list(layers),
        "world_size": world,
        "detector": detector.state_dict() if detector is not None else None,
        "noise": noise.state_dict() if noise is not None else None,
        "precursor": precursor.state_dict() if precursor is not None else None,
        "scaler_run": scaler_run,
    }


def disabled_state() -> dict[str, object]:
    """What a disabled monitor (``DISTMON_DISABLE``) saves: it learned nothing, so a monitor that loads
    it starts afresh.

    Example:
        >>> disabled_state()
        {'version': 2, 'disabled': True}
    """
    return {"version": STATE_VERSION, "disabled": True}


def state_table() -> str:
    """The table of ``state_dict()``'s fields in docs/api.md (Markdown), from :data:`STATE_FIELDS`.

    Example:
        >>> state_table().splitlines()[2].split(" | ")[0]
        '| `version`'
    """
    rows = ["| key | holds |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in STATE_FIELDS.items()]
    return "\n".join(rows) + "\n"


def load_monitor_state(
    state: Mapping[str, object],
    *,
    measured_steps: int,
    layers: Sequence[str],
    world: int,
    detector: DeviceDetector | None,
    noise: NoiseScale | None,
    precursor: PrecursorDetector | None = None,
) -> tuple[int, int] | None:
    """Check ``state`` against this monitor (which measured ``measured_steps`` steps) and load its detector
    and noise scale. Returns ``(step, scaler_run)`` for the schedule and the decoder, or None for the
    state of a disabled monitor (:func:`disabled_state`: nothing to resume, said in a warning).

    Raises ``ValueError`` for what cannot be mapped (another model or grouping, a newer state
    version, not a state at all) and ``RuntimeError`` once the monitor measured a step.
    """
    if measured_steps:
        raise RuntimeError(
            f"distmon: load_state_dict after this monitor measured {measured_steps} training steps; load "
            "the state right after building the monitor, before the first training step"
        )
    if not isinstance(state, Mapping) or not isinstance(state.get("version"), int):
        raise ValueError("distmon: load_state_dict takes what GradMonitor.state_dict() returned")
    if state.get("disabled"):
        logger.warning(
            "distmon: the state was saved with distmon off (DISTMON_DISABLE): it holds nothing to "
            "resume, so steps are counted from 1 and the detectors start cold"
        )
        return None
    if state["version"] > STATE_VERSION:
        raise ValueError(
            f"distmon: this state was written by a newer distmon (state version {state['version']}; "
            f"this one reads up to {STATE_VERSION}): upgrade distmon to resume from it"
        )
    theirs, ours = list(state["layers"]), list(layers)
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        first = f"#{at}: {theirs[at] if at < len(theirs) else 'none'!r} in the state, " + (
            f"{ours[at] if at < len(ours) else 'none'!r} here"
        )
        raise ValueError(
            f"distmon: the state's layers are not this monitor's ({len(theirs)} vs {len(ours)}; first "
            f"difference {first}): load it into a monitor of the model and groups= it was taken with"
        )
    notes = []
    same_ranks = state["world_size"] == world
    if detector is not None and state.get("detector") is not None:
        detector.load_state_dict(state["detector"], same_ranks=same_ranks)
        if not same_ranks:
            notes.append(
                f"rank-outlier scales start afresh (state from {state['world_size']} ranks, now {world})"
            )
    elif detector is not None:
        notes.append("the detectors start cold (the state was taken with detect=False)")
    if noise is not None and state.get("noise") is not None:
        noise.load_state_dict(state["noise"])
    elif noise is not None:
        notes.append("the noise scale starts cold (the state was taken without batch_size)")
    if precursor is not None and state.get("precursor") is not None:
        precursor.load_state_dict(state["precursor"])
    elif precursor is not None:
        notes.append("the divergence precursor starts cold (the state was taken without precursor=)")
    if notes:
        logger.warning("distmon: resumed at step %d; %s", state["step"], "; ".join(notes))
    return int(state["step"]), int(state.get("scaler_run", 0))
