"""Sparse reduce-scatter aggregation: regions, wire rows and the owner's reduction. Pure.

``aggregation="reduce_scatter"`` replaces a bucket's allgather, whose traffic per
worker grows as (P-1) k, by Ok-Topk's split-and-reduce followed by an allgather of
the reduced selection (Li and Hoefler, PPoPP 2022). A bucket of n entries is split
into P contiguous regions, region r owned by rank r::

    region r = [b_r, b_{r+1}),     0 = b_0 <= b_1 <= ... <= b_P = n

The owners keep K = min(n, ceil(c k)) entries between them (``global_k``; c is the
``owner_keep`` option, 1 by default: Ok-Topk's global top-k). Only the first
R = min(P, K) ranks own entries (the other regions are empty), and owner r keeps
``k'_r = floor(K / R) + [r < K mod R]`` of them, so the global selection holds at
most K entries, however small K is against P. Boundaries are
made for one R (``fits``): when K changes R (the density warm-up, an adaptive plan),
the unit starts again from equal regions, so no non-empty region is left without
an owner that keeps from it (a NaN sent there would otherwise drop out of the step
check into a residual).

Worker p, with its local selection s_p = TopK(acc_p, k) (indices ascending):

1. **split and reduce**: the entries of s_p in region r go to rank r (one alltoall);
   rank r sums what arrives, rank by rank: ``S_r = sum_p s_p`` on region r.
2. **select and gather**: rank r keeps ``min(k'_r, |region r|)`` entries of S_r (the
   same exact TopK), and one allgather gives every rank all of them::

       G = union_r TopK(S_r, k'_r),        grad[i] = S[i] / P  (i in G),  0 elsewhere

3. **error feedback, nothing lost**: what worker p contributed and G dropped goes
   back to its residual, ``eps_p = acc_p - s_p restricted to G``; so per worker
   ``acc_p = eps_p + (its contributions that were applied)``.

**Balancing.** An owner's load is what arrives in its region: U, all workers'
selections there, counted with repeats (an index two workers chose counts twice).
Every ``REBALANCE_EVERY`` iterations (from the first) each owner summarises its
part of U in ``Q`` cut points (the entries of ranks ``floor(j c_r / Q)`` among the
``c_r`` that arrived) and its count, ``Q + 1`` extra rows of its gathered message;
from everyone's summaries every rank computes the same next boundaries, the
R-quantiles of U: ``b_i`` is the cut point with the largest cumulative count at most
``i |U| / R``. So the owners' loads follow the selections at each rebalancing;
between two they drift from balance, as the next selections move away from what was
just applied to where the residuals grow (measured: docs/scaling.md). The first
iteration (and the first after a re-bucketing) uses equal regions.

**Regional selection** (``regional_selection``) takes the loads out of the
gradients' hands: worker p selects in every region r its own top ``k_r`` entries,

    s_p = union_r TopK(acc_p on region r, k_r),   k_r = [k b_{r+1} / n] - [k b_r / n]

(``regional_k``: k apportioned by the regions' sizes, [x] the nearest integer, raised
to 1 in a non-empty region, so a NaN or Inf anywhere is always sent and reaches the step check). Every
owner then receives exactly (P-1) k_r rows, in every iteration and whatever the
gradients; the counts are known on the host, and no summaries are needed (the
regions stay as they are). The owners' K is apportioned the same way, following the
k_r (``regional_keep``): ``k'_r = [K C_{r+1} / m] - [K C_r / m]``, C_r the shares
before region r and m their sum, so ``k'_r = c k_r`` for a whole c. An owner that
receives one row more in the split (k_r rounded up) keeps c more and so receives
c fewer in the gather: owner r receives (P-1) k_r + K - k'_r, for a whole c
(P-1-c) k_r + c k, at most (P-1-c) ceil(k/R) + c k. The selection is by region as LAGS's is by layer: within
a bucket, a region whose entries are small still sends its share, and the residual
carries the rest of a region whose entries are large.

**Traffic** per worker and bucket, in entries of (index, value) (``traffic``)::

    sent     = |s_p outside region p|          + (P-1) (k'_p + S)
    received = |sum_q s_q in region p| - own   + sum_{r != p} (k'_r + S)

and with regional selection, exactly (S = 0)::

    sent     = sum_{r != p} k_r  + (P-1) k'_p
    received = (P-1) k_p         + sum_{r != p} k'_r

(S = Q + 1 summary rows on a rebalancing iteration, else 0): about (1 + c) k (P-1)/P
each way when k >= P and the regions are balanced, against (P-1) k each way for the
allgather. A larger c applies more of the workers' selections each step (up to their
union, at most P k entries, as the allgather does) for (c - 1) k (P-1)/P more rows
each way.
An owner receives every contribution to its region: with K < P (R = K owners) or
every selection in one region, up to (P-1) k
(merging small tensors into buckets, ``buckets=``, keeps k >= P; the balancing
keeps the selections spread).

On the wire an entry is one row of bytes, ``[index | value]``, so one collective
carries both (``pack_rows`` / ``unpack_rows``).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import torch

__all__ = [
    "SUMMARY_POINTS",
    "REBALANCE_EVERY",
    "rebalancing",
    "global_k",
    "owners",
    "equal_boundaries",
    "fits",
    "summary",
    "balanced_boundaries",
    "region_k",
    "regional_k",
    "regional_keep",
    "select_regional",
    "splits",
    "pack_rows",
    "unpack_rows",
    "reduce_region",
    "traffic",
]

SUMMARY_POINTS = 8
"""Q: cut points per owner in the balancing summary (Q + 1 rows of its gathered message)."""
REBALANCE_EVERY = 16
"""Iterations between two rebalancings (summaries cost (P-1)(Q+1) rows per worker)."""


def rebalancing(iteration: int) -> bool:
    """Whether the owners send their summaries (and the regions move) at ``iteration``."""
    return iteration % REBALANCE_EVERY == 0


def global_k(k: int, numel: int, keep: float) -> int:
    """K = min(n, ceil(c k)): the entries the owners keep between them, for a local
    selection of k entries of an n-entry unit and ``owner_keep`` c, with c taken as the
    decimal it prints as (1.1 * 50 is 55, not the float product's 55.000...01)."""
    if keep == 1:
        return min(numel, k)
    if keep * k >= numel:  # also spares a huge c the exact product below
        return numel
    return min(numel, math.ceil(_printed(float(keep)) * k))


@functools.lru_cache(maxsize=16)
def _printed(keep: float) -> Fraction:
    """``keep`` as the exact decimal it prints as (computed once per value)."""
    return Fraction(repr(keep))


def owners(parts: int, kept: int) -> int:
    """R = min(P, K): how many ranks own a region."""
    return min(parts, kept)


def equal_boundaries(numel: int, parts: int, kept: int) -> list[int]:
    """R owned regions of (nearly) equal size, ``b_r = floor(r n / R)``, then empty ones."""
    owned = owners(parts, kept)
    return [min(r, owned) * numel // owned for r in range(parts + 1)]


def fits(boundaries: list[int], numel: int, parts: int, kept: int) -> bool:
    """Whether ``boundaries`` were made for R = min(P, K) owners of a ``numel``-entry unit:
    P + 1 of them from 0 to numel, regions R.. empty and region R-1 not ending the unit
    early (every cut point is an entry's index, below numel)."""
    owned = owners(parts, kept)
    return (
        len(boundaries) == parts + 1
        and boundaries[0] == 0
        and boundaries[-1] == numel
        and all(b == numel for b in boundaries[owned:])
        and boundaries[owned - 1] < numel
    )


def summary(arrived: torch.Tensor, start: int) -> torch.Tensor:
    """An owner's balancing summary of the indices that arrived in its region (any order):
    ``Q`` cut points, the entries of ranks ``floor(j c / Q)`` in ascending order (the
    region's start where nothing arrived), then the count c; int64, on their device."""
    count = arrived.numel()
    if count == 0:
        points = torch.full((SUMMARY_POINTS,), start, dtype=torch.int64, device=arrived.device)
    else:
        ranks = torch.tensor([j * count // SUMMARY_POINTS for j in range(SUMMARY_POINTS)], device=arrived.device)
        points = torch.sort(arrived).values[ranks].to(torch.int64)
    return torch.cat([points, torch.tensor([count], dtype=torch.int64, device=arrived.device)])


def balanced_boundaries(summaries: list[list[int]], numel: int, parts: int, kept: int) -> list[int]:
    """The next boundaries from every owner's ``summary`` (rank order): R regions with an
    equal share each of everything that arrived, then empty ones. ``b_i`` is the cut point
    with the largest cumulative count at most ``i N / R`` (N arrived in all)."""
    owned = owners(parts, kept)
    points, below = [], 0  # (index, entries of U before it)
    for entry in summaries:
        *cuts, count = entry
        points += [(cut, below + j * count // SUMMARY_POINTS) for j, cut in enumerate(cuts) if count]
        below += count
    if not points:
        return equal_boundaries(numel, parts, kept)
    cuts = []
    for i in range(1, owned):
        target = i * below / owned
        cuts.append(max(cut for cut, before in points if before <= target))
    return [0, *cuts] + [numel] * (parts + 1 - owned)


def region_k(boundaries: list[int], kept: int) -> list[int]:
    """What each owner keeps: ``min(k'_r, |region r|)``, ``k'_r = floor(K / R) + [r < K mod R]``
    for the R = min(P, K) owners, 0 for the other ranks."""
    parts = len(boundaries) - 1
    owned = owners(parts, kept)
    share = [kept // owned + (r < kept % owned) if r < owned else 0 for r in range(parts)]
    return [min(s, end - start) for s, start, end in zip(share, boundaries, boundaries[1:])]


def regional_k(boundaries: list[int], k: int) -> list[int]:
    """Regional selection's shares of a worker's k: ``[k b_{r+1} / n] - [k b_r / n]`` for region
    r of an n-entry unit, [x] the nearest integer (halves up): together k, none above its
    region's size; raised to 1 for a non-empty region, so that every non-empty region
    sends its largest entry."""
    numel = boundaries[-1]

    def nearest(b: int) -> int:
        return (2 * k * b + numel) // (2 * numel)

    return [
        max(nearest(end) - nearest(start), 1 if end > start else 0) for start, end in zip(boundaries, boundaries[1:])
    ]


def regional_keep(boundaries: list[int], k: int, kept: int) -> list[int]:
    """Regional selection's owner shares of the K = ``kept`` entries: K apportioned like the
    workers' shares k_r (``regional_k``), ``[K C_{r+1} / m] - [K C_r / m]`` with C_r the
    shares before region r and m their sum ([x] the nearest integer, halves up); at least
    1 where k_r > 0 (what was sent there is always reduced and checked), at most the
    region's size. A whole ``owner_keep`` c gives ``c k_r``."""
    shares = regional_k(boundaries, k)
    total, before, keep = sum(shares), 0, []
    for share, start, end in zip(shares, boundaries, boundaries[1:]):
        low = (2 * kept * before + total) // (2 * total)
        before += share
        high = (2 * kept * before + total) // (2 * total)
        keep.append(min(max(high - low, 1 if share else 0), end - start))
    return keep


def select_regional(x: torch.Tensor, k: int, boundaries: list[int], select) -> tuple[torch.Tensor, torch.Tensor]:
    """Regional selection: ``select`` (a ``selection`` selector, index order) applied to each
    region of ``x`` for its ``regional_k`` share; (values, indices ascending) of them all.
    A selector that declares ``in_regions`` (the library's own: ``selection.select_regions``)
    selects every region of a CPU tensor whose shares are all small (many regions: large P)
    in one compiled pass (the same result), so the cost does not grow with the number of regions; otherwise one call
    per region."""
    shares = regional_k(boundaries, k)
    in_regions = getattr(select, "in_regions", None)  # the selector's own one-pass path, if it has one
    if in_regions is not None and x.device.type == "cpu" and x.is_contiguous() and max(shares) <= ONE_PASS_SHARE:
        return in_regions(x, boundaries, shares)
    values, indices = [], []
    for start, end, share in zip(boundaries, boundaries[1:], shares):
        if share:
            chosen, where = select(x[start:end], share)
            values.append(chosen)
            indices.append(where + start)
    return torch.cat(values), torch.cat(indices)


ONE_PASS_SHARE = 64
"""Up to this share per region, ``select_regional`` selects every region in one pass: its
cost, one pass plus about share * ln(region / share) heap updates per region, is below a
call per region from there on (docs/scaling.md, "Host work per bucket")."""


def splits(indices: torch.Tensor, boundaries: list[int]) -> torch.Tensor:
    """How many of ``indices`` (ascending) fall in each region, as the int32 CPU tensor
    Horovod's alltoall takes (one host read on an accelerator)."""
    edges = torch.tensor(boundaries, dtype=indices.dtype, device=indices.device)
    positions = torch.searchsorted(indices, edges)
    return (positions[1:] - positions[:-1]).to(device="cpu", dtype=torch.int32)


def pack_rows(
    values: torch.Tensor, indices: torch.Tensor, index_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(k, w)`` uint8 rows ``[index as index_dtype | value]``; ``out`` reused when given."""
    k, index_size, value_size = values.numel(), index_dtype.itemsize, values.dtype.itemsize
    width = index_size + value_size
    if out is None or out.shape != (k, width):
        out = torch.empty(k, width, dtype=torch.uint8, device=values.device)
    out[:, :index_size].copy_(indices.to(index_dtype).view(torch.uint8).view(k, index_size))
    out[:, index_size:].copy_(values.contiguous().view(torch.uint8).view(k, value_size))
    return out


def unpack_rows(
    rows: torch.Tensor, value_dtype: torch.dtype, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows`` undone: (values, indices as int64), both 1-D, each copied once into
    fresh (so aligned) memory whatever the number of rows."""
    index_size, value_size = index_dtype.itemsize, value_dtype.itemsize
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != index_size + value_size:
        raise ValueError(
            f"rows of {index_size + value_size} bytes expected, got {tuple(rows.shape)} "
            f"{rows.dtype}: ranks disagree on the value dtype"
        )

    def column(start: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(rows.shape[0], size, dtype=torch.uint8, device=rows.device)
        out.copy_(rows[:, start : start + size])
        return out.view(dtype).view(-1)

    return column(index_size, value_size, value_dtype), column(0, index_size, index_dtype).to(torch.int64)


def reduce_region(
    values: torch.Tensor, indices: torch.Tensor, counts: list[int], start: int, size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``S_r``: the region's dense sum of what every rank sent, rank by rank (``counts``
    entries each, in rank order; each rank's indices are distinct, so the order of
    additions is fixed on every device). On the CPU one ``index_add_`` over all of them
    adds in that order by itself (whatever P); elsewhere, where it may add concurrently,
    one per rank. ValueError for an index outside the region."""
    region = torch.zeros(size, dtype=dtype, device=values.device)
    local = indices - start
    if local.numel() and bool(((local < 0) | (local >= size)).any()):
        raise ValueError("an entry lies outside this rank's region: ranks disagree on the regions")
    if values.device.type == "cpu":
        return region.index_add_(0, local, values.to(dtype))
    offset = 0
    for count in counts:
        if count:
            region.index_add_(0, local[offset : offset + count], values[offset : offset + count].to(dtype))
        offset += count
    return region


def traffic(
    sent_counts: list[int], received_counts: list[int], kept: list[int], rank: int, row_bytes: int, summary_rows: int
) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` for one bucket: its alltoall rows to and
    from other ranks, then its own gathered rows (kept entries and ``summary_rows``) to
    the P-1 others and theirs to it."""
    others = [r for r in range(len(kept)) if r != rank]
    gathered = [n + summary_rows for n in kept]
    sent = sum(sent_counts[r] for r in others) + len(others) * gathered[rank]
    received = sum(received_counts[r] for r in others) + sum(gathered[r] for r in others)
    return sent * row_bytes, received * row_bytes
