"""``average_models``: every rank's model made the ranks' average, in one collective.

Under a rule whose ranks keep their own residual in their parameters (``local_models``:
``x_p = x - eps_p``), CSER's error reset::

    x_p <- (1/P) sum_q x_q = x - (1/P) sum_q eps_q        on every rank
    eps_p <- 0

each residual applied with the weight 1/P its sending would have given it. The buckets
sent whole and the rule's replicated memories (their Adam moments) are averaged with
them, so the ranks leave it identical whatever put them apart (a resume on one rank, a
``join()``).
"""

from __future__ import annotations

import torch

from .agreement import AVERAGING
from .state import LAGSState

__all__ = ["average_models"]


@torch.no_grad()
def average_models(state: LAGSState, context) -> None:
    """The module docstring's reset over ``context``'s collectives (an ``EngineContext``):
    first a step check marked as an averaging, so a rank that calls it alone meets the
    others' next check and every rank raises ``OutOfStepError``; then one allreduce per
    device and dtype; then the residuals zeroed."""
    context.token.start(state.iteration, False, 0, 0, 1.0, 0, kind=AVERAGING)
    context.check()
    tensors = [p for unit in state.units for p in unit.params] + [t for _, t in state.replicated_memories()]
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    config = context.config
    for i, same_kind in enumerate(kinds.values()):
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        handle = config.collectives.allreduce(
            flat, f"{config.namespace}.average_models.{i}", "average", what="average_models()"
        )
        flat = config.collectives.wait(handle, "average_models()", context.options.exchange_timeout)
        for tensor, part in zip(same_kind, flat.split([t.numel() for t in same_kind])):
            tensor.copy_(part.view_as(tensor))
    state.residuals.reset()
