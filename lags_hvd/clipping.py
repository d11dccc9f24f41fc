"""Gradient clipping: DGC's local clip before selection, unit by unit, and the factor of
the merged gradient's clip (``max_grad_norm``). Pure tensor functions.

A user who clips the merged gradient to norm C wants each worker's contribution
bounded before it enters the residual, where an outlier would otherwise linger.
DGC (Lin et al., ICLR 2018) clips each worker's gradient to the share of C it would
have if the P workers' gradients were independent and alike, so that they add in
quadrature: the merged gradient ``m (g_1 + ... + g_P)`` (m = 1 for ``op=Sum``, 1/P
for ``op=Average``) then has about the norm ``m sqrt(P) ||g_p||``, and each worker's
budget is ``C / (m sqrt(P))``: ``C / sqrt(P)`` for a sum (DGC's rule, whose workers
sum), ``C sqrt(P)`` for an average (Horovod's default). Hooks see one unit at a
time, so the budget is split by size: unit u of d_u entries, in a model of d, is
clipped to

    c_u = C * sqrt(d_u / d) / (m sqrt(P))          (sum_u c_u^2 = C^2 / (m^2 P))

on the device, with no host synchronisation.

The merged gradient g is clipped as ``torch.nn.utils.clip_grad_norm_`` does,
``g <- c g`` with ``c = min(1, C / (||g|| + 1e-6))``; the engine gives ``(1 - c)`` of
each worker's applied sparse entries back to its residual (``residual.give_back``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["local_clip_norms", "clip_norm_"]


def local_clip_norms(numels: dict[str, int], max_norm: float, world: int, averaged: bool) -> dict[str, float]:
    """``c_u`` for every unit (see the module docstring); ``averaged``: the merge divides
    the workers' sum by P (``op=Average``), else it is the sum (``op=Sum``)."""
    total = sum(numels.values())
    worker = max_norm * math.sqrt(world) if averaged else max_norm / math.sqrt(world)
    return {name: worker * math.sqrt(numel / total) for name, numel in numels.items()}


def clip_norm_(
    tensors: list[torch.Tensor], max_norm: float, loss_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``tensors`` in place so that their joint 2-norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does: factor ``min(1, max_norm / (norm + 1e-6))``).
    ``tensors`` may hold the gradient times a loss scale S: the norm is then divided by S
    first, so the factor is the unscaled gradient's. Returns (norm, factor) as float32 0-d
    tensors on the first tensor's device (no host read). A non-finite norm makes the factor
    non-finite too, so NaN/Inf stay detectable."""
    if not tensors:
        return torch.zeros(()), torch.ones(())
    device = tensors[0].device
    norm = torch.linalg.vector_norm(torch.stack([_norm32(t).to(device) for t in tensors])) / loss_scale
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for t in tensors:
        t.mul_(factor.to(t.device, t.dtype))
    return norm, factor


def _norm32(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``t`` as float32, computed in at least float32 (no half overflow)."""
    wide = t.dtype.itemsize >= 4
    return torch.linalg.vector_norm(t, dtype=None if wide else torch.float32).float()
