"""Density planning: choose each unit's k from its communication-to-computation ratio.

A pure function of measured times: no communication, no clock.

The model. Backprop makes unit i's gradient ready at ``ready_i``; selecting its
entries takes ``select_i``; exchanges run one after another on the link, in the
order gradients become ready::

    start_i = max(ready_i + select_i, end_{i-1})
    end_i   = start_i + cost_i
    cost_i  = allgather(message_bytes(k_i))    sparse, k_i < d_i
            = allreduce(d_i * value_bytes)     dense,  k_i = d_i

with ``allgather`` and ``allreduce`` fitted as ``alpha + beta * bytes``.

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

from .density import k_for_density
from .sparse import message_bytes

__all__ = ["CostModel", "NetworkModel", "UnitProfile", "UnitPlan", "plan_densities", "simulate"]


@dataclass(frozen=True)
class CostModel:
    """Time of one collective: ``alpha + beta * nbytes`` seconds."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and math.isfinite(self.beta)) or self.alpha < 0 or self.beta < 0:
            raise ValueError(f"cost model needs finite alpha, beta >= 0, got {self.alpha}, {self.beta}")

    def __call__(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    def max_bytes(self, seconds: float) -> float:
        """Largest message that fits in ``seconds`` (inf when bytes are free)."""
        if seconds < self.alpha:
            return -1.0
        return math.inf if self.beta == 0 else (seconds - self.alpha) / self.beta


@dataclass(frozen=True)
class NetworkModel:
    """The cluster's collectives for ``world_size`` workers.

    ``allgather`` is a function of the bytes each rank contributes; ``allreduce``
    of the tensor's bytes.
    """

    world_size: int
    allgather: CostModel
    allreduce: CostModel

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "allgather": asdict(self.allgather),
                "allreduce": asdict(self.allreduce)}

    @classmethod
    def from_dict(cls, data: dict, world_size: int | None = None) -> "NetworkModel":
        """Validate and build; ``world_size`` given: the model must be for that many workers."""
        try:
            model = cls(int(data["world_size"]),
                        CostModel(float(data["allgather"]["alpha"]), float(data["allgather"]["beta"])),
                        CostModel(float(data["allreduce"]["alpha"]), float(data["allreduce"]["beta"])))
        except (KeyError, TypeError) as missing:
            raise ValueError(f"network profile lacks a field: {missing}; expected world_size and "
                             "allgather/allreduce with alpha and beta") from None
        if world_size is not None and model.world_size != world_size:
            raise ValueError(f"network profile was measured with {model.world_size} workers, this job "
                             f"has {world_size}: measure it again (python -m lags_hvd.profile)")
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
    start: float        # predicted start and end of the exchange
    end: float


def _sparse_cost(unit: UnitProfile, k: int, network: NetworkModel) -> float:
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
    while k > k_min and not _fits(_sparse_cost(unit, k, network), window):   # padding to 8 bytes
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


def simulate(units: list[UnitProfile], ks: dict[str, int], network: NetworkModel) -> list[tuple[float, float]]:
    """Predicted (start, end) of each unit's exchange, units in ready order."""
    schedule, link_free = [], -math.inf
    for unit in units:
        k = ks[unit.name]
        cost = _dense_cost(unit, network) if k == unit.numel else _sparse_cost(unit, k, network)
        start = max(unit.ready + unit.select, link_free)
        link_free = start + cost
        schedule.append((start, link_free))
    return schedule


def plan_densities(units: list[UnitProfile], network: NetworkModel, min_density: float = 0.001,
                   max_density: float = 1.0, slack: float = 0.02) -> list[UnitPlan]:
    """Per-unit densities for the measured ``units`` (any order); returned in ready order."""
    if not 0 < min_density <= max_density <= 1:
        raise ValueError(f"need 0 < min_density <= max_density <= 1, got {min_density}, {max_density}")
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
        plans.append(UnitPlan(unit.name, unit.numel, unit.ready, k / unit.numel, k,
                              k == unit.numel, start, link_free))
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
