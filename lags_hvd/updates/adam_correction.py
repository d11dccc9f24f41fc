"""Adam correction: each worker's Adam (or AdamW) step is accumulated, ``x -= merged``.

Why: error feedback conserves what is sent, and SGD's step is linear in it, so an entry that
waited n iterations in the residual moves as far as dense training moved it. Adam's step is
about ``lr * sign`` whatever the gradient's size, so the same entry, sent once with n
iterations' gradient, moves about lr instead of n lr. Accumulating the preconditioned step
instead of the gradient makes the update linear in what is sent again (as 1-bit Adam's frozen
variance does, without its dense warm-up): per sparse bucket on worker p, at step t::

    g   = grad / S (+ wd x for Adam's L2 decay)
    m_p = b1 m_p + (1 - b1) g                  this worker's moments, of its own gradient
    v_p = b2 v_p + (1 - b2) g^2
    d_p = lr_t (m_p / (1 - b1^t)) / (sqrt(v_p / (1 - b2^t)) + eps)     Adam's step
    acc = eps_p + d_p ;  s_p = TopK(acc, k) ;  eps_p = acc - s_p
    x  <- x (1 - lr_t wd) - (1/P) sum_p s_p    (the decay only for AdamW's decoupled one)

Per worker, everything sent plus the residual is the sum of its Adam steps (learning rate
included), so the model follows the average of the workers' Adam steps, late by what the
residual holds. A bucket sent whole is exactly Adam on the merged gradient (moments
shared by every rank): at density 1 the optimizer is Horovod's with the wrapped Adam.
"""

from __future__ import annotations

import math

import torch

from .. import transforms
from .base import UpdateRule, by_group

__all__ = ["AdamCorrection", "adam_correction_refused", "adam_step_", "decouples_decay"]


def adam_step_(m, v, out, *, lr, beta1: float, beta2: float, eps: float, step: int) -> torch.Tensor:
    """``out = lr (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)``, torch's Adam step
    (without its sign), written in place into ``out`` (which may be ``m`` or ``v``) and returned."""
    torch.sqrt(v, out=out)
    out.div_(math.sqrt(1 - beta2**step)).add_(eps)
    torch.div(m, out, out=out)
    return out.mul_(lr / (1 - beta1**step))


class AdamCorrection(UpdateRule):
    """Error feedback on Adam's preconditioned step (module docstring), for ``torch.optim.Adam``
    and ``torch.optim.AdamW`` (no amsgrad, no maximize)."""

    name = "adam_correction"
    memories = replicated = ("exp_avg", "exp_avg_sq")
    steps_itself = True
    density = 0.01  # the AdamW frontier's (docs/convergence-adam.md): 0.001 ended 7% above dense
    warmup_start = 0.05  # each accumulated step is already Adam's: DGC's 0.25 bought no perplexity

    def local(self, unit, group, scale, state, dense, out):
        if not decouples_decay(group):
            transforms.decay(unit.params, group["weight_decay"], scale)
        grads = [p.grad for p in unit.params]
        if dense:  # sent whole: the moments follow the merged gradient in step()
            return grads, 1.0 / scale
        beta1, beta2 = group["betas"]
        memories = state.rule_memories
        m = memories["exp_avg"].accumulate(unit.name, grads, grad_scale=(1 - beta1) / scale, residual_scale=beta1)
        v = memories["exp_avg_sq"].accumulate(
            unit.name, grads, grad_scale=(1 - beta2) / scale**2, residual_scale=beta2, square=True
        )
        step = adam_step_(m, v, out, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=state.updates + 1)
        return [step], 1.0

    @torch.no_grad()
    def step(self, param_groups, merged, state):
        """Adam on the buckets sent whole (their merged gradient replaced by the step, in
        place), then per param group the decoupled decay and ``x -= grad`` (one launch each)."""
        for unit, grad, dense in merged:
            if dense:
                group = param_groups[unit.group_index]
                beta1, beta2 = group["betas"]
                memories = state.rule_memories
                m, v = memories["exp_avg"].residual(unit.name), memories["exp_avg_sq"].residual(unit.name)
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                adam_step_(m, v, grad, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=state.updates)
        for group, params, steps in by_group(param_groups, merged):
            if decouples_decay(group) and group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_sub_(params, steps)


def decouples_decay(group: dict) -> bool:
    """Whether the param group's weight decay is AdamW's decoupled one (else Adam's L2)."""
    return group.get("decoupled_weight_decay", False)


def adam_correction_refused(wrapped_class: type, param_groups, units) -> str | None:
    """Why ``adam_correction`` cannot apply to an optimizer of ``wrapped_class`` with these
    groups, or None. It replaces the step of ``torch.optim.Adam`` or ``torch.optim.AdamW``
    themselves (not a subclass, whose own step it would skip), without amsgrad or maximize."""
    if wrapped_class not in (torch.optim.Adam, torch.optim.AdamW):
        return (
            "adam_correction applies to torch.optim.Adam and torch.optim.AdamW themselves (it "
            f"replaces their step); the wrapped optimizer is {wrapped_class.__qualname__}"
        )
    for unit in units:
        group = param_groups[unit.group_index]
        if group["amsgrad"] or group["maximize"]:
            return (
                f"adam_correction needs amsgrad=False and maximize=False; param group {unit.group_index} "
                f"has amsgrad {group['amsgrad']}, maximize {group['maximize']}"
            )
    return None
