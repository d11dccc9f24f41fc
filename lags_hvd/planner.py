"""Planning from measured times: each unit's k (``plan_densities``) and which parameters
share a bucket (``plan_buckets``). Pure functions: no communication, no clock.

The model. Backprop makes unit i's gradient ready at ``ready_i``; selecting its
entries takes ``select_i``; exchanges run one after another on the link, in the
order gradients become ready::

    start_i = max(ready_i + select_i, end_{i-1})
    end_i   = start_i + cost_i
    cost_i  = allgather(message_bytes(k_i))    sparse, k_i < d_i
            = allreduce(d_i * value_bytes)     dense,  k_i = d_i

with ``allgather`` and ``allreduce`` the measured costs (``CostModel``: through the
profile's samples, ``alpha + beta * bytes`` beyond them).

The plan. ``budget`` is when the exchanges would end with every unit at
``min_density`` (or when backprop ends, if later), plus ``slack`` times the
span of backprop. Walking the units in ready order, each gets the largest k
whose exchange fits in the idle time of the link before the next *large* unit's
exchange could start (the last: before ``budget``), less the min-density time of
the small units (at most ``SMALL_UNIT_BYTES``, biases and norms) ready in
between, never below ``min_density``. So a convolution is not cut short by the
BatchNorm parameters that become ready right after it. Small units take no
window: min density, or dense where an allreduce costs no more (which only
becomes more likely as bandwidth grows). A unit goes dense when its allreduce
fits its window or costs no more than its sparse exchange. Enlarging a
unit only fills idle time, so no large unit's exchange starts later than in the
min-density schedule and the last one ends by ``budget``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .density import check_density, k_for_density
from .layout import merge_small_runs
from .regions import global_k
from .sparse import message_bytes

__all__ = [
    "CostModel",
    "NetworkModel",
    "UnitProfile",
    "UnitPlan",
    "plan_densities",
    "simulate",
    "EngineCosts",
    "ParamProfile",
    "fit_engine_costs",
    "predict_iteration",
    "plan_buckets",
]


@dataclass(frozen=True)
class CostModel:
    """Time of one collective of ``nbytes`` bytes.

    Without ``points``: ``alpha + beta * nbytes``. With ``points``, the measured
    ``(bytes, seconds)`` of a profile in increasing bytes and non-decreasing seconds
    (``profiling.fit_cost_model`` makes them so), the cost is their piecewise-linear
    interpolation: the first point's time below it (latency dominates there) and
    ``beta`` per byte past the last. Real links have knees no single line follows
    (eager and rendezvous protocols, a token bucket's burst): a fit dominated by the
    large messages can price the small ones a sparse bucket sends at no latency at
    all, and then no bucket merge ever looks worth its start-up cost.
    """

    alpha: float
    beta: float
    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and math.isfinite(self.beta)) or self.alpha < 0 or self.beta < 0:
            raise ValueError(f"cost model needs finite alpha, beta >= 0, got {self.alpha}, {self.beta}")
        points = tuple((float(b), float(t)) for b, t in self.points)
        if not all(math.isfinite(b) and math.isfinite(t) and b >= 0 and t >= 0 for b, t in points) or any(
            b1 <= b0 or t1 < t0 for (b0, t0), (b1, t1) in zip(points, points[1:])
        ):
            raise ValueError(
                "cost model points need finite bytes >= 0 increasing and seconds >= 0 "
                f"non-decreasing, got {self.points}"
            )
        object.__setattr__(self, "points", points)

    def __call__(self, nbytes: float) -> float:
        if not self.points:
            return self.alpha + self.beta * nbytes
        (b0, t0), (b_last, t_last) = self.points[0], self.points[-1]
        if nbytes <= b0:
            return t0
        if nbytes >= b_last:
            return t_last + self.beta * (nbytes - b_last)
        for (b0, t0), (b1, t1) in zip(self.points, self.points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        raise AssertionError("unreachable: nbytes lies between the first and last points")

    def max_bytes(self, seconds: float) -> float:
        """Largest message that fits in ``seconds`` (-1 when none does, inf when bytes are free)."""
        if not self.points:
            if seconds < self.alpha:
                return -1.0
            return math.inf if self.beta == 0 else (seconds - self.alpha) / self.beta
        if seconds < self.points[0][1]:
            return -1.0
        for (b0, t0), (b1, t1) in zip(self.points, self.points[1:]):
            if seconds < t1:  # t0 <= seconds < t1 on this segment
                return b0 + (b1 - b0) * (seconds - t0) / (t1 - t0)
        b_last, t_last = self.points[-1]
        return math.inf if self.beta == 0 else b_last + (seconds - t_last) / self.beta


@dataclass(frozen=True)
class NetworkModel:
    """The cluster's collectives for ``world_size`` workers.

    ``allgather`` is a function of the bytes each rank contributes; ``allreduce``
    of the tensor's bytes. ``aggregation`` and ``owner_keep``: how sparse units
    combine (the options of those names; ``_sparse_cost``), not part of the saved profile.
    """

    world_size: int
    allgather: CostModel
    allreduce: CostModel
    aggregation: str = "allgather"
    owner_keep: float = 1.0

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "allgather": asdict(self.allgather), "allreduce": asdict(self.allreduce)}

    @classmethod
    def from_dict(cls, data: dict, world_size: int | None = None) -> NetworkModel:
        """Validate and build; ``world_size`` given: the model must be for that many workers."""

        def cost(kind: str) -> CostModel:  # points: optional (profiles written before them have none)
            entry = data[kind]
            return CostModel(
                float(entry["alpha"]),
                float(entry["beta"]),
                tuple((float(b), float(t)) for b, t in entry.get("points", ())),
            )

        try:
            model = cls(int(data["world_size"]), cost("allgather"), cost("allreduce"))
        except (KeyError, TypeError) as missing:
            raise ValueError(
                f"network profile lacks a field: {missing}; expected world_size and "
                "allgather/allreduce with alpha and beta (and optionally points)"
            ) from None
        if world_size is not None and model.world_size != world_size:
            raise ValueError(
                f"network profile was measured with {model.world_size} workers, this job "
                f"has {world_size}: measure it again (python -m lags_hvd.experiments.netprofile)"
            )
        return model


@dataclass(frozen=True)
class UnitProfile:
    """One exchange unit as measured: seconds since the first gradient of the iteration."""

    name: str
    numel: int
    ready: float
    select: float
    value_bytes: int = 4
    index_bytes: int = 4


@dataclass(frozen=True)
class UnitPlan:
    name: str
    numel: int
    ready: float
    density: float
    k: int
    dense: bool
    start: float  # predicted start and end of the exchange
    end: float


def _sparse_cost(unit: UnitProfile, k: int, network: NetworkModel) -> float:
    """A sparse unit's exchange. allgather: one message of k entries from every worker.
    reduce_scatter (``regions``): an alltoall of the k rows, of which (P-1)/P leave each
    worker, as many bytes as an allgather of k rows / P, then an allgather of each owner's
    share of K (``regions.global_k``, R = min(P, K) owners). The profile measures
    allgathers only, so the alltoall is costed as that allgather; both phases are
    counted as one exchange."""
    if network.aggregation == "reduce_scatter":
        row, world = unit.value_bytes + unit.index_bytes, network.world_size
        kept = global_k(k, unit.numel, network.owner_keep)
        return network.allgather(k * row / world) + network.allgather(math.ceil(kept / min(world, kept)) * row)
    return network.allgather(message_bytes(k, unit.value_bytes, unit.index_bytes))


def _dense_cost(unit: UnitProfile, network: NetworkModel) -> float:
    return network.allreduce(unit.numel * unit.value_bytes)


SMALL_UNIT_BYTES = 64 * 1024  # biases, norms: their exchanges do not end a larger unit's window
_TOLERANCE = 1e-12  # seconds: far below any real time, above the rounding of timestamps


def _fits(cost: float, window: float) -> bool:
    return cost <= window + _TOLERANCE


def _largest_k(unit: UnitProfile, window: float, k_min: int, k_max: int, network: NetworkModel) -> int:
    """Largest k in [k_min, k_max] whose sparse exchange fits ``window`` (k_min if none)."""
    per_entry = unit.value_bytes + unit.index_bytes
    room = network.allgather.max_bytes(window + _TOLERANCE)
    k = math.floor(min(room / per_entry, k_max)) if window > 0 else 0
    while k > k_min and not _fits(_sparse_cost(unit, k, network), window):  # padding to 8 bytes
        k -= 1
    return max(k, k_min)


def _choose(unit, window, min_density, max_density, network) -> tuple[int, float]:
    """(k, cost) of the unit for an idle window of the link."""
    k_min = k_for_density(min_density, unit.numel)
    k_max = k_for_density(max_density, unit.numel)
    k = _largest_k(unit, window, k_min, min(k_max, unit.numel - 1), network) if unit.numel > 1 else 1
    sparse = _sparse_cost(unit, k, network)
    if k_max == unit.numel:
        dense = _dense_cost(unit, network)
        if _fits(dense, window) or dense <= sparse or k_min == unit.numel:
            return unit.numel, dense
    return k, sparse


def link_schedule(events, link_free: float = -math.inf) -> list[tuple[float, float]]:
    """Exchanges on one link, one after another in the given order: ``events`` are
    (ready time, duration); each starts when it is ready and the link is free::

        start_i = max(ready_i, end_{i-1})        end_i = start_i + duration_i

    Returns (start, end) of each; ``link_free`` is when the link becomes free."""
    schedule = []
    for ready, duration in events:
        start = max(ready, link_free)
        link_free = start + duration
        schedule.append((start, link_free))
    return schedule


def exchange_cost(unit: UnitProfile, k: int, network: NetworkModel) -> float:
    """Seconds of ``unit``'s exchange at ``k``: a dense allreduce when ``k == numel``."""
    return _dense_cost(unit, network) if k == unit.numel else _sparse_cost(unit, k, network)


def simulate(units: list[UnitProfile], ks: dict[str, int], network: NetworkModel) -> list[tuple[float, float]]:
    """Predicted (start, end) of each unit's exchange, units in ready order."""
    return link_schedule((unit.ready + unit.select, exchange_cost(unit, ks[unit.name], network)) for unit in units)


def plan_densities(
    units: list[UnitProfile],
    network: NetworkModel,
    min_density: float = 0.001,
    max_density: float = 1.0,
    slack: float = 0.02,
) -> list[UnitPlan]:
    """Per-unit densities for the measured ``units`` (any order); returned in ready order."""
    if check_density(min_density, "min_density") > check_density(max_density, "max_density"):
        raise ValueError(f"need min_density <= max_density, got {min_density}, {max_density}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    if not units:
        return []
    units = sorted(units, key=lambda u: (u.ready + u.select, u.name))
    floor = {u.name: _choose(u, 0.0, min_density, min_density, network)[0] for u in units}
    backprop_end = max(u.ready + u.select for u in units)
    backprop_span = backprop_end - min(u.ready for u in units)
    budget = max(backprop_end, simulate(units, floor, network)[-1][1]) + slack * backprop_span

    floor_cost = [_choose(u, 0.0, min_density, min_density, network)[1] for u in units]
    plans, link_free = [], -math.inf
    for i, unit in enumerate(units):
        start = max(unit.ready + unit.select, link_free)
        # small units take no window: min density, or dense where an allreduce is no dearer
        window = 0.0 if _is_small(unit) else _window_end(units, i, floor_cost, budget) - start
        k, cost = _choose(unit, window, min_density, max_density, network)
        link_free = start + cost
        plans.append(UnitPlan(unit.name, unit.numel, unit.ready, k / unit.numel, k, k == unit.numel, start, link_free))
    return plans


def _is_small(unit: UnitProfile) -> bool:
    return unit.numel * unit.value_bytes <= SMALL_UNIT_BYTES


def _window_end(units: list[UnitProfile], i: int, floor_cost: list[float], budget: float) -> float:
    """When a large unit i's exchange must end: when the next large unit's exchange could
    start (the budget after the last one), less the min-density time of the small
    units in between, which then still fit before it."""
    reserved = 0.0
    for j in range(i + 1, len(units)):
        if not _is_small(units[j]):
            return units[j].ready + units[j].select - reserved
        reserved += floor_cost[j]
    return budget - reserved


# ---------------------------------------------------------------------- bucket planning
@dataclass(frozen=True)
class EngineCosts:
    """CPU time the optimizer spends per bucket, measured on this machine.

    ``fixed + per_element * numel`` inside the backward hook (on backprop's own
    thread, so it delays every later gradient), and ``merge`` per bucket in
    ``synchronize()`` (after backprop, before the step): finishing each bucket's
    exchange and copying the dense ones. The merges done once per arena and the one
    finiteness read cost the same for any bucketing and are left out.
    """

    fixed: float
    per_element: float
    merge: float = 0.0

    def __post_init__(self):
        if min(self.fixed, self.per_element, self.merge) < 0 or not all(
            math.isfinite(v) for v in (self.fixed, self.per_element, self.merge)
        ):
            raise ValueError(f"engine costs must be finite and >= 0, got {self}")


@dataclass(frozen=True)
class ParamProfile:
    """One parameter as measured: when its gradient is ready (seconds since the first one
    of the iteration), its size, the density it is sent at, and ``kind``: parameters of
    different kinds (param group, density) are never merged."""

    name: str
    numel: int
    ready: float
    density: float
    kind: tuple = ()
    value_bytes: int = 4
    index_bytes: int = 4


def fit_engine_costs(samples: list[tuple[int, float]], merge: float) -> EngineCosts:
    """``fixed + per_element * numel`` fitted to (entries, hook seconds) of measured buckets
    (least squares; each coefficient at least 0)."""
    numels = np.array([n for n, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    if len(samples) < 2 or np.ptp(numels) == 0:
        return EngineCosts(float(max(seconds.mean(), 0.0)) if len(samples) else 0.0, 0.0, max(merge, 0.0))
    slope, intercept = np.polyfit(numels, seconds, 1)
    slope = max(float(slope), 0.0)
    if intercept < 0:
        intercept = 0.0
    return EngineCosts(float(intercept), slope, max(merge, 0.0))


def predict_iteration(
    params: list[ParamProfile], buckets: list[list[int]], network: NetworkModel, costs: EngineCosts
) -> float:
    """Predicted seconds from the first gradient to the end of ``synchronize()``.

    ``buckets``: positions in ``params`` (which is in ready order), any positions each.
    A bucket launches when its last gradient is ready plus the hook time of every
    bucket launched so far (hooks run on backprop's thread); exchanges then run one
    after another on the link (``simulate``'s model)::

        launch_b = ready_last(b) + sum_{b' <= b} (fixed + per_element * n_b')
        end_b    = max(launch_b, end_{b-1}) + cost(k_b)
        T        = max(end of backprop + all hooks, end_last) + merge * buckets
    """
    hooks, events = 0.0, []
    for bucket in sorted(buckets, key=lambda b: max(params[i].ready for i in b)):
        members = [params[i] for i in bucket]
        numel = sum(p.numel for p in members)
        hooks += costs.fixed + costs.per_element * numel
        unit = UnitProfile(
            "", numel, max(p.ready for p in members), 0.0, members[0].value_bytes, members[0].index_bytes
        )
        events.append((unit.ready + hooks, exchange_cost(unit, k_for_density(members[0].density, numel), network)))
    backprop_end = max(p.ready for p in params) + hooks
    return max(backprop_end, link_schedule(events)[-1][1]) + costs.merge * len(buckets)


def plan_buckets(
    params: list[ParamProfile], network: NetworkModel, costs: EngineCosts
) -> tuple[list[list[str]], dict[str, float]]:
    """Buckets that minimise ``predict_iteration``.

    Parameters of different ``kind`` never share a bucket, but a bucket need not be a
    contiguous run of the ready order: with biases and norms sent dense, the sparse
    weights between them may still form one bucket (the arena lays out any bucket
    contiguously). Candidates: one bucket per parameter (the paper's layer-wise
    exchange), one bucket per kind (TopK-SGD), each kind's parameters merged in ready
    order up to a size (every power of two from 2**8 to the model's size, as the
    authors' merging rule with its threshold chosen), or while their gradients arrive
    within a time window of the run's first (every window from 1 us doubling to
    backprop's span: gradients that arrive together share one start-up cost), and the
    optimum over every cut of the ready order into segments, each segment one bucket
    per kind it holds (``_optimal_segments``, exact up to ``MAX_ATOMS`` parameters).
    Among equally good candidates the earlier in this list wins, so per-layer is kept
    unless merging is predicted to help.

    Returns the buckets as lists of parameter names, and the predicted time of the
    named candidates (``layer``, ``single``, ``optimal`` and ``chosen``).
    """
    if not params:
        return [], {}
    params = sorted(params, key=lambda p: (p.ready, p.name))
    candidates = [("layer", [[i] for i in range(len(params))]), ("single", _runs(params, lambda run, i: True))]
    total = sum(p.numel for p in params)
    size = 256
    while size < 2 * total:
        candidates.append(
            (
                f"merge {size}",
                _runs(params, lambda run, i, s=size: sum(params[j].numel for j in run) < s and params[i].numel < s),
            )
        )
        size *= 2
    span = params[-1].ready - params[0].ready
    window = 1e-6
    while window < 2 * span:
        candidates.append(
            (f"window {window:g}", _runs(params, lambda run, i, w=window: params[i].ready - params[run[0]].ready <= w))
        )
        window *= 2
    optimal = _optimal_segments(params, network, costs)
    if optimal is not None:
        candidates.append(("optimal", optimal))
    predicted = [
        (predict_iteration(params, buckets, network, costs), n, name, buckets)
        for n, (name, buckets) in enumerate(candidates)
    ]
    best = min(predicted, key=lambda item: (item[0], item[1]))
    times = {name: t for t, _, name, _ in predicted if name in ("layer", "single", "optimal")}
    times["chosen"] = best[0]
    return [[params[i].name for i in bucket] for bucket in best[3]], times


MAX_ATOMS = 512  # parameters the exact search takes one by one; more are first merged into runs
MAX_SEGMENT_KINDS = 4  # kinds one segment of the exact search may hold (one bucket each)


def segment_buckets(params: list[ParamProfile], segment: list[int]) -> list[list[int]]:
    """A segment (positions in ready order) as one bucket per kind, in the order the
    buckets launch (by their last member)."""
    by_kind: dict[tuple, list[int]] = {}
    for i in segment:
        by_kind.setdefault(params[i].kind, []).append(i)
    return sorted(by_kind.values(), key=lambda bucket: bucket[-1])


def _segment_tables(params: list[ParamProfile], atoms: list[list[int]], width: int, network: NetworkModel):
    """For every segment j..i of ``atoms``: its r-th bucket's last ready time, entries and
    exchange cost (each ``(width, n, n)``) and how many kinds it holds (> ``width``: none)."""
    n = len(atoms)
    last_ready = np.full((width, n, n), math.inf)
    numel = np.zeros((width, n, n))
    cost = np.zeros((width, n, n))
    held = np.full((n, n), width + 1, dtype=int)  # > width: not a segment (j > i or too many kinds)
    for j in range(n):
        open_buckets: dict[tuple, tuple] = {}  # kind -> (last position, entries, cost)
        for i in range(j, n):
            grown: dict[tuple, list] = {}
            for position in atoms[i]:
                grown.setdefault(params[position].kind, []).append(position)
            for kind, positions in sorted(grown.items(), key=lambda item: item[1][-1]):
                entries = open_buckets.pop(kind, (0, 0, 0.0))[1] + sum(params[q].numel for q in positions)
                first = params[positions[0]]
                unit = UnitProfile("", entries, 0.0, 0.0, first.value_bytes, first.index_bytes)
                open_buckets[kind] = (
                    positions[-1],
                    entries,  # re-inserted: now the last to launch
                    exchange_cost(unit, k_for_density(first.density, entries), network),
                )
            if len(open_buckets) > width:
                break
            held[j, i] = len(open_buckets)
            for r, (position, entries, seconds) in enumerate(open_buckets.values()):
                last_ready[r, j, i], numel[r, j, i], cost[r, j, i] = params[position].ready, entries, seconds
    return last_ready, numel, cost, held


def _optimal_segments(params: list[ParamProfile], network: NetworkModel, costs: EngineCosts) -> list[list[int]] | None:
    """The cut of the ready order into segments, each one bucket per kind it holds (at most
    ``MAX_SEGMENT_KINDS``, ``segment_buckets``), that minimises ``predict_iteration`` (DP).

    With b buckets launched so far over positions 0..j-1, the hooks have cost
    ``b fixed + per_element N_j`` (N_j: entries before j), whatever the cuts. A segment
    j..i holding m kinds adds m buckets launched in the order of their last members
    ``l_1 < ... < l_m = i``, each when that gradient is ready and its hook has run::

        launch_r = ready(l_r) + (b + r) fixed + per_element (N_j + n_1 + ... + n_r)
        free_r   = max(launch_r, free_{r-1}) + cost(bucket r),   free_0 = E(j, b)
        E(i+1, b+m) = min over j of free_m
        T        = min_b max(ready_last + b fixed + per_element N, E(last, b)) + b merge

    (a later exchange never starts earlier when the link is free earlier, so keeping
    the least E per (position, b) loses no plan). O(n^2) exchange costs and O(n^2) numpy
    steps per b; beyond ``MAX_ATOMS`` parameters the search runs over runs of consecutive
    small parameters (``layout.merge_small_runs`` at the least size leaving at most that
    many), exact over cuts between them. None when no segment plan exists (an atom
    holds more kinds than a segment may).
    """
    atoms, size = [[i] for i in range(len(params))], 256
    while len(atoms) > MAX_ATOMS:
        atoms, size = merge_small_runs([p.numel for p in params], size), 2 * size
    n, width = len(atoms), min(MAX_SEGMENT_KINDS, len({p.kind for p in params}))
    before = np.concatenate([[0.0], np.cumsum([sum(params[i].numel for i in atom) for atom in atoms])])
    last_ready, numel, cost, held = _segment_tables(params, atoms, width, network)
    ready_last, hooks_all = params[-1].ready, costs.per_element * before[-1]
    most = width * n
    free = np.full((most + 1, n + 1), math.inf)  # free[b, i]: link free, b buckets over atoms 0..i-1
    free[0, 0] = -math.inf
    cut = np.zeros((most + 1, n + 1), dtype=int)
    starts = np.arange(n)[:, None]
    best, best_b = math.inf, 0
    for b in range(1, most + 1):
        if ready_last + b * (costs.fixed + costs.merge) + hooks_all >= best:  # every later b costs at least this
            break
        prior = b - held  # buckets before the segment
        valid = (held <= width) & (prior >= 0)
        link = np.where(valid, free[np.clip(prior, 0, most), starts], math.inf)
        hooks = np.clip(prior, 0, None) * costs.fixed + costs.per_element * before[:-1, None]
        for r in range(width):
            in_segment = valid & (r < held)
            hooks = hooks + np.where(in_segment, costs.fixed + costs.per_element * numel[r], 0.0)
            link = np.where(in_segment, np.maximum(last_ready[r] + hooks, link) + cost[r], link)
        link = np.where(valid, link, math.inf)
        j = np.argmin(link, axis=0)
        free[b, 1:], cut[b, 1:] = link[j, np.arange(n)], j
        end = max(ready_last + b * costs.fixed + hooks_all, free[b, n]) + b * costs.merge
        if end < best:
            best, best_b = end, b
    if not math.isfinite(best):
        return None
    buckets, i, b = [], n, best_b
    while b > 0:
        j = int(cut[b, i])
        segment = [position for atom in atoms[j:i] for position in atom]
        buckets = segment_buckets(params, segment) + buckets
        b, i = b - int(held[j, i - 1]), j
    return buckets


def _runs(params: list[ParamProfile], joins) -> list[list[int]]:
    """Each kind's positions, in ready order, cut into runs: position i joins the open run
    of its kind when ``joins(run, i)``, else opens the next one."""
    runs, open_runs = [], {}
    for i, p in enumerate(params):
        run = open_runs.get(p.kind)
        if run is not None and joins(run, i):
            run.append(i)
        else:
            open_runs[p.kind] = run = [i]
            runs.append(run)
    return runs
