"""Adam correction with each worker's own residual applied locally (CSER's partial synchronisation).

Why: under ``AdamCorrection`` every rank holds the consensus ``x``, and a worker's own Adam
steps reach it only as they are sent: at density 0.001 an entry waits about a thousand steps,
and the gradient is computed at a model that lacks them. Here each worker's model also holds
its own unsent steps, so its next gradient is taken where its own optimizer has already gone
(Xie et al., CSER, NeurIPS 2020: error feedback with the error applied locally). On worker p,
with ``x`` the consensus (which no rank stores) and ``eps_p`` its residual::

    x_p = x - eps_p                            the worker's parameters
    acc = eps_p + d_p ;  s_p = TopK(acc, k) ;  eps_p' = acc - s_p     as AdamCorrection
    x'  = x (1 - lr_t wd) - (1/P) sum_q s_q    (the decay only for AdamW's decoupled one)
    x_p' = x_p (1 - lr_t wd) - (1/P) sum_q s_q - eps_p' + (1 - lr_t wd) eps_p  =  x' - eps_p'

Each worker moves by its own step at once and by the others' as they arrive; the
consensus moves exactly as under ``AdamCorrection``. Ranks' parameters differ, by their
residuals: the average of the workers' models, ``x - mean_p eps_p``, is the model with every
step applied (``average_models``). Units sent whole are exact Adam on the merged gradient,
the same on every rank, as under ``AdamCorrection``.
"""

from __future__ import annotations

import torch

from .adam_correction import AdamCorrection, decouples_decay

__all__ = ["LocalAdamCorrection"]


class LocalAdamCorrection(AdamCorrection):
    """``AdamCorrection`` whose worker keeps its own unsent steps in its parameters (module docstring)."""

    name = "adam_correction_local"
    local_models = True

    @torch.no_grad()
    def step(self, param_groups, merged, state):
        """``AdamCorrection``'s step, then ``x_p += (1 - lr wd) eps_p - eps_p'`` on every unit with
        a residual (one that turned dense sent its residual whole: ``eps_p' = 0`` puts the
        consensus back), so that ``x_p + eps_p`` is the consensus on every rank."""
        super().step(param_groups, merged, state)
        residuals = state.residuals
        for unit, _, _ in merged:
            if unit.name not in residuals:
                continue
            group = param_groups[unit.group_index]
            kept = 1 - group["lr"] * group["weight_decay"] if decouples_decay(group) else 1.0
            for p, now, before in zip(unit.params, residuals.members(unit.name), residuals.previous_members(unit.name)):
                p.add_(before.view_as(p), alpha=kept).sub_(now.view_as(p))
