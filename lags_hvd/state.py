"""``LAGSState``: what LAGS-SGD carries from one iteration to the next, and its checkpoint format.

Besides the wrapped optimizer's own state: the exchange units (buckets) and their
layout, k per unit (planned, and in force after the density warm-up and the
``dense_params`` policy), this rank's residuals and rule memories, the iteration and
the learning rate of the last exchanges. ``state_dict()`` / ``prepare_load()`` are
the format under the optimizer state's ``'lags'`` key: residuals and rule memories
one tensor per parameter, k per unit, the buckets as lists of parameter names,
and the iteration; the optimizer adds the world size and rank.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .agreement import k_digest
from .arena import ArenaLayout
from .checks import check_count, is_count
from .density import average_density, k_for_density, warmup_density
from .layout import ExchangeUnit
from .residual import ResidualMemory
from .sparse import unit_message_bytes

__all__ = ["LAGSState"]


@dataclass
class LAGSState:
    """What LAGS-SGD carries from one iteration to the next, besides the wrapped optimizer's state.

    Attributes:
        units: the exchange units, in name order (identical on every rank).
        layout: where each unit lives in the flat buffers (``arena``).
        k: entries each unit sends per worker; ``k == numel`` means a dense allreduce.
        residuals: this rank's error-feedback memory (``eps``), one buffer per sparse unit.
        exchange_lr: per unit, the learning rate of its last exchange (only tracked with
            ``lr_scaled_residual``).
        iteration: number of completed synchronizations.
        k_digest: a digest of every unit's k, for the per-iteration step check.
        planned_k: k per unit as planned (fixed densities or the adaptive plan), before
            the density warm-up and the ``dense_params`` policy raise it to ``k``.
        rule_memories: the update rule's own per-unit memories by name (``lags_hvd.updates``:
            DGC's ``velocities``, Adam's ``exp_avg`` and ``exp_avg_sq``; this rank's).
        masked: those of ``rule_memories`` whose sent entries are cleared with the residual's.
        replicated: those of ``rule_memories`` every rank holds alike for a unit sent whole
            (``UpdateRule.replicated``).
        updates: steps applied (iterations committed; Adam's step count).
        regions: ``aggregation="reduce_scatter"``: each sparse unit's region boundaries
            (P + 1 entry offsets, ``lags_hvd.regions``), identical on every rank; a unit
            without an entry uses equal regions.
    """

    units: list[ExchangeUnit]
    layout: ArenaLayout
    k: dict[str, int] = field(default_factory=dict)
    residuals: ResidualMemory = field(init=False)
    exchange_lr: dict[str, float] = field(default_factory=dict)
    iteration: int = 0
    k_digest: int = 0
    planned_k: dict[str, int] = field(default_factory=dict)
    rule_memories: dict[str, ResidualMemory] = field(default_factory=dict)
    masked: frozenset = frozenset()
    replicated: frozenset = frozenset()
    updates: int = 0
    regions: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.residuals = ResidualMemory(self.layout)

    def is_dense(self, unit: ExchangeUnit) -> bool:
        return self.k[unit.name] == unit.numel

    warmup_iterations: int = 0  # density warm-up (lags_hvd.density); 0: none
    warmup_start: float = 0.25
    dense_units: frozenset = frozenset()  # units always sent whole (the dense_params policy)

    @property
    def velocities(self) -> ResidualMemory | None:
        """DGC's velocities under momentum correction, else None."""
        return self.rule_memories.get("velocities")

    def memories(self) -> list[ResidualMemory]:
        return [self.residuals, *self.rule_memories.values()]

    def masked_memories(self) -> list[ResidualMemory]:
        """The memories whose sent entries are cleared: the residuals and the ``masked`` ones."""
        return [self.residuals, *(m for name, m in self.rule_memories.items() if name in self.masked)]

    def replicated_memories(self) -> list[tuple[str, torch.Tensor]]:
        """The rule memories every rank holds alike (``replicated``, of the units sent whole at
        the k in force), as ``(name, flat view)`` pairs in a fixed order."""
        return [
            (f"{name}.{unit.name}", self.rule_memories[name].residual(unit.name))
            for name in sorted(self.replicated)
            for unit in self.units
            if self.is_dense(unit)
        ]

    def commit(self) -> None:
        """Make this iteration's staged residuals (and rule memories) current: a step applied."""
        for memory in self.memories():
            memory.commit()
        self.updates += 1

    def discard(self) -> None:
        """Drop this iteration's staged residuals (and rule memories): a skipped step."""
        for memory in self.memories():
            memory.discard()

    def set_plan(self, k: dict[str, int]) -> None:
        """Set every unit's planned k and bring the k in force up to date (``apply_schedule``).
        Units planned sparse get a residual (once), whatever the warm-up sends now; units the
        ``dense_params`` policy sends whole never do."""
        self.planned_k = self._checked_k(k)
        for unit in self.units:
            if (
                self.planned_k[unit.name] < unit.numel
                and unit.name not in self.residuals
                and unit.name not in self.dense_units
            ):
                self.residuals.register(unit.name)
        self.apply_schedule()

    def apply_schedule(self) -> None:
        """k in force at ``iteration``: the plan, raised by the density warm-up while it lasts,
        and every ``dense_units`` unit whole."""
        k = {}
        for unit in self.units:
            planned = self.planned_k[unit.name]
            if unit.name in self.dense_units:
                planned = unit.numel
            elif planned < unit.numel and self.iteration < self.warmup_iterations:
                density = warmup_density(
                    self.iteration, planned / unit.numel, self.warmup_start, self.warmup_iterations
                )
                planned = max(planned, k_for_density(density, unit.numel))
            k[unit.name] = planned
        if k != self.k:
            self.set_k(k)

    def set_k(self, k: dict[str, int]) -> None:
        """Set the k in force of every unit; allocate residuals for units that become sparse."""
        k = self._checked_k(k)
        for unit in self.units:
            self.k[unit.name] = k[unit.name]
            if k[unit.name] < unit.numel and unit.name not in self.residuals:
                self.residuals.register(unit.name)
        self.k_digest = k_digest(self.k)

    @property
    def plan_digest(self) -> int:
        """``k_digest`` combined with the region boundaries: what the step check compares."""
        if not self.regions:
            return self.k_digest
        flat = [b for name in sorted(self.regions) for b in self.regions[name]]
        return self.k_digest ^ (zlib.crc32(array("q", flat).tobytes()) & 0x7FFFFFFF)

    def _checked_regions(self, regions, world: int) -> dict[str, list[int]]:
        """Saved boundaries, validated (ValueError for anything but lists of ``world`` + 1
        non-decreasing integers from 0); those of units this bucketing does not have, or
        of another size, are dropped: regions only balance the load, and a unit without
        starts from equal ones."""
        if not isinstance(regions, dict) or not all(
            isinstance(b, list)
            and len(b) == world + 1
            and b[0] == 0
            and all(is_count(x) for x in b)
            and all(x <= y for x, y in zip(b, b[1:]))
            for b in regions.values()
        ):
            raise ValueError(f"the optimizer state's 'lags' regions do not fit these units and {world} ranks")
        return self.regions_of_these_units(regions)

    def regions_of_these_units(self, regions: dict[str, list[int]]) -> dict[str, list[int]]:
        """The boundaries in ``regions`` of units this state has, at their size (copies)."""
        numel = {u.name: u.numel for u in self.units}
        return {name: list(b) for name, b in regions.items() if numel.get(name) == b[-1]}

    def _checked_k(self, k) -> dict[str, int]:
        units = {u.name: u for u in self.units}
        if (
            not isinstance(k, dict)
            or set(k) != set(units)
            or any(not is_count(v) or not 1 <= v <= units[n].numel for n, v in k.items())
        ):
            if not isinstance(k, dict):
                raise ValueError(f"k must be a {{unit: k}} dict, got {type(k).__name__}")
            missing, unknown = sorted(set(units) - set(k)), sorted(set(k) - set(units))
            wrong = [
                f"{n}={v!r} (numel {units[n].numel})"
                for n, v in sorted(k.items())
                if n in units and (not is_count(v) or not 1 <= v <= units[n].numel)
            ]
            raise ValueError(
                "k must give every unit an integer in [1, numel]: "
                + "; ".join(
                    f"{what} {', '.join(names[:5])}"
                    for what, names in (("out of range:", wrong), ("no k for", missing), ("not a unit:", unknown))
                    if names
                )
            )
        return {name: int(value) for name, value in k.items()}

    def state_dict(self) -> dict:
        state = {"residuals": self.residuals.state_dict(), **self.shared_state()}
        for name, memory in self.rule_memories.items():
            state[name] = memory.state_dict()
        return state

    def shared_state(self) -> dict:
        """What every rank must hold alike (residuals and rule memories are per rank: not part of it)."""
        return {
            "k": dict(self.k),
            "planned_k": dict(self.planned_k),
            "exchange_lr": dict(self.exchange_lr),
            "iteration": self.iteration,
            "updates": self.updates,
            "buckets": self.buckets(),
            "regions": {name: list(b) for name, b in self.regions.items()},
        }

    def average_density(self) -> float:
        """Entries sent over entries in the model, at the k in force."""
        return average_density([self.k[u.name] for u in self.units], [u.numel for u in self.units])

    def bytes_per_worker(self) -> int:
        """Bytes this worker contributes to the collectives per iteration at the k in force."""
        return sum(unit_message_bytes(self.k[u.name], u.numel, u.dtype.itemsize) for u in self.units)

    def buckets(self) -> list[list[str]]:
        """The parameter names of every unit, in unit order."""
        return [list(unit.param_names) for unit in self.units]

    def prepare_load(self, saved, *, adopt_k: bool, reset_residuals: bool, world: int) -> Callable[[], None]:
        """Check ``saved`` completely and return the function that loads it: nothing changes
        unless every part fits (k, residual and velocity names, shapes and dtypes, counters).

        ``adopt_k``: take the saved plan (the adaptive plan in force when saved).
        ``reset_residuals``: the saved residuals and rule memories are not this worker's; start
        from zero. Region boundaries saved for another number of ranks (``world``) give
        way to equal regions.
        """
        if not isinstance(saved, dict) or not isinstance(saved.get("residuals"), dict):
            raise ValueError("the optimizer state has no usable 'lags' entry (residuals missing)")
        planned = (
            self._checked_k(saved.get("planned_k", saved["k"])) if adopt_k and "k" in saved else dict(self.planned_k)
        )
        exchange_lr = saved.get("exchange_lr", {})
        iteration = saved.get("iteration", 0)
        updates = saved.get("updates", iteration)  # saved before it was recorded: every step applied
        if not isinstance(exchange_lr, dict) or not all(isinstance(v, (int, float)) for v in exchange_lr.values()):
            raise ValueError("the optimizer state's 'lags' exchange_lr is not a {unit: lr} mapping")
        check_count(iteration, "the optimizer state's 'lags' iteration")
        check_count(updates, "the optimizer state's 'lags' updates")
        regions = saved.get("regions", {})
        if saved.get("world_size", world) != world:
            regions = {}  # boundaries of another number of ranks: equal regions
        regions = self._checked_regions(regions, world)
        if not reset_residuals:
            self._check_saved_memories(saved, planned)

        def load() -> None:
            self.iteration, self.updates = iteration, updates
            self.set_plan(planned)
            if reset_residuals:
                self.residuals.reset()
            else:
                self.residuals.load_state_dict(saved["residuals"])
            for name, memory in self.rule_memories.items():
                if reset_residuals:
                    memory.reset()
                else:
                    memory.load_state_dict(saved[name])
            self.exchange_lr = dict(exchange_lr)
            self.regions = regions

        return load

    def _check_saved_memories(self, saved: dict, planned: dict[str, int]) -> None:
        """ValueError unless ``saved`` holds a residual (and each rule memory) for exactly the
        units sparse under ``planned``, each of this worker's names, shapes and dtypes."""
        sparse = self.residuals.registered | {
            u.name for u in self.units if planned[u.name] < u.numel and u.name not in self.dense_units
        }
        expected = self.residuals.expected_state(sparse)
        whole_here = sorted(
            set(saved["residuals"]) & set(self.residuals.expected_state({u.name for u in self.units})) - set(expected)
        )
        if whole_here:
            raise ValueError(
                f"the checkpoint holds residuals of {whole_here[:5]}, which this optimizer sends whole "
                "(density 1, layer_densities or dense_params): they are updates not yet sent, which it has "
                "nowhere to keep; resume with the densities the checkpoint was saved with"
            )
        ResidualMemory.check_saved(saved["residuals"], expected)
        for name, memory in self.rule_memories.items():
            if name not in saved:
                raise ValueError(
                    f"the optimizer state has no {name}: it was saved without the update rule "
                    "that keeps them, which this optimizer uses"
                )
            memory.check_state_dict(saved[name])

    def adopt(self, shared: dict, world: int) -> None:
        """Take another rank's ``shared_state()``; residuals and rule memories stay this rank's."""
        planned = self._checked_k(shared["planned_k"])
        regions = self._checked_regions(shared.get("regions", {}), world)
        self.iteration = int(shared["iteration"])
        self.updates = int(shared.get("updates", self.iteration))
        self.exchange_lr = dict(shared["exchange_lr"])
        self.regions = regions
        self.set_plan(planned)
