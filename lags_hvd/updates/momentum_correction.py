"""DGC's momentum correction: each worker's SGD velocity is accumulated, ``x -= lr * merged``."""

from __future__ import annotations

import torch

from .. import transforms
from .base import UpdateRule, by_group

__all__ = ["MomentumCorrection", "momentum_correction_refused"]


class MomentumCorrection(UpdateRule):
    """DGC's momentum correction with momentum-factor masking, for ``torch.optim.SGD``.

    Each worker keeps a velocity ``u = m u + g + wd x`` and accumulates it,
    ``acc = eps + u``; the sent entries are cleared in both ``eps`` and ``u``. The merge is
    then the update itself: ``x -= lr * merged`` (the SGD's step with momentum 0 and no
    weight decay; its param groups read, never changed). A bucket sent whole keeps its
    velocity unmasked, which makes it exactly momentum SGD."""

    name = "momentum_correction"
    memories = masked = ("velocities",)
    steps_itself = True

    def local(self, unit, group, scale, state, dense, out):
        transforms.decay(unit.params, group["weight_decay"], scale)
        grads = [p.grad for p in unit.params]
        velocity = state.rule_memories["velocities"].accumulate(
            unit.name, grads, grad_scale=1.0 / scale, residual_scale=group["momentum"]
        )
        return [velocity], 1.0

    def replayed(self, unit, group, scale, state):
        """The velocity staged, as ``local`` stages it; its kernels bake in the decay, the
        momentum and the velocity's two ranges. None where a member has no gradient under
        weight decay: ``decay`` would allocate one inside the graph."""
        if group["weight_decay"] and any(p.grad is None for p in unit.params):
            return None
        before, after = state.rule_memories["velocities"].stage(unit.name)
        return (group["weight_decay"], group["momentum"], before.data_ptr(), after.data_ptr())

    @torch.no_grad()
    def step(self, param_groups, merged, state):
        """``x -= lr * merged``, one launch per param group."""
        for group, params, updates in by_group(param_groups, merged):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                torch._foreach_sub_(params, torch._foreach_mul(updates, lr))
            else:
                torch._foreach_add_(params, updates, alpha=-lr)


def momentum_correction_refused(wrapped_class: type, param_groups, units) -> str | None:
    """Why ``momentum_correction`` cannot apply to an optimizer of ``wrapped_class`` with these
    groups, or None. It replaces the step of ``torch.optim.SGD`` itself (not a subclass,
    whose own step it would skip) by ``x -= lr * update``, which models momentum > 0,
    dampening 0, no Nesterov and no ``maximize``."""
    if wrapped_class is not torch.optim.SGD:
        return (
            "momentum_correction applies to torch.optim.SGD itself with momentum (it replaces its "
            f"step); the wrapped optimizer is {wrapped_class.__qualname__}"
        )
    for unit in units:
        group = param_groups[unit.group_index]
        if not group["momentum"] > 0 or group["dampening"] != 0 or group["nesterov"] or group.get("maximize", False):
            return (
                "momentum_correction needs SGD with momentum > 0, dampening 0, nesterov=False and "
                f"maximize=False; param group {unit.group_index} has momentum {group['momentum']}, "
                f"dampening {group['dampening']}, nesterov {group['nesterov']}, maximize "
                f"{group.get('maximize', False)}"
            )
    return None
