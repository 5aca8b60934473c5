"""How parameters fold into the layer groups the monitor reports.

A group ("layer") is named by default after the module that directly owns the parameter
(``blocks.3.mlp.fc1.weight`` belongs to ``blocks.3.mlp.fc1``). Users can pass a callable
``(param_name, param) -> group`` or a list of ``(regex, group)`` rules. The number of groups is
capped so Prometheus series stay bounded: groups past the cap fold into ``"other"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..compat import WRAPPER_SEGMENTS

GroupFn = Callable[[str, torch.nn.Parameter], str]
GroupRules = Sequence[tuple[str, str]]
GroupSpec = GroupFn | GroupRules | None

OTHER = "other"
ROOT = "root"  # parameters owned directly by the top module
# Name segments wrappers put between a module and its parameters (compat.WRAPPER_SEGMENTS: torch.compile's
# OptimizedModule, activation checkpointing, FSDP1's wrapper). Turning one on must not rename a layer series.

__all__ = ["Grouping", "build_grouping", "validate_groups", "plain_name", "GroupSpec", "OTHER"]


def plain_name(name: str) -> str:
    """A parameter's qualified name without the segments wrappers add (:data:`WRAPPER_SEGMENTS`).

    Example:
        >>> plain_name("_orig_mod.blocks.0._checkpoint_wrapped_module.attn._orig_mod.weight")
        'blocks.0.attn.weight'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class Grouping:
    """Parameters the monitor tracks and the layer each belongs to.

    ``params[i]`` is tracked in slot ``i``; ``param_layer[i]`` indexes ``layers``. Layers are
    in model order (first appearance in ``named_parameters``).
    """

    params: tuple[torch.nn.Parameter, ...]
    param_names: tuple[str, ...]
    param_layer: tuple[int, ...]
    layers: tuple[str, ...]


def _owner(name: str, _param: torch.nn.Parameter) -> str:
    return name.rpartition(".")[0] or ROOT


def _rules_fn(rules: GroupRules) -> GroupFn:
    compiled = [(re.compile(pattern), group) for pattern, group in rules]

    def fn(name: str, param: torch.nn.Parameter) -> str:
        for pattern, group in compiled:
            m = pattern.search(name)
            if m:
                return m.expand(group)
        return _owner(name, param)

    return fn


def validate_groups(groups: GroupSpec) -> GroupFn:
    """Turn the ``groups`` option into a function, raising ``ValueError``/``TypeError`` on bad input.

    Example:
        >>> fn = validate_groups([(r"^blocks\\.(\\d+)\\.", r"block\\1")])
        >>> fn("blocks.2.mlp.weight", None), fn("head.weight", None)
        ('block2', 'head')
    """
    if groups is None:
        return _owner
    if callable(groups):
        return groups
    if isinstance(groups, (list, tuple)):
        for rule in groups:
            if not (
                isinstance(rule, (list, tuple)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)
            ):
                raise TypeError(f"distmon: groups rules must be (regex, group) string pairs, got {rule!r}")
            try:
                re.compile(rule[0])
            except re.error as e:
                raise ValueError(
                    f"distmon: bad regex {rule[0]!r} in groups: {e}; fix the pattern (Python's re syntax)"
                ) from None
        return _rules_fn(groups)
    raise TypeError(
        f"distmon: groups must be None, a callable or a list of (regex, group) pairs, "
        f"got {type(groups).__name__}"
    )


def build_grouping(
    module: torch.nn.Module, groups: GroupSpec, max_layers: int, layers: Sequence[str] | None = None
) -> Grouping:
    """Group the trainable parameters of ``module`` (tied parameters counted once).

    Names are the model's own (:func:`plain_name`): ``torch.compile``, activation checkpointing
    and FSDP wrappers never change a label. ``layers``: the job's layers in order, when this
    module holds only some of them (a pipeline stage): the layer indices are the job's.

    Example:
        >>> g = build_grouping(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(),
        ...                                        torch.nn.Linear(2, 1)), None, 128)
        >>> g.layers
        ('0', '2')
    """
    fn = validate_groups(groups)
    params, names, labels = [], [], []
    for wrapped_name, p in module.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        name = plain_name(wrapped_name)
        label = fn(name, p)
        if not isinstance(label, str) or not label:
            raise TypeError(f"distmon: groups returned {label!r} for {name}; expected a non-empty str")
        params.append(p)
        names.append(name)
        labels.append(label)
    if not params:
        raise ValueError(
            "distmon: the model has no trainable parameters to monitor: build the monitor on a model "
            "whose parameters require a gradient (after unfreezing the ones you train)"
        )
    order: dict[str, int] = {}
    for label in layers if layers is not None else labels:
        order.setdefault(label, len(order))
    if len(order) > max_layers:
        keep = [label for label, i in order.items() if i < max_layers - 1]
        order = {label: i for i, label in enumerate(keep)}
        order[OTHER] = len(order)
        labels = [label if label in order else OTHER for label in labels]
    return Grouping(tuple(params), tuple(names), tuple(order[label] for label in labels), tuple(order))
