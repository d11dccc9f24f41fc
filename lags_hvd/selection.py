"""Top-k selection by magnitude: pure tensor functions, no communication.

Every selector returns the same, exactly defined index set::

    TopK(x, k) = the k indices i with the largest |x_i|,
                 ties at the k-th magnitude broken towards the lowest index,

in increasing index order, with ``x`` at those indices. The fixed order keeps
every rank's residual reproducible and lets ``numpy.argsort(-abs(x),
kind="stable")[:k]`` serve as an independent oracle.

Magnitudes are compared as integer keys: the bits of ``x`` with the sign bit
cleared, whose integer order is the order of ``|x|`` for finite values and
infinities, and which puts every NaN above +/-inf. So a NaN or Inf anywhere in
``x`` is always among the selected values: the optimizer needs no separate
finiteness pass (and no host read) before selecting, since the non-finite value
travels to every rank, whose merge sees it.

Selectors share the signature ``select(x, k) -> (values, indices)``, ``x`` 1-D
floating, ``1 <= k <= x.numel()``, ``indices`` int64:

* ``"sampled"`` (default): ``select_sampled`` on CPU tensors, ``select_torch`` on
  other devices. Estimates a threshold t from a
  sample so that a little more than k entries have ``|x| >= t``, keeps those
  candidates in one compiled pass (``_kernels.c``), and runs the exact
  k-th-value search on the candidates only. Since every entry at or above the true
  k-th magnitude is a candidate whenever at least k entries pass, the result is
  exact; when fewer pass, it falls back to the full search. Cost: about one pass
  over memory plus work proportional to k. CPU tensors go through numpy views
  (its partition is several times faster than torch's topk on one thread), other
  devices through torch. ``add_select`` is the same selection of ``a + b`` with
  the addition in the candidate pass: an accumulate and its selection in one.
* ``"torch"``: ``select_torch``, ``torch.topk`` on all magnitudes with the ties made
  distinct by position (or, on large tensors, settled by a prefix count): no value is
  read to the host, so a GPU stream never stalls on it.

A user's callable is checked (``checked_selector``) and, since its treatment of
NaN is unknown, made to propagate non-finite input (``propagating_nonfinite``); its
result is put in index order (``in_index_order``).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import threading

import numpy as np
import torch

from . import _kernels

__all__ = [
    "select_torch",
    "select_sampled",
    "select_regions",
    "add_select",
    "accumulate_select",
    "one_pass",
    "SELECTORS",
    "get_selector",
    "checked_selector",
    "in_index_order",
    "propagating_nonfinite",
]


_SUMMED_DTYPES = (torch.float32, torch.float64)  # add_select's compiled pass
_KEY_DTYPE = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
_SIGN_CLEAR = {torch.int64: 2**63 - 1, torch.int32: 2**31 - 1, torch.int16: 2**15 - 1}


class _TorchOps:
    """Magnitude operations on torch tensors (any device), on integer keys."""

    @staticmethod
    def prepare(x: torch.Tensor):
        return x.detach().view(_KEY_DTYPE[x.dtype])

    @staticmethod
    def magnitude(a):
        return torch.bitwise_and(a, _SIGN_CLEAR[a.dtype])

    @classmethod
    def sampled_magnitudes(cls, a, stride: int, offset: int):
        return cls.magnitude(a[offset::stride])

    @classmethod
    def candidates(cls, a, threshold):
        """Ascending positions with magnitude >= threshold, and their magnitudes."""
        positions = torch.nonzero(cls.magnitude(a) >= threshold).squeeze(1)
        return positions, cls.magnitude(a[positions])

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
    """The same operations on zero-copy numpy views of CPU tensors' bits (integer keys,
    as above). The candidate search is one compiled pass (``_kernels.find``): the
    keys are read from memory once, with no temporary of the tensor's size.
    """

    _local = threading.local()

    # numpy has no bfloat16: its keys are taken through torch
    _NUMPY_KEYS = {torch.float32: np.int32, torch.float64: np.int64, torch.float16: np.int16}

    @classmethod
    def prepare(cls, x: torch.Tensor) -> np.ndarray:
        keys = cls._NUMPY_KEYS.get(x.dtype)
        if keys is None:
            return x.detach().view(_KEY_DTYPE[x.dtype]).numpy()
        return x.detach().numpy().view(keys)

    _SIGN_CLEAR = {
        np.dtype(np.int16): np.int16(2**15 - 1),
        np.dtype(np.int32): np.int32(2**31 - 1),
        np.dtype(np.int64): np.int64(2**63 - 1),
    }

    @classmethod
    def _keys(cls, a: np.ndarray, out=None) -> np.ndarray:
        return np.bitwise_and(a, cls._SIGN_CLEAR[a.dtype], out=out)

    @classmethod
    def magnitude(cls, source: np.ndarray):
        return cls._keys(source)

    @classmethod
    def sampled_magnitudes(cls, source: np.ndarray, stride: int, offset: int):
        return cls._keys(source[offset::stride])

    @classmethod
    def candidates(cls, source: np.ndarray, threshold):
        source = np.ascontiguousarray(source)  # a strided tensor's keys: one copy
        found = cls._positions(0)
        count = _kernels.find(source, source.itemsize, int(threshold), found)
        return cls._found(source, threshold, found, count)

    @classmethod
    def summed_candidates(cls, a: np.ndarray, parts: list, out: np.ndarray, keys: np.ndarray, threshold):
        """``out = a + parts end to end`` (contiguous float32 or float64) and ``candidates``
        of its keys (``keys``: ``out``'s bits as integers), in one pass."""
        found = cls._positions(0)
        count = _kernels.add_find(a, parts, out, out.itemsize, int(threshold), found)
        return cls._found(keys, threshold, found, count)

    @classmethod
    def _found(cls, source: np.ndarray, threshold, found: np.ndarray, count: int):
        if count > found.size:  # more than ever before: grow, search again
            found = cls._positions(count)
            _kernels.find(source, source.itemsize, int(threshold), found)
        positions = found[:count]
        return positions, cls._keys(source[positions])

    @classmethod
    def _positions(cls, least: int) -> np.ndarray:
        """This thread's int64 scratch for candidate positions, at least ``least`` long."""
        return cls.scratch("positions", least, np.int64)

    @classmethod
    def scratch(cls, name: str, least: int, dtype) -> np.ndarray:
        """This thread's scratch array ``name`` of ``dtype``, at least ``least`` long: kept
        and reused (its contents are read before the next selection in the same thread),
        replaced by a larger one only when it is too short."""
        buffers = cls._local.__dict__.setdefault("scratch", {})
        found = buffers.get(name)
        if found is None or found.dtype != dtype or found.size < least:
            found = buffers[name] = np.empty(max(least, 1 << 14), dtype=dtype)
        return found

    @staticmethod
    def kth_largest(a, k: int):
        return np.partition(a, a.size - k)[a.size - k]

    @staticmethod
    def argmax(a):
        """Position of the largest entry, the lowest one among equals, as a 1-element array."""
        return a.argmax(keepdims=True)

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


def select_torch(
    x: torch.Tensor, k: int, *, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude with ``torch.topk``, reading nothing to the host.

    Up to ``COMPOSITE_MAX`` entries with keys of 32 bits or fewer (float32, float16,
    bfloat16), the keys become the int64 composite ``(m << 32) - i``: magnitude first,
    then the lower position, so the k largest composites are exactly TopK(x, k) whatever
    the ties: the key in one int64 temporary, the selection and a sort of k positions.
    Larger tensors (where a 64-bit selection costs more than the passes it saves: on an
    H100, 0.86 against 0.65 ms at 10M entries, 0.32 against 0.35 ms at 1M; the bound
    between is not measured) and float64's 63-bit keys take the k-th largest key, and the
    ties at it fill the rest in index order (a prefix count); ``nonzero_static`` returns
    them without a data-dependent size. ``positions``: ``arange`` of at least n entries on x's
    device, for a caller that must own the buffer (a CUDA graph reads it at every replay);
    by default one shared per device and stream."""
    _check(x, k)
    n = x.numel()
    if k == n:
        return _everything(x)
    m = _TorchOps.magnitude(_TorchOps.prepare(x))
    if n <= COMPOSITE_MAX and m.dtype != torch.int64:
        positions = _positions(n, m.device) if positions is None else positions[:n]
        composite = m.to(torch.int64).bitwise_left_shift_(32).sub_(positions)
        indices = torch.topk(composite, k, sorted=False).indices.sort().values
    else:
        kth = _TorchOps.kth_largest(m, k)
        above = m > kth
        ties = m == kth
        chosen = above | (ties & (ties.cumsum(0) <= k - above.sum()))
        indices = torch.nonzero_static(chosen, size=k).squeeze(1)
    return x[indices], indices


COMPOSITE_MAX = 2**21
_POSITIONS: dict = {}


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` in int64 on ``device`` (``n <= COMPOSITE_MAX``): a view of one buffer per
    device and, on CUDA, per stream (it is written and read on that stream alone, and a
    buffer outgrown goes back to that stream's pool), grown by doubling."""
    key = (device, torch.cuda.current_stream(device)) if device.type == "cuda" else device
    held = _POSITIONS.get(key)
    if held is None or held.numel() < n:
        size = min(max(n, 2 * (0 if held is None else held.numel())), COMPOSITE_MAX)
        held = _POSITIONS[key] = torch.arange(size, device=device)
    return held[:n]


def select_sampled(x: torch.Tensor, k: int, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude through a sampled threshold (see the module docstring).

    The sample is every ``stride``-th entry from a random offset, ``stride`` a prime
    (so it cannot line up with a layer's row length), about n/256 entries. If the
    sample holds q entries at or above the true k-th magnitude in expectation, the
    threshold aims at ``(1 + 4/sqrt(q)) * k`` candidates: four standard deviations
    of the estimate above k, so the fallback is rare while the candidate set, and
    the pass that extracts it, stay small.

    Args:
        backend: ``"numpy"`` (CPU tensors only), ``"torch"`` (reads counts to the host,
            so it waits for the device), or ``"auto"`` (numpy on CPU; elsewhere
            ``select_torch``, which never waits).
    """
    _check(x, k)
    n = x.numel()
    if k == n:
        return _everything(x)
    if backend == "auto":
        if x.device.type != "cpu":
            return select_torch(x, k)
        backend = "numpy"
    ops = _NumpyOps if backend == "numpy" else _TorchOps
    a = ops.prepare(x)
    local = None
    plan = _sampling_plan(n, k)
    if plan is not None:
        stride, q = plan
        sample = ops.sampled_magnitudes(a, stride, random.randrange(stride))
        threshold = ops.kth_largest(sample, min(q, len(sample)))
        local = _exact_from_candidates(*ops.candidates(a, threshold), k, ops)
    return ops.result(x, a, _full_search(a, k, ops) if local is None else local)


def add_select(out: torch.Tensor, a: torch.Tensor, b, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``out = a + b``, then ``select_sampled(out, k)``: an accumulate and its selection.

    ``a``, ``out``: 1-D, of one size and dtype. ``b``: a tensor of their size, or a
    sequence of 1-D tensors that make it up end to end (a bucket's gradients, in
    order). For contiguous CPU tensors of float32 or float64 the threshold is sampled
    from ``a + b`` at the sample positions (``_kernels.add_sample``), then the
    addition and the candidate search are one compiled pass (``_kernels.add_find``);
    the sum is rounded as ``torch.add`` rounds it and the result is the same exact
    TopK (where both a and b hold a NaN, which NaN payload survives may differ: either
    way the step is skipped). ``out`` must not overlap ``a`` or ``b``. Otherwise
    ``torch.add`` per part, then ``select_sampled``."""
    _check(out, k)
    parts = [b] if isinstance(b, torch.Tensor) else list(b)
    starts = list(itertools.accumulate((part.numel() for part in parts), initial=0))
    if starts[-1] != out.numel() or a.shape != out.shape:
        raise ValueError(f"add_select: parts of {starts[-1]} entries and a of {a.numel()} for out of {out.numel()}")
    n = out.numel()
    fused = (
        one_pass(n, k, out.dtype, out.device)
        and all(
            t.device == out.device and t.dtype == out.dtype and t.dim() == 1 and t.is_contiguous() for t in (a, *parts)
        )
        and out.is_contiguous()
    )
    if not fused:
        for start, end, part in zip(starts, starts[1:], parts):
            torch.add(part, a[start:end], out=out[start:end])
        return select_sampled(out, k)
    stride, q = _sampling_plan(n, k)
    a, total = a.detach().numpy(), out.detach().numpy()
    parts = [part.detach().numpy() for part in parts]
    keys = total.view(_NumpyOps._NUMPY_KEYS[out.dtype])
    sample = _NumpyOps.scratch(f"sample.{keys.dtype}", n // stride + 1, keys.dtype)
    sample = sample[: _kernels.add_sample(a, parts, total.itemsize, stride, random.randrange(stride), sample)]
    threshold = _NumpyOps.kth_largest(sample, min(q, len(sample)))
    local = _exact_from_candidates(*_NumpyOps.summed_candidates(a, parts, total, keys, threshold), k, _NumpyOps)
    return _NumpyOps.result(out, keys, _full_search(keys, k, _NumpyOps) if local is None else local)


def one_pass(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``add_select`` sums and searches in one compiled pass for a bucket of n
    entries and this k (given contiguous parts): float32 or float64 on the CPU, with a
    sampled threshold (k > 1 and n large enough against k)."""
    return device.type == "cpu" and dtype in _SUMMED_DTYPES and k < n and _sampling_plan(n, k) is not None


def _exact_from_candidates(positions, magnitudes, k: int, ops):
    """The top k among the candidates, or None when fewer than k passed the threshold
    (with at least k, every entry >= the true k-th magnitude is a candidate)."""
    if len(positions) < k:
        return None
    return positions[_indices_from_kth(magnitudes, ops.kth_largest(magnitudes, k), k, ops)]


def _full_search(a, k: int, ops):
    """Small, dense, or too few candidates: search everything."""
    m = ops.magnitude(a)
    return ops.argmax(m) if k == 1 else _indices_from_kth(m, ops.kth_largest(m, k), k, ops)


@functools.lru_cache(maxsize=4096)
def _sampling_plan(n: int, k: int) -> tuple[int, int] | None:
    """(prime stride, rank of the threshold in the sample), or None to search everything."""
    size = min(max(n // 256, 1024), 16384)
    if k == 1 or size > n // 4:
        return None
    expected = size * k / n  # sampled entries >= the k-th magnitude
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


def accumulate_select(
    residuals, name: str, grads, k: int, grad_scale: float, residual_scale: float, select
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage ``acc = residual_scale * eps + grad_scale * g`` in ``residuals`` (a
    ``ResidualMemory``) for bucket ``name`` and select its top ``k`` with ``select``:
    ``(acc, values, indices)``. ``grads``: one tensor of the whole bucket, or its members'.
    A selector may declare a fused path, ``select.accumulating(n, k, dtype, device)``: where
    it says yes, contiguous gradients at scale 1 are summed and selected in one pass
    (``select.add_select``); otherwise the memory accumulates, then ``select`` selects."""
    fusable = getattr(select, "accumulating", None)
    if fusable is not None and grad_scale == 1.0 == residual_scale and all(g is not None for g in grads):
        eps_now = residuals.residual(name)
        if (
            fusable(eps_now.numel(), k, eps_now.dtype, eps_now.device)
            and all(g.is_contiguous() for g in grads)
            and sum(g.numel() for g in grads) == eps_now.numel()
        ):
            eps, acc = residuals.stage(name)
            return (acc, *select.add_select(acc, eps, [g.view(-1) for g in grads], k))
    acc = residuals.accumulate(name, grads, grad_scale=grad_scale, residual_scale=residual_scale)
    return (acc, *select(acc, k))


def get_selector(name_or_fn, checked: bool = True):
    """Resolve a selector given by name (``SELECTORS``) or as a callable; a callable is
    wrapped in ``checked_selector`` unless ``checked`` is False, and always in
    ``in_index_order`` and ``propagating_nonfinite``."""
    if callable(name_or_fn):
        return propagating_nonfinite(in_index_order(checked_selector(name_or_fn) if checked else name_or_fn))
    try:
        return SELECTORS[name_or_fn]
    except KeyError:
        raise ValueError(
            f"unknown selector {name_or_fn!r}; choose one of {sorted(SELECTORS)} "
            f"or pass a callable select(x, k) -> (values, indices)"
        ) from None


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
            raise ValueError(
                f"selector {name} must return a (values, indices) tuple of tensors, got {type(result).__name__}"
            )
        values, indices = result
        if values.shape != (k,) or indices.shape != (k,) or indices.is_floating_point() or indices.is_complex():
            raise ValueError(
                f"selector {name} must return k={k} values and k integer indices, got shapes "
                f"{tuple(values.shape)} and {tuple(indices.shape)} ({indices.dtype})"
            )
        ordered = indices.sort().values
        ok = (ordered[0] >= 0) & (ordered[-1] < x.numel()) & (ordered[1:] != ordered[:-1]).all()
        picked = x[indices.clamp(0, x.numel() - 1)]
        ok = ok & ((values == picked) | (values.isnan() & picked.isnan())).all()
        if not bool(ok):
            raise ValueError(
                f"selector {name} returned indices out of [0, {x.numel()}), repeated indices, "
                "or values that are not x[indices]; a selector must return the exact entries "
                "it selects (pass trust_selector=True to skip this check)"
            )
        return values, indices

    return checked


def in_index_order(select):
    """``select`` whose result is in increasing index order, as the built-in selectors'
    is by construction (the reduce_scatter split counts entries per region on it)."""

    def ordered(x: torch.Tensor, k: int):
        values, indices = select(x, k)
        indices, order = torch.sort(indices)
        return values[order], indices

    return ordered


def propagating_nonfinite(select):
    """``select`` whose values turn NaN when ``x`` holds a NaN or Inf, as the built-in
    selectors' do by construction: one float64 reduction of ``x`` (which finite float32
    and smaller entries cannot overflow), no host read."""

    def propagating(x: torch.Tensor, k: int):
        values, indices = select(x, k)
        return values + (x.sum(dtype=torch.float64) * 0).to(values.dtype), indices

    return propagating


def select_regions(x: torch.Tensor, boundaries: list[int], shares: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK of every region ``[b_r, b_{r+1})`` of a CPU tensor ``x`` with ``shares[r]`` entries,
    every region in one compiled pass (``_kernels.top_regions``): the same (values, indices
    ascending) as ``select_sampled`` of each region, concatenated. Its cost is one pass plus
    about ``share * ln(region / share)`` updates per region: for many regions with small
    shares, where a call per region would cost more than its pass."""
    keys = x.detach().view(_KEY_DTYPE[x.dtype]).numpy()
    indices = np.empty(sum(shares), dtype=np.int64)
    bounds, wanted = np.asarray(boundaries, dtype=np.int64), np.asarray(shares, dtype=np.int64)
    _kernels.top_regions(keys, keys.itemsize, bounds, wanted, indices)
    indices = torch.from_numpy(indices)
    return x[indices], indices


select_sampled.accumulating = one_pass  # its fused accumulate-and-select (``accumulate_select``)
select_sampled.add_select = add_select
select_sampled.in_regions = select_regions  # its one-pass regional selection (``regions.select_regional``)
