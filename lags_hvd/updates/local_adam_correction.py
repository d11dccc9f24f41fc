"""Adam correction with each worker's own residual applied locally (CSER's partial synchronisation).

Why: under ``AdamCorrection`` every rank holds the consensus ``x``, and a worker's own Adam
steps reach it only as they are sent: at density 0.001 an entry waits about a thousand steps,
and the gradient is computed at a model that lacks them. Here each worker's model also holds
its own unsent steps, so its next gradient is taken where its own optimizer has already gone
(Xie et al., CSER, NeurIPS 2020: error feedback with the error applied locally). On worker p,
with ``x`` the consensus (which no rank stores) and ``eps_p`` its residual::

    x_p = x - eps_p                            the worker's parameters
    acc = eps_p + d_p ;  s_p = TopK(acc, k) ;  eps_p' = acc - s_p     as AdamCorrection
    x_p <- x_p + eps_p - eps_p'                at the commit, in synchronize()
    x'  = x (1 - lr_t wd) - (1/P) sum_q s_q    the step (the decay only for AdamW's)
    x_p <- x_p (1 - lr_t wd) - (1/P) sum_q s_q - lr_t wd eps_p'   =  x' - eps_p'

The commit applies the residual's change at once, so that a ``synchronize()`` no ``step()``
follows, a re-bucketing after it or ``state_dict()`` between the two leave every rank's
``x_p + eps_p`` the same consensus. Each worker moves by its own step at once and by the
others' as they arrive; the consensus moves exactly as under ``AdamCorrection``. Ranks'
parameters differ, by their residuals: the average of the workers' models,
``x - mean_p eps_p``, is the model with every step applied (``average_models``). Units sent
whole are exact Adam on the merged gradient, the same on every rank, as under
``AdamCorrection``.
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
    def committed(self, units, state):
        """``x_p += eps_p - eps_p'`` on every unit with a residual (one that turned dense sent
        its residual whole: ``eps_p' = 0`` puts it on the consensus)."""
        residuals, params, now, before = state.residuals, [], [], []
        for unit in units:
            if unit.name in residuals:
                params.extend(unit.params)
                now.extend(residuals.members(unit.name))
                before.extend(residuals.previous_members(unit.name))
        if params:  # two launches in all
            torch._foreach_add_(params, before)
            torch._foreach_sub_(params, now)

    @torch.no_grad()
    def step(self, param_groups, merged, state):
        """``AdamCorrection``'s step, then ``x_p -= lr wd eps_p'`` under AdamW's decay, so that
        the decay applies to the consensus, not to the residual."""
        super().step(param_groups, merged, state)
        residuals, decayed = state.residuals, {}
        for unit, _, _ in merged:
            group = param_groups[unit.group_index]
            if unit.name in residuals and decouples_decay(group) and group["weight_decay"]:
                params, now = decayed.setdefault(unit.group_index, ([], []))
                params.extend(unit.params)
                now.extend(residuals.members(unit.name))
        for index, (params, now) in decayed.items():  # one launch per param group
            group = param_groups[index]
            torch._foreach_sub_(params, now, alpha=group["lr"] * group["weight_decay"])
