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


def warmup_k(k: int, d: int, step: int, start: float, iterations: int) -> int:
    """DGC's density warm-up: 4 geometric stages from ``start`` to the unit's own k/d."""
    if step >= iterations or k >= d:
        return k
    target = k / d
    stage = (4 * step) // iterations
    density = start * (target / start) ** (stage / 4)
    return max(k, k_for(density, d))


def clipped(g: np.ndarray, max_norm: float) -> np.ndarray:
    """torch.nn.utils.clip_grad_norm_'s scaling of one vector."""
    norm = float(np.sqrt(np.square(g, dtype=np.float64).sum()))
    return g * np.float32(min(1.0, max_norm / (norm + 1e-6)))


def momentum_corrected_round(velocities: list[np.ndarray], residuals: list[np.ndarray], grads: list[np.ndarray],
                             momentum: float, k: int):
    """DGC momentum correction for one layer over P workers: u = m u + g; acc = eps + u;
    s = TopK(acc); eps = acc - s; u = 0 where sent (or, dense, u kept and sent whole).
    Returns (sum_p s_p / P, new velocities, new residuals)."""
    d = grads[0].size
    new_u = [np.float32(momentum) * u + g for u, g in zip(velocities, grads)]
    if k >= d:
        total = np.zeros_like(grads[0])
        for u in new_u:
            total = total + u
        return total / np.float32(len(grads)), new_u, residuals
    merged, new_eps = lags_round([eps + u for eps, u in zip(residuals, new_u)], k)
    masked = []
    for u, eps_before, u_now in zip(new_u, residuals, new_u):
        idx = topk_indices(eps_before + u_now, k)
        u = u.copy()
        u[idx] = 0
        masked.append(u)
    return merged, masked, new_eps
