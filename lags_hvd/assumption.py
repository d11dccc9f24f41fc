"""The convergence assumption of LAGS-SGD, measured.

For one unit with P workers' accumulated vectors acc_p (residual + gradient):

    xbar    = (1/P) sum_p acc_p              the dense average (one allreduce)
    shat    = (1/P) sum_p TopK(acc_p, k)     what LAGS-SGD applies
    delta   = ||xbar - shat||^2 / ((1 - k/d) ||xbar||^2)

The proof needs delta <= 1: the aggregate of local top-k is no worse than a
random-k selection applied to the true average, whose expected error is
(1 - k/d) ||xbar||^2. The paper finds delta < 1 in practice.
"""

from __future__ import annotations

import math

import torch

__all__ = ["delta"]


def delta(xbar: torch.Tensor, shat: torch.Tensor, k: int, d: int) -> float:
    """delta for one unit; nan when undefined (k == d, or xbar == 0)."""
    if k >= d:
        return math.nan
    norm = float(xbar.double().square().sum())
    if norm == 0.0:
        return math.nan
    return float((xbar.double() - shat.double()).square().sum()) / ((1 - k / d) * norm)
