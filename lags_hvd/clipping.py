"""Gradient clipping: DGC's local clip before selection, unit by unit, and the factor of
the merged gradient's clip (``max_grad_norm``). Pure tensor functions.

A user who clips the merged gradient to norm C wants each worker's contribution
bounded before it enters the residual, where an outlier would otherwise linger.
DGC clips each worker's whole gradient to ``C / sqrt(P)`` (P workers whose
independent gradients add in quadrature). Hooks see one unit at a time, so the
budget is split by size: unit u of d_u entries, in a model of d, is clipped to

    c_u = C * sqrt(d_u / d) / sqrt(P)          (sum_u c_u^2 = C^2 / P)

on the device, with no host synchronisation.

The merged gradient g is clipped as ``torch.nn.utils.clip_grad_norm_`` does,
``g <- c g`` with ``c = min(1, C / (||g|| + 1e-6))``; the engine gives ``(1 - c)`` of
each worker's applied sparse entries back to its residual (``residual.give_back``).
"""
from __future__ import annotations

import math

import torch

__all__ = ["local_clip_norms", "clip_norm_"]


def local_clip_norms(numels: dict[str, int], max_norm: float, world: int) -> dict[str, float]:
    """``c_u`` for every unit (see the module docstring)."""
    total = sum(numels.values())
    return {name: max_norm * math.sqrt(numel / total / world) for name, numel in numels.items()}


def clip_norm_(tensors: list[torch.Tensor], max_norm: float,
               loss_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
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
