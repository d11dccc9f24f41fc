"""The loops that adapt the exchange to measurements, densities and buckets, and the
optimizer's side of them (``PlanningLoops``: ask after every step, apply what they decide).

``AutoBuckets`` (``buckets="auto"``) measures ``bucket_warmup`` per-layer
iterations, then rank 0 fits the engine's cost per bucket (hook time against
entries) and plans the buckets once (``planner.plan_buckets``); every rank
applies the broadcast plan in the same ``synchronize()``.

``AdaptiveDensity`` (``density="adaptive"``) is a closed loop: measure, plan,
verify, back off.

The planner's model (exchanges on an alpha-beta link, overlapped with backprop)
is only a model: collectives also cost CPU, message types interleave, links are
shared. So a plan is trusted only once measured:

1. **baseline**: ``measure`` iterations at ``min_density``; their median
   iteration time is the reference, their hook timestamps the profile.
2. **trial**: the plan from that profile is applied; after one settling
   iteration, ``measure`` iterations are timed.
3. The trial's median within ``1 + max_slowdown`` of the baseline: the plan is
   **kept** until ``replan_every`` iterations after the baseline began, then the
   loop starts again from fresh measurements. Otherwise every unit's extra entries
   above ``min_density`` are halved and tried again; after ``max_backoffs`` halvings
   the units stay at ``min_density``.

Every rank must send the same k per unit, so rank 0 of the process set makes
every decision from its own measurements and broadcasts it; all ranks apply it
in the same ``synchronize()``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from . import sparse
from .collectives import Collectives, broadcast_object
from .density import average_density, k_for_density, param_kinds
from .engine import Engine
from .layout import build_units
from .options import LAGSOptions
from .planner import NetworkModel, ParamProfile, UnitPlan, fit_engine_costs, plan_buckets, plan_densities
from .profiling import BackwardTimer, load_network_profile, profile_network, sizes_up_to
from .report import PlanReporter

__all__ = ["AdaptiveDensity", "AutoBuckets", "Decision", "PlanningLoops", "network_from"]

MAX_BACKOFFS = 3


@dataclass(frozen=True)
class Decision:
    """One decision of the density loop, as told to its observers.

    Attributes:
        entry: the ``history`` entry (iteration, event: plan / keep / back off, median and
            baseline iteration seconds, average density).
        plan: the plan in force after it (None: every unit at ``min_density``).
        network: the network model the plan was made for.
        planner: whether this rank made the decision (rank 0 of the process set).
    """

    entry: dict
    plan: list[UnitPlan] | None
    network: NetworkModel | None
    planner: bool


class AdaptiveDensity:
    """Decides every unit's k; ``after_synchronize`` returns a new ``{name: k}`` or None."""

    def __init__(self, options: LAGSOptions, collectives, units, start: int = 0, whole_after_sparse: bool = True):
        self.options = options
        self.whole_after_sparse = whole_after_sparse
        self.collectives = collectives
        self.units = units
        self.network = network_from(options.network_profile, collectives.size, options)
        self.measure = max(1, options.warmup_iterations - 1)
        self.plan: list[UnitPlan] | None = None  # in force (None: min density)
        self.history: list[dict] = []  # decisions, identical on every rank
        self.observers: list[Callable[[Decision], None]] = []  # told of every decision (report.PlanReporter)
        self._floor = None
        self._phase, self._phase_start, self._cycle_start = "baseline", start, start
        self._baseline_s: float | None = None
        self._backoffs = 0

    def set_floor(self, k_min: dict[str, int]) -> None:
        """The k of every unit at ``min_density`` (the floor the loop returns to)."""
        self._floor = dict(k_min)

    # ------------------------------------------------------------------ the loop
    def after_synchronize(self, iteration: int, timer: BackwardTimer) -> dict[str, int] | None:
        """Called after every ``synchronize()`` (``iteration`` completed); collective when it decides."""
        done = iteration - self._phase_start
        if self._phase == "baseline" and done >= self.options.warmup_iterations:
            self.ensure_network()
            self._baseline_s = self._median_iteration(timer)
            self.plan = self._broadcast(self._make_plan(timer) if self._is_planner() else None, iteration)
            self._record(iteration, "plan", self._baseline_s)
            return self._enter("trial", iteration, {p.name: p.k for p in self.plan})
        if self._phase == "trial" and done >= 1 + self.measure:
            trial_s = self._median_iteration(timer)
            keep = trial_s <= self._baseline_s * (1 + self.options.max_slowdown)
            keep = self._broadcast(keep if self._is_planner() else None, iteration)
            self._record(iteration, "keep" if keep else "back off", trial_s)
            if keep:
                return self._enter("steady", iteration, None)
            self._backoffs += 1
            if self._backoffs > MAX_BACKOFFS:
                self.plan = None
                return self._enter("steady", iteration, dict(self._floor))
            self.plan = [self._halve(p) for p in self.plan]
            return self._enter("trial", iteration, {p.name: p.k for p in self.plan})
        if self._phase == "steady" and iteration - self._cycle_start >= self.options.replan_every:
            self.plan, self._backoffs, self._cycle_start = None, 0, iteration
            return self._enter("baseline", iteration, dict(self._floor))
        return None

    @property
    def settled(self) -> bool:
        """True once a plan is kept (or the loop gave up), until the next re-plan."""
        return self._phase == "steady"

    def resume(self, iteration: int) -> None:
        """After a checkpoint restored the k in force: keep it until the next re-plan."""
        self.plan, self._backoffs = None, 0
        self._phase, self._phase_start, self._cycle_start = "steady", iteration, iteration

    def _enter(self, phase: str, iteration: int, k: dict[str, int] | None):
        self._phase, self._phase_start = phase, iteration
        return k

    def _halve(self, p: UnitPlan) -> UnitPlan:
        k = self._floor[p.name] + (p.k - self._floor[p.name]) // 2
        return replace(p, k=k, density=k / p.numel, dense=k == p.numel)

    def _median_iteration(self, timer: BackwardTimer) -> float:
        return statistics.median(list(timer.iteration_seconds)[-self.measure :])

    def _is_planner(self) -> bool:
        return self.collectives.rank == 0

    def _make_plan(self, timer: BackwardTimer) -> list[UnitPlan]:
        """The planner's densities; without ``whole_after_sparse`` (a rule whose memories of a
        unit sent whole are the ranks' shared ones, Adam correction's moments, while a sparse
        unit's are each rank's own) a unit sparse at the floor gets at most all but one entry:
        sent whole it would step with this rank's moments on the merged gradient, and the ranks'
        models would part silently."""
        plan = plan_densities(
            timer.profile(self.units),
            self.network,
            self.options.min_density,
            self.options.max_density,
            self.options.plan_slack,
        )
        if self.whole_after_sparse:
            return plan
        return [
            replace(p, k=p.numel - 1, density=(p.numel - 1) / p.numel, dense=False)
            if p.dense and self._floor[p.name] < p.numel
            else p
            for p in plan
        ]

    def _broadcast(self, value, iteration: int):
        return _from_planner(value, self.collectives, f"lags.adaptive.{iteration}", self.options.exchange_timeout)

    def ensure_network(self) -> None:
        """Measure the network if no profile was given (collective; before the first plan)."""
        if self.network is None:
            self.network = for_aggregation(profile_network(self.collectives)[0], self.options)

    def _record(self, iteration: int, event: str, seconds: float) -> None:
        plan = self.plan
        entry = {
            "iteration": iteration,
            "event": event,
            "median_iteration_s": seconds,
            "baseline_s": self._baseline_s,
            "average_density": average_density([p.k for p in plan], [p.numel for p in plan]) if plan else None,
        }
        self.history.append(entry)
        for observe in self.observers:
            observe(Decision(entry, plan, self.network, self._is_planner()))


class AutoBuckets:
    """``buckets="auto"``: ``after_synchronize`` returns the planned buckets once (lists of
    parameter names), after ``bucket_warmup`` iterations measured once the density
    warm-up is over (so at the k the buckets will send); None otherwise.

    ``kinds``: per parameter name, what must agree for two parameters to share a
    bucket (param group, density); ``densities``: the density each is sent at.
    """

    def __init__(self, options: LAGSOptions, collectives, kinds: dict[str, tuple], densities: dict[str, float]):
        self.options, self.collectives = options, collectives
        self.kinds, self.densities = kinds, densities
        self.network = network_from(options.network_profile, collectives.size, options)
        self.planned = False
        self.history: list[dict] = []

    def after_synchronize(self, iteration: int, timer: BackwardTimer, units) -> list[list[str]] | None:
        if self.planned or iteration < self.options.density_warmup + self.options.bucket_warmup:
            return None
        if self.network is None:  # collective: every rank measures, up to the largest message planned
            sizes = sizes_up_to(largest_message_bytes(units, self.densities))
            self.network = for_aggregation(profile_network(self.collectives, sizes)[0], self.options)
        decision = self._decide(timer, units) if self.collectives.rank == 0 else None
        decision = _from_planner(decision, self.collectives, f"lags.buckets.{iteration}", self.options.exchange_timeout)
        self.planned = True
        self.history.append({"iteration": iteration, **decision})
        return decision["buckets"]

    def _decide(self, timer: BackwardTimer, units) -> dict:
        """Rank 0's plan; a plan that cannot be made (nothing was timed) keeps per-layer
        buckets on every rank rather than failing one of them."""
        if not timer.iterations:
            return {"buckets": None, "reason": "no backward pass was timed"}
        profiles = timer.profile(units)
        spent = timer.last_synchronize  # per bucket: the merge less what it does once per arena or iteration
        costs = fit_engine_costs(
            [(p.numel, p.select) for p in profiles], (spent["merge"] - spent["merge_shared"]) / max(1, len(profiles))
        )
        params = [ParamProfile(p.name, p.numel, p.ready, self.densities[p.name], self.kinds[p.name]) for p in profiles]
        buckets, times = plan_buckets(params, self.network, costs)
        return {"buckets": buckets, "engine_costs": vars(costs), "predicted_s": times}


def largest_message_bytes(units, densities: dict[str, float]) -> int:
    """Bytes of the largest exchange any bucketing of ``units`` can make (``sparse`` sizes
    it): every sparse parameter in one message, or every dense one in one allreduce."""
    sparse_params = [
        (name, p) for unit in units for name, p in zip(unit.param_names, unit.params) if densities[name] < 1.0
    ]
    dense = sum(
        sparse.unit_message_bytes(p.numel(), p.numel(), p.element_size())
        for unit in units
        for name, p in zip(unit.param_names, unit.params)
        if densities[name] >= 1.0
    )
    if not sparse_params:
        return dense
    k = sum(k_for_density(densities[name], p.numel()) for name, p in sparse_params)
    numel = sum(p.numel() for _, p in sparse_params)
    value_size = max(p.element_size() for _, p in sparse_params)
    return max(dense, sparse.message_bytes(k, value_size, sparse.index_dtype_for(numel).itemsize))


def for_aggregation(model: NetworkModel, options: LAGSOptions) -> NetworkModel:
    """``model`` costing sparse units as ``options`` aggregate them."""
    return replace(model, aggregation=options.aggregation, owner_keep=options.owner_keep)


def network_from(profile, world_size: int, options: LAGSOptions) -> NetworkModel | None:
    """The ``network_profile`` option as a model for ``world_size`` workers exchanging as
    ``options`` say (None: not given)."""
    if profile is None:
        return None
    if isinstance(profile, NetworkModel):
        model = NetworkModel.from_dict(profile.to_dict(), world_size)
    elif isinstance(profile, dict):
        model = NetworkModel.from_dict(profile, world_size)
    else:
        model = load_network_profile(profile, world_size)
    return for_aggregation(model, options)


def _from_planner(value, collectives: Collectives, name: str, timeout):
    """The value of the group's rank 0 on every member (a collective)."""
    return broadcast_object(collectives, value, collectives.global_ranks[0], name, timeout)


class PlanningLoops:
    """One optimizer's loops (``AutoBuckets`` for ``buckets="auto"``, ``AdaptiveDensity`` for
    ``density="adaptive"``) and what applying their decisions takes: a new ``Engine`` for new
    buckets, the plan of k set on the state. Every verb that may change the buckets takes the
    engine in force and returns the one to use, so the optimizer alone holds its engine."""

    def __init__(self, options: LAGSOptions, engine: Engine, names: dict):
        self._options, self._names = options, names
        self.adaptive: AdaptiveDensity | None = None
        if options.adaptive and options.buckets != "auto":
            self._start_adaptive(engine)
        self.auto_buckets: AutoBuckets | None = None
        if options.buckets == "auto":
            kinds = {names[p]: kind for p, kind in param_kinds(engine.context.param_groups, names, options).items()}
            densities = {name: kind[3] for name, kind in kinds.items()}
            self.auto_buckets = AutoBuckets(options, engine.context.config.collectives, kinds, densities)

    def after_synchronize(self, engine: Engine, may_broadcast: bool) -> Engine:
        """The buckets of ``buckets="auto"`` once planned, the adaptive k, or the warm-up's k;
        the engine to use from now on. While ranks sit in ``lags_hvd.join()`` the loops wait
        (they broadcast, and the joined ranks run no broadcast)."""
        if may_broadcast and self.auto_buckets is not None:
            buckets = self.auto_buckets.after_synchronize(engine.state.iteration, engine.timer, engine.units)
            if buckets is not None:
                engine = self._rebucket(engine, buckets)
        k = (
            self.adaptive.after_synchronize(engine.state.iteration, engine.timer)
            if may_broadcast and self.adaptive
            else None
        )
        if k is not None:
            engine.state.set_plan(k)
        else:
            engine.state.apply_schedule()
        return engine

    def adopt(self, engine: Engine, saved: dict) -> tuple[Engine, Callable[[], None]]:
        """With ``buckets="auto"``: the engine of a saved (or broadcast) state's buckets, and
        whether they were planned, so a resumed run exchanges exactly as the saved one would
        have (with its plan, or per layer until the plan is made at the same iteration); and
        the undo that puts these loops back (the caller keeps ``engine``). Raises ValueError,
        changing nothing, for buckets that do not partition the optimizer's parameters."""
        adaptive, was_planned = self.adaptive, getattr(self.auto_buckets, "planned", None)

        def undo() -> None:
            self.adaptive = adaptive
            if self.auto_buckets is not None:
                self.auto_buckets.planned = was_planned

        if self.auto_buckets is None or not isinstance(saved.get("iteration"), int) or "buckets" not in saved:
            return engine, undo
        planned = saved.get("buckets_planned")
        if not isinstance(planned, bool):  # saved before the flag: the plan's iteration tells
            planned = saved["iteration"] >= self._options.density_warmup + self._options.bucket_warmup
        buckets = saved["buckets"]
        trainable = sorted(n for unit in engine.units for n in unit.param_names)
        if (
            not isinstance(buckets, list)
            or not all(isinstance(b, list) and b and all(isinstance(n, str) for n in b) for b in buckets)
            or sorted(n for b in buckets for n in b) != trainable
        ):
            raise ValueError(
                "the saved 'buckets' do not partition this optimizer's trainable parameters: "
                "the checkpoint is from another model"
            )
        self.auto_buckets.planned = planned
        return (engine if buckets == engine.state.buckets() else self._rebucket(engine, buckets)), undo

    def resume(self, iteration: int) -> None:
        """A state loaded or adopted at ``iteration``: the adaptive loop keeps its k until the
        next re-plan (``AdaptiveDensity.resume``)."""
        if self.adaptive:
            self.adaptive.resume(iteration)

    def saved_state(self) -> dict:
        """With ``buckets="auto"``: whether the buckets were planned (the checkpoint's buckets
        are then the plan, else the per-layer ones the plan has yet to replace)."""
        return {"buckets_planned": self.auto_buckets.planned} if self.auto_buckets is not None else {}

    def _start_adaptive(self, engine: Engine) -> None:
        options = self._options
        self.adaptive = AdaptiveDensity(
            options,
            engine.context.config.collectives,
            engine.units,
            start=max(engine.state.iteration, options.density_warmup),
            whole_after_sparse=not engine.context.rule.replicated,
        )  # at k
        self.adaptive.set_floor(engine.state.planned_k)
        if options.verbose or options.plan_report_dir:
            self.adaptive.observers.append(PlanReporter(options.verbose, options.plan_report_dir))

    def _rebucket(self, engine: Engine, buckets: list[list[str]]) -> Engine:
        """The engine of a bucket plan (lists of parameter names), carrying ``engine``'s state."""
        by_name = {name: p for p, name in self._names.items()}
        groups = engine.context.param_groups
        units = build_units(groups, self._names, [[by_name[n] for n in bucket] for bucket in buckets])
        engine = Engine(units, engine.context, previous=engine)
        if self._options.adaptive:
            self._start_adaptive(engine)
        return engine
