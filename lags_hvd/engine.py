"""The exchange engine: one bucketing's buffers and the transaction of one iteration.

Per bucket u (a contiguous range of one arena, ``arena.py``) on worker p::

    hook of u's last member     acc = eps + g            one fused pass into the staging buffer
                                s   = TopK(acc, k_u)     no value read to the host
                                start allgather(s)       u's reused send buffer, a stable name
    finish()                    grad[sparse units] = 0   the merge target, per run of units
                                step check (every rank at the same iteration and plan)
                                grad += (1/P) sum_p s_p  one ``merge_into`` per arena
                                eps' = acc - s           s_p's positions read back from the merge
                                finite?  -> commit eps'  one host read for all buckets
                                            (max_grad_norm: first grad *= c, eps' += (1 - c) s_p)
                                else     -> discard eps' (every rank skips the step alike)
                                p.grad = view of grad    for every parameter

A dense bucket (k = numel) sends ``g + eps`` with an in-place allreduce instead.
How the P contributions combine is the bucket's ``aggregation`` (allgather,
reduce_scatter, or the dense allreduce): the engine starts, completes and merges every
bucket through that one interface, and runs what the merge says to do at the commit
(clear what was applied in the staged residuals). Everything of one iteration lives in
one ``Iteration``, created by the first backward hook (or by ``finish()`` when none fired)
and dropped when ``finish()`` returns, whatever happened, so nothing of it can outlive its
iteration: the engine keeps only what does (``LAGSState``, the buffers, the timer).
With a GradScaler the gradients arrive multiplied by S: the residual is kept
unscaled (``acc = eps + g / S``) and the values go out multiplied by S again.

An ``Engine`` is built for one bucketing and replaced, not mutated, when the
buckets change (``Engine(units, context, previous=old)`` carries residuals,
velocities, iteration and learning-rate record over parameter by parameter), so
restoring an engine is restoring one reference. What outlives a bucketing (the
options, the wrapped optimizer's param groups, the step check) is the
``EngineContext``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from . import selection
from .aggregation import AGGREGATIONS, Contribution, Dense
from .agreement import JOINED, StepCheck, StepToken, hyperparameter_digest, wire_namespace
from .arena import ArenaLayout, MergedGrads, bind_grads
from .assumption import delta
from .bucket import Bucket, Launch
from .clipping import clip_norm_, local_clip_norms
from .density import PAPER_DENSITY, dense_policy_units, unit_k
from .errors import OutOfStepError, WorkerLostError
from .exchange import ExchangeConfig, ExchangeStarted, all_finite, finite_flag
from .layout import ExchangeUnit
from .options import LAGSOptions
from .profiling import BackwardTimer, DeviceStamps
from .residual import ResidualMemory
from .state import LAGSState
from .updates import ErrorFeedback, UpdateRule, rule_for
from .updates.base import MergedUnit

__all__ = ["EngineContext", "Engine", "Iteration", "Outcome", "engine_context"]


@dataclass(eq=False)
class Iteration:
    """One iteration's transaction on this rank.

    Attributes:
        passes_left: per parameter (by ``id``: no tensor hashing in the hook), the backward
            passes still to accumulate before its bucket may go (``backward_passes_per_step``).
        not_ready: per bucket, the members (by ``id``) whose gradients are still to come.
        contributions: per bucket started, its exchange and what this rank sent.
        queued: per bucket selected but not yet started, what ``Engine._start`` was given (a
            backend that matches collectives by order starts them in ``Engine.launch_order``).
        started: how many buckets of the launch order have started (that backend only).
        monitored: on a monitored iteration, each sparse bucket's ``acc`` (the delta's input).
        scale: the GradScaler's scale, read once (None until read).
        group_lr: ``lr_scaled_residual``: each param group's lr, read once.
        staged_lr: ``lr_scaled_residual``: the lr of each bucket's exchange, recorded at commit.
    """

    passes_left: dict[int, int]
    not_ready: dict[str, set]
    contributions: dict[str, Contribution] = field(default_factory=dict)
    queued: dict[str, tuple] = field(default_factory=dict)
    started: int = 0
    monitored: dict[str, torch.Tensor] = field(default_factory=dict)
    scale: float | None = None
    group_lr: dict[int, float] = field(default_factory=dict)
    staged_lr: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls, units, passes: int) -> Iteration:
        """An iteration of ``units`` (the bucketing's), each member awaited ``passes`` times."""
        return cls(*cls.counters(units, passes))

    @staticmethod
    def counters(units, passes: int) -> tuple[dict, dict]:
        """Fresh ``passes_left`` and ``not_ready`` for ``units``."""
        return {id(p): passes for unit in units for p in unit.params}, {
            unit.name: {id(p) for p in unit.params} for unit in units
        }

    @property
    def in_flight(self) -> list[str]:
        """The buckets started (or selected and queued to start) and not yet finished, by name."""
        return sorted([*self.contributions, *self.queued])

    def loss_scale(self, scaler) -> float:
        """The ``grad_scaler``'s scale S (1 without one), read once per iteration, in its first
        hook: on a GPU the one device synchronisation in backward (docs/design.md, Streams).
        With the GradScaler's power-of-two scales, dividing and multiplying by S is exact."""
        if scaler is None or not scaler.is_enabled():
            return 1.0
        if self.scale is None:
            self.scale = float(scaler.get_scale())
        return self.scale

    def lr_ratio(self, name: str, group_index: int, param_groups, exchange_lr: dict) -> float:
        """``lr_scaled_residual``: eta_{t-1} / eta_t for bucket ``name``, which keeps eps in the
        paper's lr-scaled space when the lr changes; eta_t is staged for the commit. Each
        group's lr is read once (a tensor lr: one host read)."""
        lr = self.group_lr.get(group_index)
        if lr is None:
            lr = self.group_lr[group_index] = float(param_groups[group_index]["lr"])
        if not lr > 0:
            raise ValueError(f"lr_scaled_residual needs a positive learning rate, got {lr} for {name!r}")
        self.staged_lr[name] = lr
        previous = exchange_lr.get(name, lr)
        return previous / lr if previous != lr else 1.0


@dataclass
class EngineContext:
    """What every bucketing of one optimizer shares.

    Attributes:
        options: the validated LAGS options.
        config: the collectives' settings (op, scaling, compression, process set, timeout).
        live_groups: returns the wrapped optimizer's param groups as they are now (lr,
            momentum, weight decay are read from them every iteration): torch's
            ``load_state_dict``, and so every resume and ``broadcast_optimizer_state``,
            replaces the list and its dicts, and a scheduler writes into the new ones.
        param_order: every parameter, in the order backprop is expected to produce them.
        select: the top-k selector, ``(acc, k) -> (values, indices)``.
        watched: (name, parameter, requires_grad at wrapping) for every parameter, so
            that a parameter frozen on one rank only is caught by the step check.
        backward_passes_per_step: gradients accumulated locally per exchange.
        sparse_as_dense: densify ``torch.sparse`` gradients silently.
        observers: callables told of every exchange as it starts.
    """

    options: LAGSOptions
    config: ExchangeConfig
    live_groups: Callable[[], list[dict]]
    param_order: list[torch.Tensor]
    select: Callable
    watched: list[tuple[str, torch.Tensor, bool]]
    backward_passes_per_step: int = 1
    sparse_as_dense: bool = False
    observers: list = field(default_factory=list)
    sparse_grads: dict = field(default_factory=dict)  # parameter -> sparse_dim of its torch.sparse gradient
    rule: UpdateRule = field(default_factory=ErrorFeedback)  # resolved from the options and the wrapped optimizer
    token: StepToken = field(init=False)

    def __post_init__(self):
        self.token = StepToken(self.config.collectives, self.options.exchange_timeout, self.config.namespace)

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's param groups now (never a list kept from an earlier time)."""
        return self.live_groups()

    def start_check(self, state: LAGSState, params, backward: bool, scale: float) -> None:
        """Start this iteration's step check. ``fresh``: a backward pass ran on this rank, or
        every gradient of ``params`` is None or zero (a rank with an empty batch, as Horovod
        allows); a rank whose gradients are the last step's merged ones (``step()`` called
        twice) is not. ``changed``: the first watched parameter frozen or unfrozen since wrapping."""
        changed = next((i + 1 for i, (_, p, trains) in enumerate(self.watched) if p.requires_grad != trains), 0)
        fresh = backward or all(p.grad is None or not _nonzero(p.grad) for p in params)
        digest = hyperparameter_digest(self.param_groups)
        self.token.start(state.iteration, fresh, state.plan_digest, changed, scale, digest)

    def check(self) -> StepCheck:
        """Wait for this iteration's step check from every rank (raises where ranks are out of step)."""
        return self.token.check(lambda i: self.watched[i][0])

    def verdict(self) -> OutOfStepError | None:
        """This iteration's step check's ``OutOfStepError``, where it has arrived (``StepToken.verdict``)."""
        return self.token.verdict(lambda i: self.watched[i][0])


def engine_context(
    options: LAGSOptions, wiring, units, param_groups, names, wrapped_class, live_groups
) -> EngineContext:
    """What every bucketing of an optimizer (its ``param_groups``, ``names`` by parameter,
    ``live_groups`` reading its groups now) shares: the exchanges' settings from the front-end's
    ``wiring`` (``optimizer.Wiring``), the selector, the update rule the options and the wrapped
    optimizer resolve (``updates.rule_for``) with the options it decides where they are None
    (``density``, ``density_warmup_start``), the watch list."""
    if wiring.op not in ("average", "sum"):
        raise ValueError(
            "lags_hvd supports op=hvd.Average and op=hvd.Sum; Adasum, Min, Max and "
            f"Product have no meaning for a sparse sum (got {wiring.op})"
        )
    config = ExchangeConfig(
        wiring.collectives,
        wiring.op == "average",
        wiring.gradient_predivide_factor,
        wiring.compression,
        options.exchange_timeout,
        wire_namespace([n for u in units for n in u.param_names]),
    )
    # which units are sparse decides the rule, whose density may be the one in force: at any
    # density <= 0.5 (every rule's) a unit is sparse iff it has two entries or more, so the
    # paper's density decides as the rule's would
    probe = replace(options, density=PAPER_DENSITY) if options.density is None else options
    k, dense = unit_k(probe, units), set(dense_policy_units(units, options))
    sparse = options.adaptive or any(k[u.name] < u.numel and u.name not in dense for u in units)
    rule = rule_for(options, wrapped_class, param_groups, units, sparse)
    defaults = {"density": rule.density, "density_warmup_start": rule.warmup_start}
    options = replace(options, **{name: value for name, value in defaults.items() if getattr(options, name) is None})
    return EngineContext(
        options,
        config,
        live_groups,
        # backprop usually produces gradients in reverse registration order
        param_order=[p for g in reversed(param_groups) for p in reversed(g["params"])],
        select=selection.get_selector(options.selector, checked=not options.trust_selector),
        watched=[(names[p], p, p.requires_grad) for g in param_groups for p in g["params"]],
        backward_passes_per_step=wiring.backward_passes_per_step,
        sparse_as_dense=wiring.sparse_as_dense,
        rule=rule,
    )


@dataclass
class Outcome:
    """What ``Engine.finish`` tells the optimizer.

    Attributes:
        iteration: the iteration this was (counted from 0).
        nonfinite: units whose merged gradient holds a NaN or Inf (the same on every rank);
            non-empty means the step is skipped and the residuals are as before.
        delta: on a monitored iteration, the paper's delta per sparse unit, else None.
        grad_norm: with ``max_grad_norm``, the merged gradient's 2-norm before the clip (a
            0-d tensor, unscaled by the loss scale), else None.
        joined: the ranks in ``lags_hvd.join()`` during this iteration (they contributed
            zeros; the average still divides by P, as Horovod's does).
    """

    iteration: int
    nonfinite: list[str]
    joined: list[int] = field(default_factory=list)
    delta: dict[str, float] | None = None
    grad_norm: torch.Tensor | None = None


class Engine:
    """The buffers of one bucketing and the iteration transaction over them.

    Attributes:
        units: the buckets, in name order (identical on every rank).
        params: the parameters this engine exchanges (those with a hook), bucket by bucket.
        launch_order: the buckets in the expected backward order (the last member's place
            in ``param_order``): the order they start in where the collectives are matched
            by order (torch.distributed), and the order ``finish`` and ``shadow`` start
            the ones whose hooks did not fire.
        layout: where each bucket and parameter lives in the flat buffers.
        state: the LAGS state carried across iterations (k, residuals, iteration).
        timer: hook timestamps and selection times (the planners' measurements).
    """

    def __init__(self, units: list[ExchangeUnit], context: EngineContext, previous: Engine | None = None):
        self.context, self.units = context, units
        options = context.options
        layout = self.layout = ArenaLayout(units, context.param_order)
        self.state = _carried_state(units, layout, context, previous.state if previous is not None else None)
        self.state.set_plan(unit_k(options, units))
        on_gpu = any(p.is_cuda for unit in units for p in unit.params)
        self.timer = BackwardTimer(stamps=DeviceStamps() if on_gpu else None)
        self._local_clip_norm = (
            local_clip_norms(
                {u.name: u.numel for u in units},
                options.local_clip,
                context.config.world,
                averaged=context.config.average,
            )
            if options.local_clip is not None
            else {}
        )
        arguments = (context.config, self.state, context.select, options)
        self._sparse, self._dense = AGGREGATIONS[options.aggregation](*arguments), Dense(*arguments)
        self.params = tuple(p for unit in units for p in unit.params)
        self._unit_of = {id(p): unit for unit in units for p in unit.params}  # by id: no tensor hashing
        self.grads = MergedGrads(layout)  # every p.grad is a view of them after the merge
        self.buckets = {
            unit.name: Bucket(
                unit,
                self.grads.units[unit.name],
                [self.grads.views[p] for p in unit.params],
                context,
                self.state,
                (self._sparse, self._dense),
                self._local_clip_norm.get(unit.name),
            )
            for unit in units
        }
        self._now: Iteration | None = None  # the iteration under way
        expected = {p: i for i, p in enumerate(context.param_order)}
        self.launch_order = sorted(units, key=lambda u: (max(expected.get(p, -1) for p in u.params), u.name))
        self._in_order = context.config.collectives.matched_by_order

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of ``params`` (the same tensor)."""
        return id(p) in self._unit_of

    @property
    def in_flight(self) -> list[str]:
        """The buckets whose exchanges are in flight in this iteration, by name."""
        return self._now.in_flight if self._now else []

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        """Per sparse unit, (bytes sent to, bytes received from) other ranks in its last exchange."""
        return self._sparse.traffic

    @property
    def idle(self) -> bool:
        """No iteration under way: no step check started, nothing in flight."""
        return not self.context.token.started and not self.in_flight

    def reset_pass_counters(self) -> None:
        """Forget the backward passes counted so far in this iteration (a new count, or a load)."""
        if self._now is not None:
            self._now.passes_left, self._now.not_ready = Iteration.counters(self.units, self._passes)

    @property
    def _passes(self) -> int:
        return self.context.backward_passes_per_step

    def _iteration(self, backward: bool) -> Iteration:
        """The iteration under way, begun (with its step check) if none is."""
        now = self._now
        if now is None:
            now = self._now = Iteration.begin(self.units, self._passes)
        if not self.context.token.started:
            self.context.start_check(self.state, self.params, backward, self._scale())
        return now

    # ------------------------------------------------------------------ backward
    def gradient_ready(self, p: torch.Tensor, overlap: bool) -> None:
        """``p``'s gradient is accumulated: launch its bucket if it was the last one awaited
        (``overlap``), or only note the time (the serial baseline launches in ``finish``)."""
        now, key = self._iteration(backward=True), id(p)
        left = now.passes_left[key] - 1
        if left < 0:
            raise RuntimeError(
                "gradients were computed more than backward_passes_per_step times "
                "before step() or synchronize(); increase backward_passes_per_step "
                "to accumulate gradients locally (or, if a backward pass meant for "
                "another optimizer reached these parameters, freeze them for it)"
            )
        now.passes_left[key] = left
        if left:
            return
        unit = self._unit_of[key]
        waiting = now.not_ready[unit.name]
        waiting.discard(key)
        if not waiting:
            if overlap:
                self._launch(unit)
            else:
                stamp = self.timer.stamp()
                self.timer.unit_ready(unit.name, stamp, stamp)

    def _launch(self, unit: ExchangeUnit, from_hook: bool = True) -> None:
        """Start ``unit``'s bucket (``Bucket.start``: its rule, accumulate and select, launch)."""
        timer, now = self.timer, self._now
        ready_at = timer.stamp()
        launch = self.buckets[unit.name].start(
            self._scale(),
            lambda: now.lr_ratio(unit.name, unit.group_index, self.context.param_groups, self.state.exchange_lr),
        )
        if launch.acc is not None and self._monitoring():
            now.monitored[unit.name] = launch.acc * self._scale()
        self._start(launch)
        if from_hook:
            timer.unit_ready(unit.name, ready_at, timer.stamp())

    def _start(self, launch: Launch, observed: bool = True) -> None:
        """Start a bucket's exchange; on a backend that matches collectives by order, queue it
        and start every queued bucket whose predecessors in ``launch_order`` have all started
        (as DDP launches its buckets), so every rank issues them in one order."""
        if not self._in_order:
            self._issue(launch, observed)
            return
        now, order = self._now, self.launch_order
        now.queued[launch.unit.name] = (launch, observed)
        while now.started < len(order) and order[now.started].name in now.queued:
            self._issue(*now.queued.pop(order[now.started].name))
            now.started += 1

    def _issue(self, launch: Launch, observed: bool) -> None:
        unit, aggregation = launch.unit, launch.aggregation
        if launch.packed is not None:  # written by the bucket's CUDA graph
            pending = aggregation.send(unit, launch.packed)
        else:
            pending = aggregation.start(unit, launch.values, launch.indices)
        self._now.contributions[unit.name] = Contribution(unit, aggregation, pending, launch.indices, launch.unscaled)
        if observed and self.context.observers:
            event = ExchangeStarted(unit.name, unit.numel, launch.values, launch.indices, pending)
            for observe in self.context.observers:
                observe(event)

    def _scale(self) -> float:
        """The loss scale of the iteration under way (1 without a GradScaler)."""
        return self._now.loss_scale(self.context.options.grad_scaler)

    def merged_units(self) -> list[MergedUnit]:
        """Every bucket's merged gradient (a flat view of the buffer ``p.grad`` views) and
        whether it was sent whole, for an update rule's step."""
        return [(unit, self.grads.units[unit.name], self.state.is_dense(unit)) for unit in self.units]

    def _monitoring(self) -> bool:
        every = self.context.options.monitor_every
        return bool(every) and self.state.iteration % every == 0

    # ------------------------------------------------------------------ synchronize
    def finish(self, bind: bool = True) -> Outcome:
        """Complete the iteration: launch the units whose hooks did not fire (a zero gradient,
        so every rank takes part in every collective), pass the step check, collect, merge,
        commit or discard the staged residuals, and (``bind``) make every ``p.grad`` its view
        of the merged gradients (under DDP, ``.grad`` is DDP's, which copies them in)."""
        now, timer, state = self._iteration(backward=False), self.timer, self.state
        outcome, scale = Outcome(state.iteration, []), self._scale()
        try:
            for unit in self.launch_order:
                if unit.name not in now.contributions and unit.name not in now.queued:
                    self._launch(unit, from_hook=False)
            zeroing = timer.now()
            self.grads.targets.zero(self.state.k)  # every g consumed, while the exchanges are in flight
            started = timer.now()
            # the step check first: ranks out of step may wait on exchanges of different names
            outcome.joined = self.context.check().joined
            arrived = self._collect(now)
            collected = timer.now()
            outcome.nonfinite, commits, merge_shared = self._merge(now, arrived)
            merge, wait = timer.now() - collected, collected - started
            if not outcome.nonfinite:
                for commit in commits:
                    commit()
                if now.monitored:  # the paper's delta is of the update before any clip
                    outcome.delta = self._measure_delta(now)
                if (max_norm := self.context.options.max_grad_norm) is not None:
                    outcome.grad_norm = clip_merged_(self.grads.buffers, max_norm, now.contributions, state, scale)
                state.commit()
                self.context.rule.committed(self.units, state)
                state.exchange_lr.update(now.staged_lr)
            if bind:
                bind_grads(self.grads.views, self.context.sparse_grads)
        except WorkerLostError as lost:  # a peer lost, or silent, before this rank read its check
            if (verdict := self.context.verdict()) is not None:
                raise verdict from lost
            raise
        finally:
            self._end_iteration()
        timer.end_iteration(wait, merge, started - zeroing, merge_shared)
        state.iteration += 1
        return outcome

    def _collect(self, now: Iteration) -> dict:
        """Complete every bucket's exchange (the collectives after the first, once all have
        started), then wait for all of them: what arrived, per unit."""
        for aggregation in (self._sparse, self._dense):
            aggregation.complete(
                [c for c in now.contributions.values() if c.aggregation is aggregation], self.state.iteration
            )
        return {name: c.pending.finish(c.pending.collect()) for name, c in now.contributions.items()}

    @property
    def under_way(self) -> bool:
        """Whether an iteration has begun (a hook fired, or ``finish`` started) and not ended."""
        return self._now is not None

    def abandon(self) -> None:
        """Drop the iteration under way (an error in a hook: the optimizer goes no further)."""
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Drop the iteration, whatever happened in it: nothing of it is left behind."""
        self._now = None
        self.state.discard()  # whatever was not committed
        self.context.token.forget()  # after an error before the check: no handle is left behind

    def _merge(self, now: Iteration, arrived: dict) -> tuple[list[str], list, float]:
        """Write every unit's reduced gradient into the gradient buffer, one ``merge`` per
        aggregation and arena. Returns the units with a NaN or Inf, found with one host read
        in all (a second only when something is not finite), what to do at the commit, and
        the seconds the merges and that read took (the same for any bucketing)."""
        parts: dict = {}
        for name, result in arrived.items():
            contribution = now.contributions[name]
            slot = self.layout.unit_slots[name]
            parts.setdefault((contribution.aggregation, slot.key), []).append((slot.start, result, contribution))
        started = self.timer.now()
        flags, commits = [], []
        for (aggregation, key), arena_parts in parts.items():
            merged, on_commit = aggregation.merge(key, self.grads.buffers[key], arena_parts)
            flags.extend(finite_flag(values) for values in merged)
            commits.extend(on_commit)
        finite = not flags or bool(torch.stack(flags).all())
        shared = self.timer.now() - started
        if finite:
            return [], commits, shared
        return sorted(name for name in arrived if not all_finite(self.grads.units[name])), commits, shared  # rare

    def _measure_delta(self, now: Iteration) -> dict[str, float]:
        """delta per sparse unit: the dense average of acc against what was applied."""
        averages = {name: self._dense.allreduce(f"monitor.{name}", acc) for name, acc in sorted(now.monitored.items())}
        grads, k = self.grads.units, self.state.k
        return {name: delta(avg.wait(), grads[name], k[name], grads[name].numel()) for name, avg in averages.items()}

    # ------------------------------------------------------------------ join
    def start_shadow(self) -> None:
        """A rank in ``lags_hvd.join()``: post this iteration's step check, marked joined."""
        self.context.token.start(self.state.iteration, False, 0, 0, 1.0, 0, kind=JOINED)

    @property
    def shadow_ready(self) -> bool:
        """Whether ``start_shadow``'s check has arrived from every rank."""
        return self.context.token.done()

    def shadow(self) -> StepCheck:
        """A rank in ``lags_hvd.join()``, once ``start_shadow``'s check has arrived: while some
        ranks still train, take part in their iteration with a contribution of nothing to every
        bucket (``Bucket.nothing``), at their k and regions, so their collectives complete (the
        average divides by P all the same). Nothing of this rank's state changes but the
        regions, which follow the owners' as on every rank. Returns the check."""
        check = self.context.check()
        if check.iteration is None:  # every rank has joined
            return check
        state, own = self.state, self.state.iteration
        state.iteration = check.iteration  # the ranks training: their warm-up's k, their rebalancing
        state.apply_schedule()
        now = self._now = Iteration.begin(self.units, self._passes)
        try:
            for unit in self.launch_order:
                launch = self.buckets[unit.name].nothing()
                if launch.indices is not None and self._monitoring():  # the delta's allreduce, of zeros
                    now.monitored[unit.name] = torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device)
                self._start(launch, observed=False)
            self.grads.targets.zero(self.state.k)
            nonfinite, commits, _ = self._merge(now, self._collect(now))
            if not nonfinite:  # as the ranks training go on: their regions, their delta's allreduces
                for commit in commits:
                    commit()
                if now.monitored:
                    self._measure_delta(now)
        finally:
            self._end_iteration()
            state.iteration = own
            state.apply_schedule()
        return check


def clip_merged_(buffers: dict, max_norm: float, contributions: dict, state: LAGSState, scale: float) -> torch.Tensor:
    """``max_grad_norm``: clip the merged gradient, ``grad *= c`` (``clipping.clip_norm_`` over
    every arena at once), and stage ``eps += (1 - c) s`` for every entry this rank sent and the
    merge applied, so the clip delays that mass instead of dropping it. Returns the norm before
    the clip (loss scale ``scale`` removed); no host read."""
    norm, factor = clip_norm_(list(buffers.values()), max_norm, scale)
    for name, contribution in contributions.items():
        if contribution.indices is not None:
            state.residuals.give_back(name, contribution.indices, contribution.values, factor, contribution.applied)
    return norm


def _carried_state(units, layout, context: EngineContext, old: LAGSState | None) -> LAGSState:
    """A bucketing's state: new, or the previous bucketing's carried over parameter by
    parameter (residuals, rule memories, iteration, lr record, the regions of units that stay)."""
    options = context.options
    state = LAGSState(
        units=units,
        layout=layout,
        warmup_iterations=options.density_warmup,
        warmup_start=options.density_warmup_start,
        dense_units=frozenset(dense_policy_units(units, options)),
    )
    if old is not None:
        state.residuals = old.residuals.moved_to(layout)
        state.iteration = old.iteration
        # a bucket's members share one param group, so any member's old unit has its lr
        old_unit = {n: unit.name for unit in old.units for n in unit.param_names}
        state.exchange_lr = {
            unit.name: old.exchange_lr[old_unit[unit.param_names[0]]]
            for unit in units
            if old_unit[unit.param_names[0]] in old.exchange_lr
        }
        state.regions = state.regions_of_these_units(old.regions)
        state.updates = old.updates
        state.rule_memories = {name: memory.moved_to(layout) for name, memory in old.rule_memories.items()}
    else:
        state.rule_memories = {name: ResidualMemory(layout) for name in context.rule.memories}
    state.masked, state.replicated = frozenset(context.rule.masked), frozenset(context.rule.replicated)
    for memory in state.rule_memories.values():
        for unit in units:
            if unit.name not in memory:
                memory.register(unit.name)
    return state


def _nonzero(grad: torch.Tensor) -> bool:
    return bool((grad._values() if grad.is_sparse else grad).any())
