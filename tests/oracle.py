"""An independent, single-process reference of the LAGS-SGD math in numpy.

Shares no code with lags_hvd: it is the oracle the package is checked against.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np


def k_for(density: float, d: int) -> int:
    return min(d, max(1, math.ceil(density * d)))


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lowest index, ascending."""
    order = np.argsort(-np.abs(x), kind="stable")
    return np.sort(order[:k])


class Reduction(NamedTuple):
    """How the P workers' contributions x_p combine, as Horovod's ``op`` says:

    average:  (f / P) sum_p (x_p / f)      f = gradient_predivide_factor
    sum:      sum_p x_p
    """

    average: bool = True
    predivide: float = 1.0

    def before(self, x: np.ndarray) -> np.ndarray:
        """A worker's contribution as it is summed: x / f."""
        return x / x.dtype.type(self.predivide) if self.predivide != 1 else x

    def after(self, total: np.ndarray, world: int) -> np.ndarray:
        """The sum of the contributions as it is applied: times f / P, or as it is."""
        if not self.average:
            return total
        averaged = total / np.asarray(world, dtype=total.dtype)
        return averaged * total.dtype.type(self.predivide) if self.predivide != 1 else averaged


AVERAGE = Reduction()


def lags_round(accs: list[np.ndarray], k: int, reduction: Reduction = AVERAGE) -> tuple[np.ndarray, list[np.ndarray]]:
    """One exchange of one layer over P workers.

    accs[p] = eps_p + g_p. Returns (sum_p TopK(acc_p) / P, or as ``reduction`` combines
    them, new residuals eps_p). The sum runs in rank order in the accumulators' dtype.
    """
    total = np.zeros_like(accs[0])
    residuals = []
    for acc in accs:
        idx = topk_indices(acc, k)
        sent = np.zeros_like(acc)
        sent[idx] = acc[idx]
        total = total + reduction.before(sent)
        residuals.append(acc - sent)
    return reduction.after(total, len(accs)), residuals


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


def momentum_corrected_round(
    velocities: list[np.ndarray],
    residuals: list[np.ndarray],
    grads: list[np.ndarray],
    momentum: float,
    k: int,
    reduction: Reduction = AVERAGE,
):
    """DGC momentum correction for one layer over P workers: u = m u + g; acc = eps + u;
    s = TopK(acc); eps = acc - s; u = 0 where sent (or, dense, u kept and sent whole).
    Returns (sum_p s_p / P or as ``reduction`` combines them, new velocities, new residuals)."""
    d = grads[0].size
    new_u = [np.float32(momentum) * u + g for u, g in zip(velocities, grads)]
    if k >= d:
        total = np.zeros_like(grads[0])
        for u in new_u:
            total = total + reduction.before(u)
        return reduction.after(total, len(grads)), new_u, residuals
    merged, new_eps = lags_round([eps + u for eps, u in zip(residuals, new_u)], k, reduction)
    masked = []
    for u, eps_before, u_now in zip(new_u, residuals, new_u):
        idx = topk_indices(eps_before + u_now, k)
        u = u.copy()
        u[idx] = 0
        masked.append(u)
    return merged, masked, new_eps


SUMMARY = 8  # cut points per owner in reduce_scatter's balancing summary
REBALANCE_EVERY = 16  # iterations between two rebalancings, from the first


def reduce_scatter_round(
    accs: list[np.ndarray],
    k: int,
    boundaries: list[int],
    rebalance: bool = True,
    kept: int | None = None,
    regional: bool = False,
    reduction: Reduction = AVERAGE,
):
    """Ok-Topk's split-and-reduce for one bucket over P workers, written out plainly.

    Worker p selects TopK(acc_p, k); region r = [b_r, b_{r+1}) of every selection goes
    to rank r, which sums them (rank by rank). The owners keep K = ``kept`` entries
    between them (k when not given): the first R = min(P, K) ranks keep
    TopK(region sum, min(K // R + (r < K % R), |region|)), the others nothing; every rank
    applies the union G of those, divided by P (or as ``reduction`` combines the workers'
    entries: each divided by f before the owner sums them). A worker's selected entries
    outside G return to its residual. The next boundaries balance the union U of all selections:
    each owner describes what arrived in its region by SUMMARY cut points (the entries
    of ranks j c // SUMMARY, ascending) and its count c; boundary i is the cut point with
    the largest count of U before it at most i |U| / R (only when ``rebalance``; else the
    boundaries stay). Returns (merged, residuals, the next boundaries, [(rows sent, rows
    received)] per rank, each owner gathering its kept entries and, when rebalancing,
    SUMMARY + 1 summary rows; the indices each worker had applied).

    ``regional``: worker p selects instead, in every region r of n_r entries, its
    TopK(acc_p restricted to r, m_r), m_r = k b_{r+1} / d rounded to nearest (halves up)
    less k b_r / d rounded alike, but at least one where n_r > 0; owner r keeps
    K M_{r+1} / M rounded less K M_r / M rounded (M_r: the m before region r, M all of
    them), at least one where m_r > 0 and at most n_r; no summaries are sent, the
    boundaries stay.
    """
    world, d = len(accs), accs[0].size
    kept = k if kept is None else kept
    owners = min(world, kept)

    def nearest(x: Fraction) -> int:
        return math.floor(x + Fraction(1, 2))

    if regional:
        rebalance = False
        m = [
            max(nearest(Fraction(k * hi, d)) - nearest(Fraction(k * lo, d)), 1) if hi > lo else 0
            for lo, hi in zip(boundaries[:-1], boundaries[1:])
        ]
        chosen = [
            np.sort(
                np.concatenate(
                    [lo + topk_indices(acc[lo:hi], n) for lo, hi, n in zip(boundaries[:-1], boundaries[1:], m) if n]
                )
            )
            for acc in accs
        ]
        before = np.concatenate([[0], np.cumsum(m)])
        owner_share = [
            min(
                max(
                    nearest(Fraction(kept * int(before[r + 1]), sum(m)))
                    - nearest(Fraction(kept * int(before[r]), sum(m))),
                    1 if m[r] else 0,
                ),
                boundaries[r + 1] - boundaries[r],
            )
            for r in range(world)
        ]
    else:
        chosen = [topk_indices(acc, k) for acc in accs]
        owner_share = [
            min(
                (kept // owners + (1 if r < kept % owners else 0)) if r < owners else 0,
                boundaries[r + 1] - boundaries[r],
            )
            for r in range(world)
        ]
    total = np.zeros_like(accs[0])
    kept_per_region, received, summaries = [], [], []
    for r in range(world):
        lo, hi = boundaries[r], boundaries[r + 1]
        region = np.zeros(hi - lo, dtype=accs[0].dtype)
        arrived = 0
        for p in range(world):
            mine = chosen[p][(chosen[p] >= lo) & (chosen[p] < hi)]
            region[mine - lo] = region[mine - lo] + reduction.before(accs[p][mine])
            arrived += len(mine) if p != r else 0
        kr = owner_share[r]
        best = topk_indices(region, kr) if kr else np.zeros(0, dtype=np.int64)
        total[best + lo] = region[best]
        kept_per_region.append(best + lo)
        received.append(arrived)
        here = np.sort(np.concatenate([c[(c >= lo) & (c < hi)] for c in chosen]))
        cuts = [int(here[j * here.size // SUMMARY]) for j in range(SUMMARY)] if here.size else []
        summaries.append((cuts, here.size))
    kept = np.concatenate(kept_per_region)
    residuals, applied = [], []
    for p in range(world):
        eps = accs[p].copy()
        applied.append(chosen[p][np.isin(chosen[p], kept)])
        eps[applied[p]] = 0
        residuals.append(eps)
    positions, before = [], 0
    for cuts, count in summaries:
        positions += [(cut, before + j * count // SUMMARY) for j, cut in enumerate(cuts)]
        before += count
    following = (
        [0]
        + [max(cut for cut, n in positions if n <= i * before / owners) for i in range(1, owners)]
        + [d] * (world + 1 - owners)
        if rebalance
        else list(boundaries)
    )
    extra = SUMMARY + 1 if rebalance else 0
    traffic = []
    for p in range(world):
        outside = int(np.sum((chosen[p] < boundaries[p]) | (chosen[p] >= boundaries[p + 1])))
        others = [r for r in range(world) if r != p]
        traffic.append(
            (
                outside + (world - 1) * (len(kept_per_region[p]) + extra),
                received[p] + sum(len(kept_per_region[r]) + extra for r in others),
            )
        )
    return reduction.after(total, world), residuals, following, traffic, applied


class AdamCorrected:
    """Adam correction on simulated workers (lags_hvd.updates.adam_correction), in numpy.

    Per sparse layer and worker p, at step t (counted from 1)::

        g   = grad (+ wd x without decoupling)
        m_p = b1 m_p + (1 - b1) g ;  v_p = b2 v_p + (1 - b2) g^2
        d_p = lr (m_p / (1 - b1^t)) / (sqrt(v_p) / sqrt(1 - b2^t) + eps)
        x   = x (1 - lr wd, decoupled) - lags_round(eps_p + d_p)

    A layer sent whole is Adam on the reduced gradient, moments shared by every worker."""

    def __init__(self, world: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, wd=0.0, decoupled=True):
        self.world, self.lr, (self.b1, self.b2), self.eps, self.wd, self.decoupled = (
            world,
            lr,
            betas,
            eps,
            wd,
            decoupled,
        )
        self.m: dict = {}  # (rank or "shared", name) -> moments
        self.v: dict = {}
        self.residuals = [{} for _ in range(world)]
        self.t = 0

    def _step(self, key, g, t):
        f = np.float32
        m = self.m.get(key, np.zeros_like(g)) * f(self.b1) + g * f(1 - self.b1)
        v = self.v.get(key, np.zeros_like(g)) * f(self.b2) + g * g * f(1 - self.b2)
        self.m[key], self.v[key] = m, v
        denom = np.sqrt(v) / f(math.sqrt(1 - self.b2**t)) + f(self.eps)
        return f(self.lr / (1 - self.b1**t)) * (m / denom)

    def _round(self, n: str, gs: list, k: int, reduction: Reduction) -> tuple:
        """One sparse layer's exchange: ``(residuals before, merged, residuals after)``, the
        residuals kept."""
        before = [self.residuals[p].get(n, np.zeros_like(gs[p])) for p in range(self.world)]
        accs = [before[p] + self._step((p, n), gs[p], self.t) for p in range(self.world)]
        merged, new = lags_round(accs, k, reduction)
        for p in range(self.world):
            self.residuals[p][n] = new[p]
        return before, merged, new

    def _shared_step(self, n: str, gs: list, reduction: Reduction):
        """A layer sent whole: Adam's step on the reduced gradient, moments shared."""
        total = np.zeros_like(gs[0])
        for g in gs:
            total = total + reduction.before(g)
        return self._step(("shared", n), reduction.after(total, self.world), self.t)

    def step(self, params: dict, grads: list[dict], k: dict, reduction: Reduction = AVERAGE) -> dict:
        """params: name -> flat float32 array; grads[p]: name -> flat gradient; k per name."""
        self.t += 1
        f, out = np.float32, {}
        for n, x in params.items():
            gs = [g[n] + (f(self.wd) * x if not self.decoupled else 0) for g in grads]
            shrunk = x * f(1 - self.lr * self.wd) if self.decoupled and self.wd else x
            if k[n] < x.size:
                _, merged, _ = self._round(n, gs, k[n], reduction)
                out[n] = shrunk - merged
            else:
                out[n] = shrunk - self._shared_step(n, gs, reduction)
        return out


class LocalAdamCorrected(AdamCorrected):
    """Adam correction with each worker's residual kept in its own parameters
    (lags_hvd.updates.local_adam_correction), in numpy. Worker p holds ``x_p``, takes its
    gradient there (and Adam's L2 decay of ``x_p``), and per sparse layer::

        x_p = (x_p + eps_p - eps_p') (1 - lr wd) - merged - lr wd eps_p'   (AdamW's decay)
        x_p = x_p + eps_p - eps_p' - merged                                 (Adam's L2 decay)

    with ``merged`` and ``eps_p'`` as in ``AdamCorrected``. A layer sent whole is Adam on
    the reduced gradient, the same step on every worker. ``average(models)``: the mean model."""

    def step_workers(self, params: list[dict], grads: list[dict], k: dict, reduction: Reduction = AVERAGE) -> list:
        """params[p]: worker p's name -> flat float32 array; grads[p]: its gradients there."""
        self.t += 1
        f, out = np.float32, [{} for _ in params]
        for n in params[0]:
            xs = [x[n] for x in params]
            gs = [g[n] + (f(self.wd) * x if not self.decoupled else 0) for g, x in zip(grads, xs)]
            decay = f(self.lr * self.wd) if self.decoupled and self.wd else None
            shrunk = [x * (f(1) - decay) if decay else x for x in xs]
            if k[n] < xs[0].size:
                before, merged, new = self._round(n, gs, k[n], reduction)
                for p in range(self.world):
                    committed = xs[p] + before[p] - new[p]
                    if decay:
                        out[p][n] = committed * (f(1) - decay) - merged - decay * new[p]
                    else:
                        out[p][n] = committed - merged
            else:
                step = self._shared_step(n, gs, reduction)
                for p in range(self.world):
                    out[p][n] = shrunk[p] - step
        return out

    @staticmethod
    def average(params: list[dict]) -> dict:
        return {n: sum(x[n].astype(np.float64) for x in params) / len(params) for n in params[0]}
