"""Top-k selection by magnitude: pure tensor functions, no communication.

Every selector here returns the same, exactly defined index set:

    TopK(x, k) = the k indices i with the largest |x_i|,
                 ties at the k-th magnitude broken towards the lowest index,

returned in increasing index order, together with ``x`` at those indices. The
order makes the result deterministic, which keeps every rank's residual
reproducible and lets a plain ``numpy.argsort(-abs(x), kind="stable")[:k]``
serve as an independent oracle in the tests.

Selectors share the signature ``select(x, k) -> (values, indices)`` with ``x`` a
1-D floating tensor and ``1 <= k <= x.numel()``; ``indices`` is int64.
"""
from __future__ import annotations

import math

import torch

__all__ = ["k_for_density", "select_topk", "threshold_indices", "SELECTORS", "get_selector"]


def k_for_density(density: float, numel: int) -> int:
    """Number of entries a layer of ``numel`` elements sends: ``max(1, ceil(density * numel))``."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return min(numel, max(1, math.ceil(density * numel)))


def threshold_indices(magnitude: torch.Tensor, threshold: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the top-k given the k-th largest magnitude ``threshold``.

    All entries strictly above the threshold are kept (there are fewer than k), then
    the lowest-index entries equal to it fill the remaining places. Sorted ascending.
    """
    above = torch.nonzero(magnitude > threshold).squeeze(1)
    missing = k - above.numel()
    if missing <= 0:
        return above
    tied = torch.nonzero(magnitude == threshold).squeeze(1)[:missing]
    return torch.cat((above, tied)).sort().values


def select_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude using ``torch.topk`` for the k-th magnitude."""
    _check(x, k)
    if k == x.numel():
        indices = torch.arange(x.numel(), device=x.device)
        return x.clone(), indices
    magnitude = x.abs()
    kth = torch.topk(magnitude, k, sorted=False).values.min()
    indices = threshold_indices(magnitude, kth, k)
    return x[indices], indices


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"selection expects a 1-D tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")


SELECTORS = {"topk": select_topk}


def get_selector(name_or_fn):
    """Resolve a selector given by name (``SELECTORS``) or as a callable."""
    if callable(name_or_fn):
        return name_or_fn
    try:
        return SELECTORS[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown selector {name_or_fn!r}; choose one of {sorted(SELECTORS)} "
                         f"or pass a callable select(x, k) -> (values, indices)") from None
