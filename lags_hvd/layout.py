"""Exchange units: which parameters are selected and exchanged together.

A unit is the granularity of LAGS-SGD: its gradient is sparsified as one vector
(the concatenation of its members' flattened gradients) and sent in one message
as soon as the last member's gradient is ready. By default every parameter is
its own unit (layer-wise, the paper's setting). ``groups`` merges parameters:
with one group holding every parameter, the optimizer becomes TopK-SGD over the
whole model (global sparsification, exchanged after backprop).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from .checks import is_count

__all__ = ["ExchangeUnit", "name_parameters", "build_units", "first_units", "small_tensor_groups", "merge_small_runs"]


@dataclass
class ExchangeUnit:
    """Parameters selected and exchanged together, in a fixed order."""

    name: str
    params: list[torch.Tensor]
    param_names: list[str]
    group_index: int  # the optimizer param group of its members
    numel: int = field(init=False)

    def __post_init__(self):
        self.numel = sum(p.numel() for p in self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device


def name_parameters(param_groups, named_parameters) -> dict[torch.Tensor, str]:
    """Validate ``named_parameters`` against the optimizer and map each parameter to its name.

    Without ``named_parameters`` the names are positional, as Horovod makes them.
    """
    if named_parameters is None:
        named = [(f"param.{g}.{i}", p) for g, group in enumerate(param_groups) for i, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        bad = [
            item
            for item in named
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            )
        ]
        if bad:
            raise ValueError(
                "named_parameters must be a sequence of (name, parameter) tuples, "
                f"usually model.named_parameters(); got {type(bad[0]).__name__} "
                f"element {bad[0]!r:.80}"
            )
        duplicates = sorted(n for n, c in Counter(n for n, _ in named).items() if c > 1)
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(duplicates)}")
    names = {p: n for n, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters does not name {len(unnamed)} of the optimizer's "
            f"parameters (shapes {[tuple(p.shape) for p in unnamed][:5]}); pass "
            "model.named_parameters() of the model the optimizer trains"
        )
    return names


def build_units(param_groups, names: dict[torch.Tensor, str], groups=None) -> list[ExchangeUnit]:
    """Exchange units for every trainable parameter, sorted by name (identical on every rank).

    ``groups``: None (one unit per parameter), or a list of lists of parameters that
    form one unit each; parameters in no list stay units of their own.
    """
    group_of = {p: g for g, group in enumerate(param_groups) for p in group["params"]}
    trainable = sorted((p for p in group_of if p.requires_grad), key=lambda p: names[p])
    empty = [f"{names[p]!r} {tuple(p.shape)}" for p in trainable if p.numel() == 0]
    if empty:
        raise ValueError(
            f"parameters with no elements cannot be exchanged: {', '.join(empty)}; freeze them "
            "(requires_grad_(False)) or leave them out of the optimizer"
        )
    grouped: dict[torch.Tensor, int] = {}
    for i, members in enumerate(groups or []):
        for p in members:
            if p not in group_of:
                raise ValueError(f"groups[{i}] holds a tensor that the optimizer does not train")
            if p in grouped:
                raise ValueError(f"parameter {names[p]!r} appears in more than one group")
            grouped[p] = i
    units = [_unit([p], names, group_of) for p in trainable if p not in grouped]
    for members in groups or []:
        members = sorted((p for p in members if p.requires_grad), key=lambda p: names[p])
        if members:
            units.append(_unit(members, names, group_of))
    units.sort(key=lambda u: u.name)
    return units


def merge_small_runs(numels: list[int], min_numel: int) -> list[list[int]]:
    """Positions ``0..len(numels)-1`` cut into runs, in order: consecutive entries under
    ``min_numel`` are merged until a run holds at least ``min_numel`` elements; an entry of
    ``min_numel`` or more stays alone and closes the run before it. Pure; shared by
    ``small_tensor_groups`` and the benchmark simulator."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, numel in enumerate(numels):
        if numel >= min_numel:
            runs += [current, [i]] if current else [[i]]
            current, total = [], 0
            continue
        current.append(i)
        total += numel
        if total >= min_numel:
            runs.append(current)
            current, total = [], 0
    return runs + ([current] if current else [])


def small_tensor_groups(param_groups, min_numel: int, kind=None) -> list[list[torch.Tensor]]:
    """Merge consecutive small parameters into groups of at least ``min_numel`` elements.

    Walks the trainable parameters in reverse registration order (the order backprop
    usually produces their gradients), within each param group (``merge_small_runs``);
    ``kind(p)`` (optional) must be equal for parameters to share a group (dtype,
    density, ...): a change of kind closes the run. Only groups of two or more are
    returned; the rest remain units of their own.
    """
    groups: list[list[torch.Tensor]] = []
    for group in param_groups:
        params = list(reversed([p for p in group["params"] if p.requires_grad]))
        segments: list[list[torch.Tensor]] = []
        for p in params:
            if segments and (kind is None or kind(p) == kind(segments[-1][0])):
                segments[-1].append(p)
            else:
                segments.append([p])
        for segment in segments:
            groups += [[segment[i] for i in run] for run in merge_small_runs([p.numel() for p in segment], min_numel)]
    return [g for g in groups if len(g) > 1]


def _unit(members, names, group_of) -> ExchangeUnit:
    dtypes = {p.dtype for p in members}
    devices = {p.device for p in members}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"a group mixes dtypes {dtypes} or devices {devices}: {[names[p] for p in members]}")
    if not members[0].is_floating_point():
        raise TypeError(
            f"parameter {names[members[0]]!r} is {members[0].dtype}; only floating "
            "point parameters have gradients to exchange"
        )
    member_names = [names[p] for p in members]
    name = member_names[0] if len(members) == 1 else f"{member_names[0]}+{len(members) - 1}"
    return ExchangeUnit(name=name, params=members, param_names=member_names, group_index=group_of[members[0]])


def first_units(param_groups, names: dict, num_groups: int, groups, buckets, kinds: dict) -> list[ExchangeUnit]:
    """The exchange units an optimizer starts with: Horovod's ``groups``, or ``num_groups``
    groups of the parameters in name order, or small consecutive tensors merged into buckets
    of at least ``buckets`` entries (an int; ``kinds`` says which may share one), else one per
    parameter (``"layer"``, and ``"auto"`` until its plan). ValueError for a combination of
    them, or for nothing to train."""
    if sum(map(bool, (num_groups, groups is not None, buckets != "layer"))) > 1:
        raise ValueError("pass only one of num_groups, groups and buckets")
    if num_groups:
        ordered = sorted((p for g in param_groups for p in g["params"] if p.requires_grad), key=lambda p: names[p])
        size = math.ceil(len(ordered) / num_groups)
        groups = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    elif is_count(buckets):
        groups = small_tensor_groups(param_groups, buckets, kind=kinds.get)
    units = build_units(param_groups, names, groups)
    if not units:
        raise ValueError("the optimizer has no trainable parameters to exchange")
    return units
