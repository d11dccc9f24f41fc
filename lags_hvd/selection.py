"""Top-k selection by magnitude: pure tensor functions, no communication.

Every selector returns the same, exactly defined index set::

    TopK(x, k) = the k indices i with the largest |x_i|,
                 ties at the k-th magnitude broken towards the lowest index,

in increasing index order, with ``x`` at those indices. The fixed order keeps
every rank's residual reproducible and lets ``numpy.argsort(-abs(x),
kind="stable")[:k]`` serve as an independent oracle. Inputs must be free of NaN
(the optimizer refuses NaN gradients before selecting); +/-inf are fine.

Selectors share the signature ``select(x, k) -> (values, indices)``, ``x`` 1-D
floating, ``1 <= k <= x.numel()``, ``indices`` int64:

* ``"sampled"`` (default): ``select_sampled``. Estimates a threshold t from a
  sample so that a little more than k entries have ``|x| >= t``, keeps those
  candidates in one blocked pass, and runs the exact k-th-value search on the
  candidates only. Since every entry at or above the true k-th magnitude is
  a candidate whenever at least k entries pass, the result is exact; when fewer
  pass, it falls back to the full search. Cost: about one pass over memory
  plus work proportional to k. CPU tensors go through numpy (its partition and
  nonzero are several times faster than torch's on one thread), other devices
  through torch.
* ``"torch"``: ``select_torch``, ``torch.topk`` on all magnitudes; the reference.
"""
from __future__ import annotations

import functools
import math
import random
import threading

import numpy as np
import torch

__all__ = ["select_torch", "select_sampled", "SELECTORS", "get_selector", "checked_selector"]


class _TorchOps:
    """Magnitude operations on torch tensors (any device)."""

    @staticmethod
    def prepare(x: torch.Tensor):
        return x

    @staticmethod
    def magnitude(a):
        return a.abs()

    @staticmethod
    def sampled_magnitudes(a, stride: int, offset: int):
        return a[offset::stride].abs()

    @staticmethod
    def candidates(a, threshold):
        """Ascending positions with magnitude >= threshold, and their magnitudes."""
        positions = torch.nonzero(a.abs() >= threshold).squeeze(1)
        return positions, a[positions].abs()

    @staticmethod
    def kth_largest(a, k: int):
        return torch.topk(a, k, sorted=False).values.min()

    @staticmethod
    def argmax(a):
        """Position of the largest entry, the lowest one among equals, as a 1-element array."""
        return torch.nonzero(a == a.max())[0]

    @staticmethod
    def flatnonzero(mask):
        return torch.nonzero(mask).squeeze(1)


    @staticmethod
    def result(x: torch.Tensor, a, local) -> tuple[torch.Tensor, torch.Tensor]:
        return x[local], local


class _NumpyOps:
    """The same operations on zero-copy numpy views of CPU tensors.

    Magnitudes are compared as keys: |x| for float16/32/64; for bfloat16 (which
    numpy lacks) the int16 bits with the sign cleared, whose integer order is the
    order of |x|. The candidate search runs block by block, so |x| and the mask
    stay in cache and x is read from memory once.
    """

    BLOCK = 1 << 17
    _local = threading.local()

    @staticmethod
    def prepare(x: torch.Tensor) -> np.ndarray:
        return x.detach().view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.detach().numpy()

    @staticmethod
    def _keys(a: np.ndarray, out=None) -> np.ndarray:
        return np.bitwise_and(a, 0x7FFF, out=out) if a.dtype == np.int16 else np.abs(a, out=out)

    @classmethod
    def magnitude(cls, source: np.ndarray):
        return cls._keys(source)

    @classmethod
    def sampled_magnitudes(cls, source: np.ndarray, stride: int, offset: int):
        return cls._keys(source[offset::stride])

    @classmethod
    def candidates(cls, source: np.ndarray, threshold):
        if source.size <= cls.BLOCK:  # one block: no loop, fewer calls
            keys = cls._keys(source)
            positions = np.flatnonzero(keys >= threshold)
            return positions, keys[positions]
        block = cls._block_buffers(source.dtype)
        found = []
        for start in range(0, source.size, cls.BLOCK):
            chunk = source[start:start + cls.BLOCK]
            keys = cls._keys(chunk, out=block[0][:chunk.size])
            hits = np.flatnonzero(np.greater_equal(keys, threshold, out=block[1][:chunk.size]))
            if hits.size:
                found.append(hits + start)
        positions = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
        return positions, cls._keys(source[positions])

    @classmethod
    def _block_buffers(cls, dtype):
        """Per-thread block-sized scratch (keys, mask): nothing of the tensor's size is allocated."""
        buffers = cls._local.__dict__.setdefault("blocks", {})
        if dtype not in buffers:
            buffers[dtype] = (np.empty(cls.BLOCK, dtype=dtype), np.empty(cls.BLOCK, dtype=bool))
        return buffers[dtype]

    @staticmethod
    def kth_largest(a, k: int):
        return np.partition(a, a.size - k)[a.size - k]

    @staticmethod
    def argmax(a):
        """Position of the largest entry, the lowest one among equals, as a 1-element array."""
        return np.argmax(a).reshape(1)

    @staticmethod
    def flatnonzero(mask):
        return np.flatnonzero(mask)


    @staticmethod
    def result(x: torch.Tensor, source: np.ndarray, local) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.from_numpy(source[local]).view(x.dtype)
        return values, torch.from_numpy(local.astype(np.int64, copy=False))


def _indices_from_kth(m, kth, k: int, ops):
    """Positions in ``m`` of the top-k given the k-th largest value ``kth``, ascending.

    All entries above ``kth`` (fewer than k) plus the lowest-index entries equal to it,
    i.e. all entries >= kth less the highest-index ties beyond k.
    """
    chosen = m >= kth
    surplus = int(chosen.sum()) - k
    if surplus:  # ties at kth: drop the highest-index ones
        chosen[ops.flatnonzero(m == kth)[-surplus:]] = False
    return ops.flatnonzero(chosen)


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"selection expects a 1-D tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")


def _everything(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clone(), torch.arange(x.numel(), device=x.device)


def select_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude with ``torch.topk`` over all magnitudes (the reference)."""
    _check(x, k)
    if k == x.numel():
        return _everything(x)
    m = x.abs()
    indices = _indices_from_kth(m, _TorchOps.kth_largest(m, k), k, _TorchOps)
    return x[indices], indices


def select_sampled(x: torch.Tensor, k: int, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude through a sampled threshold (see the module docstring).

    The sample is every ``stride``-th entry from a random offset, ``stride`` a prime
    (so it cannot line up with a layer's row length), about n/64 entries. If the
    sample holds q entries at or above the true k-th magnitude in expectation, the
    threshold aims at ``(1 + 4/sqrt(q)) * k`` candidates: four standard deviations
    of the estimate above k, so the fallback is rare while the candidate set, and
    the pass that extracts it, stay small.

    Args:
        backend: ``"numpy"`` (CPU tensors only), ``"torch"``, or ``"auto"``.
    """
    _check(x, k)
    n = x.numel()
    if k == n:
        return _everything(x)
    if backend == "auto":
        backend = "numpy" if x.device.type == "cpu" else "torch"
    ops = _NumpyOps if backend == "numpy" else _TorchOps
    a = ops.prepare(x)
    local = None
    plan = _sampling_plan(n, k)
    if plan is not None:
        stride, q = plan
        sample = ops.sampled_magnitudes(a, stride, random.randrange(stride))
        threshold = ops.kth_largest(sample, min(q, len(sample)))
        positions, magnitudes = ops.candidates(a, threshold)
        if len(positions) >= k:   # every entry >= the true k-th magnitude is a candidate
            local = positions[_indices_from_kth(magnitudes, ops.kth_largest(magnitudes, k), k, ops)]
    if local is None:             # small, dense, or too few candidates: search everything
        m = ops.magnitude(a)
        local = ops.argmax(m) if k == 1 else _indices_from_kth(m, ops.kth_largest(m, k), k, ops)
    return ops.result(x, a, local)


@functools.lru_cache(maxsize=4096)
def _sampling_plan(n: int, k: int) -> tuple[int, int] | None:
    """(prime stride, rank of the threshold in the sample), or None to search everything."""
    size = min(max(n // 64, 1024), 65536)
    if k == 1 or size > n // 4:
        return None
    expected = size * k / n                     # sampled entries >= the k-th magnitude
    margin = 1 + 4 / math.sqrt(max(expected, 1.0))
    if margin * k >= n / 4:
        return None
    return _prime_at_least(n // size), max(1, round(margin * expected))


def _prime_at_least(m: int) -> int:
    m = max(m, 2)
    while any(m % d == 0 for d in range(2, math.isqrt(m) + 1)):
        m += 1
    return m


SELECTORS = {"sampled": select_sampled, "torch": select_torch}


def get_selector(name_or_fn, checked: bool = True):
    """Resolve a selector given by name (``SELECTORS``) or as a callable; a callable is
    wrapped in ``checked_selector`` unless ``checked`` is False."""
    if callable(name_or_fn):
        return checked_selector(name_or_fn) if checked else name_or_fn
    try:
        return SELECTORS[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown selector {name_or_fn!r}; choose one of {sorted(SELECTORS)} "
                         f"or pass a callable select(x, k) -> (values, indices)") from None


def checked_selector(select):
    """``select`` whose every result is verified against the selector contract: two 1-D
    tensors of length k, integer indices distinct and in ``[0, len(x))``, and
    ``values == x[indices]``. Shapes are checked for free; the rest costs one pass over
    the k results and one device-to-host read. A violation raises ``ValueError``: a
    duplicated index would add gradient that never existed, a wrong value lose some."""
    name = getattr(select, "__qualname__", type(select).__name__)

    def checked(x: torch.Tensor, k: int):
        result = select(x, k)
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
            raise ValueError(f"selector {name} must return a (values, indices) tuple of tensors, "
                             f"got {type(result).__name__}")
        values, indices = result
        if values.shape != (k,) or indices.shape != (k,) or indices.is_floating_point() or indices.is_complex():
            raise ValueError(f"selector {name} must return k={k} values and k integer indices, got shapes "
                             f"{tuple(values.shape)} and {tuple(indices.shape)} ({indices.dtype})")
        ordered = indices.sort().values
        ok = (ordered[0] >= 0) & (ordered[-1] < x.numel()) & (ordered[1:] != ordered[:-1]).all()
        ok = ok & (values == x[indices.clamp(0, x.numel() - 1)]).all()
        if not bool(ok):
            raise ValueError(f"selector {name} returned indices out of [0, {x.numel()}), repeated indices, "
                             "or values that are not x[indices]; a selector must return the exact entries "
                             "it selects (pass trust_selector=True to skip this check)")
        return values, indices
    return checked
