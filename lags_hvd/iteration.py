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
        queued: per bucket selected but not yet started, what ``Engine._start`` was given (a
            backend that matches collectives by order starts them in ``Engine.launch_order``).
        started: how many buckets of the launch order have started (that backend only).
        monitored: on a monitored iteration, each sparse bucket's ``acc`` (the delta's input).
        scale: the GradScaler's scale, read once (None until read).
        group_lr: ``lr_scaled_residual``: each param group's lr, read once.
        staged_lr: ``lr_scaled_residual``: the lr of each bucket's exchange, recorded at commit.
    """

    passes_left: dict[torch.Tensor, int]
    not_ready: dict[str, set]
    contributions: dict[str, Contribution] = field(default_factory=dict)
    queued: dict[str, tuple] = field(default_factory=dict)
    started: int = 0
    monitored: dict[str, torch.Tensor] = field(default_factory=dict)
    scale: float | None = None
    group_lr: dict[int, float] = field(default_factory=dict)
    staged_lr: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls, units, passes: int) -> Iteration:
        """An iteration of ``units`` (the bucketing's), each member awaited ``passes`` times."""
        return cls(*cls.counters(units, passes))

    @staticmethod
    def counters(units, passes: int) -> tuple[dict, dict]:
        """Fresh ``passes_left`` and ``not_ready`` for ``units``."""
        return {p: passes for unit in units for p in unit.params}, {unit.name: set(unit.params) for unit in units}

    @property
    def in_flight(self) -> list[str]:
        """The buckets started (or selected and queued to start) and not yet finished, by name."""
        return sorted([*self.contributions, *self.queued])

    def loss_scale(self, scaler) -> float:
        """The ``grad_scaler``'s scale S (1 without one), read once per iteration. With the
        GradScaler's power-of-two scales, dividing and multiplying by S is exact."""
        if scaler is None or not scaler.is_enabled():
            return 1.0
        if self.scale is None:
            self.scale = float(scaler.get_scale())
        return self.scale

    def lr_ratio(self, name: str, group_index: int, param_groups, exchange_lr: dict) -> float:
        """``lr_scaled_residual``: eta_{t-1} / eta_t for bucket ``name``, which keeps eps in the
        paper's lr-scaled space when the lr changes; eta_t is staged for the commit. Each
        group's lr is read once (a tensor lr: one host read)."""
        lr = self.group_lr.get(group_index)
        if lr is None:
            lr = self.group_lr[group_index] = float(param_groups[group_index]["lr"])
        if not lr > 0:
            raise ValueError(f"lr_scaled_residual needs a positive learning rate, got {lr} for {name!r}")
        self.staged_lr[name] = lr
        previous = exchange_lr.get(name, lr)
        return previous / lr if previous != lr else 1.0
