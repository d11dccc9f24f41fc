"""Local gradient clipping before selection (DGC's, unit by unit). Pure tensor functions.

A user who clips the merged gradient to norm C wants each worker's contribution
bounded before it enters the residual, where an outlier would otherwise linger.
DGC clips each worker's whole gradient to ``C / sqrt(P)`` (P workers whose
independent gradients add in quadrature). Hooks see one unit at a time, so the
budget is split by size: unit u of d_u entries, in a model of d, is clipped to

    c_u = C * sqrt(d_u / d) / sqrt(P)          (sum_u c_u^2 = C^2 / P)

on the device, with no host synchronisation.
"""
from __future__ import annotations

import math

import torch

__all__ = ["local_clip_norms", "clip_norm_"]


def local_clip_norms(numels: dict[str, int], max_norm: float, world: int) -> dict[str, float]:
    """``c_u`` for every unit (see the module docstring)."""
    total = sum(numels.values())
    return {name: max_norm * math.sqrt(numel / total / world) for name, numel in numels.items()}


def clip_norm_(tensors: list[torch.Tensor], max_norm: float) -> None:
    """Scale ``tensors`` in place so that their joint 2-norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does: factor ``min(1, max_norm / (norm + 1e-6))``).
    A non-finite norm makes the factor non-finite too, so NaN/Inf stay detectable."""
    if not tensors:
        return
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for t in tensors:
        t.mul_(factor.to(t.dtype))
