"""``Iteration``: everything that lives for one iteration, in one value.

Created by the first backward hook (or by ``synchronize()`` when none fired) and dropped
when ``Engine.finish`` returns, whatever happened, so nothing of it can outlive its
iteration: the engine keeps only what does (``LAGSState``, the buffers, the timer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .aggregation import Contribution

__all__ = ["Iteration"]


@dataclass(eq=False)
class Iteration:
    """One iteration's transaction on this rank.

    Attributes:
        passes_left: per parameter, the backward passes still to accumulate before its
            bucket may go (``backward_passes_per_step``).
        not_ready: per bucket, the members whose gradients are still to come.
        contributions: per bucket started, its exchange and what this rank sent.
        monitored: on a monitored iteration, each sparse bucket's ``acc`` (the delta's input).
        scale: the GradScaler's scale, read once (None until read).
        group_lr: ``lr_scaled_residual``: each param group's lr, read once.
        staged_lr: ``lr_scaled_residual``: the lr of each bucket's exchange, recorded at commit.
    """

    passes_left: dict[torch.Tensor, int]
    not_ready: dict[str, set]
    contributions: dict[str, Contribution] = field(default_factory=dict)
    monitored: dict[str, torch.Tensor] = field(default_factory=dict)
    scale: float | None = None
    group_lr: dict[int, float] = field(default_factory=dict)
    staged_lr: dict[str, float] = field(default_factory=dict)
