"""Adam correction with each worker's own residual applied locally (CSER's partial synchronisation).

Why: under ``AdamCorrection`` every rank holds the consensus ``x``, and a worker's own Adam
steps reach it only as they are sent: at density 0.001 an entry waits about a thousand steps,
and the gradient is computed at a model that lacks them. Here each worker's model also holds
its own unsent steps, so its next gradient is taken where its own optimizer has already gone
(Xie et al., CSER, NeurIPS 2020: error feedback with the error applied locally). On worker p,
with ``x`` the consensus (which no rank stores) and ``eps_p`` its residual::

    x_p = x - eps_p                            the worker's parameters
    acc = eps_p + d_p ;  s_p = TopK(acc, k) ;  eps_p' = acc - s_p     as AdamCorrection
    x'  = x (1 - lr_t wd) - (1/P) sum_q s_q
    x_p' = x_p (1 - lr_t wd) - (1/P) sum_q s_q - (eps_p' - eps_p)

so ``x_p' = x' - eps_p'`` up to the decay of the residual's part (``lr_t wd eps_p``, second
order). Each worker moves by its own step at once and by the others' as they arrive; the
consensus moves exactly as under ``AdamCorrection``. Ranks' parameters differ, by their
residuals: the average of the workers' models, ``x - mean_p eps_p``, is the model with every
step applied (``average_models``). Units sent whole are exact Adam on the merged gradient,
the same on every rank, as under ``AdamCorrection``.
"""

from __future__ import annotations

import torch

from .adam_correction import AdamCorrection

__all__ = ["LocalAdamCorrection"]


class LocalAdamCorrection(AdamCorrection):
    """``AdamCorrection`` whose worker keeps its own unsent steps in its parameters (module docstring)."""

    name = "adam_correction_local"
    local_models = True

    @torch.no_grad()
    def step(self, param_groups, merged, state):
        """``AdamCorrection``'s step, then ``x_p -= eps_p' - eps_p`` on every sparse unit."""
        super().step(param_groups, merged, state)
        residuals = state.residuals
        for unit, _, dense in merged:
            if dense or unit.name not in residuals:
                continue
            for p, now, before in zip(unit.params, residuals.members(unit.name), residuals.previous_members(unit.name)):
                p.add_(before.view_as(p)).sub_(now.view_as(p))
