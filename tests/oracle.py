"""An independent, single-process reference of the LAGS-SGD math in numpy.

Shares no code with lags_hvd: it is the oracle the package is checked against.
"""
from __future__ import annotations

import math

import numpy as np


def k_for(density: float, d: int) -> int:
    return min(d, max(1, math.ceil(density * d)))


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lowest index, ascending."""
    order = np.argsort(-np.abs(x), kind="stable")
    return np.sort(order[:k])


def lags_round(accs: list[np.ndarray], k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """One exchange of one layer over P workers.

    accs[p] = eps_p + g_p. Returns (sum_p TopK(acc_p) / P, new residuals eps_p).
    The sum runs in rank order in the accumulators' dtype.
    """
    total = np.zeros_like(accs[0])
    residuals = []
    for acc in accs:
        idx = topk_indices(acc, k)
        sent = np.zeros_like(acc)
        sent[idx] = acc[idx]
        total = total + sent
        residuals.append(acc - sent)
    return total / np.asarray(len(accs), dtype=total.dtype), residuals


class SGDMomentum:
    """torch.optim.SGD's update (momentum, dampening 0, weight decay), in numpy."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[str, np.ndarray] = {}

    def step(self, name: str, param: np.ndarray, grad: np.ndarray) -> np.ndarray:
        dtype = param.dtype.type
        if self.weight_decay:
            grad = grad + dtype(self.weight_decay) * param
        if self.momentum:
            if name in self.buffers:
                grad = self.buffers[name] * dtype(self.momentum) + grad
            self.buffers[name] = grad.copy()
        return param - dtype(self.lr) * grad
