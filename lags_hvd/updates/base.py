"""``UpdateRule``: the interface of what a worker accumulates and how the merged result steps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..density import PAPER_DENSITY
from ..layout import ExchangeUnit
from ..state import LAGSState

__all__ = ["UpdateRule", "MergedUnit", "by_group", "members", "unscale_for_fused_step"]

MergedUnit = tuple[ExchangeUnit, torch.Tensor, bool]
"""One bucket at the step: (the bucket, its merged gradient as a flat view, sent whole or not)."""


def members(unit: ExchangeUnit, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, its part of the bucket's flat tensor in its shape)`` for every member (the
    members lie back to back, in member order)."""
    parts = flat.split([p.numel() for p in unit.params])
    return [(p, part.view_as(p)) for p, part in zip(unit.params, parts)]


def by_group(param_groups: list[dict], merged: list[MergedUnit]) -> list[tuple[dict, list, list]]:
    """``(group, its parameters, their parts of the merged tensors)`` per param group, for one
    ``torch._foreach_*`` launch a group where a loop would launch one kernel a parameter."""
    grouped: dict[int, tuple[list, list]] = {}
    for unit, flat, _ in merged:
        params, parts = grouped.setdefault(unit.group_index, ([], []))
        for p, part in members(unit, flat):
            params.append(p)
            parts.append(part)
    return [(param_groups[index], params, parts) for index, (params, parts) in grouped.items()]


@torch.no_grad()
def unscale_for_fused_step(grad_scale, grads: list[torch.Tensor]) -> None:
    """A fused optimizer (``fused=True``) declares ``_step_supports_amp_scaling``: then
    ``GradScaler.step`` does not unscale the gradients but sets ``grad_scale`` (S, or None
    after ``unscale_``) and ``found_inf`` on the optimizer for its step to apply. A rule that
    steps itself applies them as the fused kernel would: ``grad *= 1/S``, the scaler's own
    reciprocal, exact for its power-of-two scales. ``found_inf`` needs no reading: it tests
    the merged gradient, and a non-finite one has already skipped the step on every rank."""
    if grad_scale is None:
        return
    inverse = grad_scale.double().reciprocal().float() if isinstance(grad_scale, torch.Tensor) else 1 / grad_scale
    torch._foreach_mul_(grads, inverse)


class UpdateRule(ABC):
    """How one bucket's gradient becomes what its residual accumulates, and the merged result a step.

    Attributes:
        name: the rule's name in checkpoints and in the settings every rank compares.
        memories: the per-bucket state kept beside the residual, by name (each a
            ``ResidualMemory``: staged in the hook, committed or discarded with the
            residuals, carried through checkpoints and re-bucketing).
        masked: those of ``memories`` whose sent entries are cleared with the residual's.
        replicated: those of ``memories`` that, for a bucket sent whole, follow the merged
            gradient and so are the same on every rank: shared state, which
            ``broadcast_optimizer_state`` shares and ``average_models()`` averages.
        steps_itself: ``step()`` applies the merged result here (``step``), in place of the
            wrapped optimizer's step.
        local_models: each rank's parameters hold its own unsent residual, so ranks'
            parameters differ (``LocalAdamCorrection``).
        density: the density where the options leave it None (every rule's at most 0.5, so
            that which units are sparse does not depend on it: ``engine.engine_context``).
        warmup_start: the density warm-up's first density where the options leave it None.
    """

    name: str
    memories: tuple[str, ...] = ()
    masked: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    steps_itself: bool = False
    local_models: bool = False
    density: float = PAPER_DENSITY
    warmup_start: float = 0.25  # DGC's

    @abstractmethod
    def local(
        self, unit: ExchangeUnit, group: dict, scale: float, state: LAGSState, dense: bool, out: torch.Tensor
    ) -> tuple[list[torch.Tensor | None], float]:
        """What ``unit`` accumulates into its residual this iteration (or sends whole, when
        ``dense``), as ``(parts, factor)``: the value is ``factor`` times the parts laid back
        to back, either one tensor of the whole bucket or one per member in member order (None:
        a member without a gradient, zero). ``group``: the unit's param group; ``scale``: the
        loss scale in the gradients; ``state``: the rule's memories (``state.rule_memories``)
        and the steps applied so far (``state.updates``); ``out``: the unit's range of the
        merge buffer, free to hold a result (the gradients may be views of it: read them first)."""

    def replayed(self, unit: ExchangeUnit, group: dict, scale: float, state: LAGSState) -> tuple | None:
        """Where ``local`` (a sparse bucket's) is replayed from a CUDA graph instead of run
        (``lags_hvd.capture``, reading the members' ``.grad`` where they lay at capture): its
        bookkeeping (the memories it stages) and the values its kernels bake in besides those
        addresses (hyper-parameters, the memories' ranges), which key the graph. None where it
        cannot be replayed (the default: the graph then starts from ``local``'s result)."""
        return None

    def committed(self, units: Sequence[ExchangeUnit], state: LAGSState) -> None:  # noqa: B027 (a hook)
        """Once the iteration's residuals are committed (in ``synchronize()``, before any
        ``step()``): what the rule applies at once. ``state.residuals.previous_members`` still
        holds the residuals before the commit. Nothing by default."""

    def step(self, param_groups: list[dict], merged: list[MergedUnit], state: LAGSState) -> None:
        """Apply the merged result (``steps_itself`` rules only), after the commit that counted
        this step in ``state.updates``."""
        raise NotImplementedError(f"{type(self).__name__} leaves the step to the wrapped optimizer")
